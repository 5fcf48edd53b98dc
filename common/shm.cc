#include "common/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvdepot {
namespace {

constexpr absl::string_view kShmPrefix = "/kvdepot-";
constexpr int kRandomBytes = 16;
constexpr size_t kMaxShmNameChars = 250;

absl::Status Errno(absl::string_view what, absl::string_view name) {
  const int err = errno;
  return absl::Status(
      err == ENOENT                   ? absl::StatusCode::kNotFound
      : err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInternal,
      absl::StrCat(what, "(\"", name, "\"): ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<std::string> RandomHex(int num_bytes) {
  std::string bytes(static_cast<size_t>(num_bytes), '\0');
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(bytes);
}

absl::StatusOr<std::string> RandomShmName() {
  absl::StatusOr<std::string> hex = RandomHex(kRandomBytes);
  if (!hex.ok()) return hex.status();
  return absl::StrCat(kShmPrefix, *hex);
}

absl::Status ValidateShmName(absl::string_view field, absl::string_view name) {
  if (name.size() < 2 || name[0] != '/' || name.size() > kMaxShmNameChars) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = \"", name, "\" is not a shm name (\"/\" then 1..",
        kMaxShmNameChars - 1, " characters)"));
  }
  for (size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    // No leading '.': "/." and "/.." must not name /dev/shm itself or /dev.
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                    (c == '.' && i > 1);
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = \"", name, "\": character ", i,
                       " is not in [A-Za-z0-9_.-] (no leading '.')"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmRegion> ShmRegion::Create(int64_t size, mode_t mode) {
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm size = ", size, " must be > 0"));
  }
  absl::StatusOr<std::string> name = RandomShmName();
  if (!name.ok()) return name.status();
  const int fd = shm_open(name->c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
  if (fd < 0) return Errno("shm_open", *name);
  // shm_open applies the umask; set the requested bits exactly.
  if (fchmod(fd, mode) != 0 || ftruncate(fd, size) != 0) {
    absl::Status status = Errno("ftruncate", *name);
    close(fd);
    shm_unlink(name->c_str());
    return status;
  }
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    absl::Status status = Errno("mmap", *name);
    shm_unlink(name->c_str());
    return absl::ResourceExhaustedError(status.message());
  }
  ShmRegion region;
  region.name_ = *std::move(name);
  region.data_ = static_cast<uint8_t*>(p);
  region.size_ = size;
  region.owner_ = true;
  return region;
}

absl::StatusOr<ShmRegion> ShmRegion::Open(absl::string_view name,
                                          int64_t size) {
  RETURN_IF_ERROR(ValidateShmName("shm name", name));
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm size = ", size, " must be > 0"));
  }
  const std::string n(name);
  const int fd = shm_open(n.c_str(), O_RDWR, 0);
  if (fd < 0) return Errno("shm_open", n);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status status = Errno("fstat", n);
    close(fd);
    return status;
  }
  if (st.st_size < size) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shm \"", n, "\" holds ", st.st_size,
                     " bytes, fewer than the ", size, " requested"));
  }
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Errno("mmap", n);
  ShmRegion region;
  region.name_ = n;
  region.data_ = static_cast<uint8_t*>(p);
  region.size_ = size;
  region.owner_ = false;
  return region;
}

ShmRegion::ShmRegion(ShmRegion&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      owner_(std::exchange(other.owner_, false)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
  }
  return *this;
}

ShmRegion::~ShmRegion() { Reset(); }

void ShmRegion::Reset() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  if (owner_ && !name_.empty()) shm_unlink(name_.c_str());
  data_ = nullptr;
  size_ = 0;
  owner_ = false;
  name_.clear();
}

}  // namespace kvdepot
