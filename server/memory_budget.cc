#include "server/memory_budget.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/limits.h"

namespace kvdepot {
namespace {

// cgroup v1 reports "no limit" as a page-rounded LONG_MAX.
constexpr int64_t kUnlimited = int64_t{1} << 62;

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::string s((std::istreambuf_iterator<char>(f)),
                std::istreambuf_iterator<char>());
  return s;
}

// A non-negative integer file; "max" (cgroup v2) reads as kUnlimited.
std::optional<int64_t> ReadBytes(const std::string& path) {
  std::optional<std::string> s = ReadFile(path);
  if (!s) return std::nullopt;
  absl::string_view v = absl::StripAsciiWhitespace(*s);
  if (v == "max") return kUnlimited;
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0) return std::nullopt;
  return std::min(n, kUnlimited);
}

// The cgroup path of `controller` ("" = the v2 unified line "0::").
std::optional<std::string> CgroupPath(const std::string& self_cgroup,
                                      absl::string_view controller) {
  std::optional<std::string> text = ReadFile(self_cgroup);
  if (!text) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (controller.empty() ? (f[0] == "0" && f[1].empty())
                           : absl::StrContains(f[1], controller)) {
      return std::string(f[2]);
    }
  }
  return std::nullopt;
}

// min over the levels from `dir` up to `mount` of limit - usage, where a
// level has a limit; nullopt when no level has one or nothing is readable.
std::optional<AvailableMemory> TightestLevel(const std::string& mount,
                                             std::string rel,
                                             absl::string_view limit_file,
                                             absl::string_view usage_file,
                                             absl::string_view version) {
  std::optional<AvailableMemory> best;
  while (true) {
    const std::string dir = rel.empty() || rel == "/" ? mount : mount + rel;
    const std::optional<int64_t> limit =
        ReadBytes(absl::StrCat(dir, "/", limit_file));
    const std::optional<int64_t> usage =
        ReadBytes(absl::StrCat(dir, "/", usage_file));
    if (limit && usage && *limit < kUnlimited) {
      const int64_t avail = std::max<int64_t>(0, *limit - *usage);
      if (!best || avail < best->bytes) {
        best = AvailableMemory{
            avail, absl::StrCat("cgroup ", version, " ", dir, ": ", limit_file,
                                " ", HumanBytes(*limit), " - ", usage_file, " ",
                                HumanBytes(*usage))};
      }
    }
    if (rel.empty() || rel == "/") break;
    const size_t slash = rel.rfind('/');
    rel = slash == std::string::npos ? "" : rel.substr(0, slash);
  }
  return best;
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B",   "KiB", "MiB", "GiB",
                                           "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B")
                : absl::StrFormat("%.1f %s", v, kUnits[u]);
}

absl::StatusOr<AvailableMemory> ReadAvailableMemory(
    const SystemMemoryFiles& files) {
  // cgroup v2: the unified hierarchy at the root (pure v2) or at unified/
  // (hybrid).
  if (std::optional<std::string> rel = CgroupPath(files.self_cgroup, "")) {
    for (const std::string& mount :
         {files.cgroup_root, files.cgroup_root + "/unified"}) {
      if (std::optional<AvailableMemory> a = TightestLevel(
              mount, *rel, "memory.max", "memory.current", "v2")) {
        return *a;
      }
    }
  }
  if (std::optional<std::string> rel =
          CgroupPath(files.self_cgroup, "memory")) {
    // In a container the mount is the cgroup itself: try the path under
    // the mount, then the mount.
    const std::string mount = files.cgroup_root + "/memory";
    if (std::optional<AvailableMemory> a =
            TightestLevel(mount, *rel, "memory.limit_in_bytes",
                          "memory.usage_in_bytes", "v1")) {
      return *a;
    }
    if (std::optional<AvailableMemory> a =
            TightestLevel(mount, "", "memory.limit_in_bytes",
                          "memory.usage_in_bytes", "v1")) {
      return *a;
    }
  }
  if (std::optional<std::string> text = ReadFile(files.meminfo)) {
    for (absl::string_view line : absl::StrSplit(*text, '\n')) {
      if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
      line = absl::StripAsciiWhitespace(line);
      int64_t kib = 0;
      if (absl::ConsumeSuffix(&line, "kB") &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) &&
          kib >= 0 && kib < (int64_t{1} << 52)) {
        return AvailableMemory{kib * 1024,
                               absl::StrCat(files.meminfo, " MemAvailable")};
      }
    }
  }
  return absl::InternalError(absl::StrCat(
      "cannot tell how much memory is available: no cgroup limit under ",
      files.cgroup_root, " and no MemAvailable in ", files.meminfo,
      "; give --memory_budget_bytes"));
}

MemoryBudget::MemoryBudget(int64_t total, int64_t per_client,
                           std::string source, BudgetNames names)
    : total_(std::max<int64_t>(0, total)),
      per_client_(std::max<int64_t>(0, per_client)),
      source_(std::move(source)),
      names_(std::move(names)) {}

absl::Status MemoryBudget::Reserve(absl::string_view client, int64_t bytes,
                                   absl::string_view what) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": size ", bytes, " is negative"));
  }
  absl::MutexLock lock(&mu_);
  if (bytes > total_ - used_) {
    return LimitExceeded(
        names_.total,
        absl::StrCat(what, ": ", HumanBytes(bytes), " (", bytes,
                     " bytes) does not fit the ", names_.name, ": ",
                     HumanBytes(total_ - used_), " of ", HumanBytes(total_),
                     " available (", source_, ")"));
  }
  int64_t& mine = by_client_[client];
  if (per_client_ > 0 && !client.empty() && bytes > per_client_ - mine) {
    const int64_t left = per_client_ - mine;
    if (mine == 0) by_client_.erase(client);
    return LimitExceeded(
        names_.per_client,
        absl::StrCat(what, ": ", HumanBytes(bytes), " (", bytes,
                     " bytes) exceeds this client's ", names_.name, ": ",
                     HumanBytes(left), " of ", HumanBytes(per_client_),
                     " left"));
  }
  mine += bytes;
  used_ += bytes;
  return absl::OkStatus();
}

void MemoryBudget::Release(absl::string_view client, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
  auto it = by_client_.find(client);
  if (it != by_client_.end()) {
    it->second -= bytes;
    if (it->second <= 0) by_client_.erase(it);
  }
}

int64_t MemoryBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

int64_t MemoryBudget::used_by(absl::string_view client) const {
  absl::MutexLock lock(&mu_);
  auto it = by_client_.find(client);
  return it == by_client_.end() ? 0 : it->second;
}

absl::StatusOr<MemoryReservation> MemoryReservation::Open(
    MemoryBudget* budget, absl::string_view client, int64_t bytes,
    absl::string_view what) {
  MemoryReservation r;
  if (budget == nullptr) return r;
  absl::Status status = budget->Reserve(client, bytes, what);
  if (!status.ok()) return status;
  r.budget_ = budget;
  r.client_ = std::string(client);
  r.bytes_ = bytes;
  return r;
}

MemoryReservation::MemoryReservation(MemoryReservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)),
      client_(std::move(other.client_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

MemoryReservation& MemoryReservation::operator=(
    MemoryReservation&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    client_ = std::move(other.client_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void MemoryReservation::Reset() {
  if (budget_ != nullptr) budget_->Release(client_, bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

}  // namespace kvdepot
