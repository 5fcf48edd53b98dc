// The CUDA entry points of kvdepot_kernels.h against the CPU ones, bit for
// bit (every format, block sizes 1, 7 and 133), the device-side checks of
// SPEC §9 (out-of-range entries skipped or -1 and counted, the result equal
// to the CPU entry point's on the same input with those entries removed),
// CUDA graph capture of the calls, and a pool past 4 GiB. Needs a GPU
// (tools/gpu/manifest.txt).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "libkvdepot/capi_test_util.h"
#include "libkvdepot/kvdepot_kernels.h"

namespace kvdepot {
namespace {

using capi_test::LayoutPtr;
using capi_test::MakeLayout;
using capi_test::SameBytes;

#define ASSERT_CUDA(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(expr)

// Device memory holding a copy of a host vector (or n bytes).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes) != cudaSuccess) {
      ptr_ = nullptr;
    }
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host)
      : DeviceBuffer(host.size() * sizeof(T)) {
    if (ptr_ != nullptr && bytes_ > 0) {
      cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice);
    }
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> out(bytes_ / sizeof(T));
    cudaMemcpy(out.data(), ptr_, out.size() * sizeof(T),
               cudaMemcpyDeviceToHost);
    return out;
  }
  unsigned long long Counter() const {  // a single u64 counter
    unsigned long long v = 0;
    cudaMemcpy(&v, ptr_, sizeof(v), cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// A workspace for `op` and `count`, and a zeroed invalid counter.
struct Scratch {
  Scratch(int32_t op, int64_t count)
      : workspace(static_cast<size_t>(kvdk_cuda_workspace_bytes(op, count))),
        invalid(std::vector<unsigned long long>{0}) {}
  DeviceBuffer workspace;
  DeviceBuffer invalid;
};

// Fails (not skips) without a device: the GPU bundle must not pass on
// nothing.
void RequireDevice() {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device";
  ASSERT_GT(devices, 0) << "no CUDA device";
  ASSERT_EQ(kvdk_has_cuda(), 1);
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(RequireDevice()); }
};
using CapiCudaIndexTest = CudaTest;
using CapiCudaGraphTest = CudaTest;
using CapiCudaLargeTest = CudaTest;

class CapiCudaTest
    : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(RequireDevice());
    const auto& [name, bs] = GetParam();
    block_size_ = bs;
    num_blocks_ = 160 / bs + 3;
    layout_ = MakeLayout(name, bs, num_blocks_, 2);
    ASSERT_NE(layout_, nullptr) << kvdk_last_error();
    info_ = capi_test::Info(layout_.get());
  }

  int64_t block_size_ = 0;
  int64_t num_blocks_ = 0;
  LayoutPtr layout_;
  kvdk_layout_info info_;
};

TEST_P(CapiCudaTest, StoreEqualsCpu) {
  std::mt19937 rng(401);
  const int64_t d = info_.elements;
  for (int32_t dtype : {KVDK_DTYPE_BF16, KVDK_DTYPE_FP32}) {
    if (dtype == KVDK_DTYPE_FP32 && info_.bf16_elements > 0 &&
        info_.quantized_elements > 0) {
      continue;  // DS_MLA_FP8 takes BF16 only
    }
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{79}}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dtype << " n " << n);
      std::vector<int32_t> slots =
          capi_test::RandomSlots(rng, n, info_.num_slots);
      const std::vector<uint16_t> bf16 = capi_test::RandomBf16(rng, n, d);
      const std::vector<float> fp32 = capi_test::RandomFloats(rng, n * d);
      const void* kv_host = dtype == KVDK_DTYPE_BF16
                                ? static_cast<const void*>(bf16.data())
                                : static_cast<const void*>(fp32.data());
      DeviceBuffer kv =
          dtype == KVDK_DTYPE_BF16 ? DeviceBuffer(bf16) : DeviceBuffer(fp32);
      std::vector<uint8_t> want(info_.total_bytes, 0x5A);
      DeviceBuffer pool(want);
      // The device copy gets two out-of-range slots (n > 2); the CPU one
      // has -1 there.
      std::vector<int32_t> device_slots = slots;
      int64_t bad = 0;
      if (n > 2) {
        device_slots[1] = static_cast<int32_t>(info_.num_slots);
        device_slots[n - 2] = -7;
        slots[1] = slots[n - 2] = -1;
        bad = 2;
      }
      DeviceBuffer dslots(device_slots);
      Scratch s(KVDK_OP_STORE, n);
      ASSERT_EQ(kvdk_store_cuda(layout_.get(), pool.get(), pool.bytes(), 1,
                                kv.get(), dtype, dslots.get<int32_t>(), n,
                                s.workspace.get(), s.workspace.bytes(),
                                s.invalid.get<unsigned long long>(), nullptr),
                KVDK_OK)
          << kvdk_last_error();
      ASSERT_CUDA(cudaDeviceSynchronize());
      ASSERT_EQ(kvdk_store_cpu(layout_.get(), want.data(), want.size(), 1,
                               kv_host, dtype, slots.data(), n),
                KVDK_OK)
          << kvdk_last_error();
      ASSERT_FALSE(
          SameBytes(want, std::vector<uint8_t>(info_.total_bytes, 0x5A)));
      EXPECT_TRUE(SameBytes(pool.Download<uint8_t>(), want));
      EXPECT_EQ(s.invalid.Counter(), static_cast<unsigned long long>(bad));
    }
  }
}

TEST_P(CapiCudaTest, LoadEqualsCpu) {
  std::mt19937 rng(402);
  const int64_t d = info_.elements;
  const int64_t n = info_.num_slots;
  std::vector<int32_t> all(n);
  for (int64_t i = 0; i < n; ++i) all[i] = static_cast<int32_t>(i);
  const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, n, d);
  std::vector<uint8_t> host_pool(info_.total_bytes, 0);
  ASSERT_EQ(kvdk_store_cpu(layout_.get(), host_pool.data(), host_pool.size(), 1,
                           kv.data(), KVDK_DTYPE_BF16, all.data(), n),
            KVDK_OK);
  DeviceBuffer pool(host_pool);
  const int64_t drow = info_.load_data_row_bytes;
  const int64_t srow = info_.load_scale_row_bytes;
  for (int64_t count : {int64_t{1}, int64_t{9}, int64_t{40}}) {
    SCOPED_TRACE(count);
    capi_test::Plan plan =
        capi_test::RandomPlan(rng, block_size_, num_blocks_, count);
    // The device plan gets a bad segment (block past the pool); the CPU one
    // an empty segment in its place.
    std::vector<int32_t> device_segments = plan.segments;
    device_segments[0] = static_cast<int32_t>(num_blocks_);
    plan.segments[0] = -1;
    plan.segments[2] = plan.segments[1];
    std::vector<uint8_t> want_data(plan.total_k * drow, 0xC3);
    std::vector<uint8_t> want_scales(plan.total_k * srow, 0x3C);
    DeviceBuffer data(want_data), scales(want_scales), seg(device_segments);
    Scratch s(KVDK_OP_LOAD, plan.num_segments());
    ASSERT_EQ(kvdk_load_cuda(layout_.get(), pool.get(), pool.bytes(), 1,
                             seg.get<int32_t>(), plan.num_segments(),
                             plan.total_k, data.get(), data.bytes(),
                             srow > 0 ? scales.get() : nullptr, scales.bytes(),
                             s.workspace.get(), s.workspace.bytes(),
                             s.invalid.get<unsigned long long>(), nullptr),
              KVDK_OK)
        << kvdk_last_error();
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(kvdk_load_cpu(layout_.get(), host_pool.data(), host_pool.size(),
                            1, plan.segments.data(), plan.num_segments(),
                            plan.total_k, want_data.data(), want_data.size(),
                            srow > 0 ? want_scales.data() : nullptr,
                            want_scales.size()),
              KVDK_OK)
        << kvdk_last_error();
    EXPECT_TRUE(SameBytes(data.Download<uint8_t>(), want_data));
    EXPECT_TRUE(SameBytes(scales.Download<uint8_t>(), want_scales));
    EXPECT_EQ(s.invalid.Counter(), 1u);
  }
}

TEST_P(CapiCudaTest, FusedStoreEqualsCpu) {
  const int64_t d = info_.elements;
  if (!capi_test::FusedFits(d)) GTEST_SKIP() << "no fused store for " << d;
  std::mt19937 rng(403);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{33}}) {
    SCOPED_TRACE(n);
    std::vector<int32_t> slots =
        capi_test::RandomSlots(rng, n, info_.num_slots);
    const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, n, d);
    capi_test::FusedInputs in = capi_test::RandomFused(rng, d, n);
    const bool rope = in.params.rope_style != KVDK_ROPE_NONE;
    // Token 1 (n > 2) gets a position past the cos/sin cache on the device
    // (skipped and counted); the CPU stores it nowhere.
    std::vector<int64_t> device_positions = in.positions;
    const std::vector<int32_t> device_slots = slots;
    int64_t bad_token = -1;
    if (n > 2 && rope && slots[1] >= 0) {
      bad_token = 1;
      device_positions[1] = in.params.max_position;
      slots[1] = -1;
    }
    DeviceBuffer dkv(kv), dslots(device_slots), dpos(device_positions),
        dcos(in.cos_sin), dnorm(in.norm_weight);
    kvdk_fused_params p = in.params;
    p.norm_weight = dnorm.get<uint16_t>();
    p.positions = rope ? dpos.get<int64_t>() : nullptr;
    p.cos_sin = rope ? dcos.get<float>() : nullptr;
    std::vector<uint8_t> want(info_.total_bytes, 0x11);
    std::vector<uint16_t> want_cast(n * d, 1);
    DeviceBuffer pool(want), cast(want_cast);
    Scratch s(KVDK_OP_FUSED_STORE, n);
    ASSERT_EQ(
        kvdk_fused_store_cuda(
            layout_.get(), pool.get(), pool.bytes(), 1, dkv.get<uint16_t>(), &p,
            dslots.get<int32_t>(), n, cast.get<uint16_t>(), s.workspace.get(),
            s.workspace.bytes(), s.invalid.get<unsigned long long>(), nullptr),
        KVDK_OK)
        << kvdk_last_error();
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(kvdk_fused_store_cpu(layout_.get(), want.data(), want.size(), 1,
                                   kv.data(), &in.params, slots.data(), n,
                                   want_cast.data()),
              KVDK_OK)
        << kvdk_last_error();
    EXPECT_TRUE(SameBytes(pool.Download<uint8_t>(), want));
    std::vector<uint16_t> got_cast = cast.Download<uint16_t>();
    if (bad_token >= 0) {  // that row's cast_back is unspecified
      std::fill_n(got_cast.begin() + bad_token * d, d, 0);
      std::fill_n(want_cast.begin() + bad_token * d, d, 0);
    }
    EXPECT_TRUE(SameBytes(got_cast, want_cast));
    EXPECT_EQ(s.invalid.Counter(), bad_token >= 0 ? 1u : 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CapiCudaTest,
    ::testing::Combine(::testing::ValuesIn(capi_test::Formats()),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{133})),
    [](const auto& info) {
      return capi_test::ParamName(std::get<0>(info.param),
                                  std::get<1>(info.param));
    });

TEST_F(CapiCudaIndexTest, ConvertTopkEqualsCpu) {
  std::mt19937 rng(404);
  for (int64_t bs : {int64_t{1}, int64_t{7}, int64_t{133}}) {
    LayoutPtr pool = MakeLayout("FP4_INDEX", bs, 40, 1);
    ASSERT_NE(pool, nullptr);
    const int64_t b = 79;
    const int32_t k = 300, cols = 5, stride = 6;
    std::uniform_int_distribution<int32_t> entry(-3, bs * cols + 3);
    std::uniform_int_distribution<int32_t> id(-1, 41);
    std::uniform_int_distribution<int32_t> count(0, k);
    std::uniform_int_distribution<int32_t> tokens(0, bs * cols);
    std::vector<int32_t> topk(b * k), valid(b), ntok(b), table(b * stride);
    for (int32_t& x : topk) x = entry(rng);
    for (int32_t& x : valid) x = count(rng);
    for (int32_t& x : ntok) x = tokens(rng);
    for (int32_t& x : table) x = id(rng);
    DeviceBuffer dtopk(topk), dvalid(valid), dntok(ntok), dtable(table),
        invalid(std::vector<unsigned long long>{0});
    ASSERT_EQ(kvdk_convert_topk_cuda(
                  pool.get(), dtopk.get<int32_t>(), b, k, dvalid.get<int32_t>(),
                  dntok.get<int32_t>(), dtable.get<int32_t>(), cols, stride,
                  invalid.get<unsigned long long>(), nullptr),
              KVDK_OK)
        << kvdk_last_error();
    ASSERT_CUDA(cudaDeviceSynchronize());
    int64_t want_invalid = -1;
    ASSERT_EQ(kvdk_convert_topk_cpu(pool.get(), topk.data(), b, k, valid.data(),
                                    ntok.data(), table.data(), cols, stride,
                                    &want_invalid),
              KVDK_OK);
    EXPECT_TRUE(SameBytes(dtopk.Download<int32_t>(), topk));
    EXPECT_EQ(static_cast<int64_t>(invalid.Counter()), want_invalid);
    EXPECT_GT(want_invalid, 0);
  }
}

TEST_F(CapiCudaIndexTest, SwaDecodeIndexEqualsCpu) {
  std::mt19937 rng(405);
  LayoutPtr ring = MakeLayout("V41", 133, 9, 1);
  ASSERT_NE(ring, nullptr);
  const int32_t window = 128;
  const int64_t n = 79;
  std::uniform_int_distribution<int32_t> state(0, 8), start(0, 100000),
      len(0, window);
  std::vector<int32_t> s(n), st(n), vl(n);
  for (int64_t i = 0; i < n; ++i) {
    s[i] = state(rng);
    st[i] = start(rng);
    vl[i] = len(rng);
  }
  // Three bad queries on the device; an empty window in the CPU's input.
  std::vector<int32_t> ds = s, dst = st, dvl = vl;
  ds[3] = 9;
  dst[10] = -1;
  dvl[20] = window + 1;
  for (int64_t i : {3, 10, 20}) s[i] = st[i] = vl[i] = 0;
  DeviceBuffer a(ds), b(dst), c(dvl), out(std::vector<int32_t>(n * window, 7));
  Scratch sc(KVDK_OP_SWA_DECODE_INDEX, n);
  ASSERT_EQ(
      kvdk_swa_decode_index_cuda(
          ring.get(), a.get<int32_t>(), b.get<int32_t>(), c.get<int32_t>(), n,
          window, out.get<int32_t>(), sc.workspace.get(), sc.workspace.bytes(),
          sc.invalid.get<unsigned long long>(), nullptr),
      KVDK_OK)
      << kvdk_last_error();
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> want(n * window, 7);
  ASSERT_EQ(kvdk_swa_decode_index_cpu(ring.get(), s.data(), st.data(),
                                      vl.data(), n, window, want.data()),
            KVDK_OK);
  EXPECT_TRUE(SameBytes(out.Download<int32_t>(), want));
  EXPECT_EQ(sc.invalid.Counter(), 3u);
}

TEST_F(CapiCudaIndexTest, PrefillIndicesEqualCpu) {
  std::mt19937 rng(406);
  const int64_t rows = 79;
  const int32_t width = 133, num_kv_rows = 5000;
  std::uniform_int_distribution<int32_t> len(0, 66), off(0, 4000);
  std::vector<int32_t> pivots(rows * 4);
  for (int64_t r = 0; r < rows; ++r) {
    pivots[4 * r] = off(rng);
    pivots[4 * r + 1] = len(rng);
    pivots[4 * r + 2] = off(rng);
    pivots[4 * r + 3] = len(rng);
  }
  std::vector<int32_t> dpivots = pivots;
  dpivots[4 * 5 + 1] = -1;           // negative length
  dpivots[4 * 6 + 2] = num_kv_rows;  // range 2 outside the buffer
  dpivots[4 * 6 + 3] = 1;
  for (int64_t r : {5, 6}) {
    for (int f = 0; f < 4; ++f) pivots[4 * r + f] = 0;
  }
  DeviceBuffer dp(dpivots), out(std::vector<int32_t>(rows * width, 7));
  Scratch sc(KVDK_OP_EXPAND_SWA_INDEX, rows);
  ASSERT_EQ(kvdk_expand_swa_index_cuda(
                dp.get<int32_t>(), rows, width, num_kv_rows, out.get<int32_t>(),
                sc.workspace.get(), sc.workspace.bytes(),
                sc.invalid.get<unsigned long long>(), nullptr),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> want(rows * width, 7);
  ASSERT_EQ(kvdk_expand_swa_index_cpu(pivots.data(), rows, width, num_kv_rows,
                                      want.data()),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_TRUE(SameBytes(out.Download<int32_t>(), want));
  EXPECT_EQ(sc.invalid.Counter(), 2u);

  // kv_index_cat over that index and random compressed entries.
  const int32_t topk = 64, compressed_rows = 700;
  std::uniform_int_distribution<int32_t> comp(-1, compressed_rows - 1);
  std::vector<int32_t> compressed(rows * topk);
  for (int32_t& x : compressed) x = comp(rng);
  std::vector<int32_t> dcompressed = compressed;
  dcompressed[17] = compressed_rows;
  compressed[17] = -1;
  std::vector<int32_t> swa = want;
  std::vector<int32_t> dswa = swa;
  dswa[3] = num_kv_rows;
  swa[3] = -1;
  DeviceBuffer da(dswa), db(dcompressed),
      cat(std::vector<int32_t>(rows * (width + topk), 7));
  Scratch sc2(KVDK_OP_KV_INDEX_CAT, rows * (width + topk));
  ASSERT_EQ(kvdk_kv_index_cat_cuda(
                da.get<int32_t>(), width, db.get<int32_t>(), topk, rows,
                num_kv_rows, compressed_rows, cat.get<int32_t>(),
                sc2.workspace.get(), sc2.workspace.bytes(),
                sc2.invalid.get<unsigned long long>(), nullptr),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> want_cat(rows * (width + topk), 7);
  ASSERT_EQ(
      kvdk_kv_index_cat_cpu(swa.data(), width, compressed.data(), topk, rows,
                            num_kv_rows, compressed_rows, want_cat.data()),
      KVDK_OK)
      << kvdk_last_error();
  EXPECT_TRUE(SameBytes(cat.Download<int32_t>(), want_cat));
  EXPECT_EQ(sc2.invalid.Counter(), 2u);
}

// The calls enqueue only: captured into a CUDA graph on a caller's stream
// and replayed, they write what direct calls write.
TEST_F(CapiCudaGraphTest, CapturedStoreAndLoadReplay) {
  LayoutPtr l = MakeLayout("DS_MLA_FP8", 64, 8, 1);
  ASSERT_NE(l, nullptr);
  const kvdk_layout_info info = capi_test::Info(l.get());
  std::mt19937 rng(407);
  const int64_t n = 37;
  const std::vector<int32_t> slots =
      capi_test::RandomSlots(rng, n, info.num_slots);
  const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, n, 576);
  std::vector<uint8_t> want(info.total_bytes, 0);
  ASSERT_EQ(kvdk_store_cpu(l.get(), want.data(), want.size(), 0, kv.data(),
                           KVDK_DTYPE_BF16, slots.data(), n),
            KVDK_OK);
  const std::vector<int32_t> seg = {3, 0, 64, 0, -1, 0, 5, 64, 7, 10, 20, 69};
  const int64_t total_k = 79;
  std::vector<uint16_t> want_out(total_k * 576, 9);
  ASSERT_EQ(
      kvdk_load_cpu(l.get(), want.data(), want.size(), 0, seg.data(), 3,
                    total_k, want_out.data(), want_out.size() * 2, nullptr, 0),
      KVDK_OK);
  DeviceBuffer pool(std::vector<uint8_t>(info.total_bytes, 0)), dkv(kv),
      dslots(slots), dseg(seg), out(std::vector<uint16_t>(total_k * 576, 9));
  Scratch s1(KVDK_OP_STORE, n), s2(KVDK_OP_LOAD, 3);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const int rc1 = kvdk_store_cuda(
      l.get(), pool.get(), pool.bytes(), 0, dkv.get(), KVDK_DTYPE_BF16,
      dslots.get<int32_t>(), n, s1.workspace.get(), s1.workspace.bytes(),
      s1.invalid.get<unsigned long long>(), stream);
  const int rc2 = kvdk_load_cuda(
      l.get(), pool.get(), pool.bytes(), 0, dseg.get<int32_t>(), 3, total_k,
      out.get(), out.bytes(), nullptr, 0, s2.workspace.get(),
      s2.workspace.bytes(), s2.invalid.get<unsigned long long>(), stream);
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(rc1, KVDK_OK) << kvdk_last_error();
  ASSERT_EQ(rc2, KVDK_OK) << kvdk_last_error();
  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(SameBytes(pool.Download<uint8_t>(), want));
  EXPECT_TRUE(SameBytes(out.Download<uint16_t>(), want_out));
  EXPECT_EQ(s1.invalid.Counter(), 0u);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A pool past 4 GiB: the last slot of layer 1 (beyond 4 GiB from the base)
// holds the record a CPU store writes for the same token.
TEST_F(CapiCudaLargeTest, PoolPast4GiB) {
  const int64_t blocks = (int64_t{5} << 30) / (64 * 528) / 2 + 1;
  LayoutPtr l = MakeLayout("V41", 64, blocks, 2);
  ASSERT_NE(l, nullptr);
  const kvdk_layout_info info = capi_test::Info(l.get());
  ASSERT_GT(info.layer_stride + info.layer_bytes, int64_t{4} << 30);
  DeviceBuffer pool(static_cast<size_t>(info.total_bytes));
  ASSERT_NE(pool.get(), nullptr);
  std::mt19937 rng(408);
  const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, 1, 512);
  const std::vector<int32_t> slot = {static_cast<int32_t>(info.num_slots - 1)};
  DeviceBuffer dkv(kv), dslot(slot);
  Scratch s(KVDK_OP_STORE, 1);
  ASSERT_EQ(kvdk_store_cuda(l.get(), pool.get(), pool.bytes(), 1, dkv.get(),
                            KVDK_DTYPE_BF16, dslot.get<int32_t>(), 1,
                            s.workspace.get(), s.workspace.bytes(),
                            s.invalid.get<unsigned long long>(), nullptr),
            KVDK_OK)
      << kvdk_last_error();
  std::vector<uint8_t> record(528);
  const int64_t offset = info.layer_stride + (blocks - 1) * info.block_stride +
                         63 * info.bytes_per_token;
  ASSERT_CUDA(cudaMemcpy(record.data(), pool.get<uint8_t>() + offset, 528,
                         cudaMemcpyDeviceToHost));
  LayoutPtr small = MakeLayout("V41", 64, 1, 1);
  std::vector<uint8_t> want(capi_test::Info(small.get()).total_bytes, 0);
  const int32_t zero = 0;
  ASSERT_EQ(kvdk_store_cpu(small.get(), want.data(), want.size(), 0, kv.data(),
                           KVDK_DTYPE_BF16, &zero, 1),
            KVDK_OK);
  want.resize(528);
  EXPECT_TRUE(SameBytes(record, want));
}

}  // namespace
}  // namespace kvdepot
