// How `kvcachectl registrations` shows a registration's step status: the
// doorbell's sticky status bits by name, and untrusted text (a worker
// chose the registration's name) made safe for a terminal.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_STEP_STATUS_H_
#define KVDEPOT_CLIENT_KVCACHECTL_STEP_STATUS_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvdepot::ctl {

// "ok" for 0, else the set bits joined by '|' (step_mismatch, cancelled,
// out_of_range, worker_watchdog, daemon_error; unknown bits as bit<N>).
std::string StepStatusNames(uint64_t bits);

// `text` with control bytes (escape sequences, newlines) and bytes >= 0x7f
// shown as '?'.
std::string TerminalSafe(absl::string_view text);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_STEP_STATUS_H_
