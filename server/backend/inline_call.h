// Calls the callback serving model finishes inline run on gRPC's own
// threads (server/serving.h). While such a thread waits, for the GPU or for
// a lock or buffer that a thread waiting for the GPU holds, the daemon
// reads no requests, and one client could make every client wait. So the
// code an inline call reaches never waits: where it would, it asks
// MayWait() first and, when that is false, returns DeferInlineCall(why)
// before it has written anything. The serving layer then runs the whole
// call again, from the start, on a worker thread, where waiting is allowed
// (the worker pools are bounded, with RESOURCE_EXHAUSTED beyond).
//
// Outside an InlineCall (worker threads, the sync serving model, tools)
// MayWait() is true and nothing changes.
#ifndef KVDEPOT_SERVER_BACKEND_INLINE_CALL_H_
#define KVDEPOT_SERVER_BACKEND_INLINE_CALL_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// Marks this thread as running one inline call, for its lifetime.
// REQUIRES: no other InlineCall on this thread.
class InlineCall {
 public:
  InlineCall();
  ~InlineCall();
  InlineCall(const InlineCall&) = delete;
  InlineCall& operator=(const InlineCall&) = delete;

  // Whether the call asked to run again on a worker (DeferInlineCall).
  bool deferred() const;
};

// False inside an InlineCall: the caller must not block.
bool MayWait();

// Inside an InlineCall: marks it deferred and returns the status for the
// handler to return at once (the serving layer discards it: no client sees
// it). Outside one: an internal error naming `why` (a caller that may wait
// never defers).
absl::Status DeferInlineCall(absl::string_view why);

// Whether this thread's current inline call was deferred (false outside
// one): the service skips the attempt's metrics and logs.
bool InlineCallDeferred();

// Runs `task` now, or, inside an InlineCall, on the daemon's release
// thread, in order: for work that may wait, such as dropping the last
// reference to a pool or buffer whose device memory is freed only after its
// queued work (an inline call may hold that reference when another call
// deletes the pool). The release thread starts on first use and lives as
// long as the process.
void RunOffInline(std::function<void()> task);

// Returns once every task posted before the call has run (tests).
void WaitForReleases();

// Deletes `p` on this thread, or on the release thread when this is an
// inline call and `may_wait` (its destructor may wait for the GPU). Memory
// whose release cannot wait (host memory) is freed at once, so that its
// budget is back before the call that dropped it replies.
template <typename T>
void DeleteOffInline(T* p, bool may_wait) {
  if (may_wait && !MayWait()) {
    RunOffInline([p] { delete p; });
  } else {
    delete p;
  }
}

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BACKEND_INLINE_CALL_H_
