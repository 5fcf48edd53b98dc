// Helpers of the GPU end-to-end test: the client side of CUDA IPC (streams,
// pinned host memory, a delay queued on a stream so that a missing event
// wait shows up as wrong bytes), buffers allocated through the raw RPC, and
// byte comparisons that say where they differ.
#ifndef KVDEPOT_TESTS_GPU_GPU_TEST_UTIL_H_
#define KVDEPOT_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kvdepot_client.h"
#include "kernels/format.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot::testing {

// The daemon binary: $KVDEPOT_BINARY, else the Bazel runfile
// server/kvdepotd, else "kvdepot" beside this test's executable (the GPU
// bundle puts both in bin/).
std::string DaemonBinary();

// absl::Status of a CUDA call, naming `what`.
absl::Status Cuda(cudaError_t e, const std::string& what);

// A non-blocking stream of the current device. Move-only RAII.
class Stream {
 public:
  static absl::StatusOr<Stream> Create();
  Stream(Stream&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  Stream& operator=(Stream&&) = delete;
  ~Stream();
  cudaStream_t get() const { return s_; }
  absl::Status Sync() const;

 private:
  explicit Stream(cudaStream_t s) : s_(s) {}
  cudaStream_t s_ = nullptr;
};

// Pinned host memory (true asynchronous copies). Move-only RAII.
class Pinned {
 public:
  static absl::StatusOr<Pinned> Create(int64_t bytes);
  Pinned(Pinned&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  Pinned& operator=(Pinned&&) = delete;
  ~Pinned();
  uint8_t* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  Pinned(uint8_t* p, int64_t n) : p_(p), n_(n) {}
  uint8_t* p_ = nullptr;
  int64_t n_ = 0;
};

// Queues a host function on `stream` that sleeps for `delay`: work queued
// after it starts late, so a consumer that does not wait for it reads stale
// bytes.
absl::Status DelayStream(cudaStream_t stream, absl::Duration delay);

// AllocateBuffer through the stub (the client library maps shm buffers
// only; CUDA buffers are mapped with CudaIpcMapping).
absl::StatusOr<v1::BufferInfo> AllocateCudaBuffer(KVCacheClient& client,
                                                  int64_t size);

// A DataRef naming [offset, offset + length) of buffer `id`.
v1::DataRef SliceRef(uint64_t id, int64_t offset, int64_t length);

// Empty when equal; otherwise the number of differing bytes and the first
// difference, described by `where(offset)`.
template <typename Where>
std::string CompareBytes(const uint8_t* expected, const uint8_t* actual,
                         int64_t n, Where where) {
  int64_t first = -1;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (expected[i] != actual[i]) {
      if (first < 0) first = i;
      ++count;
    }
  }
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(n) +
         " bytes differ; first at " + where(first) + ": expected " +
         std::to_string(expected[first]) + ", got " +
         std::to_string(actual[first]);
}

// "byte B (layer L, block K, token slot T, byte R of the record)" for an
// offset into a pool.
std::string DescribePoolOffset(const PoolLayout& layout, int64_t offset);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_GPU_TEST_UTIL_H_
