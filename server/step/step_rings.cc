#include "server/step/step_rings.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/log_limiter.h"
#include "server/step/step_service.h"
#include "spdlog/spdlog.h"

namespace kvdepot::step {
namespace {

// An error message longer than this is cut (a reply slot holds 4088
// bytes; the daemon's messages are far shorter).
constexpr size_t kMaxReplyMessageBytes = 2048;

// Writes `reply` into `slot` (its length word last, release).
void WriteReply(uint8_t* slot, v1::StepResponse* reply) {
  if (reply->error_message().size() > kMaxReplyMessageBytes) {
    reply->mutable_error_message()->resize(kMaxReplyMessageBytes);
  }
  if (reply->error_field().size() > kMaxReplyMessageBytes / 2) {
    reply->mutable_error_field()->resize(kMaxReplyMessageBytes / 2);
  }
  size_t size = reply->ByteSizeLong();
  if (size > static_cast<size_t>(StepRingView::reply_capacity())) {
    // Unreachable with the cuts above; kept so that a larger reply can
    // never overrun the slot.
    reply->Clear();
    reply->set_error_code(static_cast<int32_t>(absl::StatusCode::kInternal));
    reply->set_error_message("the step's reply did not fit its ring slot");
    size = reply->ByteSizeLong();
  }
  reply->SerializeWithCachedSizesToArray(slot + kStepRingSlotHeaderBytes);
  StepRingView::length(slot).store(static_cast<uint32_t>(size),
                                   std::memory_order_release);
}

}  // namespace

StepRings::StepRings(StepRegistry* registry, SessionManager* sessions,
                     StreamSlots* slots)
    : registry_(registry), sessions_(sessions), slots_(slots) {}

absl::StatusOr<UniqueFd> StepRings::OpenRing(const Caller& caller,
                                             const std::string& session_id,
                                             int32_t slots,
                                             int64_t request_bytes,
                                             MemoryReservation reservation,
                                             v1::StepRingInfo* info) {
  RETURN_IF_ERROR(RequireSession(caller));
  RETURN_IF_ERROR(
      CheckStepRingGeometry("open_step_ring", slots, request_bytes));
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError("kvdepot is draining: no new step rings");
    }
  }
  RETURN_IF_ERROR(slots_->Open());
  if (absl::Status s = slots_->Bind(caller.session); !s.ok()) {
    slots_->Close(0);
    return s;
  }
  auto ring = std::make_unique<Ring>();
  ring->session = caller.session;
  ring->log_client = caller.log_client();
  ring->session_id = session_id;
  ring->reservation = std::move(reservation);
  absl::StatusOr<MemfdRegion> region = MemfdRegion::Create(
      "kvdepot-step-ring", StepRingBytes(slots, request_bytes));
  absl::StatusOr<UniqueFd> fd =
      region.ok() ? region->Dup() : absl::StatusOr<UniqueFd>(region.status());
  if (!fd.ok()) {
    slots_->Close(caller.session);
    return fd.status();
  }
  ring->region = *std::move(region);
  ring->view = StepRingView(ring->region.data(), static_cast<uint32_t>(slots),
                            static_cast<uint32_t>(request_bytes));
  const StepRingView& v = ring->view;
  v.word(kStepRingMagicOffset).store(kStepRingMagic);
  v.word(kStepRingVersionOffset).store(kStepRingVersion);
  v.word(kStepRingSlotsOffset).store(static_cast<uint32_t>(slots));
  v.word(kStepRingRequestBytesOffset)
      .store(static_cast<uint32_t>(request_bytes));
  v.word(kStepRingReplyBytesOffset)
      .store(static_cast<uint32_t>(kStepRingReplyBytes));
  Ring* raw = ring.get();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {  // the drain began meanwhile
      slots_->Close(caller.session);
      return absl::UnavailableError("kvdepot is draining: no new step rings");
    }
    ring->id = next_id_++;
    info->set_ring_id(ring->id);
    info->set_slots(slots);
    info->set_request_bytes(request_bytes);
    info->set_reply_bytes(kStepRingReplyBytes);
    rings_.emplace(ring->id, std::move(ring));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
  if (AdmitClientLog(ClientLog::kClientEvent, caller.log_client())) {
    spdlog::info(
        "rpc=OpenStepRing session={} ring={} slots={} request_bytes={} "
        "status=OK",
        caller.session, raw->id, slots, request_bytes);
  }
  return fd;
}

void StepRings::CloseRing(Ring& ring, uint32_t state,
                          absl::string_view message) {
  if (ring.closed.exchange(true)) return;  // the first reason stays
  const StepRingView& v = ring.view;
  v.SetMessage(message);
  v.state().store(state, std::memory_order_seq_cst);
  // The scheduler sleeps on `done`; it re-reads the state when woken.
  StepRingWake(v.raw(kStepRingDoneOffset));
}

void StepRings::Serve(Ring* ring) {
  const StepRingView& v = ring->view;
  uint32_t done = 0;  // the daemon's own copy: the shared word is only output
  std::string scratch;
  v1::StepRequest request;
  while (!ring->stop.load(std::memory_order_acquire)) {
    const uint32_t submitted = v.submitted().load(std::memory_order_acquire);
    const uint32_t pending = submitted - done;
    if (pending == 0) {
      // Announce the sleep, then look again: a scheduler that published
      // before it could see the announcement is seen here (both sides use
      // sequentially consistent order on these two words).
      v.daemon_sleeping().store(1, std::memory_order_seq_cst);
      if (v.submitted().load(std::memory_order_seq_cst) == done &&
          !ring->stop.load(std::memory_order_acquire)) {
        StepRingWait(v.raw(kStepRingSubmittedOffset), done, kIdleCheck);
      }
      v.daemon_sleeping().store(0, std::memory_order_relaxed);
      continue;
    }
    if (pending > v.slots()) {
      failed_.fetch_add(1, std::memory_order_relaxed);
      const std::string why = absl::StrCat(
          "step_ring.submitted: ", submitted, " is ", pending,
          " requests ahead of done = ", done, ", more than the ring's ",
          v.slots(), " slots: the ring is closed");
      if (AdmitClientLog(ClientLog::kFailedCall, ring->log_client)) {
        spdlog::warn(
            "rpc=StepRing session={} ring={} status=FAILED error=\"{}\"",
            ring->session, ring->id, why);
      }
      CloseRing(*ring, kStepRingFailed, why);
      return;
    }
    bool session_ended = false;
    v1::StepResponse reply =
        Handle(ring, done, &scratch, &request, &session_ended);
    WriteReply(v.reply_slot(done), &reply);
    ++done;
    v.done().store(done, std::memory_order_seq_cst);
    requests_.fetch_add(1, std::memory_order_relaxed);
    if (v.client_sleeping().load(std::memory_order_seq_cst) != 0) {
      StepRingWake(v.raw(kStepRingDoneOffset));
    }
    if (session_ended) {
      CloseRing(*ring, kStepRingClosed,
                "the step ring's session ended: the ring is closed");
      return;
    }
  }
}

v1::StepResponse StepRings::Handle(Ring* ring, uint32_t n, std::string* scratch,
                                   v1::StepRequest* request,
                                   bool* session_ended) {
  const StepRingView& v = ring->view;
  uint8_t* slot = v.request_slot(n);
  // Read once: the scheduler may change the word and the bytes at any
  // time; only the copy below is parsed.
  const uint32_t length =
      StepRingView::length(slot).load(std::memory_order_acquire);
  if (length > v.request_capacity()) {
    return StepReplyOf(
        0, absl::InvalidArgumentError(absl::StrCat(
               "step_ring.request[", n, "].length: ", length,
               " bytes, more than the slot's ", v.request_capacity())));
  }
  scratch->assign(
      reinterpret_cast<const char*>(slot + kStepRingSlotHeaderBytes), length);
  if (!request->ParseFromString(*scratch)) {
    return StepReplyOf(0, absl::InvalidArgumentError(
                              absl::StrCat("step_ring.request[", n,
                                           "]: its bytes are not a serialized "
                                           "kvdepot.v1.StepRequest")));
  }
  if (!request->session_id().empty() &&
      request->session_id() != ring->session_id) {
    return StepReplyOf(
        request->step_id(),
        absl::PermissionDeniedError(absl::StrCat(
            "session_id: this step ring belongs to session ", ring->session,
            " (the companion connection that opened it); a request may name "
            "only that session, or none")));
  }
  absl::StatusOr<Caller> caller =
      sessions_->Authenticate(ring->session_id, absl::Now());
  if (!caller.ok() || !caller->authenticated()) {
    *session_ended = true;
    return StepReplyOf(request->step_id(),
                       caller.ok() ? RequireSession(*caller) : caller.status());
  }
  return StepReplyOf(request->step_id(), registry_->Step(*caller, *request));
}

void StepRings::Retire(std::unique_ptr<Ring> ring) {
  ring->stop.store(true, std::memory_order_release);
  // Wakes the thread if it sleeps on `submitted`; if it is about to, its
  // wait ends after kIdleCheck.
  StepRingWake(ring->view.raw(kStepRingSubmittedOffset));
  ring->thread.join();
  CloseRing(*ring, kStepRingClosed, "the daemon closed the step ring");
  slots_->Close(ring->session);
  if (AdmitClientLog(ClientLog::kClientEvent, ring->log_client)) {
    spdlog::info("rpc=CloseStepRing session={} ring={} status=OK",
                 ring->session, ring->id);
  }
}

absl::Status StepRings::CloseRing(const Caller& caller, uint64_t ring_id) {
  std::unique_ptr<Ring> ring;
  {
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(ring_id);
    if (it == rings_.end() || caller.session == 0 ||
        it->second->session != caller.session) {
      return absl::NotFoundError(absl::StrCat(
          "close_step_ring.ring_id: this session has no step ring ", ring_id));
    }
    ring = std::move(it->second);
    rings_.erase(it);
  }
  Retire(std::move(ring));
  return absl::OkStatus();
}

void StepRings::CloseRingsOf(uint64_t session) {
  std::vector<std::unique_ptr<Ring>> closing;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = rings_.begin(); it != rings_.end();) {
      if (it->second->session == session) {
        closing.push_back(std::move(it->second));
        rings_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& ring : closing) Retire(std::move(ring));
}

void StepRings::StopAll() {
  std::vector<std::unique_ptr<Ring>> closing;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, ring] : rings_) closing.push_back(std::move(ring));
    rings_.clear();
  }
  for (auto& ring : closing) Retire(std::move(ring));
}

int StepRings::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(rings_.size());
}

std::string StepRings::RenderPrometheus() const {
  return absl::StrCat(
      "# HELP kvdepot_step_rings_open Step rings open.\n"
      "# TYPE kvdepot_step_rings_open gauge\n"
      "kvdepot_step_rings_open ",
      open(),
      "\n# HELP kvdepot_step_ring_requests_total Requests answered "
      "through step rings.\n"
      "# TYPE kvdepot_step_ring_requests_total counter\n"
      "kvdepot_step_ring_requests_total ",
      requests_.load(std::memory_order_relaxed),
      "\n# HELP kvdepot_step_rings_failed_total Step rings closed because "
      "their scheduler broke the protocol.\n"
      "# TYPE kvdepot_step_rings_failed_total counter\n"
      "kvdepot_step_rings_failed_total ",
      failed_.load(std::memory_order_relaxed), "\n");
}

}  // namespace kvdepot::step
