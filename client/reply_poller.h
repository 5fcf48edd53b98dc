// Unary calls whose caller polls for the reply instead of sleeping on it.
//
// A thread blocked on a gRPC reply sleeps in the kernel, and waking it
// costs a scheduler round trip on every call: on a decode path, where the
// caller has nothing else to do until the reply comes, that wake-up is a
// large part of a short call (docs/BENCHMARKS.md). ReplyPoller starts the
// call on gRPC's async API and polls a completion queue with zero
// deadlines for up to `spin`, then sleeps on it as a blocking call would
// (the call's own deadline still bounds the wait). The price is the
// caller's core, busy while it polls.
//
// gRPC 1.51 offers no polling mode for its blocking stubs, hence this
// wrapper. Each call takes a completion queue of its own from a small
// free list (a queue polled by two threads would hand one thread the
// other's reply), so calls from many threads never share one.
#ifndef KVDEPOT_CLIENT_REPLY_POLLER_H_
#define KVDEPOT_CLIENT_REPLY_POLLER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvdepot {

class ReplyPoller {
 public:
  // `spin` > 0: how long a call polls before it sleeps.
  explicit ReplyPoller(absl::Duration spin) : spin_(spin) {}
  ReplyPoller(const ReplyPoller&) = delete;
  ReplyPoller& operator=(const ReplyPoller&) = delete;
  ~ReplyPoller();

  // Calls `prepare` (a stub's PrepareAsync<Method>, bound to its request)
  // and waits for the reply; `response` is filled when the status is OK.
  template <typename Resp, typename Prepare>
  grpc::Status Call(grpc::ClientContext* ctx, Resp* response, Prepare prepare) {
    std::unique_ptr<grpc::CompletionQueue> cq = Take();
    std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> reader =
        prepare(ctx, cq.get());
    reader->StartCall();
    grpc::Status status;
    int tag = 0;
    reader->Finish(response, &status, &tag);
    Await(cq.get());
    Give(std::move(cq));
    return status;
  }

 private:
  // Waits for the one event of a call started on `cq`.
  void Await(grpc::CompletionQueue* cq);
  std::unique_ptr<grpc::CompletionQueue> Take();
  void Give(std::unique_ptr<grpc::CompletionQueue> cq);

  const absl::Duration spin_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<grpc::CompletionQueue>> free_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_REPLY_POLLER_H_
