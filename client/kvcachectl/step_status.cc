#include "client/kvcachectl/step_status.h"

#include "absl/strings/str_cat.h"
#include "proto/step_doorbell.h"

namespace kvdepot::ctl {

std::string StepStatusNames(uint64_t bits) {
  if (bits == 0) return "ok";
  struct Name {
    uint64_t bit;
    const char* name;
  };
  static constexpr Name kNames[] = {
      {doorbell::kStatusStepMismatch, "step_mismatch"},
      {doorbell::kStatusCancelled, "cancelled"},
      {doorbell::kStatusOutOfRange, "out_of_range"},
      {doorbell::kStatusWorkerWatchdog, "worker_watchdog"},
      {doorbell::kStatusDaemonError, "daemon_error"},
  };
  std::string out;
  for (int b = 0; b < 64; ++b) {
    const uint64_t bit = uint64_t{1} << b;
    if ((bits & bit) == 0) continue;
    std::string name = absl::StrCat("bit", b);
    for (const Name& n : kNames) {
      if (n.bit == bit) name = n.name;
    }
    absl::StrAppend(&out, out.empty() ? "" : "|", name);
  }
  return out;
}

std::string TerminalSafe(absl::string_view text) {
  std::string out(text);
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) c = '?';
  }
  return out;
}

}  // namespace kvdepot::ctl
