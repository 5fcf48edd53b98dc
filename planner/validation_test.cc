// Every validation rule of the batch planners: INVALID_ARGUMENT naming the
// field and index, and nothing written (builder and outputs unchanged).
#include <cstdint>
#include <functional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/plan.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

// A small valid batch of four sequences; tests break one field at a time.
struct Fixture {
  std::vector<int32_t> seqlen_k = {40, 7, 0, 33};
  std::vector<int32_t> seqlen_q = {8, 7, 0, 1};
  std::vector<int32_t> state_ids = {0, 1, 2, 3};
  std::vector<int32_t> valid_start = {0, 0, 0, 5};
  std::vector<int32_t> table = {1,  2,  3,  4,  5,  6,  7,  8,  //
                                9,  -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                -1, -1, -1, -1, 10, 11, 12, 13, 14, 15, 16, 17};
  int32_t num_cols = 8;

  SequenceBatch view() const {
    SequenceBatch b;
    b.seqlen_k = seqlen_k;
    b.seqlen_q = seqlen_q;
    b.state_ids = state_ids;
    b.swa_valid_start = valid_start;
    b.block_table.data = table;
    b.block_table.num_rows = static_cast<int64_t>(seqlen_k.size());
    b.block_table.num_cols = num_cols;
    b.block_table.row_stride = 8;
    return b;
  }
};

// block_size 8, ratio 2: 4 compressed tokens per pool block of 4096.
const CompressedParams kCompressed{
    .block_size = 8, .ratio = 2, .num_blocks = 4096};
const SwaParams kSwa{.window = 16, .ring_size = 16, .num_states = 4};

struct Case {
  const char* name;
  std::function<void(Fixture&)> breakit;
  const char* message;
};

// Runs every planner that reads the broken field; each must fail with the
// message and leave its outputs as they were.
void ExpectRejected(const Case& c, bool compressed, bool swa) {
  Fixture f;
  c.breakit(f);
  const SequenceBatch batch = f.view();
  BlockLoadPlanBuilder builder(3, 3);
  ASSERT_TRUE(builder.AppendZeroFill(5).ok());
  auto expect_error = [&](const absl::Status& s, const char* who) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument)
        << c.name << " / " << who;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name << " / " << who;
    EXPECT_EQ(builder.total_k(), 5) << c.name << " / " << who;
    EXPECT_EQ(builder.source_block_size(), 3) << c.name << " / " << who;
  };
  if (compressed) {
    std::vector<int32_t> cu(5, -9);
    expect_error(
        BuildCompressedPlan(batch, kCompressed, &builder, absl::MakeSpan(cu)),
        "compressed");
    EXPECT_EQ(cu, std::vector<int32_t>(5, -9)) << c.name;
  }
  if (swa) {
    expect_error(BuildSwaPlan(batch, kSwa, &builder), "swa plan");
    std::vector<int32_t> slots(16, -9);
    expect_error(BuildSwaStoreSlots(batch, kSwa, absl::MakeSpan(slots)),
                 "store slots");
    EXPECT_EQ(slots, std::vector<int32_t>(16, -9)) << c.name;
    std::vector<int32_t> index(16 * 16, -9);
    expect_error(BuildSwaDecodeIndex(batch, kSwa, absl::MakeSpan(index)),
                 "decode index");
    EXPECT_EQ(index, std::vector<int32_t>(16 * 16, -9)) << c.name;
  }
}

TEST(ValidationTest, TheFixtureIsValid) {
  Fixture f;
  BlockLoadPlanBuilder builder(3, 3);
  std::vector<int32_t> cu(5);
  EXPECT_TRUE(
      BuildCompressedPlan(f.view(), kCompressed, &builder, absl::MakeSpan(cu))
          .ok());
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 20, 23, 24, 40}));
  EXPECT_TRUE(BuildSwaPlan(f.view(), kSwa, &builder).ok());
  std::vector<int32_t> slots(16);
  EXPECT_TRUE(BuildSwaStoreSlots(f.view(), kSwa, absl::MakeSpan(slots)).ok());
}

TEST(ValidationTest, LengthsAndSwaInputs) {
  const Case cases[] = {
      {"negative seqlen_k", [](Fixture& f) { f.seqlen_k[2] = -1; },
       "seqlen_k[2] = -1 is negative"},
      {"negative seqlen_q", [](Fixture& f) { f.seqlen_q[3] = -4; },
       "seqlen_q[3] = -4 is negative"},
      {"q above k", [](Fixture& f) { f.seqlen_q[1] = 10; },
       "seqlen_q[1] = 10 exceeds seqlen_k[1] = 7"},
      {"short seqlen_q", [](Fixture& f) { f.seqlen_q.pop_back(); },
       "seqlen_q has 3 entries, expected 4"},
      {"state outside", [](Fixture& f) { f.state_ids[3] = 4; },
       "state_ids[3] = 4 is outside [0, 4)"},
      {"negative state", [](Fixture& f) { f.state_ids[0] = -1; },
       "state_ids[0] = -1 is outside [0, 4)"},
      {"short state_ids", [](Fixture& f) { f.state_ids.pop_back(); },
       "state_ids has 3 entries, expected 4"},
      {"negative valid start", [](Fixture& f) { f.valid_start[2] = -3; },
       "swa_valid_start[2] = -3 is negative"},
      {"short valid start", [](Fixture& f) { f.valid_start.resize(2); },
       "swa_valid_start has 2 entries, expected 4"},
  };
  for (const Case& c : cases) {
    ExpectRejected(c, /*compressed=*/false, /*swa=*/true);
  }
  // The compressed plan reads seqlen_k too.
  ExpectRejected(cases[0], /*compressed=*/true, /*swa=*/false);
}

TEST(ValidationTest, BlockTable) {
  const Case cases[] = {
      {"entry outside pool", [](Fixture& f) { f.table[3 * 8 + 2] = 9000; },
       "block_table[3][2] = 9000 is outside [0, 4096)"},
      {"negative entry read", [](Fixture& f) { f.table[1 * 8 + 0] = -1; },
       "block_table[1][0] = -1 is outside [0, 4096)"},
      {"table too short", [](Fixture& f) { f.num_cols = 4; },
       "block_table[0] holds 4 blocks, fewer than the 5 that seqlen_k[0] = "
       "40 needs (20 compressed tokens, 4 per block)"},
      {"too few rows", [](Fixture& f) { f.table.resize(8 * 3); },
       "block_table data holds 24 entries, fewer than the 32"},
  };
  for (const Case& c : cases) {
    ExpectRejected(c, /*compressed=*/true, /*swa=*/false);
  }
}

TEST(ValidationTest, Parameters) {
  Fixture f;
  BlockLoadPlanBuilder builder(3, 3);
  std::vector<int32_t> cu(5, -9);
  struct ParamCase {
    CompressedParams params;
    const char* message;
  };
  const ParamCase compressed[] = {
      {{.block_size = 8, .ratio = 3, .num_blocks = 9},
       "ratio = 3 does not divide block_size = 8"},
      {{.block_size = 0, .ratio = 1, .num_blocks = 9},
       "block_size = 0 must be positive"},
      {{.block_size = 8, .ratio = 0, .num_blocks = 9},
       "ratio = 0 must be positive"},
      {{.block_size = 8, .ratio = 2, .num_blocks = 0},
       "num_blocks = 0 must be positive"},
  };
  for (const ParamCase& c : compressed) {
    absl::Status s =
        BuildCompressedPlan(f.view(), c.params, &builder, absl::MakeSpan(cu));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  std::vector<int32_t> short_cu(4);
  EXPECT_THAT(BuildCompressedPlan(f.view(), kCompressed, &builder,
                                  absl::MakeSpan(short_cu))
                  .message(),
              HasSubstr("cu_compressed has 4 entries, expected 5"));
  EXPECT_EQ(cu, std::vector<int32_t>(5, -9));

  struct SwaCase {
    SwaParams params;
    const char* message;
  };
  const SwaCase swa[] = {
      {{.window = 17, .ring_size = 16, .num_states = 4},
       "window = 17 is outside [1, ring_size = 16]"},
      {{.window = 0, .ring_size = 16, .num_states = 4},
       "window = 0 is outside [1, ring_size = 16]"},
      {{.window = 1, .ring_size = 0, .num_states = 4},
       "ring_size = 0 must be positive"},
      {{.window = 1, .ring_size = 16, .num_states = 0},
       "num_states = 0 must be positive"},
      {{.window = 1, .ring_size = 65536, .num_states = 65536},
       "exceed the int32 slot range"},
  };
  for (const SwaCase& c : swa) {
    absl::Status s = BuildSwaPlan(f.view(), c.params, &builder);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  EXPECT_EQ(builder.total_k(), 0);
  EXPECT_EQ(builder.source_block_size(), 3);

  std::vector<int32_t> slots(15, -9);
  EXPECT_THAT(
      BuildSwaStoreSlots(f.view(), kSwa, absl::MakeSpan(slots)).message(),
      HasSubstr("slots has 15 entries, expected 16"));
  EXPECT_EQ(slots, std::vector<int32_t>(15, -9));
}

TEST(ValidationTest, PrefillLayoutAndPivots) {
  Fixture f;
  EXPECT_THAT(ComputePrefillLayout(f.view(), -1, 4).status().message(),
              HasSubstr("window = -1 is negative"));
  EXPECT_THAT(ComputePrefillLayout(f.view(), 4, -2).status().message(),
              HasSubstr("ratio = -2 is negative"));
  f.seqlen_q[0] = 41;
  EXPECT_THAT(ComputePrefillLayout(f.view(), 4, 2).status().message(),
              HasSubstr("seqlen_q[0] = 41 exceeds seqlen_k[0] = 40"));
  f.seqlen_q[0] = 8;
  // Rows beyond int32: 4 sequences x window 2^30.
  absl::StatusOr<PrefillLayout> big =
      ComputePrefillLayout(f.view(), 1 << 30, 2);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.status().message(), HasSubstr("exceeds the int32 row limit"));

  absl::StatusOr<PrefillLayout> layout = ComputePrefillLayout(f.view(), 4, 2);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->swa_history_rows, 16);
  EXPECT_EQ(layout->chunk_rows, 16);
  EXPECT_EQ(layout->compressed_rows, 20 + 3 + 1 + 16);
  EXPECT_EQ(layout->main_kv_offset, 32);
  EXPECT_EQ(layout->total_rows, 72);

  std::vector<int32_t> pivots(4 * 16, -9);
  EXPECT_THAT(
      ComputeSwaPivots(f.view(), *layout, absl::MakeSpan(pivots).subspan(4))
          .message(),
      HasSubstr("pivots has 60 entries, expected 64"));
  PrefillLayout other = *layout;
  other.chunk_rows = 15;
  EXPECT_THAT(
      ComputeSwaPivots(f.view(), other, absl::MakeSpan(pivots)).message(),
      HasSubstr("does not match the batch"));
  other = *layout;
  other.window = 0;
  EXPECT_THAT(
      ComputeSwaPivots(f.view(), other, absl::MakeSpan(pivots)).message(),
      HasSubstr("layout window = 0 must be positive"));
  f.valid_start[1] = -1;
  absl::Status s = ComputeSwaPivots(f.view(), *layout, absl::MakeSpan(pivots));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("swa_valid_start[1] = -1 is negative"));
  EXPECT_EQ(pivots, std::vector<int32_t>(64, -9));
}

TEST(ValidationTest, BlockTableShape) {
  const std::vector<int32_t> data(10, 0);
  const std::vector<int32_t> lens = {2, 5};
  BlockTableView view{.data = data,
                      .num_rows = 2,
                      .num_cols = 4,
                      .row_stride = 5,
                      .row_lens = lens};
  EXPECT_THAT(view.Validate(2).message(),
              HasSubstr("block_table row_lens[1] = 5 is outside [0, 4]"));
  view.row_lens = {};
  view.row_stride = 3;
  EXPECT_THAT(view.Validate(2).message(),
              HasSubstr("block_table num_cols = 4 is outside [0, row_stride "
                        "= 3]"));
  view.row_stride = 7;
  EXPECT_THAT(
      view.Validate(2).message(),
      HasSubstr("block_table data holds 10 entries, fewer than the 11"));
  view.row_stride = 6;
  EXPECT_TRUE(view.Validate(2).ok());
  EXPECT_THAT(view.Validate(3).message(),
              HasSubstr("block_table has 2 rows, fewer than the 3 sequences"));
  view.num_rows = -1;
  EXPECT_EQ(view.Validate(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.Validate(0).message(),
              HasSubstr("block_table num_rows = -1 is negative"));
}

// Found by //tests/fuzz:index_fuzz (UBSan): (num_rows - 1) * row_stride
// overflowed int64 in the data size check.
TEST(BlockTableViewTest, HugeRowsAndStrideDoNotOverflow) {
  const std::vector<int32_t> data(10, 0);
  BlockTableView view{.data = data,
                      .num_rows = int64_t{1} << 40,
                      .num_cols = 1,
                      .row_stride = int64_t{1} << 62};
  const absl::Status s = view.Validate(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("block_table data holds 10 entries, "
                                     "fewer than the more than 2^63 that "
                                     "1099511627776 rows of stride "
                                     "4611686018427387904 need"));
}

}  // namespace
}  // namespace kvdepot
