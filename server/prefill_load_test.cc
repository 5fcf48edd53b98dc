// PrefillLoad's orchestration on the CPU backend, checked against the
// reference engine composed by hand: history rows = a load of the rings as
// they were before the call, compressed rows = a load of the main pool,
// chunk rows = what a load of each ring slot returns after the call (the
// store then load contract), every other ring slot unchanged.
#include "server/prefill_load.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "server/cpu/cpu_backend.h"
#include "server/request_checks.h"

namespace kvdepot {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<uint16_t> RandomBf16(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (uint16_t& x : v) x = FloatToBf16(dist(rng));
  return v;
}

struct Pools {
  PoolLayout swa, main;
  std::unique_ptr<Backend> backend = MakeCpuBackend(BackendOptions{});
  std::unique_ptr<Memory> swa_mem, main_mem;
  static constexpr int64_t kSwaLayer = 0, kMainLayer = 1;

  // Fills every slot of both layers with stored random tokens.
  Pools(const KVCacheFormat& f, int64_t ring, int64_t rings, int64_t main_block,
        int64_t main_blocks, std::mt19937& rng) {
    swa = *MakePoolLayout(f, ring, rings, 1);
    main = *MakePoolLayout(f, main_block, main_blocks, 2);
    swa_mem = *backend->Allocate(swa.total_bytes, "");
    main_mem = *backend->Allocate(main.total_bytes, "");
    Fill(swa, *swa_mem, kSwaLayer, rng);
    Fill(main, *main_mem, kMainLayer, rng);
  }
  void Fill(const PoolLayout& l, const Memory& m, int64_t layer,
            std::mt19937& rng) {
    std::vector<int32_t> slots(static_cast<size_t>(l.num_slots()));
    std::iota(slots.begin(), slots.end(), 0);
    const std::vector<uint16_t> kv =
        RandomBf16(l.num_slots() * l.format.elements(), rng);
    ASSERT_TRUE(
        backend->Store(l, m, layer, kv.data(), InputDtype::kBF16, slots).ok());
  }
};

// Runs a planned chunk and checks every output row and every ring slot.
void RunAndCheck(Pools& p, const PrefillLoadPlan& plan, std::mt19937& rng) {
  const PrefillLayout& pl = plan.layout;
  const int64_t e = p.swa.format.elements();
  const int64_t row = LoadDataRowBytes(p.swa.format);
  const uint8_t* rings = p.swa_mem->data() + p.swa.layer_offset(p.kSwaLayer);
  const uint8_t* main = p.main_mem->data() + p.main.layer_offset(p.kMainLayer);
  const std::vector<uint8_t> rings_before(rings, rings + p.swa.layer_bytes);
  const std::vector<uint16_t> chunk = RandomBf16(pl.chunk_rows * e, rng);
  std::vector<uint8_t> out(static_cast<size_t>(pl.total_rows * row), 0xAB);
  PrefillHostScratch scratch;
  ASSERT_TRUE(
      RunPrefillLoad(*p.backend, LayerRef{&p.swa, p.swa_mem.get(), p.kSwaLayer},
                     LayerRef{&p.main, p.main_mem.get(), p.kMainLayer}, plan,
                     reinterpret_cast<const uint8_t*>(chunk.data()),
                     InputDtype::kBF16, out.data(), GpuOrdering{}, nullptr,
                     &scratch)
          .ok());

  std::vector<uint8_t> want(out.size(), 0xCD);
  ASSERT_TRUE(LoadSegments(p.swa, rings_before.data(), plan.swa_segments,
                           pl.swa_history_rows, want.data(), nullptr)
                  .ok());
  ASSERT_TRUE(LoadSegments(p.main, main, plan.main_segments, pl.compressed_rows,
                           want.data() + pl.main_kv_offset * row, nullptr)
                  .ok());
  std::vector<bool> stored(static_cast<size_t>(p.swa.num_slots()), false);
  for (int32_t j = 0; j < pl.chunk_rows; ++j) {
    const int32_t slot = plan.store_slots[j];
    uint8_t* dst = want.data() + (pl.swa_history_rows + j) * row;
    if (slot < 0) {
      // Not kept in the ring: the row is the same store-then-load value.
      CastBackRows(p.swa.format,
                   reinterpret_cast<const uint8_t*>(chunk.data() + j * e),
                   InputDtype::kBF16, 1, dst, &scratch);
      continue;
    }
    stored[slot] = true;
    const int32_t bs = static_cast<int32_t>(p.swa.block_size);
    const int32_t seg[4] = {slot / bs, slot % bs, slot % bs + 1, 0};
    ASSERT_TRUE(LoadSegments(p.swa, rings, seg, 1, dst, nullptr).ok());
  }
  ASSERT_GT(pl.total_rows, 0);
  for (int64_t r = 0; r < pl.total_rows; ++r) {
    ASSERT_EQ(std::memcmp(out.data() + r * row, want.data() + r * row, row), 0)
        << "output row " << r << " of " << pl.total_rows << " (history "
        << pl.swa_history_rows << ", chunk " << pl.chunk_rows << ")";
  }
  for (int64_t s = 0; s < p.swa.num_slots(); ++s) {
    if (stored[s]) continue;
    const int64_t off = p.swa.slot_data_offset(s);
    ASSERT_EQ(std::memcmp(rings + off, rings_before.data() + off,
                          p.swa.format.bytes_per_token()),
              0)
        << "ring slot " << s << " changed but no chunk token maps to it";
  }
}

// SPEC §6's worked example through the real backend.
TEST(PrefillLoadTest, WorkedExample) {
  std::mt19937 rng(301);
  Pools p(*NamedFormat(FormatId::kV41), 4096, 8, 16, 1200, rng);
  const std::vector<int32_t> seqlen_k{10000}, seqlen_q{1024}, state{5};
  std::vector<int32_t> table(157);
  std::iota(table.begin(), table.end(), 1000);
  SequenceBatch b;
  b.seqlen_k = seqlen_k;
  b.seqlen_q = seqlen_q;
  b.state_ids = state;
  b.block_table = DenseTable(table, 1, 157);
  PrefillLoadPlan plan;
  ASSERT_TRUE(PlanPrefillLoad(p.swa, p.main, b, 4096, 4, &plan).ok());
  EXPECT_EQ(plan.layout.total_rows, 7620);
  EXPECT_EQ(plan.layout.main_kv_offset, 5120);
  EXPECT_THAT(plan.swa_segments, ElementsAre(5, 784, 4096, 0, 5, 0, 784, 3312));
  EXPECT_EQ(plan.main_segments.size(), 157u * 4);
  EXPECT_THAT(plan.cu_compressed, ElementsAre(0, 2500));
  RunAndCheck(p, plan, rng);
}

// Awkward sizes: ring 133, compressed blocks of 7, three sequences, a
// chunk longer than the ring (its first tokens never reach the ring).
TEST(PrefillLoadTest, AwkwardSizes) {
  std::mt19937 rng(7);
  Pools p(*NamedFormat(FormatId::kV41Fp4), 133, 4, 7, 80, rng);
  const std::vector<int32_t> seqlen_k{300, 5, 140}, seqlen_q{150, 5, 1};
  const std::vector<int32_t> state{2, 0, 3}, valid{0, 0, 90};
  std::vector<int32_t> table(3 * 16);
  std::iota(table.begin(), table.end(), 20);
  SequenceBatch b;
  b.seqlen_k = seqlen_k;
  b.seqlen_q = seqlen_q;
  b.state_ids = state;
  b.swa_valid_start = valid;
  b.block_table = DenseTable(table, 3, 16);
  PrefillLoadPlan plan;
  const absl::Status s = PlanPrefillLoad(p.swa, p.main, b, 100, 3, &plan);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(plan.layout.swa_history_rows, 300);
  EXPECT_EQ(plan.layout.chunk_rows, 156);
  EXPECT_EQ(std::count(plan.store_slots.begin(), plan.store_slots.end(), -1),
            150 - 133);
  RunAndCheck(p, plan, rng);
}

TEST(PrefillLoadTest, RejectsBadPlansWithTheField) {
  std::mt19937 rng(11);
  Pools p(*NamedFormat(FormatId::kV41), 16, 2, 4, 8, rng);
  const std::vector<int32_t> seqlen_k{8, 8}, seqlen_q{4, 4}, state{1, 1};
  std::vector<int32_t> table(2 * 2, 0);
  table[2] = table[3] = 1;
  SequenceBatch b;
  b.seqlen_k = seqlen_k;
  b.seqlen_q = seqlen_q;
  b.state_ids = state;
  b.block_table = DenseTable(table, 2, 2);
  PrefillLoadPlan plan;
  // window 0 (no SWA part) and ratio 0 (no compressed part) are each
  // valid (tests/e2e_prefill_parts_test.cc); both at once are not.
  absl::Status s = PlanPrefillLoad(p.swa, p.main, b, 0, 0, &plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("window = 0"));
  s = PlanPrefillLoad(p.swa, p.main, b, 8, 1, &plan);  // both use ring 1
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("share a ring slot"));
  const PoolLayout bf16 =
      *MakePoolLayout(*NamedFormat(FormatId::kBf16, 64), 4, 8, 1);
  s = PlanPrefillLoad(p.swa, bf16, b, 8, 1, &plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("same elements"));
}

}  // namespace
}  // namespace kvdepot
