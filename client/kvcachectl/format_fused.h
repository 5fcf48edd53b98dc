// The fused-store flags of `kvcachectl format encode` (SPEC §8): RMSNorm,
// RoPE and Hadamard applied to the input before it is encoded, exactly as
// the fused store (CPU reference, CUDA kernel, Store's `fused` option)
// computes them, so anyone can check those bytes from outside.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_FORMAT_FUSED_H_
#define KVDEPOT_CLIENT_KVCACHECTL_FORMAT_FUSED_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/kvcachectl/args.h"
#include "kernels/format.h"

namespace kvdepot::ctl {

// The flags (appended to encode's own).
std::vector<FlagSpec> FusedEncodeFlags();

// Whether any stage flag is set.
bool WantsFused(const ParsedArgs& a);

// Steps 1-4 of SPEC §8 on the n tokens of `bf16` (n x elements little-endian
// BF16, replaced by the transformed BF16). Every flag, file size and
// position is checked first (INVALID_ARGUMENT naming the flag or the
// element, e.g. "positions[3] = 9000 is outside [0, 4096)").
absl::Status FusedTransform(const ParsedArgs& a, const KVCacheFormat& f,
                            std::string* bf16);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_FORMAT_FUSED_H_
