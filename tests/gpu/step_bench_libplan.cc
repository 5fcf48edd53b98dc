#include "tests/gpu/step_bench_libplan.h"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "tests/gpu/step_bench_kernels.h"

namespace kvdepot::testing {
namespace {

double ThreadCpuNowUs() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e6 * static_cast<double>(t.tv_sec) + 1e-3 * t.tv_nsec;
}

absl::Status Kvdk(int rc, const char* what) {
  if (rc == KVDK_OK) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", rc, " ", kvdk_last_error()));
}

absl::Status Layout(const std::string& format, int64_t block_size,
                    int64_t blocks, int64_t layers, kvdk_layout** out) {
  return Kvdk(
      kvdk_layout_create(format.c_str(), 0, block_size, blocks, layers, out),
      "kvdk_layout_create");
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlanLibraryMode>> PlanLibraryMode::Create(
    StepRig* rig, const StepInput& in) {
  std::unique_ptr<PlanLibraryMode> m(new PlanLibraryMode);
  m->rig_ = rig;
  m->n_ = in.num_tokens();
  const RigOptions& o = rig->options();
  RETURN_IF_ERROR(
      Layout("V41", o.block_size, o.num_blocks, o.layers, &m->main_));
  RETURN_IF_ERROR(Layout("V41", o.ring, o.states, o.layers, &m->swa_));
  RETURN_IF_ERROR(
      Layout(o.index_format, o.block_size, o.num_blocks, o.layers, &m->index_));
  // The step path's request: with the rig's device-resident tables (the
  // benchmark's default) the worker's own tables serve convert_topk
  // (decode: row r is sequence r); slot mappings inline.
  m->request_ = rig->Request(in);
  m->request_.set_step_id(0);  // not read
  if (m->request_.slot_mappings_in_buffer()) {
    return absl::InvalidArgumentError(
        "mode (a'): run with --device_slot_mappings=false");
  }
  if (m->request_.block_tables_in_buffer()) {
    const size_t bytes = 4 * in.block_tables.size();
    RETURN_IF_ERROR(Cuda(cudaMalloc(&m->tables_, bytes), "cudaMalloc"));
    RETURN_IF_ERROR(Cuda(cudaMemcpy(m->tables_, in.block_tables.data(), bytes,
                                    cudaMemcpyHostToDevice),
                         "uploading the worker's tables"));
  }
  grpc::ClientContext ctx;
  const grpc::Status st = rig->stub()->PlanStep(&ctx, m->request_, &m->reply_);
  if (!st.ok()) {
    return absl::InternalError(absl::StrCat("PlanStep: ", st.error_message()));
  }
  const int64_t bytes = static_cast<int64_t>(m->reply_.metadata().size());
  ASSIGN_OR_RETURN(Pinned staging, Pinned::Create(bytes));
  m->staging_ = std::make_unique<Pinned>(std::move(staging));
  RETURN_IF_ERROR(Cuda(cudaMalloc(&m->metadata_, bytes), "cudaMalloc"));
  m->workspace_bytes_ =
      std::max(kvdk_cuda_workspace_bytes(KVDK_OP_STORE, m->n_),
               kvdk_cuda_workspace_bytes(KVDK_OP_SWA_DECODE_INDEX, m->n_));
  if (m->workspace_bytes_ <= 0) {
    return absl::InternalError(
        absl::StrCat("kvdk_cuda_workspace_bytes: ", kvdk_last_error()));
  }
  RETURN_IF_ERROR(
      Cuda(cudaMalloc(&m->workspace_, m->workspace_bytes_), "cudaMalloc"));
  RETURN_IF_ERROR(Cuda(cudaMalloc(reinterpret_cast<void**>(&m->invalid_), 8),
                       "cudaMalloc"));
  return m;
}

PlanLibraryMode::~PlanLibraryMode() {
  kvdk_layout_destroy(main_);
  kvdk_layout_destroy(swa_);
  kvdk_layout_destroy(index_);
  cudaFree(metadata_);
  cudaFree(workspace_);
  cudaFree(invalid_);
  cudaFree(tables_);
}

absl::Status PlanLibraryMode::Step(cudaStream_t s, int work_us,
                                   cudaEvent_t start,
                                   std::vector<cudaEvent_t>* events,
                                   double* plan_cpu_us, double* plan_wall_us) {
  // The scheduler's side: the call, then the reply into pinned memory
  // once the stream no longer reads the previous one.
  RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  const double cpu0 = ThreadCpuNowUs();
  const absl::Time wall0 = absl::Now();
  grpc::ClientContext ctx;
  const grpc::Status st = rig_->stub()->PlanStep(&ctx, request_, &reply_);
  if (!st.ok()) {
    return absl::InternalError(absl::StrCat("PlanStep: ", st.error_message()));
  }
  const std::string& meta = reply_.metadata();
  if (static_cast<int64_t>(meta.size()) > staging_->size()) {
    return absl::InternalError("PlanStep's reply grew between steps");
  }
  std::memcpy(staging_->data(), meta.data(), meta.size());
  *plan_cpu_us += ThreadCpuNowUs() - cpu0;
  *plan_wall_us += absl::ToDoubleMicroseconds(absl::Now() - wall0);
  return Launch(s, work_us, start, events);
}

absl::Status PlanLibraryMode::Launch(cudaStream_t s, int work_us,
                                     cudaEvent_t start,
                                     std::vector<cudaEvent_t>* events) {
  const RigOptions& o = rig_->options();
  auto rec = [&](size_t i) {
    if (events != nullptr) cudaEventRecord((*events)[i], s);
  };
  auto spin = [&] {
    return Cuda(
        static_cast<cudaError_t>(LaunchSpin(int64_t{work_us} * 1000, s)),
        "spin");
  };
  const v1::PlanStepResponse& p = reply_;
  const int32_t* m = static_cast<const int32_t*>(metadata_);
  uint8_t* io = rig_->io();
  if (start != nullptr) cudaEventRecord(start, s);
  RETURN_IF_ERROR(spin());
  rec(0);
  RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(metadata_, staging_->data(), p.metadata().size(),
                           cudaMemcpyHostToDevice, s),
           "uploading the metadata"));
  RETURN_IF_ERROR(Kvdk(kvdk_swa_decode_index_cuda(
                           swa_, m + p.swa_state_ids(), m + p.swa_starts(),
                           m + p.swa_valid_lens(), n_, o.window,
                           reinterpret_cast<int32_t*>(io + rig_->swa_out()),
                           workspace_, workspace_bytes_, invalid_, s),
                       "kvdk_swa_decode_index_cuda"));
  rec(1);
  if (p.topk_inputs_size() != 1 || p.topk_inputs(0).ratio() != 1) {
    return absl::InternalError("the benchmark's layers are all of ratio 1");
  }
  const v1::PlannedTopk& t = p.topk_inputs(0);
  for (int l = 0; l < o.layers; ++l) {
    const int a = 1 + 2 * l, b = 2 + 2 * l;
    RETURN_IF_ERROR(spin());
    rec(2 * a);
    const struct {
      kvdk_layout* layout;
      uint8_t* pool;
      int64_t bytes;
      int64_t in;
      int64_t slots;
    } stores[] = {
        {main_, rig_->main_pool(), rig_->main_layout().total_bytes,
         rig_->main_in(l), p.slots()},
        {swa_, rig_->swa_pool(), rig_->swa_layout().total_bytes,
         rig_->swa_in(l), p.swa_slots()},
        {index_, rig_->index_pool(), rig_->index_layout().total_bytes,
         rig_->index_in(l), p.slots()},
    };
    for (const auto& c : stores) {
      RETURN_IF_ERROR(
          Kvdk(kvdk_store_cuda(c.layout, c.pool, c.bytes, l, io + c.in,
                               KVDK_DTYPE_BF16, m + c.slots, n_, workspace_,
                               workspace_bytes_, invalid_, s),
               "kvdk_store_cuda"));
    }
    rec(2 * a + 1);
    RETURN_IF_ERROR(spin());
    rec(2 * b);
    int32_t* rows = reinterpret_cast<int32_t*>(io + rig_->out_off(l));
    RETURN_IF_ERROR(Cuda(
        cudaMemcpyAsync(rows, io + rig_->topk_off(l), int64_t{n_} * o.top_k * 4,
                        cudaMemcpyDeviceToDevice, s),
        "copying the top-k rows"));
    RETURN_IF_ERROR(Kvdk(
        kvdk_convert_topk_cuda(
            index_, rows, n_, o.top_k, m + t.valid_count(), m + t.num_tokens(),
            tables_ != nullptr ? static_cast<const int32_t*>(tables_)
                               : m + p.row_block_tables(),
            p.block_table_cols(), p.block_table_cols(), invalid_, s),
        "kvdk_convert_topk_cuda"));
    rec(2 * b + 1);
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::testing
