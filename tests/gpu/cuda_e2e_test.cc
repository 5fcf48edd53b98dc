// End to end on a GPU: kvdepot (--backend=cuda) in a child process, this
// test as its client in another process. Pools and buffers are shared by
// CUDA IPC: the client writes BF16 K/V into a daemon buffer it mapped,
// calls Store, then Load into another mapped buffer, and compares the pool
// and the output byte for byte with the CPU reference run on the same
// input; with interprocess events in both directions, and with inline and
// misaligned operands (the daemon's staging paths).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

// Work the client queues before its event starts this late: a daemon that
// ignored the event would read the old bytes.
constexpr absl::Duration kDelay = absl::Milliseconds(200);
constexpr uint8_t kFill = 0xA5;  // output bytes before a Load

// n distinct slots of [0, num_slots), every fifth one -1 (padding).
std::vector<int32_t> RandomSlots(int64_t num_slots, int64_t n,
                                 std::mt19937& rng) {
  std::vector<int32_t> slots;
  std::uniform_int_distribution<int64_t> pick(0, num_slots - 1);
  std::vector<bool> used(static_cast<size_t>(num_slots), false);
  while (static_cast<int64_t>(slots.size()) < n) {
    const int64_t s = pick(rng);
    if (used[static_cast<size_t>(s)]) continue;
    used[static_cast<size_t>(s)] = true;
    slots.push_back(static_cast<int32_t>(s));
  }
  for (size_t i = 4; i < slots.size(); i += 5) slots[i] = -1;
  return slots;
}

// A plan over the blocks the stored slots fall in (at most 48) plus some
// others: random non-empty token ranges, every fourth a zero fill (-1), and
// a few output rows (the last one included) that no segment covers.
int64_t RandomSegments(const PoolLayout& l, absl::Span<const int32_t> slots,
                       std::mt19937& rng, std::vector<int32_t>* segments) {
  std::vector<int32_t> blocks;
  for (int32_t s : slots) {
    if (s >= 0 && blocks.size() < 48) blocks.push_back(s / l.block_size);
  }
  std::uniform_int_distribution<int64_t> any(0, l.num_blocks - 1);
  for (int i = 0; i < 8; ++i) blocks.push_back(static_cast<int32_t>(any(rng)));
  std::shuffle(blocks.begin(), blocks.end(), rng);
  int64_t dst = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::uniform_int_distribution<int64_t> b(0, l.block_size - 1);
    const int64_t begin = b(rng);
    std::uniform_int_distribution<int64_t> e(begin + 1, l.block_size);
    const int64_t end = e(rng);
    segments->insert(segments->end(),
                     {i % 4 == 3 ? -1 : blocks[i], static_cast<int32_t>(begin),
                      static_cast<int32_t>(end), static_cast<int32_t>(dst)});
    dst += end - begin + (i % 5 == 2 ? 1 : 0);
  }
  return dst + 1;
}

enum class Place { kSlice, kMisaligned, kInline };

struct Case {
  const char* name;
  const char* format;
  int32_t elements;  // BF16 only
  int64_t block_size;
  int64_t num_blocks;
  int64_t num_layers;
  int64_t num_tokens;
  bool events;
  Place in;   // where the K/V input lives
  Place out;  // where the Load writes
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class RoundTripTest : public GpuTest,
                      public ::testing::WithParamInterface<Case> {};

TEST_P(RoundTripTest, StoreThenLoadMatchesTheCpuReference) {
  const Case& c = GetParam();
  cudaStream_t st = stream_->get();
  const std::string pool_name = std::string("rt_") + c.name;
  absl::StatusOr<v1::PoolInfo> info = client_->CreatePool(
      PoolRequest(pool_name, c.format, c.elements, c.block_size, c.num_blocks,
                  c.num_layers));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->handle().kind_case(), v1::SharedHandle::kCudaIpcHandle);
  LocalPool ref = LocalPool::FromInfo(*info);
  const PoolLayout& layout = ref.layout;
  const KVCacheFormat& f = layout.format;
  const int64_t layer = c.num_layers - 1;
  absl::StatusOr<CudaIpcMapping> pool = CudaIpcMapping::Open(info->handle());
  ASSERT_TRUE(pool.ok()) << "mapping the pool: " << pool.status();
  ASSERT_GE(pool->size(), layout.total_bytes);
  absl::StatusOr<Pinned> pool_host = Pinned::Create(layout.total_bytes);
  ASSERT_TRUE(pool_host.ok()) << pool_host.status();
  ASSERT_OK(
      Cuda(cudaMemcpyAsync(pool_host->data(), pool->data(), layout.total_bytes,
                           cudaMemcpyDeviceToHost, st),
           "reading the new pool"));
  ASSERT_OK(stream_->Sync());
  ASSERT_TRUE(AllZero(pool_host->data(), layout.total_bytes))
      << "a new pool must be zero-filled";

  // Input.
  std::mt19937 rng(301);
  const std::vector<float> kv = RandomKv(c.num_tokens, f.elements(), rng);
  const std::string kv_bf16 = Bf16Bytes(kv);
  const int64_t kv_bytes = static_cast<int64_t>(kv_bf16.size());
  ASSERT_FALSE(
      AllZero(reinterpret_cast<const uint8_t*>(kv_bf16.data()), kv_bytes));
  const std::vector<int32_t> slots =
      RandomSlots(layout.num_slots(), c.num_tokens, rng);
  int64_t written = 0;
  for (int32_t s : slots) written += s >= 0 ? 1 : 0;

  std::optional<CudaIpcEvent> mine;  // the client's event
  if (c.events) {
    absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Create(0);
    ASSERT_TRUE(e.ok()) << e.status();
    mine.emplace(*std::move(e));
  }
  v1::StoreRequest store =
      StoreRequest(pool_name, layer, slots, v1::INPUT_DTYPE_BF16);
  std::optional<Pinned> kv_host;
  std::optional<CudaIpcMapping> in;
  if (c.in == Place::kInline) {
    store.mutable_kv()->set_inline_data(kv_bf16);
  } else {
    const int64_t off = c.in == Place::kMisaligned ? 6 : 0;
    absl::StatusOr<v1::BufferInfo> b =
        AllocateCudaBuffer(*client_, off + kv_bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<CudaIpcMapping> m = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(m.ok()) << "mapping the input buffer: " << m.status();
    in.emplace(*std::move(m));
    absl::StatusOr<Pinned> h = Pinned::Create(kv_bytes);
    ASSERT_TRUE(h.ok()) << h.status();
    kv_host.emplace(*std::move(h));
    std::memcpy(kv_host->data(), kv_bf16.data(), kv_bf16.size());
    if (c.events) ASSERT_OK(DelayStream(st, kDelay));
    ASSERT_OK(Cuda(cudaMemcpyAsync(in->data() + off, kv_host->data(), kv_bytes,
                                   cudaMemcpyHostToDevice, st),
                   "writing the input"));
    if (!c.events) ASSERT_OK(stream_->Sync());
    *store.mutable_kv() = SliceRef(b->buffer_id(), off, kv_bytes);
  }
  if (c.events) {
    ASSERT_OK(mine->Record(st));
    store.set_wait_event_ipc_handle(mine->handle());
    store.set_record_event(true);
  }
  absl::StatusOr<v1::StoreResponse> stored = client_->Store(store);
  ASSERT_TRUE(stored.ok()) << "Store: " << stored.status();
  EXPECT_EQ(stored->tokens_written(), written);
  std::optional<CudaIpcEvent> theirs;  // the daemon's event
  if (c.events) {
    ASSERT_EQ(stored->recorded_event_ipc_handle().size(), kCudaIpcHandleBytes)
        << "Store with record_event must return the daemon's event";
    absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Open(
        "recorded_event_ipc_handle", stored->recorded_event_ipc_handle(), 0);
    ASSERT_TRUE(e.ok()) << e.status();
    theirs.emplace(*std::move(e));
    ASSERT_OK(theirs->Wait(st));
  } else {
    EXPECT_TRUE(stored->recorded_event_ipc_handle().empty());
  }
  ASSERT_OK(kvdepot::Store(layout, ref.layer(layer), kv_bf16.data(),
                           InputDtype::kBF16, slots));
  ASSERT_OK(
      Cuda(cudaMemcpyAsync(pool_host->data(), pool->data(), layout.total_bytes,
                           cudaMemcpyDeviceToHost, st),
           "reading the pool"));
  ASSERT_OK(stream_->Sync());
  EXPECT_EQ(
      CompareBytes(ref.bytes.data(), pool_host->data(), layout.total_bytes,
                   [&](int64_t o) { return DescribePoolOffset(layout, o); }),
      "")
      << "pool after Store";

  // Load.
  std::vector<int32_t> segments;
  const int64_t total_k = RandomSegments(layout, slots, rng, &segments);
  const int64_t row = LoadDataRowBytes(f);
  const int64_t data_bytes = total_k * row;
  const int64_t scale_bytes = f.do_cast ? 0 : total_k * LoadScaleRowBytes(f);
  // Uncovered rows keep a buffer's bytes; inline outputs start as zeros.
  const uint8_t before = c.out == Place::kInline ? 0 : kFill;
  std::vector<uint8_t> want_data(data_bytes, before);
  std::vector<uint8_t> want_scales(scale_bytes, before);
  ASSERT_OK(kvdepot::LoadSegments(layout, ref.layer(layer), segments, total_k,
                                  want_data.data(),
                                  f.do_cast ? nullptr : want_scales.data()));
  ASSERT_GT(std::count_if(want_data.begin(), want_data.end(),
                          [&](uint8_t b) { return b != before && b != 0; }),
            0)
      << "the plan must load some non-zero bytes";

  v1::LoadRequest load;
  load.set_pool(pool_name);
  load.set_layer(layer);
  *load.mutable_segments() = SegmentsProto(segments, total_k);
  std::optional<CudaIpcMapping> out;
  int64_t data_off = 0;
  int64_t scale_off = 0;
  if (c.out == Place::kInline) {
    load.mutable_data()->set_inline_output(true);
    if (!f.do_cast) load.mutable_scales()->set_inline_output(true);
  } else {
    const bool odd = c.out == Place::kMisaligned;
    data_off = odd ? 8 : 0;
    scale_off = data_off + data_bytes + (odd ? 2 : 0);
    const int64_t size = scale_off + std::max<int64_t>(scale_bytes, 1);
    absl::StatusOr<v1::BufferInfo> b = AllocateCudaBuffer(*client_, size);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<CudaIpcMapping> m = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(m.ok()) << "mapping the output buffer: " << m.status();
    out.emplace(*std::move(m));
    if (c.events) ASSERT_OK(DelayStream(st, kDelay));
    ASSERT_OK(Cuda(cudaMemsetAsync(out->data(), kFill, size, st),
                   "filling the output"));
    if (!c.events) ASSERT_OK(stream_->Sync());
    *load.mutable_data() = SliceRef(b->buffer_id(), data_off, data_bytes);
    if (!f.do_cast) {
      *load.mutable_scales() = SliceRef(b->buffer_id(), scale_off, scale_bytes);
    }
  }
  if (c.events) {
    ASSERT_OK(mine->Record(st));
    load.set_wait_event_ipc_handle(mine->handle());
    load.set_record_event(true);
  }
  absl::StatusOr<v1::LoadResponse> loaded = client_->Load(load);
  ASSERT_TRUE(loaded.ok()) << "Load: " << loaded.status();
  EXPECT_EQ(loaded->total_k(), total_k);
  if (c.events) {
    EXPECT_EQ(loaded->recorded_event_ipc_handle(),
              stored->recorded_event_ipc_handle())
        << "a pool records the same event every time";
    ASSERT_OK(theirs->Wait(st));
  } else {
    EXPECT_TRUE(loaded->recorded_event_ipc_handle().empty());
  }
  std::vector<uint8_t> got_data(data_bytes), got_scales(scale_bytes);
  if (c.out == Place::kInline) {
    ASSERT_EQ(static_cast<int64_t>(loaded->data().size()), data_bytes);
    ASSERT_EQ(static_cast<int64_t>(loaded->scales().size()), scale_bytes);
    std::memcpy(got_data.data(), loaded->data().data(), data_bytes);
    std::memcpy(got_scales.data(), loaded->scales().data(), scale_bytes);
  } else {
    ASSERT_OK(Cuda(cudaMemcpyAsync(got_data.data(), out->data() + data_off,
                                   data_bytes, cudaMemcpyDeviceToHost, st),
                   "reading the output"));
    if (scale_bytes > 0) {
      ASSERT_OK(Cuda(cudaMemcpyAsync(got_scales.data(), out->data() + scale_off,
                                     scale_bytes, cudaMemcpyDeviceToHost, st),
                     "reading the output scales"));
    }
    ASSERT_OK(stream_->Sync());
  }
  auto at_row = [&](int64_t row_bytes) {
    return [row_bytes](int64_t o) {
      return "row " + std::to_string(o / row_bytes) + " byte " +
             std::to_string(o % row_bytes);
    };
  };
  EXPECT_EQ(
      CompareBytes(want_data.data(), got_data.data(), data_bytes, at_row(row)),
      "")
      << "Load data";
  if (scale_bytes > 0) {
    EXPECT_EQ(CompareBytes(want_scales.data(), got_scales.data(), scale_bytes,
                           at_row(LoadScaleRowBytes(f))),
              "")
        << "Load scales";
  }
  ASSERT_OK(client_->DeletePool(pool_name));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RoundTripTest,
    ::testing::Values(
        Case{"v41_bs133", "V41", 0, 133, 5, 2, 300, false, Place::kSlice,
             Place::kSlice},
        Case{"v41_bs133_events", "V41", 0, 133, 5, 2, 300, true, Place::kSlice,
             Place::kSlice},
        Case{"v41fp4_bs7_misaligned", "V41_FP4", 0, 7, 40, 2, 200, false,
             Place::kMisaligned, Place::kMisaligned},
        Case{"fp8sf_bs17_inline", "FP8_FP32SF_INDEX", 0, 17, 11, 2, 150, false,
             Place::kInline, Place::kInline},
        Case{"mxfp8_bs3_events", "MXFP8_INDEX", 0, 3, 50, 2, 120, true,
             Place::kSlice, Place::kSlice},
        Case{"bf16_bs64_events_misaligned", "BF16", 64, 64, 4, 2, 200, true,
             Place::kMisaligned, Place::kMisaligned},
        Case{"fp4idx_bs1_events_inline", "FP4_INDEX", 0, 1, 300, 2, 250, true,
             Place::kInline, Place::kInline},
        // The 656-byte record engines read (SPEC §2.1), FlashMLA's block
        // size and an awkward one.
        Case{"dsmla_bs64_events", "DS_MLA_FP8", 0, 64, 12, 2, 300, true,
             Place::kSlice, Place::kSlice},
        Case{"dsmla_bs7_misaligned_inline", "DS_MLA_FP8", 0, 7, 60, 1, 200,
             false, Place::kMisaligned, Place::kInline},
        // One layer of 4.5 GiB: 64-bit offsets through IPC, staging, kernels.
        Case{"v41_bs64_over4GiB", "V41", 0, 64, 143000, 1, 300, false,
             Place::kSlice, Place::kSlice}),
    [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

}  // namespace
}  // namespace kvdepot::testing
