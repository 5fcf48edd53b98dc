#include "server/step/step_test_rig.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "proto/step_doorbell.h"
#include "proto/wire.h"
#include "server/cpu/cpu_backend.h"

namespace kvdepot::step {
namespace {

constexpr int kRing = 16;   // SWA pool block size (the ring)
constexpr int kWindow = 8;  // SWA window

std::string Pack(const std::vector<int32_t>& v) {
  std::string out;
  EncodeInt32s(v, &out);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepTestRig>> StepTestRig::Start(
    const StepTestRigOptions& options) {
  if (options.max_batch < 1 || options.max_batch > 4096 || options.top_k < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch = ", options.max_batch, " (in [1, 4096]), ",
                     "top_k = ", options.top_k, " (>= 1)"));
  }
  std::unique_ptr<StepTestRig> rig(new StepTestRig(options));
  RETURN_IF_ERROR(rig->Init());
  return rig;
}

absl::Status StepTestRig::Init() {
  backend_ = MakeCpuBackend({});
  pools_ = std::make_unique<PoolRegistry>(backend_.get(), int64_t{1} << 32);
  sessions_ = std::make_unique<SessionManager>(SessionLimits());
  for (auto [name, format, bs, blocks] :
       {std::tuple{"main", "V41", kBlockSize, num_blocks()},
        std::tuple{"swa", "V41", kRing, options_.max_batch},
        std::tuple{"index", "FP4_INDEX", kBlockSize, num_blocks()}}) {
    v1::CreatePoolRequest r;
    r.set_name(name);
    r.set_format(format);
    r.set_block_size(bs);
    r.set_num_blocks(blocks);
    r.set_num_layers(kLayers);
    RETURN_IF_ERROR(pools_->Create(r, kWorkerUid).status());
  }
  auto factory = std::make_unique<FakeEngineFactory>(options_.auto_finish);
  factory_ = factory.get();
  StepServerOptions so;
  so.registry.watch_interval = absl::ZeroDuration();  // no watchdog thread
  so.service = options_.service;
  so.worker_threads = 2;
  ASSIGN_OR_RETURN(step_, MakeStepServer(std::move(factory), pools_.get(),
                                         sessions_.get(), so));
  dir_ = "/tmp/kvdepot-steprig-XXXXXX";
  if (mkdtemp(dir_.data()) == nullptr) {
    return absl::InternalError("mkdtemp /tmp/kvdepot-steprig-XXXXXX failed");
  }
  target_ = "unix:" + dir_ + "/step.sock";
  grpc::ServerBuilder b;
  b.AddListeningPort(target_, grpc::InsecureServerCredentials());
  b.SetMaxReceiveMessageSize(64 << 20);
  b.SetMaxSendMessageSize(64 << 20);
  b.RegisterService(step_->service());
  server_ = b.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", target_));
  }
  return absl::OkStatus();
}

StepTestRig::~StepTestRig() {
  if (server_ != nullptr) {
    step_->EndStreams();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(5));
    server_->Wait();
  }
  if (step_ != nullptr) step_->Shutdown();
  if (!dir_.empty()) {
    unlink((dir_ + "/step.sock").c_str());
    rmdir(dir_.c_str());
  }
}

std::shared_ptr<grpc::Channel> StepTestRig::NewChannel() const {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(target_, grpc::InsecureChannelCredentials(),
                                   args);
}

absl::StatusOr<OpenedSession> StepTestRig::OpenSession(const std::string& name,
                                                       uid_t uid) {
  PeerCredentials p;
  p.uid = uid;
  p.gid = uid;
  p.pid = getpid();
  return sessions_->OpenPeer(name, p);
}

absl::StatusOr<uint64_t> StepTestRig::AddBuffer(const Caller& caller,
                                                int64_t size) {
  ASSIGN_OR_RETURN(std::unique_ptr<Memory> m, backend_->Allocate(size, "cpu"));
  ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b,
                   sessions_->AddBuffer(caller, std::move(m)));
  return b->id;
}

absl::StatusOr<uint64_t> StepTestRig::Register(const std::string& session_id) {
  ASSIGN_OR_RETURN(Caller caller,
                   sessions_->Authenticate(session_id, absl::Now()));
  const int n = options_.max_batch;
  v1::RegisterWorkerRequest r;
  r.set_session_id(session_id);
  r.set_max_tokens(n);
  r.set_max_seqs(n);
  r.set_max_top_k(options_.top_k);
  r.set_max_blocks_per_seq(kBlocksPerSeq);
  r.set_name("rig");
  int64_t off = 0;
  std::vector<v1::StepBufferRef*> refs;
  auto ref = [&](v1::StepBufferRef* out, int64_t bytes) {
    out->set_offset(off);
    off += (bytes + 255) / 256 * 256;
    refs.push_back(out);
  };
  for (int l = 0; l < kLayers; ++l) {
    v1::StepLayer* layer = r.add_layers();
    layer->set_window(kWindow);
    for (auto [cache, pool, elements] :
         {std::tuple{layer->mutable_main(), "main", 512},
          std::tuple{layer->mutable_swa(), "swa", 512},
          std::tuple{layer->mutable_index(), "index", 128}}) {
      cache->set_pool(pool);
      cache->set_layer(l);
      ref(cache->mutable_input(), int64_t{n} * elements * 2);
    }
    ref(layer->mutable_topk(), int64_t{n} * options_.top_k * 4);
    ref(layer->mutable_index_out(), int64_t{n} * options_.top_k * 4);
  }
  r.mutable_swa_index()->set_pool("swa");
  r.mutable_swa_index()->set_window(kWindow);
  ref(r.mutable_swa_index()->mutable_out(), int64_t{n} * kWindow * 4);
  ASSIGN_OR_RETURN(const uint64_t io, AddBuffer(caller, off));
  for (v1::StepBufferRef* p : refs) p->set_buffer_id(io);
  ASSIGN_OR_RETURN(const uint64_t doorbell,
                   AddBuffer(caller, doorbell::RegionBytes(kLayers)));
  r.set_doorbell_buffer_id(doorbell);
  ASSIGN_OR_RETURN(v1::RegisterWorkerResponse out,
                   step_->registry()->Register(caller, r));
  return out.registration_id();
}

absl::StatusOr<StepTestRig::Parties> StepTestRig::OpenParties() {
  Parties p;
  ASSIGN_OR_RETURN(p.worker, OpenSession("worker", kWorkerUid));
  ASSIGN_OR_RETURN(p.intruder, OpenSession("intruder", kWorkerUid + 1000));
  ASSIGN_OR_RETURN(p.registration, Register(p.worker.id));
  return p;
}

v1::StepRequest StepTestRig::Step(const std::string& session_id,
                                  uint64_t registration, uint64_t step_id,
                                  int batch) const {
  const int slots = kBlockSize * num_blocks();
  std::vector<int32_t> slot_mapping, seq_lens, query_lens, states, tables;
  for (int b = 0; b < batch; ++b) {
    slot_mapping.push_back(static_cast<int32_t>((int64_t{b} * 17) % slots));
    seq_lens.push_back(1 + (b * 37) % (kBlockSize * kBlocksPerSeq - 1));
    query_lens.push_back(1);
    states.push_back(b);
    for (int c = 0; c < kBlocksPerSeq; ++c) {
      tables.push_back((b + c) % num_blocks());
    }
  }
  v1::StepRequest r;
  r.set_session_id(session_id);
  r.set_registration_id(registration);
  r.set_step_id(step_id);
  r.set_num_tokens(batch);
  r.set_slot_mapping(Pack(slot_mapping));
  r.set_num_seqs(batch);
  r.set_seq_lens(Pack(seq_lens));
  r.set_query_lens(Pack(query_lens));
  r.set_swa_state_ids(Pack(states));
  r.set_block_tables(Pack(tables));
  r.set_block_table_cols(kBlocksPerSeq);
  r.set_top_k(options_.top_k);
  return r;
}

}  // namespace kvdepot::step
