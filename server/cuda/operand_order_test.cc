// The CUDA backend orders a call after the daemon's earlier work on the
// memory of its device operands (their UseFence), not only on its pool: a
// call that reads a buffer another stream still writes, or writes one
// another stream still reads, waits for that work on the GPU. In process
// (MakeCudaBackend), the earlier work queued on a stream of this test
// behind a host function that holds it back until released, and noted on
// the buffer's fence as the daemon notes a call that replied early
// (record_event): without the order the call runs first and the bytes
// show it, every time.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/fused.h"
#include "kernels/reference/reference.h"
#include "server/backend/backend.h"
#include "server/cuda/call_events.h"
#include "server/cuda/cuda_backend.h"
#include "server/cuda/cuda_memory.h"
#include "server/cuda/test_gate.h"

namespace kvdepot {
namespace {

constexpr int64_t kBlockSize = 64;
constexpr int64_t kBlocks = 16;
constexpr int64_t kTokens = kBlockSize * kBlocks;

class OperandOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The backend refuses lazy module loading (GPU_HOST.md).
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    BackendOptions options;
    options.cuda_memory_reserve_bytes = -1;
    absl::StatusOr<std::unique_ptr<Backend>> b = MakeCudaBackend(options);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    absl::StatusOr<KVCacheFormat> f = FormatFromName("V41");
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, kBlockSize, kBlocks, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    layout_ = *l;
    kv_bytes_ = kTokens * layout_.format.elements() * 2;
    absl::StatusOr<std::unique_ptr<Memory>> pool =
        backend_->Allocate(layout_.total_bytes, "cuda:0");
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    absl::StatusOr<std::unique_ptr<Memory>> x =
        backend_->Allocate(kv_bytes_, "cuda:0");
    ASSERT_TRUE(x.ok()) << x.status();
    x_ = *std::move(x);
    ASSERT_EQ(cudaStreamCreateWithFlags(&other_, cudaStreamNonBlocking),
              cudaSuccess);
    slots_.resize(kTokens);
    std::iota(slots_.begin(), slots_.end(), 0);
    for (int32_t k = 0; k < kBlocks; ++k) {
      segments_.insert(segments_.end(), {k, 0, static_cast<int32_t>(kBlockSize),
                                         static_cast<int32_t>(k * kBlockSize)});
    }
    ordering_.record_event = true;
    ordering_.session = 1;
    // Warm-up: the staging buffers exist before anything is gated.
    ASSERT_TRUE(backend_
                    ->StoreOrdered(layout_, *pool_, 0, x_->data(),
                                   InputDtype::kBF16, slots_, ordering_,
                                   &event_)
                    .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  void TearDown() override {
    if (other_ != nullptr) {
      (void)cudaStreamSynchronize(other_);
      (void)cudaStreamDestroy(other_);
    }
  }

  // Notes the end of the work queued on other_ so far on x_'s fence, as
  // the backend notes a call that replied before its work finished.
  void NoteOnX() {
    absl::StatusOr<CallEvent> e = events_.Record(0, other_);
    ASSERT_TRUE(e.ok()) << e.status();
    auto* mem = dynamic_cast<CudaAllocation*>(x_.get());
    ASSERT_NE(mem, nullptr);
    ASSERT_NE(mem->fence(), nullptr);
    static_cast<UseFence*>(mem->fence().get())->Note(other_, *e);
  }

  // x_ set to `value` bytes by other_ behind `gate`, noted on x_'s fence.
  void WriteXBehind(Gate& gate, int value) {
    ASSERT_NO_FATAL_FAILURE(gate.Park(other_));
    ASSERT_EQ(cudaMemsetAsync(x_->data(), value, static_cast<size_t>(kv_bytes_),
                              other_),
              cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(NoteOnX());
  }

  // x_ filled with `value` bytes, synchronously.
  void Fill(int value) {
    ASSERT_EQ(cudaMemset(x_->data(), value, static_cast<size_t>(kv_bytes_)),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  std::vector<uint8_t> PoolBytes() {
    std::vector<uint8_t> out(static_cast<size_t>(layout_.total_bytes));
    EXPECT_EQ(cudaMemcpy(out.data(), pool_->data(), out.size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  // The pool after a store of kv bytes all equal to `value`.
  std::vector<uint8_t> Reference(int value) {
    std::vector<uint8_t> pool(static_cast<size_t>(layout_.total_bytes), 0);
    const std::vector<uint8_t> kv(static_cast<size_t>(kv_bytes_),
                                  static_cast<uint8_t>(value));
    EXPECT_TRUE(
        Store(layout_, pool.data(), kv.data(), InputDtype::kBF16, slots_).ok());
    return pool;
  }

  std::unique_ptr<Backend> backend_;
  PoolLayout layout_;
  int64_t kv_bytes_ = 0;
  std::unique_ptr<Memory> pool_, x_;
  cudaStream_t other_ = nullptr;
  CallEvents events_;
  std::vector<int32_t> slots_, segments_;
  GpuOrdering ordering_;
  std::string event_;
};

// Read after write: a Store reads x_ while other_ still writes it.
TEST_F(OperandOrderTest, StoreWaitsForAWriterOfItsInput) {
  ASSERT_NO_FATAL_FAILURE(Fill(0x3C));
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(WriteXBehind(gate, 0x40));
  ASSERT_TRUE(backend_
                  ->StoreOrdered(layout_, *pool_, 0, x_->data(),
                                 InputDtype::kBF16, slots_, ordering_, &event_)
                  .ok());
  absl::SleepFor(absl::Milliseconds(50));  // time to run, were it unordered
  gate.Release();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(PoolBytes() == Reference(0x40))
      << "the store read its input before the earlier write to it";
}

// Write after read: a Load writes x_ while other_ still reads it.
TEST_F(OperandOrderTest, LoadWaitsForAReaderOfItsOutput) {
  ASSERT_NO_FATAL_FAILURE(Fill(0x40));
  ASSERT_TRUE(backend_
                  ->StoreOrdered(layout_, *pool_, 0, x_->data(),
                                 InputDtype::kBF16, slots_, GpuOrdering{},
                                 &event_)
                  .ok());
  ASSERT_NO_FATAL_FAILURE(Fill(0x3C));
  void* copy = nullptr;
  ASSERT_EQ(cudaMalloc(&copy, static_cast<size_t>(kv_bytes_)), cudaSuccess);
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(gate.Park(other_));
  ASSERT_EQ(cudaMemcpyAsync(copy, x_->data(), static_cast<size_t>(kv_bytes_),
                            cudaMemcpyDeviceToDevice, other_),
            cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(NoteOnX());
  ASSERT_TRUE(backend_
                  ->LoadOrdered(layout_, *pool_, 0, segments_, kTokens,
                                x_->data(), nullptr, ordering_, &event_)
                  .ok());
  absl::SleepFor(absl::Milliseconds(50));
  gate.Release();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> read(static_cast<size_t>(kv_bytes_));
  ASSERT_EQ(cudaMemcpy(read.data(), copy, read.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  (void)cudaFree(copy);
  EXPECT_TRUE(read == std::vector<uint8_t>(read.size(), 0x3C))
      << "the load overwrote its output before the earlier read of it";
}

// The fused store (synchronous: it waits for its own work, so the gate is
// released from another thread) reads x_ while other_ still writes it.
TEST_F(OperandOrderTest, FusedStoreWaitsForAWriterOfItsInput) {
  ASSERT_NO_FATAL_FAILURE(Fill(0x3C));
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(WriteXBehind(gate, 0x40));
  std::thread release([&gate] {
    absl::SleepFor(absl::Milliseconds(100));
    gate.Release();
  });
  // No stage: the fused store is the plain store (SPEC §8).
  const absl::Status s = backend_->StoreFused(
      layout_, *pool_, 0, reinterpret_cast<const uint16_t*>(x_->data()),
      FusedParams{}, slots_, nullptr);
  release.join();
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(PoolBytes() == Reference(0x40))
      << "the fused store read its input before the earlier write to it";
}

}  // namespace
}  // namespace kvdepot
