// The CUDA backend's fused store (SPEC §8, Backend::StoreFused): the
// Store RPC's `fused` option, a path for checking the kernel from outside,
// not the decode hot path (the step path launches kernels/cuda/fused_kernels.h
// itself). On `stream` (the caller's, already ordered after earlier work on
// the pool), it copies every operand (host or device memory) into one
// device scratch allocation, launches the kernel on the pool's layer, copies
// cast_back out and waits for that stream only (never the whole device), so
// the call completes before it returns.
#ifndef KVDEPOT_SERVER_CUDA_CUDA_FUSED_H_
#define KVDEPOT_SERVER_CUDA_CUDA_FUSED_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "server/backend/backend.h"

namespace kvdepot {

// As Backend::StoreFused; `pool` must be a CudaAllocation.
absl::Status CudaStoreFused(cudaStream_t stream, const PoolLayout& layout,
                            const Memory& pool, int64_t layer,
                            const uint16_t* kv, const FusedParams& params,
                            absl::Span<const int32_t> slot_mapping,
                            uint16_t* cast_back);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_CUDA_FUSED_H_
