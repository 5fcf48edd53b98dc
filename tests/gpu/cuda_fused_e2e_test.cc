// The Store RPC's fused option (SPEC §8) on kvdepotd --backend=cuda, as an
// engine would send it: BF16 K/V inline or in a daemon buffer, the norm
// weights, positions and cos/sin cache inline, cast_back inline or into a
// buffer. The pool (read back by CUDA IPC) and the cast_back must equal
// the CPU reference bit for bit, for DS_MLA_FP8 in the MLA configuration,
// V41 with every stage, and MXFP8_INDEX with the norm and a Hadamard at a
// size that takes fused_row.cu's two-lane kernel.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "client/mappings.h"
#include "common/cuda/cuda_mappings.h"
#include "gtest/gtest.h"
#include "kernels/fused.h"
#include "kernels/quant.h"
#include "kernels/reference/fused.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

constexpr int64_t kMaxPosition = 64;

std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

struct FusedCase {
  const char* name;
  const char* format;
  int64_t block_size;
  int64_t num_blocks;
  int64_t num_tokens;
  FusedParams params;  // arrays set by the test
  bool kv_in_buffer;
  bool cast_back_in_buffer;
};

void PrintTo(const FusedCase& c, std::ostream* os) { *os << c.name; }

FusedParams Mla() {
  FusedParams p;
  p.norm_end = 512;
  p.rope = RopeStyle::kInterleaved;
  p.rope_offset = 512;
  p.rope_dim = 64;
  return p;
}

FusedParams AllStagesV41() {
  FusedParams p;
  p.norm_begin = 8;
  p.norm_end = 504;
  p.rope = RopeStyle::kNeox;
  p.rope_offset = 448;
  p.rope_dim = 64;
  p.hadamard_len = 512;
  return p;
}

FusedParams NormHadamard128() {
  FusedParams p;
  p.norm_end = 128;
  p.hadamard_len = 128;
  return p;
}

class FusedE2eTest : public GpuTest,
                     public ::testing::WithParamInterface<FusedCase> {};

TEST_P(FusedE2eTest, PoolAndCastBackEqualTheReference) {
  const FusedCase& c = GetParam();
  cudaStream_t st = stream_->get();
  const std::string pool_name = std::string("fused_") + c.name;
  absl::StatusOr<v1::PoolInfo> info = client_->CreatePool(
      PoolRequest(pool_name, c.format, 0, c.block_size, c.num_blocks, 2));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool ref = LocalPool::FromInfo(*info);
  const PoolLayout& layout = ref.layout;
  const int64_t d = layout.format.elements();
  const int64_t n = c.num_tokens;
  absl::StatusOr<CudaIpcMapping> pool = CudaIpcMapping::Open(info->handle());
  ASSERT_TRUE(pool.ok()) << "mapping the pool: " << pool.status();

  std::mt19937 rng(1405);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<uint16_t> kv(static_cast<size_t>(n * d));
  for (uint16_t& x : kv) x = FloatToBf16(normal(rng));
  kv[3] = 0x7FC0;      // a NaN in token 0
  kv[d + 5] = 0x7F80;  // +Inf in token 1
  FusedParams p = c.params;
  std::vector<uint16_t> weight(
      static_cast<size_t>(p.norm() ? p.norm_end - p.norm_begin : 0));
  for (uint16_t& w : weight) w = FloatToBf16(0.5f + (rng() % 100) / 100.0f);
  std::vector<float> cos_sin;
  std::vector<int64_t> positions;
  if (p.rope != RopeStyle::kNone) {
    cos_sin.resize(static_cast<size_t>(kMaxPosition * p.rope_dim));
    for (size_t i = 0; i < cos_sin.size(); ++i) {
      cos_sin[i] = std::cos(0.37f * static_cast<float>(i));
    }
    positions.resize(static_cast<size_t>(n));
    for (int64_t& x : positions) x = static_cast<int64_t>(rng() % kMaxPosition);
  }
  // Distinct slots, every seventh -1.
  std::vector<int32_t> slots(static_cast<size_t>(n));
  std::vector<int32_t> order(static_cast<size_t>(layout.num_slots()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < n; ++i) slots[i] = i % 7 == 6 ? -1 : order[i];

  v1::StoreRequest r = StoreRequest(pool_name, 1, slots, v1::INPUT_DTYPE_BF16);
  const int64_t kv_bytes = n * d * 2;
  const int64_t cast_bytes = kv_bytes;
  std::optional<CudaIpcMapping> buffer;  // [kv | cast_back]
  uint64_t buffer_id = 0;
  if (c.kv_in_buffer || c.cast_back_in_buffer) {
    absl::StatusOr<v1::BufferInfo> b =
        AllocateCudaBuffer(*client_, kv_bytes + cast_bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<CudaIpcMapping> m = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(m.ok()) << m.status();
    buffer.emplace(*std::move(m));
    buffer_id = b->buffer_id();
    ASSERT_OK(Cuda(cudaMemcpyAsync(buffer->data(), kv.data(), kv_bytes,
                                   cudaMemcpyHostToDevice, st),
                   "writing the input"));
    ASSERT_OK(
        Cuda(cudaMemsetAsync(buffer->data() + kv_bytes, 0xA5, cast_bytes, st),
             "filling the cast_back"));
    ASSERT_OK(stream_->Sync());
  }
  *r.mutable_kv() = c.kv_in_buffer ? SliceRef(buffer_id, 0, kv_bytes)
                                   : InlineData(Bytes(kv.data(), kv_bytes));
  v1::FusedStoreOptions* f = r.mutable_fused();
  f->set_norm_begin(p.norm_begin);
  f->set_norm_end(p.norm_end);
  f->set_eps(p.eps);
  if (!weight.empty()) {
    *f->mutable_norm_weight() =
        InlineData(Bytes(weight.data(), weight.size() * 2));
  }
  f->set_rope(static_cast<v1::RopeStyle>(p.rope));
  f->set_rope_offset(p.rope_offset);
  f->set_rope_dim(p.rope_dim);
  if (p.rope != RopeStyle::kNone) {
    *f->mutable_positions() =
        InlineData(Bytes(positions.data(), positions.size() * 8));
    *f->mutable_cos_sin() =
        InlineData(Bytes(cos_sin.data(), cos_sin.size() * 4));
    f->set_max_position(kMaxPosition);
  }
  f->set_hadamard_begin(p.hadamard_begin);
  f->set_hadamard_len(p.hadamard_len);
  if (c.cast_back_in_buffer) {
    *f->mutable_cast_back() = SliceRef(buffer_id, kv_bytes, cast_bytes);
  } else {
    f->mutable_cast_back()->set_inline_output(true);
  }
  absl::StatusOr<v1::StoreResponse> s = client_->Store(r);
  ASSERT_TRUE(s.ok()) << "Store: " << s.status();

  p.norm_weight = weight.empty() ? nullptr : weight.data();
  p.positions = positions.empty() ? nullptr : positions.data();
  p.cos_sin = cos_sin.empty() ? nullptr : cos_sin.data();
  p.max_position = p.rope != RopeStyle::kNone ? kMaxPosition : 0;
  std::vector<uint16_t> want_cast(static_cast<size_t>(n * d));
  ASSERT_OK(
      FusedStore(layout, ref.layer(1), kv.data(), p, slots, want_cast.data()));

  std::vector<uint8_t> got(static_cast<size_t>(layout.total_bytes));
  ASSERT_OK(Cuda(cudaMemcpyAsync(got.data(), pool->data(), layout.total_bytes,
                                 cudaMemcpyDeviceToHost, st),
                 "reading the pool"));
  std::vector<uint8_t> got_cast(static_cast<size_t>(cast_bytes));
  if (c.cast_back_in_buffer) {
    ASSERT_OK(Cuda(cudaMemcpyAsync(got_cast.data(), buffer->data() + kv_bytes,
                                   cast_bytes, cudaMemcpyDeviceToHost, st),
                   "reading the cast_back"));
  } else {
    ASSERT_EQ(static_cast<int64_t>(s->cast_back().size()), cast_bytes);
    std::memcpy(got_cast.data(), s->cast_back().data(), cast_bytes);
  }
  ASSERT_OK(stream_->Sync());
  EXPECT_EQ(
      CompareBytes(ref.bytes.data(), got.data(), layout.total_bytes,
                   [&](int64_t o) { return DescribePoolOffset(layout, o); }),
      "")
      << "pool after the fused Store";
  EXPECT_EQ(CompareBytes(reinterpret_cast<const uint8_t*>(want_cast.data()),
                         got_cast.data(), cast_bytes,
                         [&](int64_t o) {
                           return "token " + std::to_string(o / (2 * d)) +
                                  " element " + std::to_string(o % (2 * d) / 2);
                         }),
            "")
      << "cast_back";
  ASSERT_OK(client_->DeletePool(pool_name));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FusedE2eTest,
    ::testing::Values(FusedCase{"dsmla_bs64_inline", "DS_MLA_FP8", 64, 8, 300,
                                Mla(), false, false},
                      FusedCase{"dsmla_bs7_buffers", "DS_MLA_FP8", 7, 60, 250,
                                Mla(), true, true},
                      FusedCase{"v41_all_stages_bs133", "V41", 133, 4, 333,
                                AllStagesV41(), true, false},
                      // Above 23K tokens: fused_row.cu's two-lane kernel.
                      FusedCase{"mxfp8_norm_hadamard_two_lanes", "MXFP8_INDEX",
                                64, 420, 26000, NormHadamard128(), true, true}),
    [](const ::testing::TestParamInfo<FusedCase>& p) { return p.param.name; });

}  // namespace
}  // namespace kvdepot::testing
