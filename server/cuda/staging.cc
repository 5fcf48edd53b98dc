#include "server/cuda/staging.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_mappings.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "server/backend/inline_call.h"

namespace kvdepot {
namespace {

constexpr int64_t kMinCapacity = int64_t{64} << 10;

}  // namespace

absl::StatusOr<std::unique_ptr<Staging>> Staging::Create(int device) {
  return std::unique_ptr<Staging>(new Staging(device));
}

Staging::~Staging() {
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device_);
  if (used_ != nullptr) (void)cudaEventSynchronize(used_.get());
  if (host_ != nullptr) (void)cudaFreeHost(host_);
  if (dev_ != nullptr) (void)cudaFree(dev_);
}

absl::Status Staging::WaitUsed() {
  if (used_ == nullptr) {
    return absl::InternalError("waiting for a staging buffer never marked");
  }
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(used_.get()),
                       "waiting for the request's kernels");
  return absl::OkStatus();
}

bool Staging::Ready() const {
  if (used_ == nullptr) return true;
  const cudaError_t e = cudaEventQuery(used_.get());
  // Not an error: not this thread's last error either.
  if (e == cudaErrorNotReady) (void)cudaGetLastError();
  return e == cudaSuccess;
}

absl::Status Staging::Prepare(int64_t bytes) {
  if (used_ != nullptr) {
    if (!MayWait() && !Ready()) {
      return DeferInlineCall("a staging buffer's last call is still running");
    }
    RETURN_IF_CUDA_ERROR(cudaEventSynchronize(used_.get()),
                         "waiting for the previous use of a staging buffer");
    used_.reset();  // recycled once no fence holds it either
  }
  if (bytes <= capacity_) return absl::OkStatus();
  if (capacity_ > 0 && !MayWait()) {
    return DeferInlineCall("a staging buffer must grow (cudaFree waits)");
  }
  const int64_t want =
      StagingRound(std::max({bytes, 2 * capacity_, kMinCapacity}));
  if (host_ != nullptr) (void)cudaFreeHost(host_);
  if (dev_ != nullptr) (void)cudaFree(dev_);
  host_ = nullptr;
  dev_ = nullptr;
  capacity_ = 0;
  void* h = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaHostAlloc(&h, static_cast<size_t>(want), cudaHostAllocDefault),
      absl::StrCat("cudaHostAlloc(", want, " bytes) for staging"));
  host_ = static_cast<uint8_t*>(h);
  void* d = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaMalloc(&d, static_cast<size_t>(want)),
      absl::StrCat("cudaMalloc(", want, " bytes) for staging"));
  dev_ = static_cast<uint8_t*>(d);
  capacity_ = want;
  return absl::OkStatus();
}

StagingPool::Lease::~Lease() {
  if (staging_ != nullptr) pool_->Return(std::move(staging_));
}

absl::StatusOr<StagingPool::Lease> StagingPool::Acquire(int device,
                                                        int64_t bytes) {
  std::unique_ptr<Staging> staging;
  {
    absl::MutexLock lock(&mu_);
    Device& d = devices_[device];
    const bool fits = !d.free.empty() && d.free.front()->Ready() &&
                      d.free.front()->capacity() >= bytes;
    const bool at_bound =
        d.created >= max_per_device_ || d.bytes >= max_bytes_per_device_;
    if (fits || (!d.free.empty() && at_bound)) {
      if (!fits && !MayWait()) {
        return DeferInlineCall(absl::StrCat(
            "all ", d.created, " staging buffers of cuda:", device, " (",
            d.bytes, " bytes) are in use by calls still running"));
      }
      staging = std::move(d.free.front());
      d.free.pop_front();
    } else {
      ++d.created;  // below the bound, or every Staging held by a thread
    }
  }
  if (staging == nullptr) {
    absl::StatusOr<std::unique_ptr<Staging>> created = Staging::Create(device);
    if (!created.ok()) {
      absl::MutexLock lock(&mu_);
      --devices_[device].created;
      return created.status();
    }
    staging = *std::move(created);
  }
  // On failure the Staging goes back to the pool (its event is valid).
  Lease lease(this, std::move(staging));
  const int64_t before = lease->capacity();
  const absl::Status prepared = lease->Prepare(bytes);
  if (lease->capacity() != before) {  // grown (or freed by a failed grow)
    absl::MutexLock lock(&mu_);
    devices_[device].bytes += lease->capacity() - before;
  }
  RETURN_IF_ERROR(prepared);
  return lease;
}

void StagingPool::Return(std::unique_ptr<Staging> staging) {
  absl::MutexLock lock(&mu_);
  devices_[staging->device()].free.push_back(std::move(staging));
}

}  // namespace kvdepot
