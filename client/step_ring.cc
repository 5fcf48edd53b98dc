#include "client/step_ring.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace kvdepot {

absl::StatusOr<std::unique_ptr<StepRingClient>> StepRingClient::Open(
    CompanionConnection* companion, int32_t slots, int64_t request_bytes) {
  if (companion == nullptr) {
    return absl::FailedPreconditionError(
        "a step ring needs a companion connection (a Unix-socket session)");
  }
  v1::CompanionRequest req;
  req.mutable_open_step_ring()->set_slots(slots);
  req.mutable_open_step_ring()->set_request_bytes(request_bytes);
  UniqueFd fd;
  ASSIGN_OR_RETURN(v1::CompanionReply reply, companion->Call(req, -1, &fd));
  if (!fd.valid() || !reply.has_step_ring()) {
    return absl::InternalError(
        "the daemon's open_step_ring reply carries no ring");
  }
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
      Map(std::move(fd), reply.fd_size(), reply.step_ring());
  if (ring.ok()) {
    (*ring)->companion_ = companion;
  } else {
    v1::CompanionRequest close;
    close.mutable_close_step_ring()->set_ring_id(reply.step_ring().ring_id());
    (void)companion->Call(close, -1, nullptr);
  }
  return ring;
}

absl::Status StepRingClient::Close() {
  if (companion_ == nullptr) return absl::OkStatus();
  CompanionConnection* companion = companion_;
  companion_ = nullptr;
  v1::CompanionRequest req;
  req.mutable_close_step_ring()->set_ring_id(ring_id_);
  return companion->Call(req, -1, nullptr).status();
}

absl::StatusOr<std::unique_ptr<StepRingClient>> StepRingClient::Map(
    UniqueFd fd, int64_t fd_size, const v1::StepRingInfo& info) {
  RETURN_IF_ERROR(
      CheckStepRingGeometry("step_ring", info.slots(), info.request_bytes()));
  if (info.reply_bytes() != kStepRingReplyBytes ||
      fd_size != StepRingBytes(info.slots(), info.request_bytes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_ring: reply_bytes ", info.reply_bytes(), " and fd_size ", fd_size,
        " do not describe a version ", kStepRingVersion, " ring"));
  }
  ASSIGN_OR_RETURN(MemfdRegion region,
                   MemfdRegion::Import("step_ring", std::move(fd), fd_size));
  std::unique_ptr<StepRingClient> ring(
      new StepRingClient(std::move(region), info));
  const StepRingView& v = ring->view_;
  if (v.word(kStepRingMagicOffset).load() != kStepRingMagic ||
      v.word(kStepRingVersionOffset).load() != kStepRingVersion ||
      v.word(kStepRingSlotsOffset).load() != v.slots() ||
      v.word(kStepRingRequestBytesOffset).load() != v.request_bytes()) {
    return absl::InvalidArgumentError(
        "step_ring: the ring's header does not match the daemon's reply");
  }
  // A fresh ring: both counters start at 0.
  ring->submitted_ = v.submitted().load();
  ring->collected_ = v.done().load();
  if (ring->submitted_ != ring->collected_) {
    return absl::InvalidArgumentError("step_ring: the ring is not fresh");
  }
  return ring;
}

StepRingClient::StepRingClient(MemfdRegion region, const v1::StepRingInfo& info)
    : region_(std::move(region)),
      view_(region_.data(), static_cast<uint32_t>(info.slots()),
            static_cast<uint32_t>(info.request_bytes())),
      ring_id_(info.ring_id()) {}

uint32_t StepRingClient::state() const {
  return view_.state().load(std::memory_order_acquire);
}

absl::Status StepRingClient::ClosedStatus() const {
  const uint32_t s = state();
  if (s == kStepRingOpen) return absl::OkStatus();
  const std::string message =
      absl::StrCat("step ring ", ring_id_, ": ", view_.Message());
  return s == kStepRingFailed ? absl::FailedPreconditionError(message)
                              : absl::UnavailableError(message);
}

absl::StatusOr<uint32_t> StepRingClient::Submit(
    const v1::StepRequest& request) {
  RETURN_IF_ERROR(ClosedStatus());
  if (submitted_ - collected_ >= view_.slots()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "step ring ", ring_id_, ": ", view_.slots(),
        " requests are uncollected, all its slots; collect a reply first"));
  }
  const size_t size = request.ByteSizeLong();
  if (size > static_cast<size_t>(view_.request_capacity())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: ", size, " bytes serialized, more than the step ring's ",
        view_.request_capacity(),
        "-byte slots; open a ring with a larger request_bytes"));
  }
  uint8_t* slot = view_.request_slot(submitted_);
  request.SerializeWithCachedSizesToArray(slot + kStepRingSlotHeaderBytes);
  StepRingView::length(slot).store(static_cast<uint32_t>(size),
                                   std::memory_order_relaxed);
  const uint32_t n = submitted_++;
  // Publishes the slot (and, sequentially consistent, orders the store
  // before the load of daemon_sleeping: see common/step_ring.h).
  view_.submitted().store(submitted_, std::memory_order_seq_cst);
  if (view_.daemon_sleeping().load(std::memory_order_seq_cst) != 0) {
    StepRingWake(view_.raw(kStepRingSubmittedOffset));
  }
  return n;
}

absl::StatusOr<v1::StepResponse> StepRingClient::Collect(
    absl::Duration timeout) {
  if (submitted_ == collected_) {
    return absl::FailedPreconditionError(
        "step ring: nothing submitted is uncollected");
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const uint32_t done = view_.done().load(std::memory_order_acquire);
    const uint32_t ready = done - collected_;
    if (ready >= 1 && ready <= submitted_ - collected_) break;
    RETURN_IF_ERROR(ClosedStatus());
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("step ring ", ring_id_, ": no reply to request ",
                       collected_, " within ", absl::FormatDuration(timeout)));
    }
    view_.client_sleeping().store(1, std::memory_order_seq_cst);
    if (view_.done().load(std::memory_order_seq_cst) == done &&
        state() == kStepRingOpen) {
      StepRingWait(view_.raw(kStepRingDoneOffset), done,
                   std::min(left, absl::Milliseconds(100)));
    }
    view_.client_sleeping().store(0, std::memory_order_relaxed);
  }
  uint8_t* slot = view_.reply_slot(collected_);
  const uint32_t length =
      StepRingView::length(slot).load(std::memory_order_acquire);
  v1::StepResponse reply;
  if (length > StepRingView::reply_capacity() ||
      !reply.ParseFromArray(slot + kStepRingSlotHeaderBytes,
                            static_cast<int>(length))) {
    return absl::InternalError(absl::StrCat("step ring ", ring_id_, ": reply ",
                                            collected_, " is not readable"));
  }
  ++collected_;
  return reply;
}

absl::StatusOr<v1::StepResponse> StepRingClient::Step(
    const v1::StepRequest& request, absl::Duration timeout) {
  if (submitted_ != collected_) {
    return absl::FailedPreconditionError(
        "step ring: Step needs every earlier reply collected");
  }
  RETURN_IF_ERROR(Submit(request).status());
  return Collect(timeout);
}

}  // namespace kvdepot
