// Test and benchmark hooks of the CUDA kernels: the empty-kernel launch
// baseline and the exhaustive encoder check.
#ifndef KVDEPOT_KERNELS_CUDA_DIAGNOSTICS_H_
#define KVDEPOT_KERNELS_CUDA_DIAGNOSTICS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/kernels.h"

namespace kvdepot::gpu {

// Launches a kernel that does nothing (one warp), with options' stream/PDL.
absl::Status LaunchEmptyKernel(const LaunchOptions& options = {});

struct EncoderCheck {
  uint64_t e4m3_mismatches = 0;       // hardware cvt vs EncodeE4M3
  uint64_t e2m1_mismatches = 0;       // fma encoder vs EncodeE2M1
  uint32_t first_e4m3 = 0xFFFFFFFFu;  // smallest mismatching fp32 bits
  uint32_t first_e2m1 = 0xFFFFFFFFu;
  // DsMlaScaleExponentOfBits vs quant.h's DsMlaScaleExponent, every finite
  // amax >= 0 (fp32 bits of the first mismatch).
  uint64_t ds_mla_scale_mismatches = 0;
  uint32_t first_ds_mla_scale = 0xFFFFFFFFu;
  // The device's UE8M0 group scales (e4m3 and e2m1 data) vs quant.h's
  // Ue8m0Scale, every finite amax >= 0 and +Inf.
  uint64_t ue8m0_scale_mismatches = 0;
  uint32_t first_ue8m0_scale = 0xFFFFFFFFu;
};

// Runs the device encoders and quant.h's over all 2^32 fp32 bit patterns,
// and DS_MLA_FP8's scale exponents and the UE8M0 group scales over every
// finite amax, on the current device (synchronous; 28 ms on the H200).
absl::StatusOr<EncoderCheck> CheckEncoders();

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_KERNELS_CUDA_DIAGNOSTICS_H_
