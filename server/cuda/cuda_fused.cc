#include "server/cuda/cuda_fused.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/fused_kernels.h"
#include "server/cuda/cuda_memory.h"

namespace kvdepot {
namespace {

constexpr int64_t kAlign = 256;

int64_t Round(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Restores the calling thread's current device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    set_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return set_; }

 private:
  int previous_ = -1;
  cudaError_t set_ = cudaSuccess;
};

// Stream-ordered: cudaFree would synchronize the whole device, and a
// step-path stream parked on a doorbell would hold it (GPU_HOST.md).
struct CudaFreeOn {
  cudaStream_t stream;
  void operator()(uint8_t* p) const { (void)cudaFreeAsync(p, stream); }
};

}  // namespace

absl::Status CudaStoreFused(cudaStream_t stream, const PoolLayout& layout,
                            const Memory& pool, int64_t layer,
                            const uint16_t* kv, const FusedParams& params,
                            absl::Span<const int32_t> slot_mapping,
                            uint16_t* cast_back) {
  const auto* mem = dynamic_cast<const CudaAllocation*>(&pool);
  if (mem == nullptr) {
    return absl::InternalError(
        "the pool's memory was not allocated by the CUDA backend");
  }
  const int64_t n = static_cast<int64_t>(slot_mapping.size());
  if (n == 0) return absl::OkStatus();
  const DeviceScope scope(mem->device_ordinal());
  RETURN_IF_CUDA_ERROR(scope.error(), "selecting the pool's device");

  const int64_t d = layout.format.elements();
  const int64_t slots_bytes = n * 4;
  const int64_t kv_bytes = n * d * 2;
  const int64_t weight_bytes =
      params.norm() ? 2 * int64_t{params.norm_end - params.norm_begin} : 0;
  const bool rope = params.rope != RopeStyle::kNone;
  const int64_t pos_bytes = rope ? n * 8 : 0;
  const int64_t cs_bytes = rope ? params.max_position * params.rope_dim * 4 : 0;
  const int64_t cast_bytes = cast_back != nullptr ? n * d * 2 : 0;
  // Scratch: [slots | kv | weight | positions | cos_sin | cast_back].
  const int64_t o_kv = Round(slots_bytes);
  const int64_t o_weight = o_kv + Round(kv_bytes);
  const int64_t o_pos = o_weight + Round(weight_bytes);
  const int64_t o_cs = o_pos + Round(pos_bytes);
  const int64_t o_cast = o_cs + Round(cs_bytes);
  const int64_t total = o_cast + Round(cast_bytes);
  uint8_t* raw = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&raw),
                      static_cast<size_t>(total), stream),
      absl::StrCat("allocating ", total, " bytes of fused-store scratch"));
  const std::unique_ptr<uint8_t, CudaFreeOn> scratch(raw, CudaFreeOn{stream});
  // cudaMemcpyDefault: request operands are host (inline) or device memory.
  auto copy_in = [&](int64_t offset, const void* src,
                     int64_t bytes) -> absl::Status {
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(raw + offset, src, static_cast<size_t>(bytes),
                        cudaMemcpyDefault, stream),
        "staging a fused-store operand");
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(copy_in(0, slot_mapping.data(), slots_bytes));
  RETURN_IF_ERROR(copy_in(o_kv, kv, kv_bytes));
  RETURN_IF_ERROR(copy_in(o_weight, params.norm_weight, weight_bytes));
  RETURN_IF_ERROR(copy_in(o_pos, params.positions, pos_bytes));
  RETURN_IF_ERROR(copy_in(o_cs, params.cos_sin, cs_bytes));
  FusedParams p = params;
  if (weight_bytes > 0) {
    p.norm_weight = reinterpret_cast<const uint16_t*>(raw + o_weight);
  }
  if (rope) {
    p.positions = reinterpret_cast<const int64_t*>(raw + o_pos);
    p.cos_sin = reinterpret_cast<const float*>(raw + o_cs);
  }
  RETURN_IF_ERROR(gpu::FusedStore(
      layout, mem->data() + layout.layer_offset(layer),
      reinterpret_cast<const uint16_t*>(raw + o_kv), p,
      reinterpret_cast<const int32_t*>(raw), n,
      cast_bytes > 0 ? reinterpret_cast<uint16_t*>(raw + o_cast) : nullptr,
      gpu::LaunchOptions{.stream = stream}));
  if (cast_bytes > 0) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(cast_back, raw + o_cast,
                                         static_cast<size_t>(cast_bytes),
                                         cudaMemcpyDefault, stream),
                         "copying cast_back out");
  }
  // The scratch is freed on return: this stream's work must be done.
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream),
                       "running the fused store");
  return absl::OkStatus();
}

}  // namespace kvdepot
