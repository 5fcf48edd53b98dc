// A unary call's reactor that keeps the call's reply reservations
// (server/reply_scope.h) until gRPC is done with the call: its reply sent,
// or the call failed or was cancelled. Used by the KVCache serving layer
// and the Step service alike.
#ifndef KVDEPOT_SERVER_REPLY_REACTOR_H_
#define KVDEPOT_SERVER_REPLY_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <utility>
#include <vector>

#include "server/memory_budget.h"

namespace kvdepot {

class ReplyReactor final : public grpc::ServerUnaryReactor {
 public:
  // Before Finish: the handler's reservations (ReplyScope::Take).
  void Hold(std::vector<MemoryReservation> held) { held_ = std::move(held); }
  void OnDone() override { delete this; }  // the reservations go with it

 private:
  std::vector<MemoryReservation> held_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_REPLY_REACTOR_H_
