// A Backend that forwards every call to another one and records, for
// Store and Load, the tokens, bytes and time spent in ServerMetrics (the
// daemon's "kernel time": wall clock of the backend call; with GPU
// record_event only the launch is timed).
#ifndef KVDEPOT_SERVER_INSTRUMENTED_BACKEND_H_
#define KVDEPOT_SERVER_INSTRUMENTED_BACKEND_H_

#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/metrics.h"

namespace kvdepot {

class InstrumentedBackend final : public Backend {
 public:
  // `metrics` must outlive this backend.
  InstrumentedBackend(std::unique_ptr<Backend> inner, ServerMetrics* metrics)
      : inner_(std::move(inner)), metrics_(metrics) {}

  absl::string_view name() const override { return inner_->name(); }
  absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const override {
    return inner_->ResolveDevice(requested);
  }
  absl::StatusOr<std::unique_ptr<Memory>> Allocate(
      int64_t size, absl::string_view device) override {
    return inner_->Allocate(size, device);
  }
  absl::StatusOr<std::unique_ptr<Memory>> Import(
      const v1::SharedHandle& handle) override {
    return inner_->Import(handle);
  }
  absl::StatusOr<std::unique_ptr<Memory>> ImportFd(UniqueFd fd,
                                                   int64_t size) override {
    return inner_->ImportFd(std::move(fd), size);
  }
  bool legacy_handles() const override { return inner_->legacy_handles(); }
  absl::Status Store(const PoolLayout& layout, const Memory& pool,
                     int64_t layer, const void* kv, InputDtype dtype,
                     absl::Span<const int32_t> slot_mapping) override;
  absl::Status Load(const PoolLayout& layout, const Memory& pool, int64_t layer,
                    absl::Span<const int32_t> segments, int64_t total_k,
                    void* data, void* scales) override;
  absl::Status StoreOrdered(const PoolLayout& layout, const Memory& pool,
                            int64_t layer, const void* kv, InputDtype dtype,
                            absl::Span<const int32_t> slot_mapping,
                            const GpuOrdering& ordering,
                            std::string* recorded_event) override;
  absl::Status LoadOrdered(const PoolLayout& layout, const Memory& pool,
                           int64_t layer, absl::Span<const int32_t> segments,
                           int64_t total_k, void* data, void* scales,
                           const GpuOrdering& ordering,
                           std::string* recorded_event) override;
  absl::Status StoreFused(const PoolLayout& layout, const Memory& pool,
                          int64_t layer, const uint16_t* kv,
                          const FusedParams& params,
                          absl::Span<const int32_t> slot_mapping,
                          uint16_t* cast_back) override;
  absl::Status CopyBytes(void* dst, const void* src, int64_t n) override {
    return inner_->CopyBytes(dst, src, n);
  }
  absl::Status CastBack(const KVCacheFormat& format, const void* kv,
                        InputDtype dtype, int64_t n, void* out,
                        const GpuOrdering& ordering) override {
    return inner_->CastBack(format, kv, dtype, n, out, ordering);
  }
  absl::Status AwaitClientEvent(const Memory& pool,
                                absl::string_view wait_event,
                                absl::Time deadline) override {
    return inner_->AwaitClientEvent(pool, wait_event, deadline);
  }
  // The index operations (no metrics of their own: the RPC counters time
  // them). Every virtual of Backend is forwarded: a default left in place
  // here would silently send the daemon's index calls to the host path.
  absl::Status ConvertTopkOrdered(const Memory& device_memory,
                                  const ConvertTopkCall& call,
                                  const GpuOrdering& ordering,
                                  absl::Time deadline, int64_t* invalid,
                                  std::string* recorded_event) override {
    return inner_->ConvertTopkOrdered(device_memory, call, ordering, deadline,
                                      invalid, recorded_event);
  }
  absl::Status SwaDecodeOrdered(const Memory& device_memory,
                                const SwaDecodeCall& call,
                                const GpuOrdering& ordering,
                                absl::Time deadline,
                                std::string* recorded_event) override {
    return inner_->SwaDecodeOrdered(device_memory, call, ordering, deadline,
                                    recorded_event);
  }
  absl::Status PrefillIndexOrdered(const Memory& device_memory,
                                   const PrefillIndexCall& call,
                                   const GpuOrdering& ordering,
                                   absl::Time deadline, int64_t* invalid,
                                   std::string* recorded_event) override {
    return inner_->PrefillIndexOrdered(device_memory, call, ordering, deadline,
                                       invalid, recorded_event);
  }

 private:
  void CountStore(const PoolLayout& layout,
                  absl::Span<const int32_t> slot_mapping, int64_t us);
  void CountLoad(const PoolLayout& layout, int64_t total_k, int64_t us);

  const std::unique_ptr<Backend> inner_;
  ServerMetrics* const metrics_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_INSTRUMENTED_BACKEND_H_
