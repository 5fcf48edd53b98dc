// The CUDA entry points of a build without CUDA (KVDEPOT_DISABLE_CUDA=1 or
// no toolkit): each returns KVDK_ERR_UNSUPPORTED and writes nothing.
#include <cstdint>

#include "libkvdepot/capi_internal.h"

namespace {

int NoCuda(const char* where) {
  return kvdepot::capi::Fail(
      KVDK_ERR_UNSUPPORTED,
      std::string(where) + ": this libkvdepot_kernels was built without CUDA");
}

}  // namespace

extern "C" {

int kvdk_has_cuda(void) { return 0; }

int kvdk_store_cuda(const kvdk_layout*, void*, int64_t, int64_t, const void*,
                    int32_t, const int32_t*, int64_t, void*, int64_t,
                    unsigned long long*, void*) {
  return NoCuda("kvdk_store_cuda");
}

int kvdk_load_cuda(const kvdk_layout*, const void*, int64_t, int64_t,
                   const int32_t*, int64_t, int64_t, void*, int64_t, void*,
                   int64_t, void*, int64_t, unsigned long long*, void*) {
  return NoCuda("kvdk_load_cuda");
}

int kvdk_fused_store_cuda(const kvdk_layout*, void*, int64_t, int64_t,
                          const uint16_t*, const kvdk_fused_params*,
                          const int32_t*, int64_t, uint16_t*, void*, int64_t,
                          unsigned long long*, void*) {
  return NoCuda("kvdk_fused_store_cuda");
}

int kvdk_convert_topk_cuda(const kvdk_layout*, int32_t*, int64_t, int32_t,
                           const int32_t*, const int32_t*, const int32_t*,
                           int32_t, int64_t, unsigned long long*, void*) {
  return NoCuda("kvdk_convert_topk_cuda");
}

int kvdk_swa_decode_index_cuda(const kvdk_layout*, const int32_t*,
                               const int32_t*, const int32_t*, int64_t, int32_t,
                               int32_t*, void*, int64_t, unsigned long long*,
                               void*) {
  return NoCuda("kvdk_swa_decode_index_cuda");
}

int kvdk_expand_swa_index_cuda(const int32_t*, int64_t, int32_t, int32_t,
                               int32_t*, void*, int64_t, unsigned long long*,
                               void*) {
  return NoCuda("kvdk_expand_swa_index_cuda");
}

int kvdk_kv_index_cat_cuda(const int32_t*, int32_t, const int32_t*, int32_t,
                           int64_t, int32_t, int32_t, int32_t*, void*, int64_t,
                           unsigned long long*, void*) {
  return NoCuda("kvdk_kv_index_cat_cuda");
}

}  // extern "C"
