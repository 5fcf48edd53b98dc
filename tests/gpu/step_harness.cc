#include "tests/gpu/step_harness.h"

#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"
#include "planner/plan.h"
#include "proto/step_doorbell.h"
#include "proto/wire.h"
#include "tests/gpu/step_worker_kernels.h"

namespace kvdepot::testing {
namespace {

constexpr int64_t kAlign = 256;
int64_t Up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

absl::Status Worker(int rc, absl::string_view what) {
  if (rc == KVD_OK) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": rc ", rc, ": ", kvd_last_error()));
}

// A companion request with a descriptor in the reply.
absl::StatusOr<v1::CompanionReply> CallForFd(KVCacheClient* client,
                                             const v1::CompanionRequest& req,
                                             UniqueFd* fd) {
  ASSIGN_OR_RETURN(v1::CompanionReply r,
                   client->companion()->Call(req, -1, fd));
  if (!fd->valid()) return absl::InternalError("no descriptor in the reply");
  return r;
}

// The rows a worker's kernels produce: seed per (step, layer, kind).
enum RowKind { kMainRows = 0, kSwaRows = 1, kIndexRows = 2, kTopkRows = 3 };
uint64_t InputSeed(uint64_t kv_seed, uint64_t step, int layer, RowKind kind) {
  return StepHash(kv_seed, step * 4096 + static_cast<uint64_t>(layer) * 4 +
                               static_cast<uint64_t>(kind));
}
// Top-k entries reach a little past the longest sequence a step can have.
int32_t TopkLimit(const RigOptions& o) {
  return o.block_size * o.max_blocks_per_seq;
}

// What the block-table buffer holds where no step reads: entries outside
// [-1, num_blocks) of every kind, so a read there changes the index rows.
void PoisonTables(int32_t num_blocks, int32_t* p, int64_t n) {
  const int32_t poison[] = {
      std::numeric_limits<int32_t>::min(), -2,    num_blocks,
      std::numeric_limits<int32_t>::max(), -1000, num_blocks + 17};
  for (int64_t i = 0; i < n; ++i) p[i] = poison[i % 6];
}

uint16_t RandomBf16(std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-3.0f, 3.0f);
  const float f = d(rng);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

void SetStepEnvironment() { setenv("CUDA_MODULE_LOADING", "EAGER", 1); }

absl::Status SyncWithin(cudaStream_t s, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (true) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return Cuda(e, "cudaStreamQuery");
    if (absl::Now() > end) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the stream did not finish within ", absl::FormatDuration(limit)));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

StepRig::~StepRig() {
  if (stream_ != nullptr) {
    stream_->WritesDone();
    stream_->Finish().IgnoreError();
  }
  if (worker_ != nullptr) kvd_worker_close(worker_);
  if (options_.delete_pools && options_.create_pools && client_ != nullptr) {
    for (const PoolRef* p : {&main_, &swa_, &index_}) {
      if (!p->name.empty()) client_->DeletePool(p->name).IgnoreError();
    }
  }
  if (registration_id_ != 0 && stub_ != nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::UnregisterRequest r;
    r.set_session_id(client_->session_id());
    r.set_registration_id(registration_id_);
    v1::UnregisterResponse out;
    stub_->Unregister(&ctx, r, &out);
  }
}

absl::StatusOr<std::unique_ptr<StepRig>> StepRig::Create(
    const std::string& socket, const RigOptions& options) {
  std::unique_ptr<StepRig> rig(new StepRig());
  rig->options_ = options;
  RETURN_IF_ERROR(rig->Init(socket));
  return rig;
}

absl::Status StepRig::AllocatePoisoned(int64_t bytes, int32_t bound,
                                       uint64_t* id,
                                       gpu::VmmAllocation* mapping,
                                       std::unique_ptr<Pinned>* staging) {
  v1::CompanionRequest req;
  req.mutable_allocate_buffer()->set_size(bytes);
  UniqueFd fd;
  ASSIGN_OR_RETURN(v1::CompanionReply r, CallForFd(client_.get(), req, &fd));
  *id = r.buffer().buffer_id();
  ASSIGN_OR_RETURN(*mapping,
                   gpu::VmmAllocation::Import(fd.get(), r.fd_size(), 0));
  ASSIGN_OR_RETURN(Pinned t, Pinned::Create(bytes));
  *staging = std::make_unique<Pinned>(std::move(t));
  PoisonTables(bound, reinterpret_cast<int32_t*>((*staging)->data()),
               bytes / 4);
  return Cuda(cudaMemcpy(mapping->data(), (*staging)->data(), bytes,
                         cudaMemcpyHostToDevice),
              "poisoning a worker buffer");
}

absl::StatusOr<StepRig::PoolRef> StepRig::OpenPool(const std::string& name,
                                                   const std::string& format,
                                                   int64_t block_size,
                                                   int64_t num_blocks) {
  PoolRef p;
  p.name = name;
  ASSIGN_OR_RETURN(KVCacheFormat f, FormatFromName(format));
  ASSIGN_OR_RETURN(p.layout,
                   MakePoolLayout(f, block_size, num_blocks, PoolLayers()));
  if (options_.create_pools) {
    v1::CreatePoolRequest c;
    c.set_name(name);
    c.set_format(format);
    c.set_block_size(block_size);
    c.set_num_blocks(num_blocks);
    c.set_num_layers(PoolLayers());
    RETURN_IF_ERROR(client_->CreateOrGetPool(c).status());
  }
  v1::CompanionRequest req;
  req.mutable_map_pool()->set_name(name);
  UniqueFd fd;
  ASSIGN_OR_RETURN(v1::CompanionReply r, CallForFd(client_.get(), req, &fd));
  ASSIGN_OR_RETURN(p.mapping,
                   gpu::VmmAllocation::Import(fd.get(), r.fd_size(), 0));
  p.reference.assign(static_cast<size_t>(p.layout.total_bytes), 0);
  if (!options_.create_pools) {
    // A shared pool: start the reference from what it holds now.
    RETURN_IF_ERROR(
        Cuda(cudaMemcpy(p.reference.data(), p.mapping.data(),
                        p.layout.total_bytes, cudaMemcpyDeviceToHost),
             "reading a shared pool"));
  }
  return p;
}

absl::Status StepRig::Init(const std::string& socket) {
  ClientOptions co;
  co.address = socket;
  co.client_name = options_.prefix;
  ASSIGN_OR_RETURN(client_, KVCacheClient::Connect(co));
  stub_ = v1::Step::NewStub(client_->channel());
  const RigOptions& o = options_;
  ASSIGN_OR_RETURN(
      main_, OpenPool(o.prefix + "_main", "V41", o.block_size, o.num_blocks));
  ASSIGN_OR_RETURN(swa_, OpenPool(o.prefix + "_swa", "V41", o.ring, o.states));
  ASSIGN_OR_RETURN(index_, OpenPool(o.prefix + "_index", o.index_format,
                                    o.block_size, o.num_blocks));

  kv_bytes_ = Up(int64_t{o.max_tokens} * 512 * 2);
  index_bytes_ = Up(int64_t{o.max_tokens} * 128 * 2);
  topk_bytes_ = Up(int64_t{o.max_tokens} * o.top_k * 4);
  layer_stride_ = 2 * kv_bytes_ + index_bytes_ + 2 * topk_bytes_;
  io_bytes_ =
      o.layers * layer_stride_ + Up(int64_t{o.max_tokens} * o.window * 4);
  {
    v1::CompanionRequest req;
    req.mutable_allocate_buffer()->set_size(io_bytes_);
    UniqueFd fd;
    ASSIGN_OR_RETURN(v1::CompanionReply r, CallForFd(client_.get(), req, &fd));
    io_id_ = r.buffer().buffer_id();
    ASSIGN_OR_RETURN(io_, gpu::VmmAllocation::Import(fd.get(), r.fd_size(), 0));
  }
  ASSIGN_OR_RETURN(Pinned pinned, Pinned::Create(io_bytes_));
  staging_ = std::make_unique<Pinned>(std::move(pinned));

  if (o.device_block_tables && !o.bare) {
    // The worker's block tables in device memory: max_seqs rows of
    // table_stride() int32 from kTableOffset, poisoned until a step's rows
    // are staged.
    tables_bytes_ = kTableOffset + int64_t{o.max_seqs} * table_stride() * 4;
    RETURN_IF_ERROR(AllocatePoisoned(tables_bytes_, o.num_blocks, &tables_id_,
                                     &tables_, &table_staging_));
  }
  if (o.device_slot_mappings && !o.bare) {
    // The worker's slot mappings in device memory: slot_rows() rows of
    // slot_row_stride() int32 from kSlotOffset, poisoned (every value outside
    // the pools) until a step's mappings are staged.
    slots_bytes_ = kSlotOffset + int64_t{slot_rows()} * slot_row_stride() * 4;
    RETURN_IF_ERROR(AllocatePoisoned(slots_bytes_, SlotCapacity(), &slots_id_,
                                     &slot_buffer_, &slot_staging_));
  }

  UniqueFd doorbell_fd;
  v1::CompanionReply doorbell;
  {
    v1::CompanionRequest req;
    req.mutable_allocate_buffer()->set_size(doorbell::RegionBytes(o.layers));
    ASSIGN_OR_RETURN(doorbell, CallForFd(client_.get(), req, &doorbell_fd));
    doorbell_id_ = doorbell.buffer().buffer_id();
  }

  v1::RegisterWorkerRequest r;
  r.set_session_id(client_->session_id());
  r.set_doorbell_buffer_id(doorbell_id_);
  r.set_max_tokens(o.max_tokens);
  r.set_max_seqs(o.max_seqs);
  r.set_max_top_k(o.top_k);
  r.set_max_blocks_per_seq(o.max_blocks_per_seq);
  r.set_name(o.prefix);
  auto ref = [this](v1::StepBufferRef* out, int64_t offset) {
    out->set_buffer_id(io_id_);
    out->set_offset(offset);
  };
  for (int l = 0; l < o.layers && o.bare; ++l) r.add_layers();
  for (int l = 0; l < o.layers && !o.bare; ++l) {
    v1::StepLayer* layer = r.add_layers();
    layer->set_ratio(LayerRatio(o, l));
    layer->set_window(o.window);
    layer->mutable_main()->set_pool(main_.name);
    layer->mutable_main()->set_layer(l);
    ref(layer->mutable_main()->mutable_input(), main_in(l));
    layer->mutable_swa()->set_pool(swa_.name);
    layer->mutable_swa()->set_layer(l);
    ref(layer->mutable_swa()->mutable_input(), swa_in(l));
    layer->mutable_index()->set_pool(index_.name);
    layer->mutable_index()->set_layer(l);
    ref(layer->mutable_index()->mutable_input(), index_in(l));
    ref(layer->mutable_topk(), topk_off(l));
    ref(layer->mutable_index_out(), out_off(l));
  }
  if (!o.bare) {
    r.mutable_swa_index()->set_pool(swa_.name);
    r.mutable_swa_index()->set_window(o.window);
    ref(r.mutable_swa_index()->mutable_out(), swa_out());
  }
  if (tables_id_ != 0) {
    r.mutable_block_tables()->set_buffer_id(tables_id_);
    r.mutable_block_tables()->set_offset(kTableOffset);
    r.mutable_block_tables()->set_row_stride(int64_t{4} * table_stride());
  }
  if (slots_id_ != 0) {
    r.mutable_slot_mappings()->set_buffer_id(slots_id_);
    r.mutable_slot_mappings()->set_offset(kSlotOffset);
    r.mutable_slot_mappings()->set_row_stride(int64_t{4} * slot_row_stride());
  }
  if (o.edit_registration) o.edit_registration(&r);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::RegisterWorkerResponse reg;
  grpc::Status s = stub_->RegisterWorker(&ctx, r, &reg);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("RegisterWorker: ", s.error_code(),
                                            " ", s.error_message()));
  }
  registration_id_ = reg.registration_id();
  RETURN_IF_ERROR(Worker(kvd_worker_open(doorbell_fd.get(), doorbell.fd_size(),
                                         0, o.layers, o.watchdog_ms, &worker_),
                         "kvd_worker_open"));
  return absl::OkStatus();
}

StepInput StepRig::RandomStep(uint64_t step_id, std::mt19937& rng) const {
  return RandomStepFor(options_, step_id, rng);
}

StepInput RandomStepFor(const RigOptions& o, uint64_t step_id,
                        std::mt19937& rng) {
  const int num_states = o.state_count > 0 ? o.state_count : o.states;
  StepInput in;
  in.step_id = step_id;
  const int seqs = o.decode_only
                       ? std::min(o.max_seqs, num_states)
                       : std::uniform_int_distribution<int>(
                             1, std::min(o.max_seqs, num_states))(rng);
  int total = 0;
  for (int b = 0; b < seqs; ++b) {
    const int left = o.max_tokens - total - (seqs - b - 1);
    const int q =
        o.decode_only
            ? 1
            : std::min(left, std::uniform_int_distribution<int>(1, 2)(rng));
    in.query_lens.push_back(q);
    total += q;
    in.seq_lens.push_back(std::uniform_int_distribution<int>(
        q, o.block_size * o.max_blocks_per_seq)(rng));
  }
  std::vector<int32_t> states(num_states);
  std::iota(states.begin(), states.end(), o.state_offset);
  std::shuffle(states.begin(), states.end(), rng);
  in.states.assign(states.begin(), states.begin() + seqs);
  std::vector<int32_t> slots;
  for (int s = o.slot_offset; s < o.block_size * o.num_blocks;
       s += o.slot_stride) {
    slots.push_back(s);
  }
  std::shuffle(slots.begin(), slots.end(), rng);
  in.slots.assign(slots.begin(), slots.begin() + total);
  for (int32_t& s : in.slots) {
    if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) s = -1;
  }
  for (int i = 0; i < seqs * o.max_blocks_per_seq; ++i) {
    const bool hole = std::uniform_int_distribution<int>(0, 49)(rng) == 0;
    in.block_tables.push_back(
        hole ? -1
             : std::uniform_int_distribution<int>(0, o.num_blocks - 1)(rng));
  }
  // Drawn only here, so the other rigs' random steps stay the same.
  auto draw_compressed = [&] {
    std::vector<int32_t> c;
    for (int s = 0; s < o.block_size * o.num_blocks; ++s) c.push_back(s);
    std::shuffle(c.begin(), c.end(), rng);
    c.resize(total);
    for (int32_t& s : c) {
      if (std::uniform_int_distribution<int>(0, 3)(rng) != 0) s = -1;
    }
    return c;
  };
  if (o.ratio > 1) in.compressed_slots = draw_compressed();
  if (o.ratio2 > 1) in.compressed_slots2 = draw_compressed();
  in.kv_main.resize(o.layers);
  in.kv_swa.resize(o.layers);
  in.kv_index.resize(o.layers);
  in.topk.resize(o.layers);
  for (int l = 0; l < o.layers && o.kv_seed != 0; ++l) {
    // What the worker's kernels produce (EnqueueWorker).
    for (int i = 0; i < total * 512; ++i) {
      in.kv_main[l].push_back(
          StepValueBf16(InputSeed(o.kv_seed, step_id, l, kMainRows), i));
      in.kv_swa[l].push_back(
          StepValueBf16(InputSeed(o.kv_seed, step_id, l, kSwaRows), i));
    }
    for (int i = 0; i < total * 128; ++i) {
      in.kv_index[l].push_back(
          StepValueBf16(InputSeed(o.kv_seed, step_id, l, kIndexRows), i));
    }
    for (int i = 0; i < total * o.top_k; ++i) {
      in.topk[l].push_back(StepValueTopk(
          InputSeed(o.kv_seed, step_id, l, kTopkRows), i, TopkLimit(o)));
    }
  }
  for (int l = 0; l < o.layers && o.kv_seed == 0; ++l) {
    for (int i = 0; i < total * 512; ++i)
      in.kv_main[l].push_back(RandomBf16(rng));
    for (int i = 0; i < total * 512; ++i)
      in.kv_swa[l].push_back(RandomBf16(rng));
    for (int i = 0; i < total * 128; ++i)
      in.kv_index[l].push_back(RandomBf16(rng));
    int row = 0;
    for (int b = 0; b < seqs; ++b) {
      for (int j = 0; j < in.query_lens[b]; ++j, ++row) {
        std::uniform_int_distribution<int> x(-1, in.seq_lens[b] + 2);
        for (int c = 0; c < o.top_k; ++c) in.topk[l].push_back(x(rng));
      }
    }
  }
  return in;
}

v1::StepRequest StepRig::Request(const StepInput& in) const {
  v1::StepRequest r;
  FillRequest(in, &r);
  return r;
}

void StepRig::FillRequest(const StepInput& in, v1::StepRequest* r) const {
  // Every field is set each time; bytes fields are refilled in place
  // (their capacity stays), so a reused request allocates nothing.
  r->set_session_id(client_->session_id());
  r->set_registration_id(registration_id_);
  r->set_step_id(in.step_id);
  EncodeInt32s(in.slots, r->mutable_slot_mapping());
  r->set_num_tokens(in.num_tokens());
  r->set_slot_mappings_in_buffer(false);
  r->set_num_seqs(static_cast<int32_t>(in.query_lens.size()));
  EncodeInt32s(in.seq_lens, r->mutable_seq_lens());
  EncodeInt32s(in.query_lens, r->mutable_query_lens());
  r->set_deadline_ms(options_.deadline_ms);
  if (options_.bare) {
    r->clear_swa_state_ids();
    r->clear_block_tables();
    r->set_block_tables_in_buffer(false);
    r->set_block_table_cols(0);
    r->set_top_k(0);
    return;
  }
  EncodeInt32s(in.states, r->mutable_swa_state_ids());
  if (tables_in_buffer(in)) {
    r->clear_block_tables();  // the worker's stream writes them (staged)
    r->set_block_tables_in_buffer(true);
  } else {
    EncodeInt32s(in.block_tables, r->mutable_block_tables());
    r->set_block_tables_in_buffer(false);
  }
  r->set_block_table_cols(table_cols(in));
  r->set_top_k(options_.top_k);
  if (options_.ratio > 1 && options_.ratio2 > 1) {
    // Several ratios: one StepRequest.compressed entry each.
    r->clear_compressed_slot_mapping();
    while (r->compressed_size() < 2) r->add_compressed();
    r->mutable_compressed(0)->set_ratio(options_.ratio);
    EncodeInt32s(in.compressed_slots,
                 r->mutable_compressed(0)->mutable_slot_mapping());
    r->mutable_compressed(1)->set_ratio(options_.ratio2);
    EncodeInt32s(in.compressed_slots2,
                 r->mutable_compressed(1)->mutable_slot_mapping());
  } else if (options_.ratio > 1) {
    EncodeInt32s(in.compressed_slots, r->mutable_compressed_slot_mapping());
    r->clear_compressed();
  } else {
    r->clear_compressed_slot_mapping();
    r->clear_compressed();
  }
  if (slots_in_buffer(in)) {
    // The worker's stream writes every mapping (staged); none inline.
    r->clear_slot_mapping();
    r->clear_compressed_slot_mapping();
    r->clear_compressed();
    r->set_slot_mappings_in_buffer(true);
  }
  if (options_.edit_step) options_.edit_step(in, r);
}

absl::StatusOr<v1::StepResponse> StepRig::SendStep(const StepInput& in) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  FillRequest(in, &request_);
  grpc::Status s = stub_->Step(&ctx, request_, &reply_);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("Step: ", s.error_message()));
  }
  return reply_;
}

absl::StatusOr<v1::StepResponse> StepRig::SendStepOnStream(
    const StepInput& in) {
  if (stream_ == nullptr) {
    stream_ctx_ = std::make_unique<grpc::ClientContext>();
    stream_ = stub_->StepStream(stream_ctx_.get());
  }
  FillRequest(in, &request_);
  if (stream_->Write(request_) && stream_->Read(&reply_)) {
    if (reply_.error_code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(reply_.error_code()),
                          absl::StrCat("Step: ", reply_.error_message()));
    }
    return reply_;
  }
  const grpc::Status s = stream_->Finish();
  stream_.reset();
  return absl::UnavailableError(
      absl::StrCat("the step stream ended: ", s.error_message()));
}

absl::StatusOr<v1::StepResponse> StepRig::SendStepOnRing(const StepInput& in) {
  FillRequest(in, &request_);
  if (ring_ == nullptr) {
    const int64_t bytes = std::max<int64_t>(
        kStepRingMinRequestBytes,
        (2 * static_cast<int64_t>(request_.ByteSizeLong()) + 63) / 64 * 64);
    ASSIGN_OR_RETURN(ring_,
                     StepRingClient::Open(client_->companion(), 4, bytes));
  }
  ASSIGN_OR_RETURN(v1::StepResponse reply,
                   ring_->Step(request_, absl::Seconds(10)));
  if (reply.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.error_code()),
                        absl::StrCat("Step: ", reply.error_message()));
  }
  return reply;
}

absl::StatusOr<v1::RegistrationInfo> StepRig::Status() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StepStatusRequest r;
  r.set_session_id(client_->session_id());
  r.set_registration_id(registration_id_);
  v1::StepStatusResponse out;
  grpc::Status s = stub_->StepStatus(&ctx, r, &out);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("StepStatus: ", s.error_message()));
  }
  return out.registration();
}

void StepRig::StageInputs(const StepInput& in) {
  const int n = in.num_tokens();
  staged_step_ = in.step_id;
  staged_tokens_ = n;
  if (table_staging_ != nullptr) {
    // Poison everywhere, then the step's rows [0, seqs) x [0, cols) (none
    // for an inline step: the kernel must not read the buffer then).
    int32_t* t = reinterpret_cast<int32_t*>(table_staging_->data());
    PoisonTables(options_.num_blocks, t, tables_bytes_ / 4);
    if (tables_in_buffer(in)) {
      const int cols = table_cols(in);
      int32_t* rows = t + kTableOffset / 4;
      for (int b = 0; b < in.num_seqs(); ++b) {
        std::memcpy(rows + int64_t{b} * table_stride(),
                    in.block_tables.data() + int64_t{b} * cols, 4 * cols);
      }
    }
  }
  if (slot_staging_ != nullptr) StageSlots(in);
  if (options_.kv_seed != 0) return;  // the worker's kernels produce them
  uint8_t* p = staging_->data();
  for (int l = 0; l < options_.layers; ++l) {
    std::memcpy(p + main_in(l), in.kv_main[l].data(), n * 1024);
    std::memcpy(p + swa_in(l), in.kv_swa[l].data(), n * 1024);
    std::memcpy(p + index_in(l), in.kv_index[l].data(), n * 256);
    std::memcpy(p + topk_off(l), in.topk[l].data(), n * options_.top_k * 4);
  }
}

void StepRig::StageSlots(const StepInput& in) {
  // Poison everywhere, then the step's rows [0, num_tokens) (none for an
  // inline step: the import must not read the buffer then).
  int32_t* t = reinterpret_cast<int32_t*>(slot_staging_->data());
  PoisonTables(SlotCapacity(), t, slots_bytes_ / 4);
  if (!slots_in_buffer(in)) return;
  int32_t* rows = t + kSlotOffset / 4;
  auto put = [&](int row, const std::vector<int32_t>& v) {
    std::memcpy(rows + int64_t{row} * slot_row_stride(), v.data(),
                4 * v.size());
  };
  put(0, in.slots);
  const RigOptions& o = options_;
  if (o.ratio > 1 && o.ratio2 > 1) {  // rows in ascending ratio order
    put(o.ratio < o.ratio2 ? 1 : 2, in.compressed_slots);
    put(o.ratio < o.ratio2 ? 2 : 1, in.compressed_slots2);
  } else if (o.ratio > 1) {
    put(1, in.compressed_slots);
  }
}

absl::Status StepRig::EnqueueWorker(cudaStream_t s, bool copy_inputs,
                                    const WorkerHooks& hooks) {
  const int n = staged_tokens_;
  uint8_t* dev = io_.data();
  const uint8_t* host = staging_->data();
  const RigOptions& o = options_;
  auto copy = [&](int64_t off, int64_t bytes) {
    return Cuda(cudaMemcpyAsync(dev + off, host + off, bytes,
                                cudaMemcpyHostToDevice, s),
                "copying the worker's rows");
  };
  // The worker's own kernels write the layer's rows (kv_seed).
  auto produce = [&](int l, RowKind kind) -> absl::Status {
    const uint64_t seed = InputSeed(o.kv_seed, staged_step_, l, kind);
    int e = 0;
    switch (kind) {
      case kMainRows:
        e = LaunchFillBf16(reinterpret_cast<uint16_t*>(dev + main_in(l)),
                           int64_t{n} * 512, seed, s);
        break;
      case kSwaRows:
        e = LaunchFillBf16(reinterpret_cast<uint16_t*>(dev + swa_in(l)),
                           int64_t{n} * 512, seed, s);
        break;
      case kIndexRows:
        e = LaunchFillBf16(reinterpret_cast<uint16_t*>(dev + index_in(l)),
                           int64_t{n} * 128, seed, s);
        break;
      case kTopkRows:
        e = LaunchFillTopk(reinterpret_cast<int32_t*>(dev + topk_off(l)),
                           int64_t{n} * o.top_k, seed, TopkLimit(o), s);
        break;
    }
    return Cuda(static_cast<cudaError_t>(e), "producing the worker's rows");
  };
  auto record = [&](int index) -> absl::Status {
    if (hooks.phase_events == nullptr) return absl::OkStatus();
    return Cuda(cudaEventRecord((*hooks.phase_events)[index], s),
                "cudaEventRecord");
  };
  // work, event, mark, wait, event.
  auto phase = [&](int p) -> absl::Status {
    if (hooks.work) RETURN_IF_ERROR(hooks.work(s));
    RETURN_IF_ERROR(record(2 * p));
    RETURN_IF_ERROR(Worker(kvd_mark(worker_, s, p), "kvd_mark"));
    RETURN_IF_ERROR(Worker(kvd_wait(worker_, s, p), "kvd_wait"));
    return record(2 * p + 1);
  };
  RETURN_IF_ERROR(record(0));
  RETURN_IF_ERROR(Worker(kvd_step_begin(worker_, s), "kvd_step_begin"));
  RETURN_IF_ERROR(Worker(kvd_wait(worker_, s, KVD_BEGIN), "kvd_wait(begin)"));
  RETURN_IF_ERROR(record(1));
  for (int l = 0; l < options_.layers; ++l) {
    if (copy_inputs && !o.bare && o.kv_seed != 0) {
      RETURN_IF_ERROR(produce(l, kMainRows));
      RETURN_IF_ERROR(produce(l, kSwaRows));
      RETURN_IF_ERROR(produce(l, kIndexRows));
    } else if (copy_inputs && !o.bare) {
      RETURN_IF_ERROR(copy(main_in(l), n * 1024));
      RETURN_IF_ERROR(copy(swa_in(l), n * 1024));
      RETURN_IF_ERROR(copy(index_in(l), n * 256));
    }
    if (l == 0 && copy_inputs && slot_staging_ != nullptr) {
      // The slot mappings' ordering contract: written on the worker's
      // stream before mark(A_0), the phase whose start imports them; the
      // previous step's A_0 done was waited for long before.
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(slot_buffer_.data(), slot_staging_->data(),
                               slots_bytes_, cudaMemcpyHostToDevice, s),
               "writing the slot mappings"));
    }
    RETURN_IF_ERROR(phase(kvd_phase_a(l)));
    if (hooks.after_stores) RETURN_IF_ERROR(hooks.after_stores(s, l));
    if (l == 0 && copy_inputs && table_staging_ != nullptr) {
      // The ordering contract at its edge: the step's tables written on
      // the worker's stream before mark(B_0), the first phase that reads
      // them; the previous step's B_{L-1} done was waited for above.
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(tables_.data(), table_staging_->data(),
                               tables_bytes_, cudaMemcpyHostToDevice, s),
               "writing the block tables"));
    }
    if (copy_inputs && !o.bare && o.kv_seed != 0) {
      RETURN_IF_ERROR(produce(l, kTopkRows));
    } else if (copy_inputs && !o.bare) {
      RETURN_IF_ERROR(copy(topk_off(l), n * options_.top_k * 4));
    }
    RETURN_IF_ERROR(phase(kvd_phase_b(l)));
  }
  return absl::OkStatus();
}

int LayerRatio(const RigOptions& o, int layer) {
  if (layer == o.ratio_layer) return std::max(o.ratio, 1);
  if (layer == o.ratio2_layer) return std::max(o.ratio2, 1);
  return 1;
}

const std::vector<int32_t>& LayerSlots(const RigOptions& o, const StepInput& in,
                                       int layer) {
  if (o.ratio > 1 && layer == o.ratio_layer) return in.compressed_slots;
  if (o.ratio2 > 1 && layer == o.ratio2_layer) return in.compressed_slots2;
  return in.slots;
}

StepInput StepRig::DropOutOfRangeSlots(const StepInput& in) {
  StepInput out = in;
  const int64_t capacity = SlotCapacity();
  for (std::vector<int32_t>* v :
       {&out.slots, &out.compressed_slots, &out.compressed_slots2}) {
    for (int32_t& slot : *v) {
      if (slot < -1 || slot >= capacity) {
        slot = -1;
        ++expected_out_of_range_;
        ++dropped_slots_;
      }
    }
  }
  return out;
}

absl::Status StepRig::ApplyReference(const StepInput& step) {
  // Device-resident mappings: the import kernel turns an entry outside
  // the pools into -1 and counts it; the reference does the same.
  std::optional<StepInput> dropped;
  if (slots_in_buffer(step)) dropped = DropOutOfRangeSlots(step);
  const StepInput& in = dropped.has_value() ? *dropped : step;
  const RigOptions& o = options_;
  const int n = in.num_tokens();
  SequenceBatch batch;
  batch.seqlen_k = in.seq_lens;
  batch.seqlen_q = in.query_lens;
  batch.state_ids = in.states;
  SwaParams store{o.ring, o.ring, o.states};
  std::vector<int32_t> swa_slots(n);
  RETURN_IF_ERROR(BuildSwaStoreSlots(batch, store, absl::MakeSpan(swa_slots)));
  SwaParams window{o.window, o.ring, o.states};
  expected_swa_.assign(static_cast<size_t>(n) * o.window, 0);
  RETURN_IF_ERROR(
      BuildSwaDecodeIndex(batch, window, absl::MakeSpan(expected_swa_)));
  // Per query row: its sequence's table row and seqlen_k; per layer its
  // convert_topk length (seq_len / ratio rows) and valid count.
  std::vector<int32_t> rows_table, row_seq_len;
  const int cols = table_cols(in);
  if (in.block_tables.size() != static_cast<size_t>(in.num_seqs()) * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tables has ", in.block_tables.size(),
                     " entries, not ", in.num_seqs(), " x ", cols));
  }
  for (size_t b = 0; b < in.query_lens.size(); ++b) {
    for (int j = 0; j < in.query_lens[b]; ++j) {
      rows_table.insert(rows_table.end(), in.block_tables.begin() + b * cols,
                        in.block_tables.begin() + (b + 1) * cols);
      row_seq_len.push_back(in.seq_lens[b]);
    }
  }
  BlockTableView table;
  table.data = rows_table;
  table.num_rows = n;
  table.num_cols = cols;
  table.row_stride = cols;
  expected_out_.clear();
  for (int l = 0; l < o.layers; ++l) {
    uint8_t* main_layer = main_.reference.data() + main_.layout.layer_offset(l);
    const std::vector<int32_t>& slots = LayerSlots(o, in, l);
    std::vector<int32_t> num_tokens, valid;
    for (int32_t len : row_seq_len) {
      num_tokens.push_back(len / LayerRatio(o, l));
      valid.push_back(std::min(o.top_k, num_tokens.back()));
    }
    if (o.main_reference) {
      RETURN_IF_ERROR(o.main_reference(l, in, main_.layout, main_layer));
    } else {
      RETURN_IF_ERROR(kvdepot::Store(main_.layout, main_layer,
                                     in.kv_main[l].data(), InputDtype::kBF16,
                                     slots));
    }
    RETURN_IF_ERROR(kvdepot::Store(
        swa_.layout, swa_.reference.data() + swa_.layout.layer_offset(l),
        in.kv_swa[l].data(), InputDtype::kBF16, swa_slots));
    RETURN_IF_ERROR(kvdepot::Store(
        index_.layout, index_.reference.data() + index_.layout.layer_offset(l),
        in.kv_index[l].data(), InputDtype::kBF16, slots));
    std::vector<int32_t> topk = in.topk[l];
    ASSIGN_OR_RETURN(int64_t invalid, ConvertTopk(absl::MakeSpan(topk), o.top_k,
                                                  valid, num_tokens, table,
                                                  o.block_size, o.num_blocks));
    expected_out_of_range_ += static_cast<uint64_t>(invalid);
    expected_out_.insert(expected_out_.end(), topk.begin(), topk.end());
  }
  return absl::OkStatus();
}

absl::Status StepRig::CheckPools() {
  for (PoolRef* p : {&main_, &swa_, &index_}) {
    std::vector<uint8_t> got(p->reference.size());
    RETURN_IF_ERROR(Cuda(cudaMemcpy(got.data(), p->mapping.data(), got.size(),
                                    cudaMemcpyDeviceToHost),
                         "reading a pool"));
    for (int l = 0; l < options_.layers; ++l) {
      const int64_t base = p->layout.layer_offset(l);
      for (int64_t i = 0; i < p->layout.layer_bytes; ++i) {
        if (got[base + i] != p->reference[base + i]) {
          return absl::InternalError(absl::StrCat(
              "pool ", p->name, " layer ", l, " byte ", i, " (slot ",
              i / std::max<int64_t>(1, p->layout.format.bytes_per_token()),
              "~): device ", got[base + i], " reference ",
              p->reference[base + i]));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status StepRig::CheckIndexRows(const StepInput& in) {
  const int n = in.num_tokens();
  const int k = options_.top_k;
  std::vector<int32_t> got(static_cast<size_t>(n) * k);
  for (int l = 0; l < options_.layers; ++l) {
    RETURN_IF_ERROR(Cuda(cudaMemcpy(got.data(), io_.data() + out_off(l),
                                    got.size() * 4, cudaMemcpyDeviceToHost),
                         "reading index rows"));
    for (int i = 0; i < n * k; ++i) {
      if (got[i] != expected_out_[static_cast<size_t>(l) * n * k + i]) {
        return absl::InternalError(
            absl::StrCat("layer ", l, " index_out[", i / k, "][", i % k,
                         "] = ", got[i], ", the planner's ",
                         expected_out_[static_cast<size_t>(l) * n * k + i]));
      }
    }
  }
  std::vector<int32_t> swa(expected_swa_.size());
  RETURN_IF_ERROR(Cuda(cudaMemcpy(swa.data(), io_.data() + swa_out(),
                                  swa.size() * 4, cudaMemcpyDeviceToHost),
                       "reading the SWA index"));
  for (size_t i = 0; i < swa.size(); ++i) {
    if (swa[i] != expected_swa_[i]) {
      return absl::InternalError(absl::StrCat(
          "swa_index[", i / options_.window, "][", i % options_.window,
          "] = ", swa[i], ", the planner's ", expected_swa_[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::testing
