#include "common/memfd.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvdepot {
namespace {

absl::Status Errno(absl::string_view what) {
  const int err = errno;
  return absl::Status(err == ENOMEM || err == ENOSPC || err == EFBIG
                          ? absl::StatusCode::kResourceExhausted
                          : absl::StatusCode::kInternal,
                      absl::StrCat(what, ": ", std::strerror(err)));
}

absl::Status NotMemfd(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": the descriptor ", why,
                   " (only sealed memfds are accepted, SPEC §11)"));
}

}  // namespace

absl::Status ValidateMemfd(absl::string_view field, int fd, int64_t size) {
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": size = ", size, " must be > 0"));
  }
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    return NotMemfd(field, "is not an open file");
  }
  if (!S_ISREG(st.st_mode)) {
    return NotMemfd(field, "is not a regular file (a pipe, socket or device)");
  }
  struct statfs fs;
  if (fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    return NotMemfd(field, "is not on tmpfs");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) return NotMemfd(field, "has no readable seals");
  if ((seals & kRequiredSeals) != kRequiredSeals) {
    return NotMemfd(field,
                    "is not sealed against shrinking and growing "
                    "(F_SEAL_SHRINK | F_SEAL_GROW)");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return NotMemfd(field, "is sealed against writing");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return NotMemfd(field, "is not open read-write");
  }
  if (st.st_size != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": the memfd holds ", st.st_size,
                     " bytes, not the declared size = ", size));
  }
  if (static_cast<int64_t>(st.st_blocks) * 512 < size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the memfd has holes (", st.st_blocks * 512, " of ", size,
        " bytes allocated); fallocate it in full before handing it over"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MemfdRegion> MemfdRegion::Create(absl::string_view name,
                                                int64_t size) {
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memfd size = ", size, " must be > 0"));
  }
  const std::string n(name);
  UniqueFd fd(memfd_create(n.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return Errno("memfd_create");
  if (ftruncate(fd.get(), size) != 0) return Errno("ftruncate(memfd)");
  // Allocate every page now: a later store can then not fail for memory.
  int rc;
  do {
    rc = fallocate(fd.get(), 0, 0, size);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return Errno(absl::StrCat("fallocate(memfd, ", size, " bytes)"));
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) !=
      0) {
    return Errno("F_ADD_SEALS");
  }
  return Import("memfd", std::move(fd), size, /*keep_fd=*/true);
}

absl::StatusOr<MemfdRegion> MemfdRegion::Import(absl::string_view field,
                                                UniqueFd fd, int64_t size,
                                                bool keep_fd) {
  RETURN_IF_ERROR(ValidateMemfd(field, fd.get(), size));
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return Errno("fstat(memfd)");
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat(field, ": mmap"));
  MemfdRegion region;
  region.data_ = static_cast<uint8_t*>(p);
  region.size_ = size;
  region.dev_ = st.st_dev;
  region.ino_ = st.st_ino;
  if (keep_fd) region.fd_ = std::move(fd);
  return region;
}

absl::StatusOr<UniqueFd> MemfdRegion::Dup() const {
  if (!fd_.valid()) {
    return absl::FailedPreconditionError("the memfd was not kept");
  }
  UniqueFd copy(fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return Errno("dup(memfd)");
  return copy;
}

MemfdRegion::MemfdRegion(MemfdRegion&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      dev_(std::exchange(other.dev_, 0)),
      ino_(std::exchange(other.ino_, 0)) {}

MemfdRegion& MemfdRegion::operator=(MemfdRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    dev_ = std::exchange(other.dev_, 0);
    ino_ = std::exchange(other.ino_, 0);
  }
  return *this;
}

MemfdRegion::~MemfdRegion() { Reset(); }

void MemfdRegion::Reset() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  data_ = nullptr;
  size_ = 0;
  fd_.reset();
}

}  // namespace kvdepot
