// What the StepRegistry tests share (testonly): a CPU backend, a pool
// registry and a session manager, a registry whose engines record the
// plans they are given, and helpers for sessions, pools and buffers.
#ifndef KVDEPOT_SERVER_STEP_REGISTRY_FIXTURE_H_
#define KVDEPOT_SERVER_STEP_REGISTRY_FIXTURE_H_

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvdepot/v1/step.pb.h"
#include "server/backend/backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/step_engine.h"
#include "server/step/step_registry.h"

namespace kvdepot::step {

// int32s packed as a Step request's bytes fields are (proto/wire.h).
std::string PackInt32s(const std::vector<int32_t>& v);

// Consecutive slices of one buffer, 256-byte aligned, for the
// StepBufferRefs of a test registration.
class BufferSlices {
 public:
  explicit BufferSlices(uint64_t buffer_id) : id_(buffer_id) {}
  // Points *out at the next `bytes` of the buffer.
  void Next(v1::StepBufferRef* out, int64_t bytes);

 private:
  uint64_t id_;
  int64_t offset_ = 0;
};

// Records plans; Finish() reports the oldest finished with an outcome.
class RecordingEngine : public StepEngine {
 public:
  explicit RecordingEngine(CompletionFn done) : done_(std::move(done)) {}
  absl::Status Enqueue(StepPlan plan) override;
  void Cancel() override { ++cancels; }
  // REQUIRES: a plan is recorded.
  void Finish(uint64_t status_bits = 0, uint64_t out_of_range = 0,
              std::vector<float> phase_us = {}, bool instantiated = false);

  std::deque<StepPlan> plans;
  int cancels = 0;

 private:
  CompletionFn done_;
};

class RecordingFactory : public StepEngineFactory {
 public:
  absl::StatusOr<std::unique_ptr<StepEngine>> Create(
      const RegistrationConfig& config, CompletionFn done) override;

  RecordingEngine* last = nullptr;  // the engine created last
  RegistrationConfig last_config;   // and its registration
};

class RegistryFixture : public ::testing::Test {
 protected:
  // The backend, pools, sessions and a registry without a watchdog
  // thread (tests call Watch).
  void SetUp() override;

  // A peer session of `uid`, authenticated.
  Caller Open(const std::string& name, uid_t uid);
  // A pool of `layers` layers owned by uid 1000.
  void CreatePool(const std::string& name, const std::string& format, int bs,
                  int blocks, int layers);
  // A CPU buffer of `size` bytes in the caller's session; its id.
  uint64_t AddBuffer(const Caller& c, int64_t size);
  // The base of buffer `id` of the caller's session (null: not found).
  uint8_t* BufferBase(const Caller& c, uint64_t id);
  // Registers `r` for `owner`; its id, or 0 and a test failure if refused.
  uint64_t RegisterOk(const Caller& owner, const v1::RegisterWorkerRequest& r);

  RecordingFactory factory_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<PoolRegistry> pools_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<StepRegistry> registry_;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_REGISTRY_FIXTURE_H_
