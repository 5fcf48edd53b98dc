#include "server/step/registry_fixture.h"

#include <utility>

#include "proto/wire.h"
#include "server/cpu/cpu_backend.h"

namespace kvdepot::step {

std::string PackInt32s(const std::vector<int32_t>& v) {
  std::string out;
  EncodeInt32s(v, &out);
  return out;
}

absl::Status RecordingEngine::Enqueue(StepPlan plan) {
  plans.push_back(std::move(plan));
  return absl::OkStatus();
}

void RecordingEngine::Finish(uint64_t status_bits, uint64_t out_of_range,
                             std::vector<float> phase_us, bool instantiated) {
  StepOutcome o;
  o.step_id = plans.front().step_id;
  o.status_bits = status_bits;
  o.out_of_range = out_of_range;
  o.phase_us = std::move(phase_us);
  o.graph_instantiated = instantiated;
  plans.pop_front();
  done_(o);
}

absl::StatusOr<std::unique_ptr<StepEngine>> RecordingFactory::Create(
    const RegistrationConfig& config, CompletionFn done) {
  auto e = std::make_unique<RecordingEngine>(std::move(done));
  last = e.get();
  last_config = config;
  return e;
}

void RegistryFixture::SetUp() {
  backend_ = MakeCpuBackend({});
  pools_ = std::make_unique<PoolRegistry>(backend_.get(), int64_t{1} << 30);
  sessions_ = std::make_unique<SessionManager>(SessionLimits());
  RegistryOptions o;
  o.watch_interval = absl::ZeroDuration();  // Watch is called by hand
  registry_ = std::make_unique<StepRegistry>(&factory_, pools_.get(),
                                             sessions_.get(), o);
}

Caller RegistryFixture::Open(const std::string& name, uid_t uid) {
  PeerCredentials p;
  p.uid = uid;
  p.gid = uid;
  p.pid = 1;
  absl::StatusOr<OpenedSession> s = sessions_->OpenPeer(name, p);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return Caller();
  absl::StatusOr<Caller> c = sessions_->Authenticate(s->id, absl::Now());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : Caller();
}

void RegistryFixture::CreatePool(const std::string& name,
                                 const std::string& format, int bs, int blocks,
                                 int layers) {
  v1::CreatePoolRequest r;
  r.set_name(name);
  r.set_format(format);
  r.set_block_size(bs);
  r.set_num_blocks(blocks);
  r.set_num_layers(layers);
  absl::StatusOr<std::shared_ptr<Pool>> p = pools_->Create(r, 1000);
  ASSERT_TRUE(p.ok()) << name << ": " << p.status();
}

void BufferSlices::Next(v1::StepBufferRef* out, int64_t bytes) {
  out->set_buffer_id(id_);
  out->set_offset(offset_);
  offset_ += (bytes + 255) / 256 * 256;
}

uint64_t RegistryFixture::RegisterOk(const Caller& owner,
                                     const v1::RegisterWorkerRequest& r) {
  absl::StatusOr<v1::RegisterWorkerResponse> made =
      registry_->Register(owner, r);
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? made->registration_id() : 0;
}

uint64_t RegistryFixture::AddBuffer(const Caller& c, int64_t size) {
  absl::StatusOr<std::unique_ptr<Memory>> m = backend_->Allocate(size, "cpu");
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return 0;
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      sessions_->AddBuffer(c, *std::move(m));
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? (*b)->id : 0;
}

uint8_t* RegistryFixture::BufferBase(const Caller& c, uint64_t id) {
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      sessions_->GetBuffer(c, "test", id);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? (*b)->memory->data() : nullptr;
}

}  // namespace kvdepot::step
