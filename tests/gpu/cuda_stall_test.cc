// A client's wait event that never fires (SPEC §10/§11, GPU_HOST.md): the
// daemon awaits it on the host with a watchdog, so only that request fails
// (DEADLINE_EXCEEDED, nothing written) while another session's Stores and
// Loads on the same pool complete meanwhile. And the device budget: a pool
// that does not fit in the free memory minus the reserve fails with
// RESOURCE_EXHAUSTED saying how much is available.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_events.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kWatchdogMs = 3000;

std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> args) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    ADD_FAILURE() << "no CUDA device: this test runs on the GPU host";
    return nullptr;
  }
  args.insert(args.begin(), {"--backend=cuda", "--log_level=warn"});
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start(args, DaemonBinary());
  if (!d.ok()) {
    ADD_FAILURE() << "starting kvdepotd --backend=cuda: " << d.status();
    return nullptr;
  }
  return *std::move(d);
}

// A host function parked on `stream` until Release(): everything queued
// behind it (an event record) waits.
class Gate {
 public:
  absl::Status Park(cudaStream_t stream) {
    return Cuda(cudaLaunchHostFunc(
                    stream,
                    [](void* self) {
                      static_cast<Gate*>(self)->open_.WaitForNotification();
                    },
                    this),
                "cudaLaunchHostFunc(gate)");
  }
  void Release() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }

 private:
  absl::Notification open_;
};

v1::StoreRequest InlineStore(const std::string& pool,
                             const std::vector<int32_t>& slots,
                             const std::string& bf16) {
  v1::StoreRequest r = StoreRequest(pool, 0, slots, v1::INPUT_DTYPE_BF16);
  r.mutable_kv()->set_inline_data(bf16);
  return r;
}

// Every slot of the layer, one segment per block.
std::vector<int32_t> WholeLayer(const PoolLayout& l) {
  std::vector<int32_t> segs;
  for (int64_t b = 0; b < l.num_blocks; ++b) {
    segs.insert(segs.end(),
                {static_cast<int32_t>(b), 0, static_cast<int32_t>(l.block_size),
                 static_cast<int32_t>(b * l.block_size)});
  }
  return segs;
}

// What the CPU reference loads from `ref` for WholeLayer.
std::string Expected(LocalPool& ref) {
  const PoolLayout& l = ref.layout;
  const int64_t total_k = l.num_blocks * l.block_size;
  std::string want(static_cast<size_t>(total_k * LoadDataRowBytes(l.format)),
                   '\0');
  const absl::Status s =
      LoadSegments(l, ref.layer(0), WholeLayer(l), total_k,
                   reinterpret_cast<uint8_t*>(want.data()), nullptr);
  EXPECT_TRUE(s.ok()) << s;
  return want;
}

// The whole layer as the daemon has it.
absl::StatusOr<std::string> ReadPool(KVCacheClient& c, const std::string& pool,
                                     const PoolLayout& l) {
  const std::vector<int32_t> segs = WholeLayer(l);
  v1::LoadRequest load;
  load.set_pool(pool);
  *load.mutable_segments() = SegmentsProto(segs, l.num_blocks * l.block_size);
  load.mutable_data()->set_inline_output(true);
  absl::StatusOr<v1::LoadResponse> r = c.Load(load);
  if (!r.ok()) return r.status();
  return r->data();
}

TEST(CudaStallTest, AWaitEventThatNeverFiresFailsOnlyItsOwnRequest) {
  std::unique_ptr<DaemonProcess> d =
      StartDaemon({absl::StrCat("--cuda_wait_timeout_ms=", kWatchdogMs)});
  ASSERT_NE(d, nullptr);
  std::unique_ptr<KVCacheClient> a = ConnectOrDie(d->socket_path());
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(d->socket_path());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // BF16 rows of 64 elements: Load returns exactly what Store wrote.
  absl::StatusOr<v1::PoolInfo> info =
      a->CreatePool(PoolRequest("stall", "BF16", 64, 16, 8, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool ref = LocalPool::FromInfo(*info);
  const PoolLayout& l = ref.layout;

  // Client A's event, recorded behind a parked host function: never fires
  // until the gate opens.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::StatusOr<Stream> sa = Stream::Create();
  ASSERT_TRUE(sa.ok()) << sa.status();
  Gate gate;
  ASSERT_TRUE(gate.Park(sa->get()).ok());
  absl::StatusOr<CudaIpcEvent> ea = CudaIpcEvent::Create(0);
  ASSERT_TRUE(ea.ok()) << ea.status();
  ASSERT_TRUE(ea->Record(sa->get()).ok());

  std::mt19937 rng(301);
  const std::vector<int32_t> a_slots = {0, 1, 2, 3, 4};
  const std::string a_kv = Bf16Bytes(RandomKv(5, 64, rng));
  std::atomic<bool> a_done{false};
  absl::Status a_status;
  absl::Duration a_took;
  std::thread stalled([&] {
    v1::StoreRequest r = InlineStore("stall", a_slots, a_kv);
    r.set_wait_event_ipc_handle(ea->handle());
    const absl::Time t0 = absl::Now();
    a_status = a->Store(r).status();
    a_took = absl::Now() - t0;
    a_done.store(true);
  });

  // Client B, another session on the same pool: 20 Stores and Loads, each
  // checked against the CPU reference, all while A's request waits.
  absl::SleepFor(absl::Milliseconds(100));  // A's request is in
  for (int it = 0; it < 20; ++it) {
    std::vector<int32_t> slots;
    for (int t = 0; t < 4; ++t) {
      slots.push_back(static_cast<int32_t>(16 + (it * 4 + t) % (7 * 16)));
    }
    const std::vector<float> kv = RandomKv(4, 64, rng);
    const std::string bf16 = Bf16Bytes(kv);
    absl::StatusOr<v1::StoreResponse> s =
        b->Store(InlineStore("stall", slots, bf16));
    ASSERT_TRUE(s.ok()) << "B's store " << it << ": " << s.status();
    ASSERT_TRUE(
        kvdepot::Store(l, ref.layer(0), bf16.data(), InputDtype::kBF16, slots)
            .ok());
  }
  absl::StatusOr<std::string> during = ReadPool(*b, "stall", l);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_FALSE(a_done.load())
      << "B's 20 stores and a load finished only after A's stalled request "
         "ended (they must not wait for it): A took "
      << a_took;
  EXPECT_TRUE(*during == Expected(ref))
      << "the pool differs from the CPU reference of B's stores";

  stalled.join();
  EXPECT_EQ(a_status.code(), absl::StatusCode::kDeadlineExceeded) << a_status;
  EXPECT_THAT(std::string(a_status.message()),
              HasSubstr("wait_event_ipc_handle"));
  EXPECT_GE(a_took, absl::Milliseconds(kWatchdogMs - 100));
  // Nothing of A's request was written.
  absl::StatusOr<std::string> after = ReadPool(*b, "stall", l);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(*after == Expected(ref))
      << "the failed request wrote into the pool";

  // Once the event fires, the same request goes through.
  gate.Release();
  ASSERT_TRUE(sa->Sync().ok());
  v1::StoreRequest r = InlineStore("stall", a_slots, a_kv);
  r.set_wait_event_ipc_handle(ea->handle());
  absl::StatusOr<v1::StoreResponse> ok = a->Store(r);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE(
      kvdepot::Store(l, ref.layer(0), a_kv.data(), InputDtype::kBF16, a_slots)
          .ok());
  absl::StatusOr<std::string> last = ReadPool(*a, "stall", l);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_FALSE(AllZero(ref.layer(0), l.layer_bytes));
  EXPECT_TRUE(*last == Expected(ref)) << "A's store after the event fired";
}

TEST(CudaStallTest, APoolBeyondTheDeviceBudgetIsRefused) {
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  {
    std::unique_ptr<DaemonProcess> d = StartDaemon(
        {"--cuda_memory_reserve_bytes=0", "--max_pool_bytes=4398046511104"});
    ASSERT_NE(d, nullptr);
    std::unique_ptr<KVCacheClient> c = ConnectOrDie(d->socket_path());
    ASSERT_NE(c, nullptr);
    // BF16, 4096 elements, blocks of 64 tokens: 512 KiB per block; twice
    // the device's memory.
    const int64_t block = 64 * 4096 * 2;
    const int64_t too_many = 2 * static_cast<int64_t>(total_bytes) / block;
    absl::StatusOr<v1::PoolInfo> big =
        c->CreatePool(PoolRequest("big", "BF16", 4096, 64, too_many, 1));
    ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted)
        << big.status();
    EXPECT_THAT(std::string(big.status().message()),
                HasSubstr("bytes available to kvdepot"));
    // 60 % of what is free fits, twice in a row: deleting gives it back.
    const int64_t fits = static_cast<int64_t>(free_bytes) * 6 / 10 / block;
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<v1::PoolInfo> p =
          c->CreatePool(PoolRequest("fits", "BF16", 4096, 64, fits, 1));
      ASSERT_TRUE(p.ok()) << "round " << i << ": " << p.status();
      absl::StatusOr<v1::PoolInfo> second =
          c->CreatePool(PoolRequest("second", "BF16", 4096, 64, fits, 1));
      EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted)
          << "two pools of 60 % of the free memory each";
      ASSERT_TRUE(c->DeletePool("fits").ok());
    }
  }
  {
    // A reserve larger than the free memory leaves nothing.
    std::unique_ptr<DaemonProcess> d = StartDaemon({absl::StrCat(
        "--cuda_memory_reserve_bytes=", free_bytes + (int64_t{1} << 30))});
    ASSERT_NE(d, nullptr);
    std::unique_ptr<KVCacheClient> c = ConnectOrDie(d->socket_path());
    ASSERT_NE(c, nullptr);
    absl::StatusOr<v1::PoolInfo> small =
        c->CreatePool(PoolRequest("small", "V41", 0, 16, 4, 1));
    ASSERT_EQ(small.status().code(), absl::StatusCode::kResourceExhausted)
        << small.status();
    EXPECT_THAT(std::string(small.status().message()),
                HasSubstr("has 0 bytes available"));
  }
}

}  // namespace
}  // namespace kvdepot::testing
