// End to end: the Store RPC's fused option (SPEC §8) on a kvdepotd process
// (CPU backend). The pool bytes and the cast_back output must equal the CPU
// reference run on a local copy; every validation rule is refused with a
// message naming the field, and a refused request leaves the pool unchanged.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fused.h"
#include "kernels/quant.h"
#include "kernels/reference/fused.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMaxPosition = 16;

std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

class FusedStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }

  // A pool `name` of `format` (9 blocks of 7, 2 layers) and its mapping.
  void MakePool(const std::string& name, const std::string& format,
                int32_t elements) {
    client_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(client_, nullptr);
    absl::StatusOr<v1::PoolInfo> info =
        client_->CreatePool(PoolRequest(name, format, elements, 7, 9, 2));
    ASSERT_TRUE(info.ok()) << info.status();
    local_ = LocalPool::FromInfo(*info);
    absl::StatusOr<const PoolMapping*> m = client_->MapPool(name);
    ASSERT_TRUE(m.ok()) << m.status();
    mapped_ = *m;
  }

  // n tokens of random BF16, weights near 1, a cos/sin cache, positions in
  // range; the request for layer 1 with cast_back inline.
  v1::StoreRequest Request(const std::string& pool, FusedParams& p,
                           std::vector<int32_t>& slots, std::mt19937& rng) {
    const int64_t d = local_.layout.format.elements();
    const int64_t n = static_cast<int64_t>(slots.size());
    std::normal_distribution<float> normal(0.0f, 2.0f);
    kv_.resize(n * d);
    for (uint16_t& x : kv_) x = FloatToBf16(normal(rng));
    kv_[3] = 0x7FC0;  // a NaN in token 0
    weight_.assign(static_cast<size_t>(p.norm_end - p.norm_begin), 0);
    for (uint16_t& w : weight_) w = FloatToBf16(0.5f + (rng() % 100) / 100.0f);
    cos_sin_.resize(kMaxPosition * p.rope_dim);
    for (size_t i = 0; i < cos_sin_.size(); ++i) {
      cos_sin_[i] = std::cos(0.37f * static_cast<float>(i));
    }
    positions_.resize(n);
    for (int64_t& x : positions_)
      x = static_cast<int64_t>(rng() % kMaxPosition);

    v1::StoreRequest r = StoreRequest(pool, 1, slots, v1::INPUT_DTYPE_BF16);
    *r.mutable_kv() = InlineData(Bytes(kv_.data(), kv_.size() * 2));
    v1::FusedStoreOptions* f = r.mutable_fused();
    f->set_norm_begin(p.norm_begin);
    f->set_norm_end(p.norm_end);
    f->set_eps(p.eps);
    *f->mutable_norm_weight() =
        InlineData(Bytes(weight_.data(), weight_.size() * 2));
    f->set_rope(static_cast<v1::RopeStyle>(p.rope));
    f->set_rope_offset(p.rope_offset);
    f->set_rope_dim(p.rope_dim);
    *f->mutable_positions() =
        InlineData(Bytes(positions_.data(), positions_.size() * 8));
    *f->mutable_cos_sin() =
        InlineData(Bytes(cos_sin_.data(), cos_sin_.size() * 4));
    f->set_max_position(kMaxPosition);
    f->set_hadamard_begin(p.hadamard_begin);
    f->set_hadamard_len(p.hadamard_len);
    f->mutable_cast_back()->set_inline_output(true);
    p.norm_weight = weight_.data();
    p.positions = positions_.data();
    p.cos_sin = cos_sin_.data();
    p.max_position = kMaxPosition;
    return r;
  }

  void ExpectRefused(const v1::StoreRequest& r, const std::string& message) {
    SCOPED_TRACE(message);
    const std::vector<uint8_t> before(
        mapped_->data(), mapped_->data() + local_.layout.total_bytes);
    absl::StatusOr<v1::StoreResponse> s = client_->Store(r);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(message));
    EXPECT_EQ(0, std::memcmp(mapped_->data(), before.data(), before.size()))
        << "a refused request changed the pool";
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<KVCacheClient> client_;
  LocalPool local_;
  const PoolMapping* mapped_ = nullptr;
  std::vector<uint16_t> kv_, weight_;
  std::vector<float> cos_sin_;
  std::vector<int64_t> positions_;
};

DaemonProcess* FusedStoreTest::daemon_ = nullptr;

TEST_F(FusedStoreTest, DsMlaRangesMatchTheReference) {
  MakePool("mla", "DS_MLA_FP8", 0);
  std::mt19937 rng(1403);
  FusedParams p;
  p.norm_end = 512;
  p.rope = RopeStyle::kInterleaved;
  p.rope_offset = 512;
  p.rope_dim = 64;
  std::vector<int32_t> slots = {5, -1, 0, 62, 17, 33, -1, 8};
  const v1::StoreRequest r = Request("mla", p, slots, rng);
  absl::StatusOr<v1::StoreResponse> s = client_->Store(r);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tokens_written(), 6);
  const int64_t d = local_.layout.format.elements();
  std::vector<uint16_t> cast(slots.size() * d);
  ASSERT_TRUE(FusedStore(local_.layout, local_.layer(1), kv_.data(), p, slots,
                         cast.data())
                  .ok());
  ASSERT_FALSE(AllZero(local_.bytes.data(), local_.layout.total_bytes));
  EXPECT_EQ(0, std::memcmp(mapped_->data(), local_.bytes.data(),
                           static_cast<size_t>(local_.layout.total_bytes)));
  ASSERT_EQ(s->cast_back().size(), cast.size() * 2);
  EXPECT_EQ(0, std::memcmp(s->cast_back().data(), cast.data(),
                           s->cast_back().size()));
}

TEST_F(FusedStoreTest, EveryStageOnV41MatchesTheReference) {
  MakePool("v41", "V41", 0);
  std::mt19937 rng(1404);
  FusedParams p;
  p.norm_begin = 8;
  p.norm_end = 504;
  p.rope = RopeStyle::kNeox;
  p.rope_offset = 448;
  p.rope_dim = 64;
  p.hadamard_begin = 0;
  p.hadamard_len = 256;
  std::vector<int32_t> slots = {1, 2, -1, 40, 9};
  const v1::StoreRequest r = Request("v41", p, slots, rng);
  absl::StatusOr<v1::StoreResponse> s = client_->Store(r);
  ASSERT_TRUE(s.ok()) << s.status();
  const int64_t d = local_.layout.format.elements();
  std::vector<uint16_t> cast(slots.size() * d);
  ASSERT_TRUE(FusedStore(local_.layout, local_.layer(1), kv_.data(), p, slots,
                         cast.data())
                  .ok());
  EXPECT_EQ(0, std::memcmp(mapped_->data(), local_.bytes.data(),
                           static_cast<size_t>(local_.layout.total_bytes)));
  ASSERT_EQ(s->cast_back().size(), cast.size() * 2);
  EXPECT_EQ(0, std::memcmp(s->cast_back().data(), cast.data(),
                           s->cast_back().size()));
}

TEST_F(FusedStoreTest, RefusalsNameTheFieldAndChangeNothing) {
  MakePool("bad", "V41", 0);
  std::mt19937 rng(1405);
  FusedParams p;
  p.norm_end = 512;
  p.rope = RopeStyle::kNeox;
  p.rope_offset = 0;
  p.rope_dim = 64;
  p.hadamard_len = 128;
  std::vector<int32_t> slots = {3, 4, 5};
  const v1::StoreRequest good = Request("bad", p, slots, rng);

  v1::StoreRequest r = good;
  std::vector<int64_t> beyond = positions_;
  beyond[1] = kMaxPosition;
  *r.mutable_fused()->mutable_positions() =
      InlineData(Bytes(beyond.data(), beyond.size() * 8));
  ExpectRefused(r, "fused: positions[1] = 16 is outside [0, 16)");

  r = good;
  r.mutable_fused()->set_hadamard_len(96);
  ExpectRefused(r, "hadamard_len = 96 is not a power of two");
  r.mutable_fused()->set_hadamard_len(32);
  ExpectRefused(r,
                "hadamard_len = 32 is a power of two the fused store does "
                "not support");
  r = good;
  r.mutable_fused()->set_hadamard_begin(400);
  ExpectRefused(r, "hadamard range [400, 528) is not inside");
  r = good;
  r.mutable_fused()->set_norm_end(520);
  ExpectRefused(r, "norm range [0, 520) is not inside");
  r = good;
  r.mutable_fused()->set_norm_begin(4);
  ExpectRefused(r, "must start and end on multiples of 8");
  // Ends whose int32 difference overflows (found by step_fuzz).
  r = good;
  r.mutable_fused()->set_norm_begin(std::numeric_limits<int32_t>::min());
  r.mutable_fused()->set_norm_end(std::numeric_limits<int32_t>::max());
  ExpectRefused(r, "norm range [-2147483648, 2147483647) is not inside");
  r = good;
  r.mutable_fused()->set_norm_begin(56);
  r.mutable_fused()->set_norm_end(std::numeric_limits<int32_t>::min());
  ExpectRefused(r, "norm range [56, -2147483648) is not inside");
  r = good;
  r.mutable_fused()->set_rope_offset(480);
  ExpectRefused(r, "rope range [480, 544) is not inside");
  r = good;
  r.mutable_fused()->set_rope_dim(63);
  ExpectRefused(r, "rope_dim = 63");
  r = good;
  r.mutable_fused()->set_rope(static_cast<v1::RopeStyle>(9));
  ExpectRefused(r, "fused.rope = 9 is not a RopeStyle");
  r = good;
  r.mutable_fused()->set_eps(std::nanf(""));
  ExpectRefused(r, "eps = nan");
  r = good;
  r.mutable_fused()->set_max_position(-1);
  ExpectRefused(r, "fused.max_position = -1");
  r = good;
  r.mutable_fused()->set_max_position(kMaxPosition + 1);  // cos_sin too short
  ExpectRefused(r, "fused.cos_sin");
  r = good;
  *r.mutable_fused()->mutable_norm_weight() = InlineData("abc");
  ExpectRefused(r, "fused.norm_weight");
  r = good;
  r.mutable_fused()->clear_positions();
  ExpectRefused(r, "fused.positions");
  r = good;
  r.set_dtype(v1::INPUT_DTYPE_FP32);
  ExpectRefused(r, "BF16 input only");
  r = good;
  r.set_record_event(true);
  ExpectRefused(r, "record_event");

  // cast_back overlapping the input in one buffer.
  const int64_t kv_bytes = static_cast<int64_t>(kv_.size()) * 2;
  absl::StatusOr<BufferMapping> buf = client_->AllocateBuffer(2 * kv_bytes);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::memcpy(buf->data(), kv_.data(), kv_bytes);
  r = good;
  *r.mutable_kv() = buf->Slice(0, kv_bytes);
  *r.mutable_fused()->mutable_cast_back() = buf->Slice(2, kv_bytes);
  ExpectRefused(r, "fused.cast_back [2, ");
  // The same with disjoint slices is accepted, and writes the buffer.
  *r.mutable_fused()->mutable_cast_back() = buf->Slice(kv_bytes, kv_bytes);
  absl::StatusOr<v1::StoreResponse> s = client_->Store(r);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<uint16_t> cast(kv_.size());
  FusedParams q = p;
  q.norm_weight = weight_.data();
  ASSERT_TRUE(FusedStore(local_.layout, local_.layer(1), kv_.data(), q, slots,
                         cast.data())
                  .ok());
  EXPECT_EQ(0, std::memcmp(buf->data() + kv_bytes, cast.data(), kv_bytes));
  EXPECT_EQ(0, std::memcmp(mapped_->data(), local_.bytes.data(),
                           static_cast<size_t>(local_.layout.total_bytes)));
}

}  // namespace
}  // namespace kvdepot::testing
