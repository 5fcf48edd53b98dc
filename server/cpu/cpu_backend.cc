#include "server/cpu/cpu_backend.h"

#include <sys/types.h>

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/memfd.h"
#include "common/status_macros.h"
#include "kernels/reference/fused.h"
#include "kernels/reference/reference.h"
#include "server/descriptors.h"

namespace kvdepot {
namespace {

// Identities (st_dev, st_ino) of memfds: the ones this backend created (an
// import of one of them, a client handing a pool back as its "own" buffer,
// is refused) and the ones it imported (an import of the same memfd again,
// while the first is alive, is refused: one client memfd is one buffer).
class MemfdIds {
 public:
  void Add(dev_t dev, ino_t ino) {
    absl::MutexLock lock(&mu_);
    ids_.insert({dev, ino});
  }
  // False when the identity is there already.
  bool TryAdd(dev_t dev, ino_t ino) {
    absl::MutexLock lock(&mu_);
    return ids_.insert({dev, ino}).second;
  }
  void Remove(dev_t dev, ino_t ino) {
    absl::MutexLock lock(&mu_);
    ids_.erase({dev, ino});
  }
  bool Contains(dev_t dev, ino_t ino) const {
    absl::MutexLock lock(&mu_);
    return ids_.contains({dev, ino});
  }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_set<std::pair<dev_t, ino_t>> ids_ ABSL_GUARDED_BY(mu_);
};

// A memfd region whose identity is in `ids` (added by the creator) until
// the region is freed; `descriptor` admits its descriptor.
class MemfdMemory final : public Memory {
 public:
  MemfdMemory(MemfdRegion region, std::shared_ptr<MemfdIds> ids,
              DescriptorLease descriptor)
      : region_(std::move(region)),
        ids_(std::move(ids)),
        descriptor_(std::move(descriptor)) {}
  ~MemfdMemory() override { ids_->Remove(region_.dev(), region_.ino()); }
  uint8_t* data() const override { return region_.data(); }
  int64_t size() const override { return region_.size(); }
  absl::StatusOr<UniqueFd> ExportFd() const override { return region_.Dup(); }

 private:
  MemfdRegion region_;
  std::shared_ptr<MemfdIds> ids_;
  DescriptorLease descriptor_;  // released after the region closes
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(std::shared_ptr<DescriptorBudget> descriptors)
      : descriptors_(std::move(descriptors)),
        own_(std::make_shared<MemfdIds>()),
        imported_(std::make_shared<MemfdIds>()) {}

  absl::string_view name() const override { return "cpu"; }

  absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const override {
    if (requested.empty() || requested == "cpu") return std::string("cpu");
    return absl::InvalidArgumentError(absl::StrCat(
        "device = \"", requested, "\": the cpu backend has only \"cpu\""));
  }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(
      int64_t size, absl::string_view /*device*/) override {
    ASSIGN_OR_RETURN(DescriptorLease descriptor, Admit("descriptors"));
    ASSIGN_OR_RETURN(MemfdRegion region, MemfdRegion::Create("kvdepot", size));
    own_->Add(region.dev(), region.ino());
    return std::make_unique<MemfdMemory>(std::move(region), own_,
                                         std::move(descriptor));
  }

  absl::StatusOr<std::unique_ptr<Memory>> ImportFd(UniqueFd fd,
                                                   int64_t size) override {
    ASSIGN_OR_RETURN(DescriptorLease descriptor, Admit("import_buffer.fd"));
    ASSIGN_OR_RETURN(
        MemfdRegion region,
        MemfdRegion::Import("import_buffer.fd", std::move(fd), size));
    if (own_->Contains(region.dev(), region.ino())) {
      return absl::InvalidArgumentError(
          "import_buffer.fd is memory this daemon allocated (a pool or "
          "buffer); address it by its name or buffer id instead");
    }
    if (!imported_->TryAdd(region.dev(), region.ino())) {
      return absl::InvalidArgumentError(
          "import_buffer.fd is a memfd already imported as a buffer (by this "
          "or another session); name that buffer (Grant shares it) instead of "
          "importing it again");
    }
    return std::make_unique<MemfdMemory>(std::move(region), imported_,
                                         std::move(descriptor));
  }

  absl::Status Store(const PoolLayout& layout, const Memory& pool,
                     int64_t layer, const void* kv, InputDtype dtype,
                     absl::Span<const int32_t> slot_mapping) override {
    return kvdepot::Store(layout, pool.data() + layout.layer_offset(layer), kv,
                          dtype, slot_mapping);
  }

  absl::Status StoreFused(const PoolLayout& layout, const Memory& pool,
                          int64_t layer, const uint16_t* kv,
                          const FusedParams& params,
                          absl::Span<const int32_t> slot_mapping,
                          uint16_t* cast_back) override {
    return FusedStore(layout, pool.data() + layout.layer_offset(layer), kv,
                      params, slot_mapping, cast_back);
  }

  absl::Status Load(const PoolLayout& layout, const Memory& pool, int64_t layer,
                    absl::Span<const int32_t> segments, int64_t total_k,
                    void* data, void* scales) override {
    return LoadSegments(layout, pool.data() + layout.layer_offset(layer),
                        segments, total_k, data, scales);
  }

 private:
  absl::StatusOr<DescriptorLease> Admit(absl::string_view field) {
    if (descriptors_ == nullptr) return DescriptorLease();
    return descriptors_->Acquire(field);
  }

  std::shared_ptr<DescriptorBudget> descriptors_;  // null: not budgeted
  std::shared_ptr<MemfdIds> own_;       // pools and allocated buffers
  std::shared_ptr<MemfdIds> imported_;  // clients' memfds, imported
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options.descriptors);
}

}  // namespace kvdepot
