#include "tests/e2e_util.h"

#include <cstring>

#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "proto/wire.h"

namespace kvdepot::testing {

LocalPool LocalPool::FromInfo(const v1::PoolInfo& info) {
  const v1::PoolLayout& l = info.layout();
  absl::StatusOr<KVCacheFormat> f = FormatFromName(l.format());
  EXPECT_TRUE(f.ok()) << f.status();
  absl::StatusOr<PoolLayout> layout =
      MakePoolLayout(*f, l.block_size(), l.num_blocks(), l.num_layers());
  EXPECT_TRUE(layout.ok()) << layout.status();
  LocalPool p;
  p.layout = *layout;
  p.bytes.assign(static_cast<size_t>(layout->total_bytes), 0);
  EXPECT_EQ(layout->total_bytes, l.total_bytes());
  EXPECT_EQ(layout->block_stride, l.block_stride());
  EXPECT_EQ(layout->layer_stride, l.layer_stride());
  return p;
}

v1::CreatePoolRequest PoolRequest(const std::string& name,
                                  const std::string& format, int32_t elements,
                                  int64_t block_size, int64_t num_blocks,
                                  int64_t num_layers) {
  v1::CreatePoolRequest r;
  r.set_name(name);
  r.set_format(format);
  r.set_elements(elements);
  r.set_block_size(block_size);
  r.set_num_blocks(num_blocks);
  r.set_num_layers(num_layers);
  return r;
}

std::vector<float> RandomKv(int64_t n, int64_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, 63);
  std::vector<float> v(static_cast<size_t>(n * elements));
  for (float& x : v) x = pick(rng) == 0 ? normal(rng) * 100.0f : normal(rng);
  return v;
}

std::string Fp32Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

std::string Bf16Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = FloatToBf16(v[i]);
    std::memcpy(s.data() + 2 * i, &h, 2);
  }
  return s;
}

std::vector<float> Bf16Values(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16ToFloat(FloatToBf16(v[i]));
  return out;
}

std::string Pack(absl::Span<const int32_t> v) {
  std::string s;
  EncodeInt32s(v, &s);
  return s;
}

bool AllZero(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

std::unique_ptr<KVCacheClient> ConnectOrDie(const std::string& socket,
                                            absl::Duration lease) {
  ClientOptions options;
  options.address = socket;
  options.lease = lease;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
      KVCacheClient::Connect(options);
  if (!c.ok()) {
    ADD_FAILURE() << c.status();
    return nullptr;
  }
  return *std::move(c);
}

v1::StoreRequest StoreRequest(const std::string& pool, int64_t layer,
                              absl::Span<const int32_t> slots,
                              v1::InputDtype dtype) {
  v1::StoreRequest r;
  r.set_pool(pool);
  r.set_layer(layer);
  r.set_num_tokens(static_cast<int64_t>(slots.size()));
  r.set_slot_mapping(Pack(slots));
  r.set_dtype(dtype);
  return r;
}

v1::Segments SegmentsProto(absl::Span<const int32_t> segments,
                           int64_t total_k) {
  v1::Segments s;
  s.set_num_segments(static_cast<int64_t>(segments.size()) / 4);
  s.set_segments(Pack(segments));
  s.set_total_k(total_k);
  return s;
}

int64_t Rejections(KVCacheClient& c, const std::string& reason) {
  absl::StatusOr<v1::StatsResponse> s = c.Stats();
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return -1;
  for (const v1::Rejection& r : s->rejections()) {
    if (r.reason() == reason) return r.count();
  }
  return 0;
}

}  // namespace kvdepot::testing
