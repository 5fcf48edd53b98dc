#include "server/pools.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/format_host.h"
#include "kernels/store_load_host.h"
#include "server/backend/inline_call.h"
#include "server/limits.h"
#include "server/logging.h"

namespace kvdepot {
namespace {
constexpr size_t kMaxPoolNameChars = 64;
}  // namespace

absl::Status ValidatePoolName(absl::string_view field, absl::string_view name) {
  if (name.empty() || name.size() > kMaxPoolNameChars) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = \"", EscapeForLog(name, kMaxPoolNameChars), "\" has ",
        name.size(), " bytes; a pool name has 1..", kMaxPoolNameChars));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' &&
        c != '.' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = \"", EscapeForLog(name, kMaxPoolNameChars),
                       "\": character ", i, " is not in [A-Za-z0-9_.-]"));
    }
  }
  return absl::OkStatus();
}

void LayoutToProto(const PoolLayout& l, v1::PoolLayout* out) {
  const KVCacheFormat& f = l.format;
  absl::StatusOr<std::string> name = FormatName(f);
  out->set_format(name.ok() ? *name : "custom");
  out->set_quantized_dtype(std::string(QuantDtypeName(f.quantized_dtype)));
  out->set_elements(f.elements());
  out->set_elements_per_sf(f.elements_per_sf);
  out->set_sf_format(std::string(ScaleFormatName(f.sf_format)));
  out->set_do_cast(f.do_cast);
  out->set_token_interleaved(f.token_interleaved);
  out->set_data_bytes(f.data_bytes());
  out->set_sf_bytes(f.sf_bytes());
  out->set_bytes_per_token(f.bytes_per_token());
  out->set_block_size(l.block_size);
  out->set_num_blocks(l.num_blocks);
  out->set_num_layers(l.num_layers);
  out->set_block_stride(l.block_stride);
  out->set_layer_bytes(l.layer_bytes);
  out->set_layer_stride(l.layer_stride);
  out->set_total_bytes(l.total_bytes);
  out->set_load_data_row_bytes(LoadDataRowBytes(f));
  out->set_load_scale_row_bytes(f.do_cast ? 0 : LoadScaleRowBytes(f));
  out->set_tail_bytes(f.tail_bytes());
  out->set_scale_rounding(std::string(ScaleRoundingName(f.scale_rounding)));
}

void Pool::ToProto(v1::PoolInfo* info) const {
  info->set_name(name);
  info->set_device(device);
  LayoutToProto(layout, info->mutable_layout());
  if (handle.kind_case() != v1::SharedHandle::KIND_NOT_SET) {
    *info->mutable_handle() = handle;
  }
}

absl::Status Pool::CheckUse(const Caller& caller,
                            absl::string_view field) const {
  if (!caller.authenticated()) {
    return absl::UnauthenticatedError(absl::StrCat(
        field, " = \"", name,
        "\": using a pool needs a session (connect to the companion socket "
        "and pass its session id)"));
  }
  if (caller.admin || Owner{owner_uid, owner_tls_subject}.Is(caller)) {
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&acl_mu);
    if (acl.Allows(caller)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      field, " = \"", name, "\": this session (", DescribeCaller(caller),
      ") is neither the pool's owner nor granted it"));
}

absl::Status Pool::CheckOwner(const Caller& caller,
                              absl::string_view what) const {
  if (!caller.authenticated()) return RequireSession(caller);
  const Owner owner{owner_uid, owner_tls_subject};
  if (caller.admin || owner.Is(caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " pool \"", name, "\" needs its owner (", owner.Describe(),
      ") or the admin identity; this session is ", DescribeCaller(caller)));
}

absl::Status Pool::Grant(const Acl& grant) {
  absl::MutexLock lock(&acl_mu);
  RETURN_IF_ERROR(
      CheckGrantFits(acl, grant, absl::StrCat("pool \"", name, "\"")));
  acl.Merge(grant);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::Create(
    const v1::CreatePoolRequest& r, uid_t owner_uid,
    absl::string_view budget_client, absl::string_view owner_tls_subject) {
  RETURN_IF_ERROR(ValidatePoolName("name", r.name()));
  absl::StatusOr<std::string> device = backend_->ResolveDevice(r.device());
  if (!device.ok()) return device.status();
  // "BF16" + elements, or any full name ("V41", "BF16(512)").
  std::string format_name = r.format();
  if (absl::EqualsIgnoreCase(format_name, "BF16")) {
    format_name = absl::StrCat("BF16(", r.elements(), ")");
  } else if (r.elements() != 0 &&
             !absl::StartsWithIgnoreCase(format_name, "BF16")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "elements = ", r.elements(), " is only allowed with format BF16"));
  }
  absl::StatusOr<KVCacheFormat> format = FormatFromName(format_name);
  if (!format.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "format = \"", r.format(), "\": ", format.status().message()));
  }
  if (r.block_size() <= 0 || r.block_size() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", r.block_size(), " is outside [1, 2^31)"));
  }
  if (r.num_blocks() <= 0 || r.num_blocks() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks = ", r.num_blocks(), " is outside [1, 2^31)"));
  }
  if (r.num_layers() <= 0 || r.num_layers() > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers = ", r.num_layers(), " is outside [1, 65536]"));
  }
  absl::StatusOr<PoolLayout> layout =
      MakePoolLayout(*format, r.block_size(), r.num_blocks(), r.num_layers());
  if (!layout.ok()) {
    return absl::InvalidArgumentError(layout.status().message());
  }
  if (layout->num_slots() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size * num_blocks = ", layout->num_slots(),
                     " slots do not fit the int32 slot mapping"));
  }
  if (layout->total_bytes > max_pool_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool \"", r.name(), "\" needs ", layout->total_bytes,
                     " bytes, more than --max_pool_bytes = ", max_pool_bytes_));
  }
  {
    absl::MutexLock lock(&mu_);
    if (pools_.contains(r.name())) {
      return absl::AlreadyExistsError(
          absl::StrCat("pool \"", r.name(), "\" already exists"));
    }
    RETURN_IF_ERROR(CheckCountLocked());
  }
  ASSIGN_OR_RETURN(
      MemoryReservation reservation,
      MemoryReservation::Open(budget_, budget_client, layout->total_bytes,
                              absl::StrCat("pool \"", r.name(), "\"")));
  absl::StatusOr<std::unique_ptr<Memory>> memory =
      backend_->Allocate(layout->total_bytes, *device);
  if (!memory.ok()) return memory.status();
  // Device memory is freed off gRPC's threads: an inline call may drop the
  // last reference (a DeletePool meanwhile), and freeing waits for the
  // memory's queued work.
  std::shared_ptr<Pool> pool(new Pool, [](Pool* p) {
    DeleteOffInline(p, p->memory != nullptr && p->memory->device() != "cpu");
  });
  pool->reservation = std::move(reservation);
  pool->name = r.name();
  pool->device = *device;
  pool->layout = *layout;
  pool->owner_uid = owner_uid;
  pool->owner_tls_subject = std::string(owner_tls_subject);
  if (backend_->legacy_handles()) (*memory)->FillHandle(&pool->handle);
  {
    absl::MutexLock pool_lock(&pool->mu);
    pool->memory = *std::move(memory);
  }
  absl::MutexLock lock(&mu_);
  // Again: another Create may have added one since the check above.
  if (!pools_.contains(r.name())) RETURN_IF_ERROR(CheckCountLocked());
  auto [it, inserted] = pools_.emplace(r.name(), pool);
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("pool \"", r.name(), "\" already exists"));
  }
  return pool;
}

absl::Status PoolRegistry::CheckCountLocked() const {
  if (static_cast<int64_t>(pools_.size()) < max_pools_) return absl::OkStatus();
  return LimitExceeded(
      Limit::kPools,
      absl::StrCat("there are already ", pools_.size(), " pools, the most ",
                   "this daemon holds (--max_pools = ", max_pools_, ")"));
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::Get(
    absl::string_view field, absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) {
    return absl::NotFoundError(
        absl::StrCat(field, " = \"", name, "\": no such pool"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Pool>> PoolRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Pool>> out;
  out.reserve(pools_.size());
  for (const auto& [name, pool] : pools_) out.push_back(pool);
  return out;
}

absl::Status PoolRegistry::Delete(absl::string_view name) {
  std::shared_ptr<Pool> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) {
    return absl::NotFoundError(
        absl::StrCat("name = \"", name, "\": no such pool"));
  }
  dropped = std::move(it->second);
  pools_.erase(it);
  return absl::OkStatus();
}

void PoolRegistry::Clear() {
  absl::btree_map<std::string, std::shared_ptr<Pool>> dropped;
  absl::MutexLock lock(&mu_);
  dropped.swap(pools_);
}

int64_t PoolRegistry::total_bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [name, pool] : pools_) total += pool->layout.total_bytes;
  return total;
}

}  // namespace kvdepot
