// The Store RPC's `fused` option (SPEC §8, kvdepot.proto FusedStoreOptions):
// its preconditions, the resolution of its DataRefs and the validation of
// every field (ValidateFused with a host copy of the positions), all before
// anything is written.
#ifndef KVDEPOT_SERVER_FUSED_STORE_H_
#define KVDEPOT_SERVER_FUSED_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/store_load.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/backend/backend.h"
#include "server/data_refs.h"
#include "server/sessions.h"

namespace kvdepot {

// A resolved fused option: params point into the resolved ranges (backend
// or request memory), which the ranges keep alive.
struct FusedStoreInputs {
  FusedParams params;
  ByteRange norm_weight, positions, cos_sin, cast_back;
  std::vector<int64_t> host_positions;  // the validated copy
};

// BF16 input and no GPU ordering (INVALID_ARGUMENT naming the field).
absl::Status CheckFusedStore(InputDtype dtype, bool gpu_ordering);

// Resolves and validates `o` for num_tokens tokens of `format`; kv is the
// request's resolved input (cast_back must not overlap any input).
// cast_back with inline_output goes to *inline_cast_back.
absl::StatusOr<FusedStoreInputs> ResolveFusedStore(
    const SessionManager& sessions, Backend& backend, const Caller& caller,
    const KVCacheFormat& format, const v1::FusedStoreOptions& o,
    int64_t num_tokens, const ByteRange& kv, int64_t max_array_elements,
    int64_t max_inline_bytes, std::string* inline_cast_back);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_FUSED_STORE_H_
