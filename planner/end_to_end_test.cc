// The planner end to end through the CPU reference
// (kernels/reference/reference.h): BF16(4) pools hold tokens whose values
// encode {sequence, position, kind}, exactly. A prefill batch is planned and
// loaded into one buffer with the SPEC §6 layout; every query row's SWA index
// (expand_swa_index of the pivots) and its causal compressed index
// (kv_index_cat) must point at exactly the keys its window allows, and those
// rows must hold those tokens. Then the chunk is stored through the SWA store
// slots and the SWA decode index of each sequence's last token is read back
// from the ring.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"
#include "planner/plan.h"
#include "planner/test_util.h"

namespace kvdepot {
namespace {

using testing::BatchShape;
using testing::OwnedBatch;
using testing::RandomBatch;

constexpr int kElements = 4;  // BF16(4): {seq, pos / 256, pos % 256, kind}
enum Kind : int { kHistory = 1, kChunk = 2, kCompressed = 3, kStale = 99 };

struct Token {
  int seq, pos, kind;
  bool operator==(const Token& o) const {
    return seq == o.seq && pos == o.pos && kind == o.kind;
  }
};
std::ostream& operator<<(std::ostream& os, const Token& t) {
  return os << "{seq " << t.seq << ", pos " << t.pos << ", kind " << t.kind
            << "}";
}

void Encode(const Token& t, float* x) {
  x[0] = static_cast<float>(t.seq);
  x[1] = static_cast<float>(t.pos / 256);
  x[2] = static_cast<float>(t.pos % 256);
  x[3] = static_cast<float>(t.kind);
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

Token DecodeRow(const uint16_t* row) {
  return Token{static_cast<int>(Bf16ToFloat(row[0])),
               static_cast<int>(Bf16ToFloat(row[1])) * 256 +
                   static_cast<int>(Bf16ToFloat(row[2])),
               static_cast<int>(Bf16ToFloat(row[3]))};
}

// A BF16(4) pool layer.
struct Pool {
  PoolLayout layout;
  std::vector<uint8_t> layer;

  Pool(int64_t block_size, int64_t num_blocks) {
    absl::StatusOr<KVCacheFormat> format = NamedFormat(FormatId::kBf16, 4);
    EXPECT_TRUE(format.ok()) << format.status();
    absl::StatusOr<PoolLayout> l =
        MakePoolLayout(*format, block_size, num_blocks, 1);
    EXPECT_TRUE(l.ok()) << l.status();
    layout = *l;
    layer.assign(layout.layer_bytes, 0xEE);
  }
  void Store(const std::vector<Token>& tokens,
             const std::vector<int32_t>& slots) {
    std::vector<float> kv(tokens.size() * kElements);
    for (size_t i = 0; i < tokens.size(); ++i) Encode(tokens[i], &kv[i * 4]);
    ASSERT_TRUE(kvdepot::Store(layout, layer.data(), kv.data(),
                               InputDtype::kFP32, slots)
                    .ok());
  }
  Token AtSlot(int32_t slot) const {
    uint16_t row[kElements];
    std::memcpy(row, layer.data() + layout.slot_data_offset(slot), sizeof(row));
    return DecodeRow(row);
  }
};

// (ring size, window, compressed tokens per pool block, ratio)
class EndToEndTest : public ::testing::TestWithParam<
                         std::tuple<int32_t, int32_t, int32_t, int32_t>> {};

TEST_P(EndToEndTest, QueriesSeeExactlyTheirWindowsInTheBuffer) {
  const auto [ring, window, pool_block, ratio] = GetParam();
  std::mt19937 rng(301);
  const int64_t n = 23;
  BatchShape shape;
  shape.num_seqs = n;
  shape.max_seqlen = std::max(3 * ring + 10, 3 * ratio * pool_block);
  shape.block_size = pool_block * ratio;
  shape.ratio = ratio;
  shape.num_blocks = 1;  // ids replaced below with distinct ones
  shape.num_states = static_cast<int32_t>(n);
  OwnedBatch batch = RandomBatch(rng, shape);
  // Distinct rings and distinct compressed blocks across the batch.
  std::iota(batch.state_ids.begin(), batch.state_ids.end(), 0);
  std::shuffle(batch.state_ids.begin(), batch.state_ids.end(), rng);
  const int32_t num_blocks = static_cast<int32_t>(batch.table.size()) + 5;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (size_t i = 0; i < batch.table.size(); ++i) batch.table[i] = ids[i];

  // The ring holds the last `ring` history positions; those before the
  // valid start are stale leftovers that no window may expose.
  Pool swa_pool(ring, n), main_pool(pool_block, num_blocks);
  {
    std::vector<Token> tokens;
    std::vector<int32_t> slots;
    for (int64_t b = 0; b < n; ++b) {
      const int32_t he = batch.seqlen_k[b] - batch.seqlen_q[b];
      for (int32_t x = std::max(0, he - ring); x < he; ++x) {
        tokens.push_back(Token{static_cast<int>(b), x,
                               x < batch.valid_start[b] ? kStale : kHistory});
        slots.push_back(batch.state_ids[b] * ring + x % ring);
      }
      for (int32_t t = 0; t < batch.seqlen_k[b] / ratio; ++t) {
        main_pool.Store(
            {Token{static_cast<int>(b), t, kCompressed}},
            {batch.table[b * batch.stride + t / pool_block] * pool_block +
             t % pool_block});
      }
    }
    ASSERT_FALSE(tokens.empty());
    swa_pool.Store(tokens, slots);
  }

  // Plan, lay out and load: SWA history, this chunk (written by the
  // worker), compressed.
  const SequenceBatch view = batch.view();
  const SwaParams swa{.window = window,
                      .ring_size = ring,
                      .num_states = static_cast<int32_t>(n)};
  const CompressedParams compressed{.block_size = pool_block * ratio,
                                    .ratio = ratio,
                                    .num_blocks = num_blocks};
  absl::StatusOr<PrefillLayout> layout =
      ComputePrefillLayout(view, window, ratio);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<uint16_t> buffer(
      static_cast<size_t>(layout->total_rows) * kElements, 0xFFFF);
  BlockLoadPlanBuilder builder(1, 1);
  ASSERT_TRUE(BuildSwaPlan(view, swa, &builder).ok());
  ASSERT_EQ(builder.total_k(), layout->swa_history_rows);
  ASSERT_TRUE(LoadSegments(swa_pool.layout, swa_pool.layer.data(),
                           builder.Finish(), builder.total_k(), buffer.data(),
                           nullptr)
                  .ok());
  std::vector<int32_t> cu_q(n + 1, 0);
  for (int64_t b = 0; b < n; ++b) {
    cu_q[b + 1] = cu_q[b] + batch.seqlen_q[b];
    const int32_t he = batch.seqlen_k[b] - batch.seqlen_q[b];
    for (int32_t j = 0; j < batch.seqlen_q[b]; ++j) {
      float x[kElements];
      Encode(Token{static_cast<int>(b), he + j, kChunk}, x);
      uint16_t* row =
          &buffer[(layout->swa_history_rows + cu_q[b] + j) * kElements];
      for (int e = 0; e < kElements; ++e) {
        uint32_t u;
        std::memcpy(&u, &x[e], sizeof(u));
        row[e] = static_cast<uint16_t>(u >> 16);  // exact: small integers
      }
    }
  }
  std::vector<int32_t> cu_compressed(n + 1);
  ASSERT_TRUE(BuildCompressedPlan(view, compressed, &builder,
                                  absl::MakeSpan(cu_compressed))
                  .ok());
  ASSERT_EQ(builder.total_k(), layout->compressed_rows);
  ASSERT_TRUE(LoadSegments(main_pool.layout, main_pool.layer.data(),
                           builder.Finish(), builder.total_k(),
                           &buffer[layout->main_kv_offset * kElements], nullptr)
                  .ok());
  for (const uint16_t v : buffer) ASSERT_NE(v, 0xFFFF);  // every row written

  // Indices: SWA from the pivots; compressed = the causal compressed tokens
  // of each query (t with (t + 1) * ratio <= p + 1), padded with -1.
  const int32_t total_q = layout->chunk_rows;
  ASSERT_GT(total_q, 0);
  std::vector<int32_t> pivots(4 * total_q), swa_index(total_q * window);
  ASSERT_TRUE(ComputeSwaPivots(view, *layout, absl::MakeSpan(pivots)).ok());
  ASSERT_TRUE(ExpandSwaIndex(pivots, window, layout->main_kv_offset,
                             absl::MakeSpan(swa_index))
                  .ok());
  int32_t comp_width = 1;
  for (const int32_t k : batch.seqlen_k) {
    comp_width = std::max(comp_width, k / ratio);
  }
  std::vector<int32_t> comp_index(static_cast<size_t>(total_q) * comp_width,
                                  -1);
  for (int64_t b = 0; b < n; ++b) {
    const int32_t he = batch.seqlen_k[b] - batch.seqlen_q[b];
    for (int32_t j = 0; j < batch.seqlen_q[b]; ++j) {
      const int32_t visible = (he + j + 1) / ratio;
      for (int32_t t = 0; t < visible; ++t) {
        comp_index[(cu_q[b] + j) * comp_width + t] = cu_compressed[b] + t;
      }
    }
  }
  const int32_t width = window + comp_width;
  std::vector<int32_t> cat(static_cast<size_t>(total_q) * width);
  ASSERT_TRUE(KvIndexCat(swa_index, window, comp_index, comp_width, total_q,
                         layout->main_kv_offset, layout->compressed_rows,
                         absl::MakeSpan(cat))
                  .ok());

  int64_t swa_keys = 0, comp_keys = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t he = batch.seqlen_k[b] - batch.seqlen_q[b];
    for (int32_t j = 0; j < batch.seqlen_q[b]; ++j) {
      const int32_t p = he + j;
      const int32_t* row = &cat[(cu_q[b] + j) * width];
      std::vector<Token> want, got;
      for (int32_t x = std::max({0, p - window + 1, batch.valid_start[b]});
           x <= p; ++x) {
        want.push_back(
            Token{static_cast<int>(b), x, x < he ? kHistory : kChunk});
      }
      for (int32_t c = 0; c < window && row[c] != -1; ++c) {
        got.push_back(DecodeRow(&buffer[row[c] * kElements]));
      }
      for (int32_t c = static_cast<int32_t>(got.size()); c < window; ++c) {
        ASSERT_EQ(row[c], -1) << "sequence " << b << " query " << j;
      }
      ASSERT_EQ(got, want) << "sequence " << b << " query " << j;
      swa_keys += got.size();
      for (int32_t c = 0; c < comp_width; ++c) {
        const int32_t r = row[window + c];
        if (c < (p + 1) / ratio) {
          ASSERT_GE(r, layout->main_kv_offset);
          ASSERT_EQ(DecodeRow(&buffer[r * kElements]),
                    (Token{static_cast<int>(b), c, kCompressed}))
              << "sequence " << b << " query " << j << " column " << c;
          ++comp_keys;
        } else {
          ASSERT_EQ(r, -1);
        }
      }
    }
  }
  EXPECT_GT(swa_keys, 0);
  EXPECT_GT(comp_keys, 0);

  // Store this chunk (after the load), then read each sequence's last
  // token's decode window straight from the ring.
  {
    std::vector<int32_t> slots(total_q);
    ASSERT_TRUE(BuildSwaStoreSlots(view, swa, absl::MakeSpan(slots)).ok());
    std::vector<Token> tokens;
    std::vector<int32_t> kept;
    for (int64_t b = 0; b < n; ++b) {
      const int32_t he = batch.seqlen_k[b] - batch.seqlen_q[b];
      for (int32_t j = 0; j < batch.seqlen_q[b]; ++j) {
        const int32_t slot = slots[cu_q[b] + j];
        if (slot == -1) continue;
        tokens.push_back(Token{static_cast<int>(b), he + j, kChunk});
        kept.push_back(slot);
      }
    }
    swa_pool.Store(tokens, kept);
  }
  OwnedBatch decode = batch;
  for (int64_t b = 0; b < n; ++b) {
    decode.seqlen_q[b] = std::min(decode.seqlen_k[b], 1);
  }
  int32_t decode_q = 0;
  for (const int32_t q : decode.seqlen_q) decode_q += q;
  std::vector<int32_t> decode_index(static_cast<size_t>(decode_q) * window);
  ASSERT_TRUE(
      BuildSwaDecodeIndex(decode.view(), swa, absl::MakeSpan(decode_index))
          .ok());
  int64_t row = 0, ring_keys = 0;
  for (int64_t b = 0; b < n; ++b) {
    if (decode.seqlen_q[b] == 0) continue;
    const int32_t k = batch.seqlen_k[b];
    const int32_t he = k - batch.seqlen_q[b];
    const int32_t* slots = &decode_index[row++ * window];
    int32_t c = 0;
    for (int32_t x = std::max({0, k - window, batch.valid_start[b]}); x < k;
         ++x, ++c) {
      ASSERT_NE(slots[c], -1);
      ASSERT_EQ(swa_pool.AtSlot(slots[c]),
                (Token{static_cast<int>(b), x, x < he ? kHistory : kChunk}))
          << "sequence " << b << " position " << x;
      ++ring_keys;
    }
    for (; c < window; ++c) ASSERT_EQ(slots[c], -1);
  }
  EXPECT_GT(ring_keys, 0);
}

INSTANTIATE_TEST_SUITE_P(Pools, EndToEndTest,
                         ::testing::Values(std::make_tuple(17, 13, 3, 4),
                                           std::make_tuple(64, 64, 7, 1),
                                           std::make_tuple(133, 100, 1, 128),
                                           std::make_tuple(7, 1, 64, 4),
                                           std::make_tuple(1, 1, 17, 1)));

}  // namespace
}  // namespace kvdepot
