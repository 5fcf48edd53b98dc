// libkvdepot_worker: the C ABI of kvdepot_worker.h over the doorbell's
// VMM mapping, the driver's stream memory operations and a watchdog thread.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cuda/driver_api.h"
#include "common/cuda/vmm.h"
#include "proto/step_doorbell.h"
#include "worker/kvdepot_worker.h"
#include "worker/worker_kernels.h"

namespace db = ::kvdepot::doorbell;

namespace {

thread_local std::string last_error;

int Fail(int code, const std::string& message) {
  last_error = message;
  return code;
}

int FailCuda(const absl::Status& s) { return Fail(KVD_ERR_CUDA, s.ToString()); }

}  // namespace

struct kvd_mapping {
  kvdepot::gpu::VmmAllocation allocation;
};

struct kvd_worker {
  kvdepot::gpu::VmmAllocation doorbell;
  const kvdepot::gpu::DriverApi* api = nullptr;
  int device = 0;
  int num_layers = 0;
  int64_t watchdog_ms = 0;
  cudaStream_t control = nullptr;  // the watchdog's reads and releases
  uint64_t* pinned = nullptr;      // header readback
  absl::Mutex mu;                  // control stream and pinned
  std::atomic<bool> released{false};
  std::atomic<bool> stopping{false};
  std::thread watchdog;

  uint64_t* words() const {
    return reinterpret_cast<uint64_t*>(doorbell.device_ptr());
  }
  CUdeviceptr Addr(int64_t word) const {
    return doorbell.device_ptr() + static_cast<CUdeviceptr>(8 * word);
  }
  int num_phases() const { return static_cast<int>(db::NumPhases(num_layers)); }

  // The header words into out[0..7]; waits for the control stream only.
  int ReadHeader(uint64_t* out) {
    absl::MutexLock lock(&mu);
    cudaError_t e = cudaMemcpyAsync(pinned, words(), db::kLineBytes,
                                    cudaMemcpyDeviceToHost, control);
    if (e == cudaSuccess) e = cudaStreamSynchronize(control);
    if (e != cudaSuccess) {
      return Fail(KVD_ERR_CUDA, absl::StrCat("reading the doorbell: ",
                                             cudaGetErrorString(e)));
    }
    std::memcpy(out, pinned, db::kLineBytes);
    return KVD_OK;
  }

  // Memory writes only: cancel, every flag, every done.
  void Release() {
    absl::MutexLock lock(&mu);
    CUstream s = reinterpret_cast<CUstream>(control);
    api->cuStreamWriteValue64(s, Addr(db::kCancelWord), 1, 0);
    for (int p = 0; p < num_phases(); ++p) {
      api->cuStreamWriteValue64(s, Addr(db::FlagWord(p)), 1, 0);
      api->cuStreamWriteValue64(s, Addr(db::DoneWord(p)), 1, 0);
    }
  }

  void WatchLoop() {
    cudaSetDevice(device);
    uint64_t last_counter = 0, last_done = 0;
    absl::Time stuck_since = absl::InfiniteFuture();
    uint64_t header[db::kWordsPerLine];
    while (!stopping.load()) {
      absl::SleepFor(absl::Milliseconds(5));
      if (released.load()) continue;
      if (ReadHeader(header) != KVD_OK) continue;
      const uint64_t counter = header[db::kStepCounter];
      const uint64_t done = header[db::kDaemonDone];
      const absl::Time now = absl::Now();
      if (counter <= done) {
        stuck_since = absl::InfiniteFuture();
      } else if (counter != last_counter || done != last_done ||
                 stuck_since == absl::InfiniteFuture()) {
        stuck_since = now;
      } else if (now - stuck_since > absl::Milliseconds(watchdog_ms)) {
        released.store(true);
        Release();
      }
      last_counter = counter;
      last_done = done;
    }
  }
};

namespace {

int Check(kvd_worker* w, void* stream, int phase, bool phase_needed) {
  if (w == nullptr) return Fail(KVD_ERR_INVALID, "worker is NULL");
  if (stream == nullptr) {
    return Fail(KVD_ERR_INVALID,
                "stream is NULL (the legacy default stream cannot be "
                "captured; pass the worker's own stream)");
  }
  if (phase_needed && (phase < 0 || phase >= w->num_phases())) {
    return Fail(KVD_ERR_INVALID,
                absl::StrCat("phase ", phase, " is outside [0, ",
                             w->num_phases(), ")"));
  }
  if (w->released.load()) {
    return Fail(KVD_ERR_RELEASED,
                "the worker's watchdog released this doorbell (the daemon "
                "did not finish a begun step in time); re-register");
  }
  return KVD_OK;
}

}  // namespace

extern "C" {

int kvd_worker_open(int fd, int64_t fd_size, int device, int num_layers,
                    int64_t watchdog_ms, kvd_worker** out) {
  if (out == nullptr) return Fail(KVD_ERR_INVALID, "out is NULL");
  *out = nullptr;
  const std::string env = db::CheckStepEnvironment();
  if (!env.empty()) return Fail(KVD_ERR_ENVIRONMENT, env);
  if (num_layers < 1 || num_layers > db::kMaxLayers) {
    return Fail(KVD_ERR_INVALID,
                absl::StrCat("num_layers = ", num_layers, " is outside [1, ",
                             db::kMaxLayers, "]"));
  }
  if (fd_size < db::RegionBytes(num_layers)) {
    return Fail(KVD_ERR_INVALID,
                absl::StrCat("fd_size = ", fd_size, " is below the ",
                             db::RegionBytes(num_layers), " bytes ", num_layers,
                             " layers need"));
  }
  if (watchdog_ms < 0) return Fail(KVD_ERR_INVALID, "watchdog_ms < 0");
  absl::StatusOr<const kvdepot::gpu::DriverApi*> api = kvdepot::gpu::Driver();
  if (!api.ok()) return FailCuda(api.status());
  if (cudaSetDevice(device) != cudaSuccess) {
    return Fail(KVD_ERR_INVALID, absl::StrCat("device ", device, " unusable"));
  }
  auto w = std::make_unique<kvd_worker>();
  absl::StatusOr<kvdepot::gpu::VmmAllocation> m =
      kvdepot::gpu::VmmAllocation::Import(fd, fd_size, device);
  if (!m.ok()) return FailCuda(m.status());
  w->doorbell = *std::move(m);
  w->api = *api;
  w->device = device;
  w->num_layers = num_layers;
  w->watchdog_ms = watchdog_ms == 0 ? 10000 : watchdog_ms;
  cudaError_t e = cudaStreamCreateWithFlags(&w->control, cudaStreamNonBlocking);
  if (e == cudaSuccess) {
    e = cudaHostAlloc(reinterpret_cast<void**>(&w->pinned), db::kLineBytes,
                      cudaHostAllocDefault);
  }
  if (e != cudaSuccess) {
    if (w->control != nullptr) cudaStreamDestroy(w->control);
    return Fail(KVD_ERR_CUDA, absl::StrCat("creating the control stream: ",
                                           cudaGetErrorString(e)));
  }
  uint64_t header[db::kWordsPerLine];
  if (w->ReadHeader(header) != KVD_OK) {
    cudaStreamDestroy(w->control);
    cudaFreeHost(w->pinned);
    return KVD_ERR_CUDA;
  }
  if (header[db::kMagicWord] != db::kDoorbellMagic) {
    cudaStreamDestroy(w->control);
    cudaFreeHost(w->pinned);
    return Fail(KVD_ERR_INVALID,
                "the buffer is not an initialized doorbell (register it "
                "with the daemon first)");
  }
  kvd_worker* raw = w.get();
  w->watchdog = std::thread([raw] { raw->WatchLoop(); });
  *out = w.release();
  return KVD_OK;
}

void kvd_worker_close(kvd_worker* w) {
  if (w == nullptr) return;
  w->stopping.store(true);
  if (w->watchdog.joinable()) w->watchdog.join();
  cudaStreamSynchronize(w->control);
  cudaStreamDestroy(w->control);
  cudaFreeHost(w->pinned);
  delete w;
}

int kvd_step_begin(kvd_worker* w, void* stream) {
  if (int rc = Check(w, stream, 0, false); rc != KVD_OK) return rc;
  const int e = kvdepot::worker::LaunchStepBegin(w->words(), stream);
  if (e != 0) {
    return Fail(KVD_ERR_CUDA,
                absl::StrCat("launching step_begin: ",
                             cudaGetErrorString(static_cast<cudaError_t>(e))));
  }
  return kvd_mark(w, stream, KVD_BEGIN);
}

int kvd_mark(kvd_worker* w, void* stream, int phase) {
  if (int rc = Check(w, stream, phase, true); rc != KVD_OK) return rc;
  const CUresult r = w->api->cuStreamWriteValue64(
      static_cast<CUstream>(stream), w->Addr(db::FlagWord(phase)), 1, 0);
  if (r != CUDA_SUCCESS) {
    return FailCuda(kvdepot::gpu::DriverStatus(r, "cuStreamWriteValue64"));
  }
  return KVD_OK;
}

int kvd_wait(kvd_worker* w, void* stream, int phase) {
  if (int rc = Check(w, stream, phase, true); rc != KVD_OK) return rc;
  CUstream s = static_cast<CUstream>(stream);
  CUresult r = w->api->cuStreamWaitValue64(s, w->Addr(db::DoneWord(phase)), 1,
                                           CU_STREAM_WAIT_VALUE_EQ);
  if (r == CUDA_SUCCESS) {
    r = w->api->cuStreamWriteValue64(s, w->Addr(db::DoneWord(phase)), 0, 0);
  }
  if (r != CUDA_SUCCESS) {
    return FailCuda(kvdepot::gpu::DriverStatus(r, "waiting for done"));
  }
  return KVD_OK;
}

int kvd_status(kvd_worker* w, uint64_t* status_bits, uint64_t* out_of_range,
               uint64_t* step_counter, uint64_t* daemon_done) {
  if (w == nullptr) return Fail(KVD_ERR_INVALID, "worker is NULL");
  uint64_t header[db::kWordsPerLine];
  if (int rc = w->ReadHeader(header); rc != KVD_OK) return rc;
  if (status_bits != nullptr) {
    *status_bits = header[db::kStatusWord] |
                   (w->released.load() ? db::kStatusWorkerWatchdog : 0);
  }
  if (out_of_range != nullptr) *out_of_range = header[db::kOutOfRange];
  if (step_counter != nullptr) *step_counter = header[db::kStepCounter];
  if (daemon_done != nullptr) *daemon_done = header[db::kDaemonDone];
  return KVD_OK;
}

void* kvd_doorbell_ptr(kvd_worker* w) {
  return w == nullptr ? nullptr : w->words();
}

int kvd_map_vmm_fd(int fd, int64_t size, int device, void** ptr,
                   kvd_mapping** out) {
  if (ptr == nullptr || out == nullptr) {
    return Fail(KVD_ERR_INVALID, "ptr or out is NULL");
  }
  absl::StatusOr<kvdepot::gpu::VmmAllocation> m =
      kvdepot::gpu::VmmAllocation::Import(fd, size, device);
  if (!m.ok()) {
    return Fail(m.status().code() == absl::StatusCode::kInvalidArgument
                    ? KVD_ERR_INVALID
                    : KVD_ERR_CUDA,
                m.status().ToString());
  }
  auto* mapping = new (std::nothrow) kvd_mapping{*std::move(m)};
  if (mapping == nullptr) return Fail(KVD_ERR_CUDA, "out of host memory");
  *ptr = mapping->allocation.data();
  *out = mapping;
  return KVD_OK;
}

void kvd_unmap(kvd_mapping* m) {
  if (m == nullptr) return;
  // cuMemUnmap does not wait for the GPU: a kernel of this process still
  // using the range faults (CUDA error 700, sticky for the whole context).
  // Seen with kvdepot.torch: a clone of a pool view whose last tensor was
  // collected while the clone ran. So this process's work on the device
  // finishes first; unmapping is rare (a buffer's or a pool's last view).
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess &&
      cudaSetDevice(m->allocation.device()) == cudaSuccess) {
    (void)cudaDeviceSynchronize();  // a sticky error: nothing runs anymore
    (void)cudaSetDevice(previous);
  }
  delete m;
}

const char* kvd_last_error(void) { return last_error.c_str(); }

}  // extern "C"
