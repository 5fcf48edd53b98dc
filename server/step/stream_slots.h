// The StepStream limits (docs/DAEMON.md "Limits"): open streams in the
// whole daemon and per session. A stream takes a daemon slot when it opens
// and a session slot when it is bound to a session; both are given back
// when the stream ends, however it ends. Step rings (step_rings.h) count
// as streams: one of each slot while open.
#ifndef KVDEPOT_SERVER_STEP_STREAM_SLOTS_H_
#define KVDEPOT_SERVER_STEP_STREAM_SLOTS_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot::step {

class StreamSlots {
 public:
  // REQUIRES: both >= 1.
  StreamSlots(int max_streams, int max_per_session)
      : max_streams_(max_streams), max_per_session_(max_per_session) {}
  StreamSlots(const StreamSlots&) = delete;
  StreamSlots& operator=(const StreamSlots&) = delete;

  // A daemon slot, or RESOURCE_EXHAUSTED naming --max_step_streams.
  absl::Status Open();
  // A slot of `session` (a session number) for a stream that holds a
  // daemon slot, or RESOURCE_EXHAUSTED naming
  // --max_step_streams_per_session.
  absl::Status Bind(uint64_t session);
  // Gives back the daemon slot and, when `session` != 0, that session's.
  void Close(uint64_t session);

  int open() const;
  int open_of(uint64_t session) const;
  // Streams refused by either limit since start.
  int64_t refused() const;
  // The Prometheus text of open() (gauge kvdepot_step_streams_open) and
  // refused() (counter kvdepot_step_streams_refused_total).
  std::string RenderPrometheus() const;

 private:
  const int max_streams_;
  const int max_per_session_;
  mutable absl::Mutex mu_;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, int> per_session_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STREAM_SLOTS_H_
