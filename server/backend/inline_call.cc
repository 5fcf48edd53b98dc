#include "server/backend/inline_call.h"

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

struct ThreadState {
  bool active = false;
  bool deferred = false;
};

thread_local ThreadState state;

}  // namespace

InlineCall::InlineCall() { state = ThreadState{.active = true}; }

InlineCall::~InlineCall() { state = ThreadState{}; }

bool InlineCall::deferred() const { return state.deferred; }

bool MayWait() { return !state.active; }

absl::Status DeferInlineCall(absl::string_view why) {
  if (!state.active) {
    return absl::InternalError(
        absl::StrCat("deferring a call that is not inline: ", why));
  }
  state.deferred = true;
  return absl::UnavailableError(
      absl::StrCat("deferred to a worker thread: ", why));
}

bool InlineCallDeferred() { return state.active && state.deferred; }

}  // namespace kvdepot
