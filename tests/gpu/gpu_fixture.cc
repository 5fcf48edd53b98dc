#include "tests/gpu/gpu_fixture.h"

#include <cuda_runtime_api.h>
#include <signal.h>

#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

class DaemonEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) return;  // GpuTest::SetUp reports it
    const std::string binary = DaemonBinary();
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
        {"--backend=cuda", "--legacy_cuda_ipc", "--log_level=warn"}, binary);
    if (!d.ok()) {
      ADD_FAILURE() << "starting " << binary
                    << " --backend=cuda (set KVDEPOT_BINARY to override): "
                    << d.status();
      return;
    }
    daemon_ = *std::move(d);
    socket_ = daemon_->socket_path();
  }

  void TearDown() override {
    if (daemon_ == nullptr) return;
    // A graceful drain frees every pool, buffer and import on the GPU.
    absl::StatusOr<int> code = daemon_->Signal(SIGTERM, absl::Seconds(60));
    EXPECT_TRUE(code.ok()) << "stopping the daemon: " << code.status();
    if (code.ok()) {
      EXPECT_EQ(*code, 0) << "the daemon's exit code";
    }
    daemon_.reset();
  }

  const std::string& socket() const { return socket_; }

 private:
  std::unique_ptr<DaemonProcess> daemon_;
  std::string socket_;
};

DaemonEnvironment* const environment = static_cast<DaemonEnvironment*>(
    ::testing::AddGlobalTestEnvironment(new DaemonEnvironment));

}  // namespace

const std::string& DaemonSocket() { return environment->socket(); }

void GpuTest::SetUp() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  ASSERT_TRUE(e == cudaSuccess && count > 0)
      << "this test needs a CUDA device: cudaGetDeviceCount = " << count << " ("
      << cudaGetErrorString(e) << ")";
  device_count_ = count;
  ASSERT_FALSE(DaemonSocket().empty()) << "the daemon did not start";
  client_ = ConnectOrDie(DaemonSocket());
  ASSERT_NE(client_, nullptr);
  absl::StatusOr<Stream> s = Stream::Create();
  ASSERT_TRUE(s.ok()) << s.status();
  stream_.emplace(*std::move(s));
}

}  // namespace kvdepot::testing
