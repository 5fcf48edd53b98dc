#include "tests/gpu/step_send_retry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvdepot::testing {

absl::Status SendRespectingDepth(absl::FunctionRef<absl::Status()> send,
                                 const InFlightRetry& retry, int* retries) {
  int n = 0;
  absl::Status s = send();
  if (s.code() == absl::StatusCode::kResourceExhausted) {
    const absl::Time give_up = absl::Now() + retry.budget;
    absl::Duration backoff = retry.first_backoff;
    while (s.code() == absl::StatusCode::kResourceExhausted) {
      const absl::Time now = absl::Now();
      if (now >= give_up) {
        s = absl::Status(s.code(),
                         absl::StrCat(s.message(), " (still refused after ", n,
                                      " retries over ",
                                      absl::FormatDuration(retry.budget), ")"));
        break;
      }
      absl::SleepFor(std::min(backoff, give_up - now));
      backoff = std::min(2 * backoff, retry.max_backoff);
      ++n;
      s = send();
    }
  }
  if (retries != nullptr) *retries = n;
  return s;
}

}  // namespace kvdepot::testing
