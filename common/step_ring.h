// The step ring (SPEC §10, docs/STEP_PATH.md "Step ring"): StepRequests
// submitted through shared memory instead of a gRPC call. The daemon
// creates the ring (a sealed memfd) for a companion-socket session and
// hands it over as a descriptor; the scheduler writes serialized
// StepRequests into request slots and publishes them by advancing one
// 32-bit counter; a daemon thread copies each request out, runs the same
// checks and enqueue as the unary Step, writes the serialized StepResponse
// into the matching reply slot and advances its own counter. Either side
// sleeps on the other's counter with a futex (shared, not private: the
// two processes map the same memfd) only after announcing it in its
// "sleeping" word, so a busy peer never pays a system call.
//
// Layout (every integer little-endian, the counters 4-byte aligned words
// used through std::atomic_ref):
//   [0, 4096)  header
//     0   u32 magic kStepRingMagic     } written by the daemon when it
//     4   u32 version                  } creates the ring; it never reads
//     8   u32 slots (a power of two)   } them back
//     12  u32 request_bytes            }
//     16  u32 reply_bytes              }
//     64  u32 submitted   requests published (the scheduler's counter)
//     128 u32 daemon_sleeping          (the daemon's)
//     192 u32 done        replies published (the daemon's counter)
//     256 u32 client_sleeping          (the scheduler's)
//     320 u32 state       kStepRingOpen / kStepRingClosed / kStepRingFailed
//     384 u32 length of the closing message, then its bytes (<= 1024)
//   request slot i, i in [0, slots): kStepRingHeaderBytes + i *
//   request_bytes: u32 length, u32 zero, then `length` bytes of a
//   serialized StepRequest.
//   reply slot i: after the request slots, i * reply_bytes: u32 length,
//   u32 zero, then a serialized StepResponse.
// Request n (n counts from 0, modulo 2^32) lives in slot n % slots and its
// reply in reply slot n % slots. The scheduler publishes request n by
// storing submitted = n + 1 (release) once submitted - done < slots; the
// daemon publishes its reply by storing done = n + 1 (release). The
// scheduler must read reply n before it submits request n + slots (that
// submission lets the daemon overwrite it).
//
// Nothing the scheduler writes is trusted: the daemon reads `submitted`
// once per wake-up and closes the ring (kStepRingFailed, with the reason
// as the closing message) when it is more than `slots` ahead of `done`;
// it reads a request's length once, refuses lengths beyond the slot with
// an error reply, and copies the bytes out before it parses them.
#ifndef KVDEPOT_COMMON_STEP_RING_H_
#define KVDEPOT_COMMON_STEP_RING_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvdepot {

inline constexpr uint32_t kStepRingMagic = 0x5253564b;  // "KVSR"
inline constexpr uint32_t kStepRingVersion = 1;
inline constexpr int64_t kStepRingHeaderBytes = 4096;
// Each slot starts with its u32 length and a u32 zero.
inline constexpr int64_t kStepRingSlotHeaderBytes = 8;

// Header byte offsets.
inline constexpr int64_t kStepRingMagicOffset = 0;
inline constexpr int64_t kStepRingVersionOffset = 4;
inline constexpr int64_t kStepRingSlotsOffset = 8;
inline constexpr int64_t kStepRingRequestBytesOffset = 12;
inline constexpr int64_t kStepRingReplyBytesOffset = 16;
inline constexpr int64_t kStepRingSubmittedOffset = 64;
inline constexpr int64_t kStepRingDaemonSleepingOffset = 128;
inline constexpr int64_t kStepRingDoneOffset = 192;
inline constexpr int64_t kStepRingClientSleepingOffset = 256;
inline constexpr int64_t kStepRingStateOffset = 320;
inline constexpr int64_t kStepRingMessageOffset = 384;
inline constexpr int64_t kStepRingMaxMessageBytes = 1024;

// The state word.
inline constexpr uint32_t kStepRingOpen = 0;
inline constexpr uint32_t kStepRingClosed = 1;  // by the daemon, in order
inline constexpr uint32_t kStepRingFailed = 2;  // the scheduler broke it

// Bounds the daemon enforces on a ring's geometry.
inline constexpr int kStepRingMaxSlots = 64;
inline constexpr int64_t kStepRingMinRequestBytes = 4096;
inline constexpr int64_t kStepRingMaxRequestBytes = int64_t{16} << 20;
inline constexpr int64_t kStepRingReplyBytes = 4096;
inline constexpr int64_t kStepRingMaxTotalBytes = int64_t{256} << 20;

// OK when `slots` is a power of two in [1, kStepRingMaxSlots] and
// `request_bytes` a multiple of 64 in [kStepRingMinRequestBytes,
// kStepRingMaxRequestBytes] whose ring stays within kStepRingMaxTotalBytes;
// otherwise INVALID_ARGUMENT naming `field`.slots or `field`.request_bytes.
absl::Status CheckStepRingGeometry(absl::string_view field, int64_t slots,
                                   int64_t request_bytes);

// Bytes of a ring of that geometry (a multiple of 4096).
int64_t StepRingBytes(int64_t slots, int64_t request_bytes);

// A mapped ring's words and slots; does not own the mapping. Both sides
// use it: each writes only its own words.
class StepRingView {
 public:
  StepRingView() = default;
  // REQUIRES: `base` maps StepRingBytes(slots, request_bytes) bytes.
  StepRingView(uint8_t* base, uint32_t slots, uint32_t request_bytes)
      : base_(base), slots_(slots), request_bytes_(request_bytes) {}

  uint8_t* base() const { return base_; }
  uint32_t slots() const { return slots_; }
  uint32_t request_bytes() const { return request_bytes_; }
  // Payload bytes a request or reply slot holds.
  int64_t request_capacity() const {
    return request_bytes_ - kStepRingSlotHeaderBytes;
  }
  static constexpr int64_t reply_capacity() {
    return kStepRingReplyBytes - kStepRingSlotHeaderBytes;
  }

  uint32_t* raw(int64_t offset) const {
    return reinterpret_cast<uint32_t*>(base_ + offset);
  }
  std::atomic_ref<uint32_t> word(int64_t offset) const {
    return std::atomic_ref<uint32_t>(*raw(offset));
  }
  std::atomic_ref<uint32_t> submitted() const {
    return word(kStepRingSubmittedOffset);
  }
  std::atomic_ref<uint32_t> daemon_sleeping() const {
    return word(kStepRingDaemonSleepingOffset);
  }
  std::atomic_ref<uint32_t> done() const { return word(kStepRingDoneOffset); }
  std::atomic_ref<uint32_t> client_sleeping() const {
    return word(kStepRingClientSleepingOffset);
  }
  std::atomic_ref<uint32_t> state() const { return word(kStepRingStateOffset); }

  // Slot of request / reply number n (the slot's u32 length first).
  uint8_t* request_slot(uint32_t n) const {
    return base_ + kStepRingHeaderBytes +
           int64_t{n & (slots_ - 1)} * request_bytes_;
  }
  uint8_t* reply_slot(uint32_t n) const {
    return base_ + kStepRingHeaderBytes + int64_t{slots_} * request_bytes_ +
           int64_t{n & (slots_ - 1)} * kStepRingReplyBytes;
  }
  // A slot's length word.
  static std::atomic_ref<uint32_t> length(uint8_t* slot) {
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(slot));
  }

  // The closing message (the daemon writes it before the state word).
  void SetMessage(absl::string_view message) const;
  std::string Message() const;

 private:
  uint8_t* base_ = nullptr;
  uint32_t slots_ = 0;
  uint32_t request_bytes_ = 0;
};

// Sleeps while *word == expected, at most `timeout` (a futex shared
// between processes). Returns early on a wake-up, a changed word, a
// signal or the timeout; callers re-check their condition.
void StepRingWait(uint32_t* word, uint32_t expected, absl::Duration timeout);
// Wakes every sleeper on `word`.
void StepRingWake(uint32_t* word);

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_STEP_RING_H_
