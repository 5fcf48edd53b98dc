#include "tests/gpu/gpu_test_util.h"

#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvdepot::testing {

std::string DaemonBinary() {
  if (const char* env = std::getenv("KVDEPOT_BINARY"); env != nullptr) {
    return env;
  }
  if (access("server/kvdepotd", X_OK) == 0) return "server/kvdepotd";
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "kvdepotd";
  std::string path(self, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/') + 1) + "kvdepotd";
}

absl::Status Cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ",
                                          cudaGetErrorString(e)));
}

absl::StatusOr<Stream> Stream::Create() {
  cudaStream_t s = nullptr;
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags"));
  return Stream(s);
}

Stream::~Stream() {
  if (s_ != nullptr) {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }
}

absl::Status Stream::Sync() const {
  return Cuda(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
}

absl::StatusOr<Pinned> Pinned::Create(int64_t bytes) {
  void* p = nullptr;
  RETURN_IF_ERROR(Cuda(cudaMallocHost(&p, static_cast<size_t>(bytes)),
                       absl::StrCat("cudaMallocHost(", bytes, ")")));
  return Pinned(static_cast<uint8_t*>(p), bytes);
}

Pinned::~Pinned() {
  if (p_ != nullptr) (void)cudaFreeHost(p_);
}

absl::Status DelayStream(cudaStream_t stream, absl::Duration delay) {
  static_assert(sizeof(int64_t) <= sizeof(void*));
  auto* ms = new int64_t(absl::ToInt64Milliseconds(delay));
  return Cuda(cudaLaunchHostFunc(
                  stream,
                  [](void* arg) {
                    auto* p = static_cast<int64_t*>(arg);
                    std::this_thread::sleep_for(std::chrono::milliseconds(*p));
                    delete p;
                  },
                  ms),
              "cudaLaunchHostFunc(delay)");
}

absl::StatusOr<v1::BufferInfo> AllocateCudaBuffer(KVCacheClient& client,
                                                  int64_t size) {
  v1::AllocateBufferRequest r;
  r.set_session_id(client.session_id());
  r.set_size(size);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::BufferInfo info;
  const grpc::Status s = client.stub()->AllocateBuffer(&ctx, r, &info);
  if (!s.ok()) return FromGrpcStatus(s);
  return info;
}

v1::DataRef SliceRef(uint64_t id, int64_t offset, int64_t length) {
  v1::DataRef ref;
  v1::BufferSlice* s = ref.mutable_slice();
  s->set_buffer_id(id);
  s->set_offset(offset);
  s->set_length(length);
  return ref;
}

std::string DescribePoolOffset(const PoolLayout& layout, int64_t offset) {
  const int64_t layer = offset / layout.layer_stride;
  const int64_t in_layer = offset % layout.layer_stride;
  const int64_t block = in_layer / layout.block_stride;
  const int64_t in_block = in_layer % layout.block_stride;
  std::string where = absl::StrCat("byte ", offset, " (layer ", layer);
  if (in_layer >= layout.layer_bytes) {
    return absl::StrCat(where, ", layer padding)");
  }
  const KVCacheFormat& f = layout.format;
  if (f.token_interleaved) {
    const int64_t t = in_block / f.bytes_per_token();
    if (t >= layout.block_size) {
      return absl::StrCat(where, ", block ", block, " padding)");
    }
    return absl::StrCat(where, ", block ", block, ", token ", t, ", byte ",
                        in_block % f.bytes_per_token(), " of the record)");
  }
  const int64_t data_part = layout.block_size * f.data_bytes();
  if (in_block < data_part) {
    return absl::StrCat(where, ", block ", block, ", token ",
                        in_block / f.data_bytes(), ", data byte ",
                        in_block % f.data_bytes(), ")");
  }
  const int64_t s = in_block - data_part;
  if (s >= layout.block_size * f.sf_bytes()) {
    return absl::StrCat(where, ", block ", block, " padding)");
  }
  return absl::StrCat(where, ", block ", block, ", token ", s / f.sf_bytes(),
                      ", scale byte ", s % f.sf_bytes(), ")");
}

}  // namespace kvdepot::testing
