// Inspect and Verify on device pools: the daemon copies the records a
// chunk (4 MiB) at a time from device memory. Each pool gets the same
// stores as a CPU-reference copy; Verify's checksums must equal XXH3 of the
// reference blocks (and its pool checksum theirs), and every record Inspect
// decodes must equal CheckRecord on the reference bytes. One pool per
// path: blocks read whole (V41, MXFP8_INDEX) and blocks larger than a
// chunk (BF16(4096) blocks of 600 records: 4.9 MB).
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "server/record_check.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"

namespace kvdepot::testing {
namespace {

struct ScanCase {
  const char* name;
  const char* format;
  int32_t elements;  // BF16 only
  int64_t block_size;
  int64_t num_blocks;
};

void PrintTo(const ScanCase& c, std::ostream* os) { *os << c.name; }

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

class DeviceScanTest : public GpuTest,
                       public ::testing::WithParamInterface<ScanCase> {};

TEST_P(DeviceScanTest, InspectAndVerifyMatchTheCpuReference) {
  const ScanCase& c = GetParam();
  const std::string name = absl::StrCat("scan_", c.name);
  absl::StatusOr<v1::PoolInfo> info = client_->CreatePool(
      PoolRequest(name, c.format, c.elements, c.block_size, c.num_blocks, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool ref = LocalPool::FromInfo(*info);
  const PoolLayout& l = ref.layout;
  const KVCacheFormat& f = l.format;

  // Stores into every block but the last (which stays zero).
  std::mt19937 rng(307);
  std::vector<int32_t> slots(static_cast<size_t>(l.num_slots() - l.block_size));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(std::min<size_t>(slots.size(), 700));
  const std::vector<float> kv =
      RandomKv(static_cast<int64_t>(slots.size()), f.elements(), rng);
  const std::string kv_bf16 = Bf16Bytes(kv);
  v1::StoreRequest store = StoreRequest(name, 0, slots, v1::INPUT_DTYPE_BF16);
  store.mutable_kv()->set_inline_data(kv_bf16);
  ASSERT_TRUE(client_->Store(store).ok());
  ASSERT_OK(kvdepot::Store(l, ref.layer(0), kv_bf16.data(), InputDtype::kBF16,
                           slots));

  // Verify.
  grpc::ClientContext ctx;
  v1::VerifyRequest vr;
  vr.set_pool(name);
  vr.set_progress_every(1);
  auto reader = client_->stub()->Verify(&ctx, vr);
  std::vector<v1::VerifyProgress> msgs;
  v1::VerifyProgress m;
  while (reader->Read(&m)) msgs.push_back(m);
  grpc::Status vs = reader->Finish();
  ASSERT_TRUE(vs.ok()) << vs.error_message();
  ASSERT_EQ(static_cast<int64_t>(msgs.size()), l.num_blocks);
  std::vector<uint64_t> sums;
  for (int64_t b = 0; b < l.num_blocks; ++b) {
    ASSERT_EQ(msgs[b].checksums_size(), 1);
    EXPECT_EQ(msgs[b].checksums(0).xxh3(),
              XXH3_64bits(ref.layer(0) + l.block_offset(b),
                          static_cast<size_t>(l.block_stride)))
        << "block " << b;
    sums.push_back(msgs[b].checksums(0).xxh3());
  }
  EXPECT_EQ(msgs.back().blocks_with_issues(), 0);
  EXPECT_EQ(msgs.back().pool_xxh3(),
            XXH3_64bits(sums.data(), sums.size() * sizeof(uint64_t)));

  // Inspect every block, and one slot of each, against the reference.
  std::vector<float> values(static_cast<size_t>(f.elements()));
  for (int64_t b = 0; b < l.num_blocks; ++b) {
    const uint8_t* block = ref.layer(0) + l.block_offset(b);
    v1::InspectRequest ir;
    ir.set_pool(name);
    ir.set_block(b);
    ir.set_max_values(64);
    grpc::ClientContext ictx;
    v1::InspectResponse out;
    grpc::Status s = client_->stub()->Inspect(&ictx, ir, &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(out.records_size(), l.block_size);
    for (int64_t t = 0; t < l.block_size; ++t) {
      const RecordHealth h = CheckRecord(l, block, t, values.data());
      const v1::InspectRecord& rec = out.records(static_cast<int>(t));
      ASSERT_EQ(rec.all_zero(), h.all_zero) << "block " << b << " record " << t;
      ASSERT_EQ(rec.values_size(), std::min(64, f.elements()));
      for (int i = 0; i < rec.values_size(); ++i) {
        ASSERT_EQ(Bits(rec.values(i)), Bits(values[i]))
            << "block " << b << " record " << t << " value " << i;
      }
    }
    ir.set_slot(b * l.block_size + l.block_size / 2);
    ir.set_all_values(true);
    grpc::ClientContext sctx;
    s = client_->stub()->Inspect(&sctx, ir, &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(out.records_size(), 1);
    CheckRecord(l, block, l.block_size / 2, values.data());
    ASSERT_EQ(out.records(0).values_size(), f.elements());
    for (int i = 0; i < f.elements(); ++i) {
      ASSERT_EQ(Bits(out.records(0).values(i)), Bits(values[i]))
          << "slot of block " << b << " value " << i;
    }
  }
  EXPECT_TRUE(client_->DeletePool(name).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Pools, DeviceScanTest,
    ::testing::Values(ScanCase{"v41_bs64", "V41", 0, 64, 3},
                      ScanCase{"mxfp8_bs7", "MXFP8_INDEX", 0, 7, 5},
                      ScanCase{"bf16_chunked", "BF16", 4096, 600, 2}),
    [](const ::testing::TestParamInfo<ScanCase>& i) { return i.param.name; });

}  // namespace
}  // namespace kvdepot::testing
