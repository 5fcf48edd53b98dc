// Helpers of the end-to-end tests: a local mirror of a daemon pool run
// through the CPU reference, random K/V, packing.
#ifndef KVDEPOT_TESTS_E2E_UTIL_H_
#define KVDEPOT_TESTS_E2E_UTIL_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "client/kvdepot_client.h"
#include "kernels/format.h"
#include "kernels/reference/reference.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot::testing {

// A host copy of a pool: the expected bytes, computed with the reference.
struct LocalPool {
  PoolLayout layout;
  std::vector<uint8_t> bytes;  // [total_bytes]

  static LocalPool FromInfo(const v1::PoolInfo& info);
  uint8_t* layer(int64_t l) { return bytes.data() + layout.layer_offset(l); }
};

v1::CreatePoolRequest PoolRequest(const std::string& name,
                                  const std::string& format, int32_t elements,
                                  int64_t block_size, int64_t num_blocks,
                                  int64_t num_layers);

// n * elements values, normal(0, 2) with a few large outliers.
std::vector<float> RandomKv(int64_t n, int64_t elements, std::mt19937& rng);
std::string Fp32Bytes(const std::vector<float>& v);
std::string Bf16Bytes(const std::vector<float>& v);
// The fp32 values the BF16 bytes stand for.
std::vector<float> Bf16Values(const std::vector<float>& v);

std::string Pack(absl::Span<const int32_t> v);
bool AllZero(const uint8_t* p, int64_t n);

// A client on the test daemon's socket.
std::unique_ptr<KVCacheClient> ConnectOrDie(
    const std::string& socket, absl::Duration lease = absl::ZeroDuration());

// A Store request with inline or buffer data filled in by the caller.
v1::StoreRequest StoreRequest(const std::string& pool, int64_t layer,
                              absl::Span<const int32_t> slots,
                              v1::InputDtype dtype);

// Segments DataRef-free request parts.
v1::Segments SegmentsProto(absl::Span<const int32_t> segments, int64_t total_k);

// Requests the daemon refused under `reason` ("limit_pools", ...) so far,
// from Stats (0 when none; -1, with a test failure, when Stats fails).
int64_t Rejections(KVCacheClient& c, const std::string& reason);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_E2E_UTIL_H_
