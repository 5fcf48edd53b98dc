// The Step service without a GPU, in-process, for tests and the CPU
// benchmark (step_stream_benchmark): a CPU backend with the pools a
// registration names, a SessionManager whose sessions the caller opens
// and closes directly, the StepServer with FakeEngine registrations, and
// a gRPC server on a fresh Unix socket. Requests are sized like
// tests/gpu/step_benchmark's decode steps at batch B: B tokens and
// sequences, slot mapping, seq_lens, query_lens, SWA states and block
// tables [B][kBlocksPerSeq].
#ifndef KVDEPOT_SERVER_STEP_STEP_TEST_RIG_H_
#define KVDEPOT_SERVER_STEP_STEP_TEST_RIG_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvdepot/v1/step.pb.h"
#include "server/backend/backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/fake_engine.h"
#include "server/step/step_server.h"

namespace kvdepot::step {

struct StepTestRigOptions {
  // FakeEngine: report each step finished at once (else FinishOne()).
  bool auto_finish = true;
  StepServiceOptions service;
  int max_batch = 256;  // the registration's max_tokens and max_seqs
  int top_k = 2048;     // max_top_k and each step's top_k
};

class StepTestRig {
 public:
  static constexpr uid_t kWorkerUid = 1000;  // owns the rig's pools
  static constexpr int kLayers = 2;
  static constexpr int kBlockSize = 64;     // main and index pools
  static constexpr int kBlocksPerSeq = 64;  // block-table columns

  static absl::StatusOr<std::unique_ptr<StepTestRig>> Start(
      const StepTestRigOptions& options);
  StepTestRig(const StepTestRig&) = delete;
  StepTestRig& operator=(const StepTestRig&) = delete;
  // Ends the streams, shuts the server down, removes the socket.
  ~StepTestRig();

  // "unix:/path" of the server.
  const std::string& target() const { return target_; }
  std::shared_ptr<grpc::Channel> NewChannel() const;

  // A peer session of `uid` (what a companion connection opens).
  absl::StatusOr<OpenedSession> OpenSession(const std::string& name, uid_t uid);
  // Registers a worker of `session_id`, a session of kWorkerUid (two layers:
  // main, SWA and index caches, top-k; the SWA index) on buffers of that
  // session.
  absl::StatusOr<uint64_t> Register(const std::string& session_id);
  // The cast of the attack tests: a worker session of kWorkerUid with its
  // registration (Register) and an intruder session of another uid.
  struct Parties {
    OpenedSession worker;
    OpenedSession intruder;
    uint64_t registration = 0;
  };
  absl::StatusOr<Parties> OpenParties();
  // Step `step_id` of `registration` at batch `batch` (<= max_batch).
  v1::StepRequest Step(const std::string& session_id, uint64_t registration,
                       uint64_t step_id, int batch) const;

  SessionManager* sessions() { return sessions_.get(); }
  Backend* backend() { return backend_.get(); }
  PoolRegistry* pools() { return pools_.get(); }
  StepServer* step() { return step_.get(); }
  FakeEngineFactory* factory() { return factory_; }

 private:
  explicit StepTestRig(const StepTestRigOptions& options) : options_(options) {}
  absl::Status Init();
  absl::StatusOr<uint64_t> AddBuffer(const Caller& caller, int64_t size);
  int num_blocks() const {
    return std::max(64, 2 * options_.max_batch / 64 + 64);
  }

  const StepTestRigOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<PoolRegistry> pools_;
  std::unique_ptr<SessionManager> sessions_;
  FakeEngineFactory* factory_ = nullptr;  // owned by step_
  std::unique_ptr<StepServer> step_;
  std::unique_ptr<grpc::Server> server_;
  std::string dir_, target_;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_TEST_RIG_H_
