#include "common/step_ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::Status CheckStepRingGeometry(absl::string_view field, int64_t slots,
                                   int64_t request_bytes) {
  if (slots < 1 || slots > kStepRingMaxSlots || (slots & (slots - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".slots: ", slots, " is not a power of two in [1, ",
                     kStepRingMaxSlots, "]"));
  }
  if (request_bytes < kStepRingMinRequestBytes ||
      request_bytes > kStepRingMaxRequestBytes || request_bytes % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".request_bytes: ", request_bytes,
                     " is not a multiple of 64 in [", kStepRingMinRequestBytes,
                     ", ", kStepRingMaxRequestBytes, "]"));
  }
  if (StepRingBytes(slots, request_bytes) > kStepRingMaxTotalBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".request_bytes: ", slots, " slots of ", request_bytes,
        " bytes make a ring of ", StepRingBytes(slots, request_bytes),
        " bytes, more than the ", kStepRingMaxTotalBytes, " allowed"));
  }
  return absl::OkStatus();
}

int64_t StepRingBytes(int64_t slots, int64_t request_bytes) {
  const int64_t bytes =
      kStepRingHeaderBytes + slots * (request_bytes + kStepRingReplyBytes);
  return (bytes + 4095) / 4096 * 4096;
}

void StepRingView::SetMessage(absl::string_view message) const {
  const uint32_t n = static_cast<uint32_t>(
      std::min<size_t>(message.size(), kStepRingMaxMessageBytes));
  std::memcpy(base_ + kStepRingMessageOffset + 4, message.data(), n);
  word(kStepRingMessageOffset).store(n, std::memory_order_release);
}

std::string StepRingView::Message() const {
  // The peer may write anything here: the length is clamped, the bytes
  // copied once.
  const uint32_t n = std::min<uint32_t>(
      word(kStepRingMessageOffset).load(std::memory_order_acquire),
      kStepRingMaxMessageBytes);
  return std::string(
      reinterpret_cast<const char*>(base_ + kStepRingMessageOffset + 4), n);
}

void StepRingWait(uint32_t* word, uint32_t expected, absl::Duration timeout) {
  if (std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire) !=
      expected) {
    return;
  }
  const timespec ts = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  // Not FUTEX_PRIVATE_FLAG: the word is in memory both processes map.
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void StepRingWake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace kvdepot
