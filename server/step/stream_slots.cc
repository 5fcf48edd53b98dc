#include "server/step/stream_slots.h"

#include "absl/strings/str_cat.h"

namespace kvdepot::step {

absl::Status StreamSlots::Open() {
  absl::MutexLock lock(&mu_);
  if (open_ >= max_streams_) {
    ++refused_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon has ", open_,
        " step streams and step rings open, its limit (--max_step_streams = ",
        max_streams_, "); close one or send unary Step calls"));
  }
  ++open_;
  return absl::OkStatus();
}

absl::Status StreamSlots::Bind(uint64_t session) {
  absl::MutexLock lock(&mu_);
  int& n = per_session_[session];
  if (n >= max_per_session_) {
    if (n == 0) per_session_.erase(session);
    ++refused_;
    return absl::ResourceExhaustedError(
        absl::StrCat("session ", session, " has ", n,
                     " step streams and step rings open, the most one "
                     "session may have "
                     "(--max_step_streams_per_session = ",
                     max_per_session_, "); close one first"));
  }
  ++n;
  return absl::OkStatus();
}

void StreamSlots::Close(uint64_t session) {
  absl::MutexLock lock(&mu_);
  --open_;
  if (session == 0) return;
  auto it = per_session_.find(session);
  if (it != per_session_.end() && --it->second <= 0) per_session_.erase(it);
}

int StreamSlots::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

int StreamSlots::open_of(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = per_session_.find(session);
  return it == per_session_.end() ? 0 : it->second;
}

int64_t StreamSlots::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

std::string StreamSlots::RenderPrometheus() const {
  absl::MutexLock lock(&mu_);
  return absl::StrCat(
      "# HELP kvdepot_step_streams_open StepStream calls and step rings "
      "open.\n"
      "# TYPE kvdepot_step_streams_open gauge\n"
      "kvdepot_step_streams_open ",
      open_,
      "\n# HELP kvdepot_step_streams_refused_total StepStream calls and step "
      "rings refused by --max_step_streams or "
      "--max_step_streams_per_session.\n"
      "# TYPE kvdepot_step_streams_refused_total counter\n"
      "kvdepot_step_streams_refused_total ",
      refused_, "\n");
}

}  // namespace kvdepot::step
