// The CUDA backend's default memory, seen from a client in another process:
// kvdepotd --backend=cuda (no --legacy_cuda_ipc) in a child process hands
// pools and buffers over as CUDA VMM descriptors on the companion socket
// and imports the client's VMM descriptors; anything else handed to
// import_buffer (a memfd, a pipe, a wrong size) is INVALID_ARGUMENT and
// leaves no descriptor behind in the daemon.
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/cuda/vmm.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (false)

// One daemon for the whole binary, without the legacy flag.
class VmmDaemon : public ::testing::Environment {
 public:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
        {"--backend=cuda", "--log_level=warn"}, DaemonBinary());
    if (!d.ok()) {
      ADD_FAILURE() << "starting kvdepotd --backend=cuda: " << d.status();
      return;
    }
    daemon_ = *std::move(d);
  }
  void TearDown() override {
    if (daemon_ == nullptr) return;
    absl::StatusOr<int> code = daemon_->Signal(SIGTERM, absl::Seconds(60));
    EXPECT_TRUE(code.ok()) << "stopping the daemon: " << code.status();
    if (code.ok()) {
      EXPECT_EQ(*code, 0) << "the daemon's exit code";
    }
    daemon_.reset();
  }
  DaemonProcess* daemon() const { return daemon_.get(); }

 private:
  std::unique_ptr<DaemonProcess> daemon_;
};

VmmDaemon* const env =
    static_cast<VmmDaemon*>(::testing::AddGlobalTestEnvironment(new VmmDaemon));

// Open descriptors of `pid` (-1 when /proc cannot tell).
int CountFds(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

class CudaVmmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    ASSERT_TRUE(e == cudaSuccess && count > 0)
        << "this test needs a CUDA device (" << cudaGetErrorString(e) << ")";
    ASSERT_NE(env->daemon(), nullptr) << "the daemon did not start";
    ASSERT_OK(Cuda(cudaSetDevice(0), "cudaSetDevice(0)"));
    client_ = ConnectOrDie(env->daemon()->socket_path());
    ASSERT_NE(client_, nullptr);
    ASSERT_NE(client_->companion(), nullptr);
  }

  // map_pool: the pool's descriptor imported and mapped on its device.
  absl::StatusOr<gpu::VmmAllocation> MapPool(const std::string& name,
                                             v1::CompanionReply* reply) {
    v1::CompanionRequest req;
    req.mutable_map_pool()->set_name(name);
    UniqueFd fd;
    absl::StatusOr<v1::CompanionReply> r =
        client_->companion()->Call(req, -1, &fd);
    if (!r.ok()) return r.status();
    *reply = *r;
    if (!fd.valid()) return absl::InternalError("map_pool sent no descriptor");
    return gpu::VmmAllocation::Import(fd.get(), r->fd_size(), 0);
  }

  // allocate_buffer: a daemon buffer, imported and mapped.
  absl::StatusOr<gpu::VmmAllocation> AllocateBuffer(int64_t size,
                                                    v1::CompanionReply* reply) {
    v1::CompanionRequest req;
    req.mutable_allocate_buffer()->set_size(size);
    UniqueFd fd;
    absl::StatusOr<v1::CompanionReply> r =
        client_->companion()->Call(req, -1, &fd);
    if (!r.ok()) return r.status();
    *reply = *r;
    if (!fd.valid()) {
      return absl::InternalError("allocate_buffer sent no descriptor");
    }
    return gpu::VmmAllocation::Import(fd.get(), r->fd_size(), 0);
  }

  // import_buffer with `fd` attached, claiming `size` bytes.
  absl::StatusOr<v1::CompanionReply> Import(int fd, int64_t size) {
    v1::CompanionRequest req;
    req.mutable_import_buffer()->set_size(size);
    return client_->companion()->Call(req, fd, nullptr);
  }

  std::unique_ptr<KVCacheClient> client_;
};

std::vector<uint8_t> ReadDevice(const uint8_t* p, int64_t n) {
  std::vector<uint8_t> host(static_cast<size_t>(n));
  const absl::Status s = Cuda(cudaMemcpy(host.data(), p, static_cast<size_t>(n),
                                         cudaMemcpyDeviceToHost),
                              "reading device memory");
  EXPECT_TRUE(s.ok()) << s;
  return host;
}

TEST_F(CudaVmmTest, StoreFromAnImportedBufferThenLoadIntoADaemonBuffer) {
  const std::string name = "vmm_rt";
  absl::StatusOr<v1::PoolInfo> info =
      client_->CreatePool(PoolRequest(name, "V41", 0, 133, 40, 2));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->has_handle()) << "no bearer handle without the flag";
  LocalPool ref = LocalPool::FromInfo(*info);
  const PoolLayout& layout = ref.layout;
  const KVCacheFormat& f = layout.format;
  const int64_t layer = 1;

  v1::CompanionReply mapped;
  absl::StatusOr<gpu::VmmAllocation> pool = MapPool(name, &mapped);
  ASSERT_TRUE(pool.ok()) << "mapping the pool: " << pool.status();
  EXPECT_EQ(mapped.fd_device(), "cuda:0");
  ASSERT_GE(mapped.fd_size(), layout.total_bytes);
  absl::StatusOr<int64_t> g = gpu::VmmAllocation::Granularity(0);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(mapped.fd_size() % *g, 0);
  ASSERT_TRUE(AllZero(ReadDevice(pool->data(), layout.total_bytes).data(),
                      layout.total_bytes))
      << "a new pool must be zero-filled";

  // The client's own VMM buffer holding the K/V, imported by the daemon.
  std::mt19937 rng(1201);
  const int64_t n = 300;
  const std::vector<float> kv = RandomKv(n, f.elements(), rng);
  const std::string kv_bf16 = Bf16Bytes(kv);
  const int64_t kv_bytes = static_cast<int64_t>(kv_bf16.size());
  std::vector<int32_t> slots(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    slots[static_cast<size_t>(i)] =
        i % 7 == 3 ? -1 : static_cast<int32_t>((i * 37) % layout.num_slots());
  }
  absl::StatusOr<gpu::VmmAllocation> mine =
      gpu::VmmAllocation::Create(0, kv_bytes);
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_OK(Cuda(cudaMemcpy(mine->data(), kv_bf16.data(), kv_bf16.size(),
                            cudaMemcpyHostToDevice),
                 "writing the input"));
  uint64_t input_id = 0;
  {
    absl::StatusOr<UniqueFd> fd = mine->ExportFd();
    ASSERT_TRUE(fd.ok()) << fd.status();
    absl::StatusOr<v1::CompanionReply> r = Import(fd->get(), mine->size());
    ASSERT_TRUE(r.ok()) << "import_buffer: " << r.status();
    EXPECT_EQ(r->buffer().size(), mine->size());
    input_id = r->buffer().buffer_id();
  }
  v1::StoreRequest store =
      StoreRequest(name, layer, slots, v1::INPUT_DTYPE_BF16);
  *store.mutable_kv() = SliceRef(input_id, 0, kv_bytes);
  absl::StatusOr<v1::StoreResponse> stored = client_->Store(store);
  ASSERT_TRUE(stored.ok()) << "Store: " << stored.status();
  ASSERT_OK(kvdepot::Store(layout, ref.layer(layer), kv_bf16.data(),
                           InputDtype::kBF16, slots));
  const std::vector<uint8_t> got = ReadDevice(pool->data(), layout.total_bytes);
  EXPECT_EQ(
      CompareBytes(ref.bytes.data(), got.data(), layout.total_bytes,
                   [&](int64_t o) { return DescribePoolOffset(layout, o); }),
      "")
      << "the pool through the client's own mapping after Store";

  // Load whole blocks into a daemon-allocated buffer mapped by descriptor.
  std::vector<int32_t> segments;
  int64_t total_k = 0;
  for (int32_t b = 0; b < 6; ++b) {
    segments.insert(segments.end(), {b == 4 ? -1 : b * 5, 0,
                                     static_cast<int32_t>(layout.block_size),
                                     static_cast<int32_t>(total_k)});
    total_k += layout.block_size;
  }
  const int64_t data_bytes = total_k * LoadDataRowBytes(f);
  const int64_t scale_bytes = f.do_cast ? 0 : total_k * LoadScaleRowBytes(f);
  v1::CompanionReply out_reply;
  absl::StatusOr<gpu::VmmAllocation> out =
      AllocateBuffer(data_bytes + scale_bytes, &out_reply);
  ASSERT_TRUE(out.ok()) << "allocate_buffer: " << out.status();
  EXPECT_EQ(out_reply.fd_device(), "cuda:0");
  std::vector<uint8_t> want(static_cast<size_t>(data_bytes + scale_bytes), 0);
  ASSERT_OK(kvdepot::LoadSegments(
      layout, ref.layer(layer), segments, total_k, want.data(),
      f.do_cast ? nullptr : want.data() + data_bytes));
  v1::LoadRequest load;
  load.set_pool(name);
  load.set_layer(layer);
  *load.mutable_segments() = SegmentsProto(segments, total_k);
  const uint64_t out_id = out_reply.buffer().buffer_id();
  *load.mutable_data() = SliceRef(out_id, 0, data_bytes);
  if (!f.do_cast)
    *load.mutable_scales() = SliceRef(out_id, data_bytes, scale_bytes);
  absl::StatusOr<v1::LoadResponse> loaded = client_->Load(load);
  ASSERT_TRUE(loaded.ok()) << "Load: " << loaded.status();
  const std::vector<uint8_t> got_out =
      ReadDevice(out->data(), data_bytes + scale_bytes);
  EXPECT_EQ(CompareBytes(want.data(), got_out.data(), data_bytes + scale_bytes,
                         [](int64_t o) { return "byte " + std::to_string(o); }),
            "")
      << "the Load output through the client's mapping of the buffer";

  // Release the daemon's mappings before ours (either order is legal).
  client_.reset();
  ASSERT_OK(ConnectOrDie(env->daemon()->socket_path())->DeletePool(name));
}

TEST_F(CudaVmmTest, DescriptorsThatAreNotVmmExportsAreRefused) {
  const pid_t daemon = env->daemon()->pid();
  absl::StatusOr<int64_t> g = gpu::VmmAllocation::Granularity(0);
  ASSERT_TRUE(g.ok()) << g.status();
  // Warm up: one good import, so lazily opened driver descriptors exist.
  absl::StatusOr<gpu::VmmAllocation> good = gpu::VmmAllocation::Create(0, *g);
  ASSERT_TRUE(good.ok()) << good.status();
  {
    absl::StatusOr<UniqueFd> fd = good->ExportFd();
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_TRUE(Import(fd->get(), *g).ok());
  }
  const int fds_before = CountFds(daemon);
  ASSERT_GT(fds_before, 0);

  auto expect_refused = [&](int fd, int64_t size, const std::string& what) {
    absl::StatusOr<v1::CompanionReply> r = Import(fd, size);
    ASSERT_FALSE(r.ok()) << what << " was accepted";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << what << ": " << r.status();
  };
  for (int round = 0; round < 3; ++round) {
    UniqueFd memfd(memfd_create("not_vmm", MFD_CLOEXEC));
    ASSERT_TRUE(memfd.valid());
    ASSERT_EQ(ftruncate(memfd.get(), *g), 0);
    expect_refused(memfd.get(), *g, "a memfd");
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    UniqueFd r(p[0]), w(p[1]);
    expect_refused(r.get(), *g, "a pipe");
    absl::StatusOr<UniqueFd> fd = good->ExportFd();
    ASSERT_TRUE(fd.ok()) << fd.status();
    expect_refused(fd->get(), 2 * *g, "a VMM export claiming twice its size");
    expect_refused(fd->get(), *g - 4096, "a size off the granularity");
  }
  EXPECT_EQ(CountFds(daemon), fds_before)
      << "refused imports left descriptors open in the daemon";

  // Legacy handles are refused without the flag.
  v1::ImportBufferRequest legacy;
  legacy.mutable_handle()->set_cuda_ipc_handle(std::string(64, '\1'));
  legacy.mutable_handle()->set_size(*g);
  absl::StatusOr<v1::BufferInfo> b = client_->ImportBuffer(legacy);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition)
      << b.status();
  EXPECT_THAT(b.status().message(), HasSubstr("--legacy_cuda_ipc"));
}

}  // namespace
}  // namespace kvdepot::testing
