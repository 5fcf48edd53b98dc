#include "tests/gpu/step_bench_rpc.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/plan.h"
#include "proto/wire.h"
#include "tests/gpu/step_bench_kernels.h"

namespace kvdepot::testing {
namespace {

std::string Pack(absl::Span<const int32_t> v) {
  std::string out;
  EncodeInt32s(v, &out);
  return out;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(60));
}

}  // namespace

absl::Status PerLayerRpcMode::Call(const char* what,
                                   const grpc::Status& s) const {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

absl::Status PerLayerRpcMode::Init(StepRig* rig, const StepInput& in) {
  rig_ = rig;
  const RigOptions& o = rig->options();
  n_ = in.num_tokens();
  const std::string& prefix = o.prefix;
  SequenceBatch batch;
  batch.seqlen_k = in.seq_lens;
  batch.seqlen_q = in.query_lens;
  batch.state_ids = in.states;
  std::vector<int32_t> swa(n_), state(n_), start(n_), valid(n_);
  RETURN_IF_ERROR(BuildSwaStoreSlots(batch, {o.ring, o.ring, o.states},
                                     absl::MakeSpan(swa)));
  RETURN_IF_ERROR(ComputeSwaDecodeWindows(
      batch, {o.window, o.ring, o.states}, absl::MakeSpan(state),
      absl::MakeSpan(start), absl::MakeSpan(valid)));
  ASSIGN_OR_RETURN(CudaIpcEvent e, CudaIpcEvent::Create(0));
  worker_event_ = std::make_unique<CudaIpcEvent>(std::move(e));

  const std::string slots = Pack(in.slots), swa_slots = Pack(swa);
  const std::string session = rig->client()->session_id();
  auto store = [&](const std::string& pool, int l, const std::string& slot,
                   int64_t offset, int64_t elements) {
    v1::StoreRequest r;
    r.set_session_id(session);
    r.set_pool(pool);
    r.set_layer(l);
    r.set_num_tokens(n_);
    r.set_slot_mapping(slot);
    r.set_dtype(v1::INPUT_DTYPE_BF16);
    v1::BufferSlice* s = r.mutable_kv()->mutable_slice();
    s->set_buffer_id(rig->io_buffer_id());
    s->set_offset(offset);
    s->set_length(int64_t{n_} * elements * 2);
    r.set_record_event(true);
    return r;
  };
  for (int l = 0; l < o.layers; ++l) {
    stores_.push_back(store(prefix + "_main", l, slots, rig->main_in(l), 512));
    // The first Store of a layer waits for the worker's K/V; the others
    // follow it on the session's stream.
    stores_.back().set_wait_event_ipc_handle(worker_event_->handle());
    stores_.push_back(
        store(prefix + "_swa", l, swa_slots, rig->swa_in(l), 512));
    stores_.push_back(
        store(prefix + "_index", l, slots, rig->index_in(l), 128));
  }

  swa_.set_pool(prefix + "_swa");
  swa_.set_window(o.window);
  swa_.set_num_queries(n_);
  std::vector<int32_t> queries;
  for (int i = 0; i < n_; ++i) {
    queries.insert(queries.end(), {state[i], start[i], valid[i]});
  }
  swa_.set_queries(Pack(queries));

  std::vector<int32_t> valid_count, num_tokens, table;
  for (size_t b = 0; b < in.query_lens.size(); ++b) {
    for (int j = 0; j < in.query_lens[b]; ++j) {
      valid_count.push_back(std::min(o.top_k, in.seq_lens[b]));
      num_tokens.push_back(in.seq_lens[b]);
      table.insert(table.end(),
                   in.block_tables.begin() + b * o.max_blocks_per_seq,
                   in.block_tables.begin() + (b + 1) * o.max_blocks_per_seq);
    }
  }
  convert_.set_pool(prefix + "_index");
  convert_.set_batch(n_);
  convert_.set_k(o.top_k);
  convert_.set_valid_count(Pack(valid_count));
  convert_.set_num_tokens(Pack(num_tokens));
  convert_.set_max_blocks_per_seq(o.max_blocks_per_seq);
  convert_.set_block_table(Pack(table));

  const int64_t topk_bytes = int64_t{n_} * o.top_k * 4;
  ASSIGN_OR_RETURN(Pinned a, Pinned::Create(std::max<int64_t>(topk_bytes, 4)));
  topk_host_ = std::make_unique<Pinned>(std::move(a));
  ASSIGN_OR_RETURN(Pinned b, Pinned::Create(std::max<int64_t>(topk_bytes, 4)));
  out_host_ = std::make_unique<Pinned>(std::move(b));
  ASSIGN_OR_RETURN(Pinned c, Pinned::Create(std::max<int64_t>(
                                 int64_t{n_} * o.window * 4, 4)));
  swa_host_ = std::make_unique<Pinned>(std::move(c));
  return absl::OkStatus();
}

absl::StatusOr<cudaEvent_t> PerLayerRpcMode::DaemonEvent(
    const std::string& handle) {
  auto it = daemon_events_.find(handle);
  if (it == daemon_events_.end()) {
    ASSIGN_OR_RETURN(
        CudaIpcEvent e,
        CudaIpcEvent::Open("recorded_event_ipc_handle", handle, 0));
    it = daemon_events_.emplace(handle, std::move(e)).first;
  }
  return it->second.get();
}

absl::Status PerLayerRpcMode::SwaIndex(cudaStream_t s) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::SwaDecodeIndexResponse r;
  RETURN_IF_ERROR(Call("SwaDecodeIndex",
                       rig_->client()->stub()->SwaDecodeIndex(&ctx, swa_, &r)));
  const int64_t bytes = int64_t{n_} * rig_->options().window * 4;
  if (static_cast<int64_t>(r.slots().size()) != bytes) {
    return absl::InternalError("SwaDecodeIndex: reply of the wrong size");
  }
  // The previous step's copy from this buffer finished: Step synchronized
  // the stream in every phase B since.
  std::memcpy(swa_host_->data(), r.slots().data(), bytes);
  return Cuda(cudaMemcpyAsync(rig_->io() + rig_->swa_out(), swa_host_->data(),
                              bytes, cudaMemcpyHostToDevice, s),
              "copying the SWA index rows");
}

absl::Status PerLayerRpcMode::StoreLayer(int l, cudaStream_t s) {
  RETURN_IF_ERROR(worker_event_->Record(s));
  std::string handle;
  for (int c = 0; c < 3; ++c) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::StoreResponse r;
    RETURN_IF_ERROR(Call(
        "Store", rig_->client()->stub()->Store(&ctx, stores_[3 * l + c], &r)));
    handle = r.recorded_event_ipc_handle();
  }
  ASSIGN_OR_RETURN(cudaEvent_t e, DaemonEvent(handle));
  return Cuda(cudaStreamWaitEvent(s, e, 0), "waiting on the daemon's event");
}

absl::Status PerLayerRpcMode::ConvertLayer(int l, cudaStream_t s) {
  const int64_t bytes = int64_t{n_} * rig_->options().top_k * 4;
  // The worker's top-k rows, on the host: the scheduler waits for them.
  RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(topk_host_->data(), rig_->io() + rig_->topk_off(l),
                           bytes, cudaMemcpyDeviceToHost, s),
           "reading the top-k rows"));
  RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(s), "waiting for the top-k"));
  convert_.mutable_topk()->assign(
      reinterpret_cast<const char*>(topk_host_->data()), bytes);
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ConvertTopkResponse r;
  RETURN_IF_ERROR(Call(
      "ConvertTopk", rig_->client()->stub()->ConvertTopk(&ctx, convert_, &r)));
  if (static_cast<int64_t>(r.slots().size()) != bytes) {
    return absl::InternalError("ConvertTopk: reply of the wrong size");
  }
  std::memcpy(out_host_->data(), r.slots().data(), bytes);
  return Cuda(cudaMemcpyAsync(rig_->io() + rig_->out_off(l), out_host_->data(),
                              bytes, cudaMemcpyHostToDevice, s),
              "copying the index rows");
}

absl::Status PerLayerRpcMode::Step(cudaStream_t s, int work_us,
                                   std::vector<cudaEvent_t>* events) {
  auto rec = [&](size_t i) -> absl::Status {
    if (events == nullptr) return absl::OkStatus();
    return Cuda(cudaEventRecord((*events)[i], s), "cudaEventRecord");
  };
  auto spin = [&]() {
    return Cuda(
        static_cast<cudaError_t>(LaunchSpin(int64_t{work_us} * 1000, s)),
        "spin");
  };
  RETURN_IF_ERROR(spin());
  RETURN_IF_ERROR(rec(0));
  RETURN_IF_ERROR(SwaIndex(s));
  RETURN_IF_ERROR(rec(1));
  for (int l = 0; l < rig_->options().layers; ++l) {
    const int a = 1 + 2 * l, b = 2 + 2 * l;
    RETURN_IF_ERROR(spin());
    RETURN_IF_ERROR(rec(2 * a));
    RETURN_IF_ERROR(StoreLayer(l, s));
    RETURN_IF_ERROR(rec(2 * a + 1));
    RETURN_IF_ERROR(spin());
    RETURN_IF_ERROR(rec(2 * b));
    RETURN_IF_ERROR(ConvertLayer(l, s));
    RETURN_IF_ERROR(rec(2 * b + 1));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::testing
