// Shared by the CPU and CUDA halves of libkvdepot_kernels: the layout handle,
// the per-thread last error, and the host-side argument checks both halves
// run before anything is written or launched. Not part of the ABI.
#ifndef KVDEPOT_LIBKVDEPOT_CAPI_INTERNAL_H_
#define KVDEPOT_LIBKVDEPOT_CAPI_INTERNAL_H_

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "libkvdepot/kvdepot_kernels.h"

struct kvdk_layout {
  kvdepot::PoolLayout layout;  // what MakePoolLayout built
  std::string name;            // canonical format name
};

namespace kvdepot::capi {

// Sets the thread's last error and returns `code`.
int Fail(int code, absl::string_view message);
// The KVDK_ERR_* of a status (INVALID_ARGUMENT -> KVDK_ERR_INVALID,
// OUT_OF_RANGE -> KVDK_ERR_CAPACITY (only this library's own capacity
// checks return it), UNIMPLEMENTED -> KVDK_ERR_UNSUPPORTED, anything else
// -> KVDK_ERR_CUDA for `cuda`, KVDK_ERR_INVALID otherwise), with the
// message prefixed by `where` ("kvdk_store_cpu: ...").
int FailStatus(absl::string_view where, const absl::Status& status,
               bool cuda = false);
// Clears the last error and returns KVDK_OK.
int Ok();
const char* LastError();

// Runs an entry point's body: its status becomes the return code and the
// last error; nothing escapes (an allocation failure is an error too).
template <typename F>
int Guard(const char* where, F&& body, bool cuda = false) {
  try {
    const absl::Status s = body();
    return s.ok() ? Ok() : FailStatus(where, s, cuda);
  } catch (const std::bad_alloc&) {
    return Fail(KVDK_ERR_INVALID, std::string(where) + ": out of host memory");
  } catch (...) {
    return Fail(KVDK_ERR_INVALID, std::string(where) + ": internal error");
  }
}

absl::Status CheckLayout(const kvdk_layout* layout, absl::string_view name);
absl::Status CheckNotNull(const void* p, absl::string_view name);
// count in [0, max] (max defaults to INT32_MAX: every int32 index fits).
absl::Status CheckCount(int64_t count, absl::string_view name,
                        int64_t max = INT32_MAX);
// pool non-null, layer in [0, num_layers), pool_bytes >= layer_offset +
// layer_bytes (the caller owns the whole layer).
absl::Status CheckPool(const kvdepot::PoolLayout& layout, const void* pool,
                       int64_t pool_bytes, int64_t layer);
// The layer's base inside `pool` (after CheckPool).
inline uint8_t* LayerBase(const kvdepot::PoolLayout& layout, const void* pool,
                          int64_t layer) {
  return static_cast<uint8_t*>(const_cast<void*>(pool)) +
         layout.layer_offset(layer);
}
// A caller buffer of `have` bytes for `rows` rows of `row_bytes`.
absl::Status CheckOutput(const void* p, int64_t have, int64_t rows,
                         int64_t row_bytes, absl::string_view name);
// dtype is KVDK_DTYPE_BF16 or KVDK_DTYPE_FP32 and the format takes it.
absl::Status CheckDtype(const kvdepot::KVCacheFormat& format, int32_t dtype);
// Converts the ABI struct (checking the enum) into FusedParams.
absl::Status ToFusedParams(const kvdk_fused_params* in,
                           kvdepot::FusedParams* out);

inline constexpr int64_t kWorkspaceAlignment = 256;

// Workspace of a CUDA entry point: parts at 256-byte aligned offsets.
struct Workspace {
  int64_t part_bytes[3] = {0, 0, 0};  // bytes of each part (0 = unused)
  int64_t offset[3] = {0, 0, 0};      // byte offset of each part
  int64_t total = 0;                  // kvdk_cuda_workspace_bytes
};
// The parts of `op` (KVDK_OP_*) for `count` items.
absl::Status WorkspaceFor(int32_t op, int64_t count, Workspace* out);

}  // namespace kvdepot::capi

#endif  // KVDEPOT_LIBKVDEPOT_CAPI_INTERNAL_H_
