// The CUDA backend's handles, imports and GPU ordering rules, seen from a
// client in another process: devices, buffers the client allocated and
// the daemon imports, handles the daemon must refuse, malformed event
// handles (nothing written), and the client's per-handle mapping cache.
#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cuda/cuda_mappings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

// Reads a whole pool (or buffer) of the daemon into host memory.
std::vector<uint8_t> ReadAll(const CudaIpcMapping& m, int64_t bytes) {
  std::vector<uint8_t> host(static_cast<size_t>(bytes));
  const absl::Status s =
      Cuda(cudaMemcpy(host.data(), m.data(), bytes, cudaMemcpyDeviceToHost),
           "reading daemon memory");
  EXPECT_TRUE(s.ok()) << s;
  return host;
}

using CudaIpcTest = GpuTest;

TEST_F(CudaIpcTest, TheDaemonRunsTheCudaBackend) {
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->backend(), "cuda");
}

TEST_F(CudaIpcTest, PoolsAreOnTheRequestedDevice) {
  v1::CreatePoolRequest r = PoolRequest("dev_ok", "V41", 0, 17, 3, 1);
  r.set_device("cuda:0");
  absl::StatusOr<v1::PoolInfo> info = client_->CreatePool(r);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->device(), "cuda:0");
  EXPECT_EQ(info->handle().device_ordinal(), 0);
  EXPECT_EQ(info->handle().offset(), 0);
  EXPECT_EQ(info->handle().cuda_ipc_handle().size(), kCudaIpcHandleBytes);
  ASSERT_OK(client_->DeletePool("dev_ok"));

  const std::string bad = "cuda:" + std::to_string(device_count_);
  r = PoolRequest("dev_bad", "V41", 0, 17, 3, 1);
  r.set_device(bad);
  info = client_->CreatePool(r);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(), HasSubstr("\"" + bad + "\""));
  EXPECT_THAT(info.status().message(),
              HasSubstr("outside [0, " + std::to_string(device_count_) + ")"));
  r.set_device("gpu0");
  info = client_->CreatePool(r);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(), HasSubstr("is not \"cuda:N\""));
}

TEST_F(CudaIpcTest, ClientMappingsAreCachedPerHandle) {
  absl::StatusOr<v1::BufferInfo> b = AllocateCudaBuffer(*client_, 3 << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string& key = b->handle().cuda_ipc_handle();
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 0);
  absl::StatusOr<CudaIpcMapping> m1 = CudaIpcMapping::Open(b->handle());
  ASSERT_TRUE(m1.ok()) << m1.status();
  {
    absl::StatusOr<CudaIpcMapping> m2 = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(m2.ok()) << m2.status();
    EXPECT_EQ(m1->base(), m2->base());
    EXPECT_EQ(CudaIpcMapping::RefCount(key), 2);
  }
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 1);
  EXPECT_EQ(m1->size(), 3 << 20);
  // A new buffer is zero-filled.
  const std::vector<uint8_t> bytes = ReadAll(*m1, m1->size());
  EXPECT_TRUE(AllZero(bytes.data(), static_cast<int64_t>(bytes.size())));
  // A size beyond the exported allocation is refused.
  v1::SharedHandle big = b->handle();
  big.set_size(int64_t{1} << 30);
  absl::StatusOr<CudaIpcMapping> m3 = CudaIpcMapping::Open(big);
  ASSERT_FALSE(m3.ok());
  EXPECT_EQ(m3.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m3.status().message(),
              HasSubstr("exceeds the exported allocation's"));
  absl::StatusOr<CudaIpcMapping> again = CudaIpcMapping::Open(b->handle());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 2);
  *m1 = *std::move(again);  // move-assign releases one reference
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 1);
  again =
      absl::CancelledError("moved from");  // a moved-from mapping owns nothing
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 1);
  m1 = absl::StatusOr<CudaIpcMapping>(absl::CancelledError("drop"));
  EXPECT_EQ(CudaIpcMapping::RefCount(key), 0);
}

// The daemon imports a buffer this process allocated and stores from it.
TEST_F(CudaIpcTest, StoresFromAnImportedClientBuffer) {
  absl::StatusOr<v1::PoolInfo> info =
      client_->CreatePool(PoolRequest("import_pool", "V41", 0, 7, 9, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool ref = LocalPool::FromInfo(*info);
  std::mt19937 rng(301);
  const int64_t n = 29;
  const std::string kv = Bf16Bytes(RandomKv(n, 512, rng));
  std::vector<int32_t> slots(n);
  for (int64_t i = 0; i < n; ++i) slots[i] = static_cast<int32_t>(62 - 2 * i);
  slots[5] = -1;

  void* mine = nullptr;
  ASSERT_OK(Cuda(cudaMalloc(&mine, 4 << 20), "cudaMalloc"));
  ASSERT_OK(Cuda(cudaMemcpy(mine, kv.data(), kv.size(), cudaMemcpyHostToDevice),
                 "writing the client buffer"));
  cudaIpcMemHandle_t h;
  ASSERT_OK(Cuda(cudaIpcGetMemHandle(&h, mine), "cudaIpcGetMemHandle"));
  v1::ImportBufferRequest imp;
  imp.mutable_handle()->set_cuda_ipc_handle(
      std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
  imp.mutable_handle()->set_size(4 << 20);
  imp.mutable_handle()->set_device_ordinal(0);
  absl::StatusOr<v1::BufferInfo> b1 = client_->ImportBuffer(imp);
  ASSERT_TRUE(b1.ok()) << b1.status();
  // The same handle again: the daemon shares its one mapping.
  absl::StatusOr<v1::BufferInfo> b2 = client_->ImportBuffer(imp);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_NE(b1->buffer_id(), b2->buffer_id());
  ASSERT_OK(client_->ReleaseBuffer(b1->buffer_id()));

  v1::StoreRequest store =
      StoreRequest("import_pool", 0, slots, v1::INPUT_DTYPE_BF16);
  *store.mutable_kv() = SliceRef(b2->buffer_id(), 0, kv.size());
  absl::StatusOr<v1::StoreResponse> stored = client_->Store(store);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->tokens_written(), n - 1);
  ASSERT_OK(kvdepot::Store(ref.layout, ref.layer(0), kv.data(),
                           InputDtype::kBF16, slots));
  absl::StatusOr<CudaIpcMapping> pool = CudaIpcMapping::Open(info->handle());
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<uint8_t> got = ReadAll(*pool, ref.layout.total_bytes);
  ASSERT_FALSE(AllZero(ref.bytes.data(), ref.layout.total_bytes));
  EXPECT_EQ(CompareBytes(
                ref.bytes.data(), got.data(), ref.layout.total_bytes,
                [&](int64_t o) { return DescribePoolOffset(ref.layout, o); }),
            "");

  // A size beyond the client's allocation is refused.
  imp.mutable_handle()->set_size(int64_t{1} << 30);
  absl::StatusOr<v1::BufferInfo> b3 = client_->ImportBuffer(imp);
  ASSERT_FALSE(b3.ok());
  EXPECT_EQ(b3.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b3.status().message(),
              HasSubstr("exceeds the exported allocation's"));
  ASSERT_OK(client_->ReleaseBuffer(b2->buffer_id()));
  ASSERT_OK(client_->DeletePool("import_pool"));
  ASSERT_OK(Cuda(cudaFree(mine), "cudaFree"));
}

TEST_F(CudaIpcTest, RefusesHandlesItCannotImport) {
  absl::StatusOr<v1::PoolInfo> info =
      client_->CreatePool(PoolRequest("own_pool", "V41", 0, 7, 3, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  struct Bad {
    v1::SharedHandle handle;
    std::string message;
  };
  std::vector<Bad> bad;
  bad.push_back({info->handle(), "names memory this daemon allocated"});
  v1::SharedHandle h = info->handle();
  h.set_cuda_ipc_handle("short");
  bad.push_back({h, "handle.cuda_ipc_handle holds 5 bytes"});
  h = info->handle();
  h.set_device_ordinal(device_count_);
  bad.push_back({h, "handle.device_ordinal = " + std::to_string(device_count_) +
                        " is outside [0, "});
  h = info->handle();
  h.set_size(0);
  // The service bounds the size (by --max_buffer_bytes) before the backend.
  bad.push_back({h, "handle.size = 0 is outside [1, "});
  h = info->handle();
  h.set_offset(h.size());
  bad.push_back(
      {h, "handle.offset = " + std::to_string(h.size()) + " is outside [0, "});
  h.Clear();
  h.set_shm_name("/kvdepot-0123");
  h.set_size(4096);
  bad.push_back({h, "needs cuda_ipc_handle (got shm_name)"});
  for (const Bad& b : bad) {
    v1::ImportBufferRequest r;
    *r.mutable_handle() = b.handle;
    absl::StatusOr<v1::BufferInfo> got = client_->ImportBuffer(r);
    ASSERT_FALSE(got.ok()) << b.message;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
        << got.status();
    EXPECT_THAT(got.status().message(), HasSubstr(b.message));
  }
  ASSERT_OK(client_->DeletePool("own_pool"));
}

// A malformed or unopenable wait event fails the request before anything
// is written.
TEST_F(CudaIpcTest, BadWaitEventsChangeNothing) {
  absl::StatusOr<v1::PoolInfo> info =
      client_->CreatePool(PoolRequest("ev_pool", "MXFP8_INDEX", 0, 3, 4, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<CudaIpcMapping> pool = CudaIpcMapping::Open(info->handle());
  ASSERT_TRUE(pool.ok()) << pool.status();
  const int64_t total = info->layout().total_bytes();
  std::mt19937 rng(301);
  const std::vector<int32_t> slots = {0, 4, -1, 11};
  const std::string kv = Bf16Bytes(RandomKv(4, 128, rng));
  for (const std::string& handle :
       {std::string("abc"), std::string(kCudaIpcHandleBytes, '\x5a')}) {
    v1::StoreRequest store =
        StoreRequest("ev_pool", 0, slots, v1::INPUT_DTYPE_BF16);
    store.mutable_kv()->set_inline_data(kv);
    store.set_wait_event_ipc_handle(handle);
    absl::StatusOr<v1::StoreResponse> r = client_->Store(store);
    ASSERT_FALSE(r.ok()) << handle.size() << "-byte handle";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("wait_event_ipc_handle"));
    if (handle.size() == 3) {
      EXPECT_THAT(r.status().message(), HasSubstr("holds 3 bytes"));
    }
    const std::vector<uint8_t> after = ReadAll(*pool, total);
    EXPECT_TRUE(AllZero(after.data(), total)) << "the pool changed";
  }
  // A Load with a bad event leaves its output alone.
  absl::StatusOr<v1::BufferInfo> b = AllocateCudaBuffer(*client_, 4096);
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<CudaIpcMapping> out = CudaIpcMapping::Open(b->handle());
  ASSERT_TRUE(out.ok()) << out.status();
  v1::LoadRequest load;
  load.set_pool("ev_pool");
  const std::vector<int32_t> segments = {1, 0, 3, 0};
  *load.mutable_segments() = SegmentsProto(segments, 3);
  *load.mutable_data() = SliceRef(b->buffer_id(), 0, 3 * 128);
  // MXFP8_INDEX rows: 128 data bytes, one int32 of four UE8M0 scales.
  *load.mutable_scales() = SliceRef(b->buffer_id(), 1024, 3 * 4);
  load.set_wait_event_ipc_handle(std::string(7, '\x01'));
  absl::StatusOr<v1::LoadResponse> r = client_->Load(load);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("wait_event_ipc_handle holds 7 bytes"));
  const std::vector<uint8_t> after = ReadAll(*out, 4096);
  EXPECT_TRUE(AllZero(after.data(), 4096)) << "the output changed";
  ASSERT_OK(client_->DeletePool("ev_pool"));
}

}  // namespace
}  // namespace kvdepot::testing
