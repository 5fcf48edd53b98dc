// The sources of cross-layer shared prefill loads (SPEC §6, docs/SPEC.md
// "shared compressed cache"): what the last full PrefillLoads wrote into
// buffer slices, so that a consumer layer's PrefillLoad (shared_compressed)
// can check that the compressed rows it leaves in place are the ones it
// would have loaded itself.
//
// A full PrefillLoad into a buffer slice forgets every record overlapping
// the slice before it writes, and records itself once it has completed
// (its reply means done, so a consumer that finds a record queues its work
// after the source's finished). A consumer looks up the record of exactly
// its (buffer, offset) and compares its request with it (CheckConsumer).
//
// What a record proves: the daemon wrote those compressed rows with the
// same main pool, layer, window, ratio and sequences. What it cannot see:
// the client's own writes into its buffer (its kernels, a later Load into
// the same rows); those are the client's responsibility, as in the seed's
// cross_layer_runtime. A stale or missing record is FAILED_PRECONDITION,
// never a wrong write: every size is checked against the consumer's own
// request and the buffer.
//
// Bounds: at most kMaxSourcesPerBuffer records per buffer (the oldest is
// forgotten) and kMaxSourceBytes of recorded arrays in all (records of
// released buffers go first, then the oldest); a forgotten record only
// makes its consumers fall back to a full load.
#ifndef KVDEPOT_SERVER_PREFILL_SOURCES_H_
#define KVDEPOT_SERVER_PREFILL_SOURCES_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "planner/prefill_layout.h"
#include "server/pools.h"
#include "server/sessions.h"

namespace kvdepot {

inline constexpr int kMaxSourcesPerBuffer = 4;
inline constexpr int64_t kMaxSourceBytes = int64_t{64} << 20;

// What decides the compressed rows of a prefill buffer.
struct PrefillSourceKey {
  std::weak_ptr<Pool> main_pool;  // the object, not its name
  int64_t main_layer = 0;
  int32_t window = 0;
  int32_t ratio = 0;  // as resolved (0: no compressed part, never a source)
  std::vector<int32_t> seqlen_k, seqlen_q, swa_valid_start;  // [num_seqs]
  PrefillLayout layout;
};

// One completed full load into [offset, offset + bytes) of a buffer.
struct PrefillSource {
  uint64_t buffer_id = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
  uint64_t sequence = 0;  // insertion order (oldest first out)
  PrefillSourceKey key;

  int64_t array_bytes() const {
    return static_cast<int64_t>(key.seqlen_k.size() + key.seqlen_q.size() +
                                key.swa_valid_start.size()) *
           4;
  }
};

class PrefillSources {
 public:
  PrefillSources() = default;
  PrefillSources(const PrefillSources&) = delete;
  PrefillSources& operator=(const PrefillSources&) = delete;

  // Forgets the records of `buffer_id` that overlap [offset, offset+bytes).
  void Forget(uint64_t buffer_id, int64_t offset, int64_t bytes);

  // Records a completed full load into [offset, offset + bytes) of
  // `buffer` (replacing overlapping records; see the bounds above).
  void Record(const std::shared_ptr<Buffer>& buffer, int64_t offset,
              int64_t bytes, PrefillSourceKey key);

  // The record of exactly (buffer_id, offset), or FAILED_PRECONDITION
  // saying that no full load into that slice is recorded.
  absl::StatusOr<std::shared_ptr<const PrefillSource>> Find(
      uint64_t buffer_id, int64_t offset) const;

  int64_t size() const;
  int64_t array_bytes() const;

 private:
  struct Entry {
    std::weak_ptr<Buffer> buffer;
    std::vector<std::shared_ptr<const PrefillSource>> sources;
  };
  void ForgetLocked(uint64_t buffer_id, int64_t offset, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops records until `incoming` more bytes fit kMaxSourceBytes.
  void MakeRoomLocked(int64_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
};

// Compares a consumer's request (`consumer`, its own main pool object and
// the layout its own sequences give) with its source: FAILED_PRECONDITION
// naming the first field that differs (and the index for arrays), OK when
// the compressed rows in place are the ones the consumer would load.
absl::Status CheckConsumer(const PrefillSource& source,
                           const std::shared_ptr<Pool>& main_pool,
                           int64_t main_layer, int32_t window, int32_t ratio,
                           absl::Span<const int32_t> seqlen_k,
                           absl::Span<const int32_t> seqlen_q,
                           absl::Span<const int32_t> swa_valid_start,
                           const PrefillLayout& layout);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_PREFILL_SOURCES_H_
