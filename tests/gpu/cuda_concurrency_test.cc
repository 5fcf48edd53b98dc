// Several client threads at once: Loads of one shared pool (they run
// concurrently under the pool's reader lock, on one stream, each with its
// own staging buffers) and Stores into per-thread pools (one stream each),
// mixing in-place slices, inline bytes and event-ordered requests. Every
// result is compared with the CPU reference.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

constexpr int kThreads = 4;
constexpr int kIterations = 24;

// One thread's work; failures are reported with EXPECT (thread-safe).
void Worker(int t, const LocalPool& shared) {
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(DaemonSocket());
  ASSERT_NE(c, nullptr);
  absl::StatusOr<Stream> stream = Stream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<CudaIpcEvent> mine = CudaIpcEvent::Create(0);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const PoolLayout& l = shared.layout;
  const int64_t row = LoadDataRowBytes(l.format);
  const int64_t max_rows = 4 * l.block_size;
  absl::StatusOr<v1::BufferInfo> buf = AllocateCudaBuffer(*c, max_rows * row);
  ASSERT_TRUE(buf.ok()) << buf.status();
  absl::StatusOr<CudaIpcMapping> out = CudaIpcMapping::Open(buf->handle());
  ASSERT_TRUE(out.ok()) << out.status();

  // This thread's own pool, stored into while the others load.
  const std::string own = "cc_own_" + std::to_string(t);
  absl::StatusOr<v1::PoolInfo> own_info =
      c->CreatePool(PoolRequest(own, "V41", 0, 7, 16, 1));
  ASSERT_TRUE(own_info.ok()) << own_info.status();
  LocalPool own_ref = LocalPool::FromInfo(*own_info);

  std::mt19937 rng(301 + t);
  std::optional<CudaIpcEvent> theirs;
  for (int it = 0; it < kIterations; ++it) {
    const int mode = it % 3;  // 0 slice, 1 inline, 2 slice + events
    // Load up to four random block ranges of the shared pool.
    std::vector<int32_t> segs;
    int64_t total_k = 0;
    std::uniform_int_distribution<int64_t> block(0, l.num_blocks - 1);
    for (int s = 0; s < 4; ++s) {
      std::uniform_int_distribution<int64_t> begin(0, l.block_size - 1);
      const int64_t b = begin(rng);
      segs.insert(
          segs.end(),
          {static_cast<int32_t>(block(rng)), static_cast<int32_t>(b),
           static_cast<int32_t>(l.block_size), static_cast<int32_t>(total_k)});
      total_k += l.block_size - b;
    }
    std::vector<uint8_t> want(total_k * row);  // every row is covered
    ASSERT_TRUE(LoadSegments(l, shared.bytes.data(), segs, total_k, want.data(),
                             nullptr)
                    .ok());
    v1::LoadRequest load;
    load.set_pool("cc_shared");
    *load.mutable_segments() = SegmentsProto(segs, total_k);
    if (mode == 1) {
      load.mutable_data()->set_inline_output(true);
    } else {
      *load.mutable_data() = SliceRef(buf->buffer_id(), 0, total_k * row);
    }
    if (mode == 2) {
      ASSERT_TRUE(mine->Record(stream->get()).ok());
      load.set_wait_event_ipc_handle(mine->handle());
      load.set_record_event(true);
    }
    absl::StatusOr<v1::LoadResponse> r = c->Load(load);
    ASSERT_TRUE(r.ok()) << "thread " << t << " load " << it << ": "
                        << r.status();
    std::vector<uint8_t> got(total_k * row);
    if (mode == 1) {
      ASSERT_EQ(r->data().size(), got.size());
      std::memcpy(got.data(), r->data().data(), got.size());
    } else {
      if (mode == 2) {
        if (!theirs.has_value()) {
          absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Open(
              "recorded_event_ipc_handle", r->recorded_event_ipc_handle(), 0);
          ASSERT_TRUE(e.ok()) << e.status();
          theirs.emplace(*std::move(e));
        }
        ASSERT_TRUE(theirs->Wait(stream->get()).ok());
      }
      ASSERT_TRUE(Cuda(cudaMemcpyAsync(got.data(), out->data(), got.size(),
                                       cudaMemcpyDeviceToHost, stream->get()),
                       "reading the output")
                      .ok());
      ASSERT_TRUE(stream->Sync().ok());
    }
    EXPECT_EQ(CompareBytes(want.data(), got.data(), want.size(),
                           [](int64_t o) { return std::to_string(o); }),
              "")
        << "thread " << t << " load " << it << " mode " << mode;

    // Store five tokens into the own pool (inline K/V).
    std::vector<int32_t> slots;
    std::uniform_int_distribution<int32_t> slot(0, 7 * 16 - 1);
    while (slots.size() < 5) {
      const int32_t s = slot(rng);
      if (std::find(slots.begin(), slots.end(), s) == slots.end()) {
        slots.push_back(s);
      }
    }
    const std::string kv = Bf16Bytes(RandomKv(5, 512, rng));
    v1::StoreRequest store = StoreRequest(own, 0, slots, v1::INPUT_DTYPE_BF16);
    store.mutable_kv()->set_inline_data(kv);
    absl::StatusOr<v1::StoreResponse> sr = c->Store(store);
    ASSERT_TRUE(sr.ok()) << sr.status();
    ASSERT_TRUE(kvdepot::Store(own_ref.layout, own_ref.layer(0), kv.data(),
                               InputDtype::kBF16, slots)
                    .ok());
  }
  absl::StatusOr<CudaIpcMapping> own_map =
      CudaIpcMapping::Open(own_info->handle());
  ASSERT_TRUE(own_map.ok()) << own_map.status();
  std::vector<uint8_t> bytes(own_ref.bytes.size());
  ASSERT_TRUE(Cuda(cudaMemcpy(bytes.data(), own_map->data(), bytes.size(),
                              cudaMemcpyDeviceToHost),
                   "reading the own pool")
                  .ok());
  EXPECT_EQ(CompareBytes(own_ref.bytes.data(), bytes.data(), bytes.size(),
                         [&](int64_t o) {
                           return DescribePoolOffset(own_ref.layout, o);
                         }),
            "")
      << "thread " << t << " own pool";
  EXPECT_TRUE(c->DeletePool(own).ok());
}

using CudaConcurrencyTest = GpuTest;

TEST_F(CudaConcurrencyTest, ParallelClientsAgreeWithTheReference) {
  absl::StatusOr<v1::PoolInfo> info =
      client_->CreatePool(PoolRequest("cc_shared", "V41", 0, 17, 24, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool shared = LocalPool::FromInfo(*info);
  const int64_t slots = shared.layout.num_slots();
  std::vector<int32_t> all(slots);
  for (int64_t i = 0; i < slots; ++i) all[i] = static_cast<int32_t>(i);
  std::mt19937 rng(301);
  const std::string kv = Bf16Bytes(RandomKv(slots, 512, rng));
  v1::StoreRequest store =
      StoreRequest("cc_shared", 0, all, v1::INPUT_DTYPE_BF16);
  store.mutable_kv()->set_inline_data(kv);
  ASSERT_TRUE(client_->Store(store).ok());
  ASSERT_OK(kvdepot::Store(shared.layout, shared.layer(0), kv.data(),
                           InputDtype::kBF16, all));

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &shared] { Worker(t, shared); });
  }
  for (std::thread& th : threads) th.join();
  ASSERT_OK(client_->DeletePool("cc_shared"));
}

// --backend=auto picks CUDA where a GPU is visible.
TEST_F(CudaConcurrencyTest, AutoBackendPicksCuda) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
      {"--legacy_cuda_ipc", "--log_level=warn"}, DaemonBinary());
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(c, nullptr);
  absl::StatusOr<v1::StatsResponse> stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->backend(), "cuda");
}

}  // namespace
}  // namespace kvdepot::testing
