#include "server/cpu/cpu_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/shm.h"
#include "common/status_macros.h"
#include "kernels/reference/reference.h"

namespace kvdepot {
namespace {

class ShmMemory final : public Memory {
 public:
  explicit ShmMemory(ShmRegion region) : region_(std::move(region)) {}
  uint8_t* data() const override { return region_.data(); }
  int64_t size() const override { return region_.size(); }
  void FillHandle(v1::SharedHandle* handle) const override {
    handle->set_shm_name(region_.name());
    handle->set_size(region_.size());
    handle->set_offset(0);
    handle->set_device_ordinal(-1);
  }

 private:
  ShmRegion region_;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options) : options_(options) {}

  absl::string_view name() const override { return "cpu"; }

  absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const override {
    if (requested.empty() || requested == "cpu") return std::string("cpu");
    return absl::InvalidArgumentError(absl::StrCat(
        "device = \"", requested, "\": the cpu backend has only \"cpu\""));
  }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(
      int64_t size, absl::string_view /*device*/) override {
    absl::StatusOr<ShmRegion> region =
        ShmRegion::Create(size, options_.shm_mode);
    if (!region.ok()) return region.status();
    return std::make_unique<ShmMemory>(*std::move(region));
  }

  absl::StatusOr<std::unique_ptr<Memory>> Import(
      const v1::SharedHandle& handle) override {
    if (handle.kind_case() != v1::SharedHandle::kShmName) {
      return absl::InvalidArgumentError(
          "handle: the cpu backend imports shm_name handles only");
    }
    RETURN_IF_ERROR(ValidateShmName("handle.shm_name", handle.shm_name()));
    if (handle.size() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("handle.size = ", handle.size(), " must be > 0"));
    }
    if (handle.offset() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "handle.offset = ", handle.offset(), " must be 0 for shm imports"));
    }
    absl::StatusOr<ShmRegion> region =
        ShmRegion::Open(handle.shm_name(), handle.size());
    if (!region.ok()) return region.status();
    return std::make_unique<ShmMemory>(*std::move(region));
  }

  absl::Status Store(const PoolLayout& layout, const Memory& pool,
                     int64_t layer, const void* kv, InputDtype dtype,
                     absl::Span<const int32_t> slot_mapping) override {
    return kvdepot::Store(layout, pool.data() + layout.layer_offset(layer), kv,
                          dtype, slot_mapping);
  }

  absl::Status Load(const PoolLayout& layout, const Memory& pool, int64_t layer,
                    absl::Span<const int32_t> segments, int64_t total_k,
                    void* data, void* scales) override {
    return LoadSegments(layout, pool.data() + layout.layer_offset(layer),
                        segments, total_k, data, scales);
  }

 private:
  const BackendOptions options_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace kvdepot
