// A step-path rig for the GPU tests and the step benchmark: a client of a
// kvdepotd --backend=cuda, its pools (main V41, SWA V41 ring, index
// FP4_INDEX or MXFP8_INDEX), one daemon buffer for the worker's rows, a
// doorbell, a registration and the worker library opened on it; random
// steps; and the CPU reference (kernels/reference for the caches, the
// planner for the index rows) the device results are compared with.
#ifndef KVDEPOT_TESTS_GPU_STEP_HARNESS_H_
#define KVDEPOT_TESTS_GPU_STEP_HARNESS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kvdepot_client.h"
#include "client/step_ring.h"
#include "common/cuda/vmm.h"
#include "kernels/format.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/kvdepot_worker.h"

namespace kvdepot::testing {

// Sets CUDA_MODULE_LOADING=EAGER (before CUDA starts; the daemon child
// inherits it). Call first thing in main or a static initializer.
void SetStepEnvironment();

// Waits for `s` with a deadline (a stalled doorbell fails, never hangs).
absl::Status SyncWithin(cudaStream_t s, absl::Duration limit);

// One step's inputs (host copies).
struct StepInput {
  uint64_t step_id = 0;
  std::vector<int32_t> query_lens, seq_lens, states, slots;
  // [seqs][table_cols()]; entries past a sequence's blocks may be -1. With
  // device-resident tables (RigOptions.device_block_tables) any value: the
  // kernel turns a read outside [0, num_blocks) into -1 and counts it.
  std::vector<int32_t> block_tables;
  int32_t block_table_cols = 0;  // 0 = RigOptions.max_blocks_per_seq
  // A rig with device-resident tables sends this step's inline (the
  // buffer's rows then hold poison the kernel must not read).
  bool inline_tables = false;
  // A rig with device-resident slot mappings sends this step's inline.
  bool inline_slots = false;
  // RigOptions.ratio > 1: compressed_slot_mapping (distinct main-pool
  // slots, most -1: tokens that complete no compressed row).
  std::vector<int32_t> compressed_slots;
  // RigOptions.ratio2 > 1: the mapping of that second ratio, drawn the
  // same way (both then go in StepRequest.compressed).
  std::vector<int32_t> compressed_slots2;
  // Per layer: BF16 bits.
  std::vector<std::vector<uint16_t>> kv_main, kv_swa, kv_index;
  std::vector<std::vector<int32_t>> topk;  // [n][top_k]
  int num_tokens() const { return static_cast<int>(slots.size()); }
  int num_seqs() const { return static_cast<int>(query_lens.size()); }
};

struct RigOptions {
  std::string prefix = "step";  // pool names: <prefix>_main, ...
  bool create_pools = true;     // false: use the pools of that prefix
  int layers = 3;
  int block_size = 16;  // main and index pools
  // Layer ratio_layer (-1 = none) has this ratio > 1: its main and index
  // caches store compressed rows from compressed_slot_mapping, and its
  // convert_topk sees seq_len / ratio rows. Every other layer: ratio 1.
  int ratio_layer = -1;
  int ratio = 1;
  // A second compressed ratio (a registration of several): layer
  // ratio2_layer (-1 = none) has ratio2 > 1, != ratio, and its own
  // compressed slot mapping; the steps then carry StepRequest.compressed
  // with one entry per ratio instead of compressed_slot_mapping.
  int ratio2_layer = -1;
  int ratio2 = 1;
  int num_blocks = 64;
  int ring = 32;  // SWA pool block size
  int states = 16;
  int window = 16;
  int max_tokens = 32;
  int max_seqs = 8;
  int top_k = 24;
  int max_blocks_per_seq = 8;
  std::string index_format = "FP4_INDEX";
  // Block tables in device memory (RegisterWorkerRequest.block_tables,
  // StepRequest.block_tables_in_buffer): a buffer of the rig's session,
  // max_seqs rows of table_stride int32 (0 = max_blocks_per_seq) from
  // kTableOffset, written by the worker's stream after wait(A_0) and before
  // mark(B_0) (EnqueueWorker, from StageInputs' staging); every entry no
  // step reads (rows >= num_seqs, columns >= cols) holds poison.
  bool device_block_tables = false;
  int table_stride = 0;
  // Slot mappings in device memory (RegisterWorkerRequest.slot_mappings,
  // StepRequest.slot_mappings_in_buffer): a buffer of the rig's session,
  // slot_rows() rows of slot_row_stride int32 (0 = max_tokens) from
  // kSlotOffset (slot_mapping, then each compressed ratio's, ascending),
  // written by the worker's stream before mark(A_0); every entry past
  // num_tokens holds poison (values outside the pools). The steps' slots
  // may then hold any value: ApplyReference drops those outside the pools
  // (-1) and counts them, as the import kernel does.
  bool device_slot_mappings = false;
  int slot_row_stride = 0;
  int64_t watchdog_ms = 20000;
  // StepRequest.deadline_ms of every step (0 = the daemon's default).
  uint32_t deadline_ms = 0;
  // Every step: max_seqs sequences of one query token (plain decode).
  bool decode_only = false;
  // Layers with no cache and no top-k, no SWA index: every phase is the
  // bare handshake (the gate kernel only). For the bare round trip.
  bool bare = false;
  bool delete_pools = false;  // delete the created pools on destruction
  int pool_layers = 0;        // layers of the created pools (0 = layers)
  // Workers sharing pools: slots = slot_offset mod slot_stride only, SWA
  // states in [state_offset, state_offset + state_count) (0 = all).
  int slot_stride = 1;
  int slot_offset = 0;
  int state_offset = 0;
  int state_count = 0;
  // Nonzero: the rows are StepValueBf16/StepValueTopk of seeds derived
  // from this, and EnqueueWorker produces them with the worker's kernels
  // (step_worker_kernels.h) instead of copying them from the host.
  uint64_t kv_seed = 0;
  // Optional hooks (step_fused_test): edit the registration before it is
  // sent, edit each Step request, and store layer `layer`'s main cache
  // into the reference (BF16 rows `kv`) instead of the plain store.
  std::function<void(v1::RegisterWorkerRequest*)> edit_registration;
  std::function<void(const StepInput&, v1::StepRequest*)> edit_step;
  std::function<absl::Status(int layer, const StepInput& in,
                             const PoolLayout& layout, uint8_t* layer_bytes)>
      main_reference;
};

// Optional instrumentation of StepRig::EnqueueWorker.
struct WorkerHooks {
  // Runs on the stream before each mark (the worker's own GPU work).
  std::function<absl::Status(cudaStream_t)> work;
  // [2 * phases]: recorded right before mark(p) and right after wait(p).
  std::vector<cudaEvent_t>* phase_events = nullptr;
  // Runs on the stream right after wait(A_l), with l (the worker reads
  // what the daemon stored).
  std::function<absl::Status(cudaStream_t, int)> after_stores;
};

// Layer l's ratio: options.ratio for ratio_layer, ratio2 for
// ratio2_layer, else 1.
int LayerRatio(const RigOptions& options, int layer);
// The slots layer l's main and index caches are stored at: the
// compressed ones for options.ratio_layer (ratio2_layer: the second
// ratio's), else the step's slot_mapping.
const std::vector<int32_t>& LayerSlots(const RigOptions& options,
                                       const StepInput& in, int layer);

// A random step for a rig of `options` (slots, lengths, states, block
// tables, rows); the same rng gives the same step in any process.
StepInput RandomStepFor(const RigOptions& options, uint64_t step_id,
                        std::mt19937& rng);

class StepRig {
 public:
  static absl::StatusOr<std::unique_ptr<StepRig>> Create(
      const std::string& socket, const RigOptions& options);
  ~StepRig();

  const RigOptions& options() const { return options_; }
  uint64_t registration_id() const { return registration_id_; }
  // The daemon buffer holding the worker's rows (io()).
  uint64_t io_buffer_id() const { return io_id_; }
  kvd_worker* worker() const { return worker_; }
  KVCacheClient* client() const { return client_.get(); }
  v1::Step::Stub* stub() const { return stub_.get(); }

  StepInput RandomStep(uint64_t step_id, std::mt19937& rng) const;
  v1::StepRequest Request(const StepInput& in) const;
  // Sets every field of *r for `in` (bytes fields refilled in place).
  void FillRequest(const StepInput& in, v1::StepRequest* r) const;
  // The scheduler's call.
  absl::StatusOr<v1::StepResponse> SendStep(const StepInput& in);
  // The same on the rig's StepStream (opened at its first step, and again
  // after one ended): one Write and one Read; a refusal is the reply's
  // error_code / error_message.
  absl::StatusOr<v1::StepResponse> SendStepOnStream(const StepInput& in);
  // The same through the rig's step ring (client/step_ring.h, opened on
  // the rig's companion connection at its first step, sized for that
  // step's request twice over): one Submit and one Collect.
  absl::StatusOr<v1::StepResponse> SendStepOnRing(const StepInput& in);
  // StepStatus of this registration.
  absl::StatusOr<v1::RegistrationInfo> Status();
  // Copies the step's rows into pinned staging (host; before EnqueueWorker).
  void StageInputs(const StepInput& in);
  // The worker's side of one step on `stream`: step_begin, begin wait, and
  // per layer the row copies from staging, mark/wait A, top-k copy, mark/
  // wait B. With copy_inputs false, no copies (graph replay of fixed rows).
  absl::Status EnqueueWorker(cudaStream_t stream, bool copy_inputs = true,
                             const WorkerHooks& hooks = {});
  // The worker's rows (device) and their offsets, for library mode.
  uint8_t* io() const { return io_.data(); }
  int64_t main_in(int l) const { return region_[0] + l * layer_stride_; }
  int64_t swa_in(int l) const { return main_in(l) + kv_bytes_; }
  int64_t index_in(int l) const { return swa_in(l) + kv_bytes_; }
  int64_t topk_off(int l) const { return index_in(l) + index_bytes_; }
  int64_t out_off(int l) const { return topk_off(l) + topk_bytes_; }
  int64_t swa_out() const {
    return region_[0] + options_.layers * layer_stride_;
  }
  // The block-table buffer's layout (device_block_tables).
  static constexpr int64_t kTableOffset = 256;
  int table_stride() const {
    return options_.table_stride > 0 ? options_.table_stride
                                     : options_.max_blocks_per_seq;
  }
  int table_cols(const StepInput& in) const {
    return in.block_table_cols > 0 ? in.block_table_cols
                                   : options_.max_blocks_per_seq;
  }
  bool tables_in_buffer(const StepInput& in) const {
    return options_.device_block_tables && !in.inline_tables;
  }
  // The slot-mapping buffer's layout (device_slot_mappings).
  static constexpr int64_t kSlotOffset = 512;
  int slot_row_stride() const {
    return options_.slot_row_stride > 0 ? options_.slot_row_stride
                                        : options_.max_tokens;
  }
  int slot_rows() const {
    return 1 + (options_.ratio > 1 ? 1 : 0) + (options_.ratio2 > 1 ? 1 : 0);
  }
  bool slots_in_buffer(const StepInput& in) const {
    return options_.device_slot_mappings && !in.inline_slots;
  }
  // Slots of the main and index pools (every slot-mapping row's bound).
  int32_t SlotCapacity() const {
    return options_.block_size * options_.num_blocks;
  }
  const PoolLayout& main_layout() const { return main_.layout; }
  const PoolLayout& swa_layout() const { return swa_.layout; }
  const PoolLayout& index_layout() const { return index_.layout; }
  uint8_t* main_pool() const { return main_.mapping.data(); }
  uint8_t* swa_pool() const { return swa_.mapping.data(); }
  uint8_t* index_pool() const { return index_.mapping.data(); }
  // Applies the step to the reference pools and expected index rows.
  absl::Status ApplyReference(const StepInput& in);
  // Device pools byte-identical to the reference, every layer.
  absl::Status CheckPools();
  // Index and SWA rows of the last step equal the planner's.
  absl::Status CheckIndexRows(const StepInput& in);
  // Entries the planner turned into -1 as invalid, over all applied steps.
  uint64_t expected_out_of_range() const { return expected_out_of_range_; }
  // Of those, the slots of device-resident mappings outside the pools.
  uint64_t dropped_slots() const { return dropped_slots_; }

 private:
  struct PoolRef {
    std::string name;
    PoolLayout layout;
    gpu::VmmAllocation mapping;
    std::vector<uint8_t> reference;  // total_bytes
  };
  StepRig() = default;
  int64_t PoolLayers() const {
    return options_.pool_layers > 0 ? options_.pool_layers : options_.layers;
  }
  absl::Status Init(const std::string& socket);
  // A daemon buffer of `bytes` of the rig's session mapped here and its
  // pinned twin, both filled with values outside [-1, bound).
  absl::Status AllocatePoisoned(int64_t bytes, int32_t bound, uint64_t* id,
                                gpu::VmmAllocation* mapping,
                                std::unique_ptr<Pinned>* staging);
  // Stages the step's slot mappings into the buffer's twin.
  void StageSlots(const StepInput& in);
  // `in` with every slot outside the pools -1, counted as out of range.
  StepInput DropOutOfRangeSlots(const StepInput& in);
  absl::StatusOr<PoolRef> OpenPool(const std::string& name,
                                   const std::string& format,
                                   int64_t block_size, int64_t num_blocks);

  RigOptions options_;
  std::unique_ptr<KVCacheClient> client_;
  std::unique_ptr<v1::Step::Stub> stub_;
  PoolRef main_, swa_, index_;
  gpu::VmmAllocation io_;  // the worker's rows
  uint64_t io_id_ = 0;
  uint64_t doorbell_id_ = 0;
  kvd_worker* worker_ = nullptr;
  uint64_t registration_id_ = 0;
  int64_t kv_bytes_ = 0, index_bytes_ = 0, topk_bytes_ = 0;
  int64_t layer_stride_ = 0;
  int64_t region_[1] = {0};
  int64_t io_bytes_ = 0;
  std::unique_ptr<Pinned> staging_;
  gpu::VmmAllocation tables_;  // device_block_tables: the worker's tables
  uint64_t tables_id_ = 0;
  int64_t tables_bytes_ = 0;               // kTableOffset + rows
  std::unique_ptr<Pinned> table_staging_;  // its next contents
  gpu::VmmAllocation slot_buffer_;         // device_slot_mappings: the worker's
  uint64_t slots_id_ = 0;
  int64_t slots_bytes_ = 0;               // kSlotOffset + rows
  std::unique_ptr<Pinned> slot_staging_;  // its next contents
  int staged_tokens_ = 0;
  uint64_t staged_step_ = 0;
  v1::StepRequest request_;  // SendStep's, reused
  v1::StepResponse reply_;
  std::unique_ptr<StepRingClient> ring_;
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
  std::vector<int32_t> expected_out_;  // [layers][n][top_k]
  std::vector<int32_t> expected_swa_;  // [n][window]
  uint64_t expected_out_of_range_ = 0;
  uint64_t dropped_slots_ = 0;
};

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_HARNESS_H_
