// GPU index operations against the planner's CPU versions, entry by entry.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kernels.h"
#include "planner/batch.h"
#include "planner/decode_index.h"
#include "planner/index_ops.h"
#include "planner/sequence_plans.h"

namespace kvdepot::gpu {
namespace {

using ::testing::HasSubstr;

// Uploads a host vector; the buffer stays alive in `keep`.
int32_t* Upload(const std::vector<int32_t>& v,
                std::vector<DeviceBuffer>& keep) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Open(v.size() * 4);
  EXPECT_TRUE(b.ok());
  EXPECT_TRUE(b->CopyFrom(v.data(), v.size() * 4).ok());
  keep.push_back(*std::move(b));
  return keep.back().as<int32_t>();
}

std::vector<int32_t> Download(const int32_t* p, size_t n) {
  std::vector<int32_t> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return v;
}

int32_t Uniform(std::mt19937& rng, int32_t lo, int32_t hi) {
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

bool AllNegativeOne(const std::vector<int32_t>& v) {
  for (int32_t x : v) {
    if (x != -1) return false;
  }
  return true;
}

TEST(IndexOpsTest, ConvertTopkMatchesPlanner) {
  std::mt19937 rng(301);
  for (const int32_t block_size : {1, 7, 16, 133}) {
    const int64_t seqs = 79;
    const int32_t k = 64, cols = 40, num_blocks = 500;
    const int64_t stride = 43;
    std::vector<int32_t> valid(seqs), tokens(seqs), lens(seqs);
    std::vector<int32_t> table(seqs * stride), topk(seqs * k);
    for (int64_t b = 0; b < seqs; ++b) {
      valid[b] = Uniform(rng, 0, k);
      lens[b] = Uniform(rng, 0, cols);
      tokens[b] = Uniform(rng, 0, cols * block_size + 5);
    }
    for (int32_t& t : table) t = Uniform(rng, -1, num_blocks + 3);
    for (int32_t& x : topk) x = Uniform(rng, -3, cols * block_size + 10);
    BlockTableView view{table, seqs, cols, stride, lens};
    std::vector<int32_t> want = topk;
    const absl::StatusOr<int64_t> invalid = kvdepot::ConvertTopk(
        absl::MakeSpan(want), k, valid, tokens, view, block_size, num_blocks);
    ASSERT_TRUE(invalid.ok()) << invalid.status();
    ASSERT_GT(*invalid, 0);
    ASSERT_FALSE(AllNegativeOne(want));

    std::vector<DeviceBuffer> keep;
    int32_t* d_topk = Upload(topk, keep);
    auto counter = DeviceBuffer::Open(8);
    ASSERT_TRUE(counter.ok());
    ASSERT_EQ(cudaMemset(counter->get(), 0, 8), cudaSuccess);
    ASSERT_TRUE(gpu::ConvertTopk(d_topk, seqs, k, Upload(valid, keep),
                                 Upload(tokens, keep), Upload(table, keep),
                                 Upload(lens, keep), cols, stride, block_size,
                                 num_blocks, counter->as<unsigned long long>())
                    .ok());
    EXPECT_EQ(Download(d_topk, topk.size()), want) << "B=" << block_size;
    unsigned long long count = 0;
    ASSERT_TRUE(counter->CopyTo(&count, 8).ok());
    EXPECT_EQ(static_cast<int64_t>(count), *invalid);
  }
}

TEST(IndexOpsTest, SwaDecodeIndexMatchesPlanner) {
  std::mt19937 rng(302);
  for (const int32_t window : {1, 7, 128}) {
    const SwaParams params{window, window + 77, 12};
    const int64_t n = 79;
    std::vector<int32_t> ids(n), starts(n), lens(n);
    for (int64_t i = 0; i < n; ++i) {
      ids[i] = Uniform(rng, 0, params.num_states - 1);
      starts[i] = Uniform(rng, 0, 1 << 30);
      lens[i] = Uniform(rng, 0, window);
    }
    std::vector<int32_t> want(n * window);
    ASSERT_TRUE(
        ExpandSwaDecodeIndex(ids, starts, lens, params, absl::MakeSpan(want))
            .ok());
    ASSERT_FALSE(AllNegativeOne(want));
    std::vector<DeviceBuffer> keep;
    int32_t* out = Upload(std::vector<int32_t>(want.size(), 7), keep);
    ASSERT_TRUE(SwaDecodeIndex(Upload(ids, keep), Upload(starts, keep),
                               Upload(lens, keep), n, window, params.ring_size,
                               out)
                    .ok());
    EXPECT_EQ(Download(out, want.size()), want) << "W=" << window;
  }
}

TEST(IndexOpsTest, ExpandSwaIndexMatchesPlanner) {
  std::mt19937 rng(303);
  const int32_t width = 100, kv_rows = 5000;
  const int64_t rows = 333;
  std::vector<int32_t> pivots;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t len1 = Uniform(rng, 0, width);
    const int32_t len2 = Uniform(rng, 0, width - len1);
    pivots.insert(pivots.end(), {Uniform(rng, 0, kv_rows - len1), len1,
                                 Uniform(rng, 0, kv_rows - len2), len2});
  }
  std::vector<int32_t> want(rows * width);
  ASSERT_TRUE(
      kvdepot::ExpandSwaIndex(pivots, width, kv_rows, absl::MakeSpan(want))
          .ok());
  ASSERT_FALSE(AllNegativeOne(want));
  std::vector<DeviceBuffer> keep;
  int32_t* out = Upload(std::vector<int32_t>(want.size(), 7), keep);
  ASSERT_TRUE(gpu::ExpandSwaIndex(Upload(pivots, keep), rows, width, out).ok());
  EXPECT_EQ(Download(out, want.size()), want);
}

TEST(IndexOpsTest, KvIndexCatMatchesPlanner) {
  std::mt19937 rng(304);
  const int32_t sw = 65, cw = 130, offset = 5120, comp_rows = 2500;
  const int64_t rows = 79;
  std::vector<int32_t> swa(rows * sw), comp(rows * cw);
  for (int32_t& x : swa) x = Uniform(rng, -1, offset - 1);
  for (int32_t& x : comp) x = Uniform(rng, -1, comp_rows - 1);
  std::vector<int32_t> want(rows * (sw + cw));
  ASSERT_TRUE(kvdepot::KvIndexCat(swa, sw, comp, cw, rows, offset, comp_rows,
                                  absl::MakeSpan(want))
                  .ok());
  std::vector<DeviceBuffer> keep;
  int32_t* out = Upload(std::vector<int32_t>(want.size(), 7), keep);
  ASSERT_TRUE(gpu::KvIndexCat(Upload(swa, keep), sw, Upload(comp, keep), cw,
                              rows, offset, out)
                  .ok());
  EXPECT_EQ(Download(out, want.size()), want);
}

// The checked variant on an untrusted compressed index: entries outside
// [-1, comp_rows) become -1 and are counted, the rest equal the planner's.
TEST(IndexOpsTest, KvIndexCatCheckedCountsOutOfRangeEntries) {
  std::mt19937 rng(305);
  const int32_t sw = 65, cw = 300, offset = 5120, comp_rows = 2500;
  const int64_t rows = 79;
  std::vector<int32_t> swa(rows * sw), comp(rows * cw);
  for (int32_t& x : swa) x = Uniform(rng, -1, offset - 1);
  for (int32_t& x : comp) x = Uniform(rng, -4, comp_rows + 3);
  std::vector<int32_t> clean = comp;
  unsigned long long bad = 0;
  for (int32_t& x : clean) {
    if (x < -1 || x >= comp_rows) {
      x = -1;
      ++bad;
    }
  }
  ASSERT_GT(bad, 0u);
  std::vector<int32_t> want(rows * (sw + cw));
  ASSERT_TRUE(kvdepot::KvIndexCat(swa, sw, clean, cw, rows, offset, comp_rows,
                                  absl::MakeSpan(want))
                  .ok());
  std::vector<DeviceBuffer> keep;
  int32_t* out = Upload(std::vector<int32_t>(want.size(), 7), keep);
  absl::StatusOr<DeviceBuffer> counter = DeviceBuffer::Open(8);
  ASSERT_TRUE(counter.ok());
  ASSERT_EQ(cudaMemset(counter->as<int32_t>(), 0, 8), cudaSuccess);
  auto* count = reinterpret_cast<unsigned long long*>(counter->as<int32_t>());
  ASSERT_TRUE(gpu::KvIndexCatChecked(Upload(swa, keep), sw, Upload(comp, keep),
                                     cw, rows, offset, comp_rows, out, count)
                  .ok());
  EXPECT_EQ(Download(out, want.size()), want);
  unsigned long long got = 0;
  ASSERT_EQ(cudaMemcpy(&got, count, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, bad);
  int32_t x = 0;
  absl::Status s = gpu::KvIndexCatChecked(&x, 1, &x, 1, 1, 0, 4, &x, nullptr);
  EXPECT_THAT(s.message(), HasSubstr("invalid_count"));
}

TEST(IndexOpsTest, RejectsBadShapes) {
  int32_t x = 0;
  absl::Status s = gpu::SwaDecodeIndex(&x, &x, &x, 1, 8, 4, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("window = 8, ring_size = 4"));
  s = gpu::ConvertTopk(&x, 1, 4, &x, &x, &x, nullptr, 5, 3, 16, 10, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("row_stride >= num_cols"));
  alignas(16) int32_t pivots[8] = {};
  s = gpu::ExpandSwaIndex(pivots + 1, 1, 4, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("pivots is not 16-byte aligned"));
  s = gpu::KvIndexCat(&x, -1, &x, 2, 1, 0, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("swa_width = -1 is negative"));
}

}  // namespace
}  // namespace kvdepot::gpu
