// A hostile scheduler on a step ring (common/step_ring.h,
// server/step/step_rings.h): the fuzz bytes are a sequence of writes into
// the ring's shared memory — StepRequests built by the test rig and then
// mutated, raw bytes with any length word, counters set to any value,
// bytes anywhere in the request slots, the daemon's own words overwritten
// — each followed, when it published something, by a wait for the
// daemon's thread. The daemon side is the real one (StepTestRig: the Step
// service in this process, a CPU backend, FakeEngine registrations that
// finish each step at once).
//
// Properties: no crash or sanitizer report; the daemon's thread answers
// every request it accepts within 10 s or fails the ring (never hangs);
// the state word only ever holds open, closed or failed; every reply fits
// its slot, parses as a StepResponse and is
// never INTERNAL, UNKNOWN or DATA_LOSS; a failed ring's closing message
// names step_ring.submitted; closing works whatever the ring went through
// (after the input wrote the daemon's own words nothing else is checked).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/step_ring.h"
#include "common/step_ring.h"
#include "kvdepot/v1/step.pb.h"
#include "server/memory_budget.h"
#include "server/step/step_test_rig.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvdepot::fuzz {
namespace {

constexpr int kSlots = 4;
constexpr int64_t kRequestBytes = 8192;

struct World {
  std::unique_ptr<step::StepTestRig> rig;
  OpenedSession session;
  uint64_t registration = 0;
};

World& TheWorld() {
  static World* w = [] {
    spdlog::set_level(spdlog::level::off);
    auto* world = new World;
    step::StepTestRigOptions o;
    o.max_batch = 4;
    o.top_k = 16;
    absl::StatusOr<std::unique_ptr<step::StepTestRig>> rig =
        step::StepTestRig::Start(o);
    FUZZ_CHECK(rig.ok(), "%s", rig.status().ToString().c_str());
    world->rig = *std::move(rig);
    absl::StatusOr<OpenedSession> s =
        world->rig->OpenSession("scheduler", step::StepTestRig::kWorkerUid);
    FUZZ_CHECK(s.ok(), "%s", s.status().ToString().c_str());
    world->session = *s;
    absl::StatusOr<uint64_t> reg = world->rig->Register(s->id);
    FUZZ_CHECK(reg.ok(), "%s", reg.status().ToString().c_str());
    world->registration = *reg;
    return world;
  }();
  return *w;
}

// Waits until the daemon answered every request up to `submitted` or the
// ring is no longer open; checks each new reply.
void AwaitAndCheck(const StepRingView& v, uint32_t submitted,
                   uint32_t* checked) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    const uint32_t state = v.state().load();
    FUZZ_CHECK(state <= kStepRingFailed, "state %u", state);
    const uint32_t done = v.done().load();
    // Replies the daemon published since the last check (the daemon's
    // `done` never runs past what was published).
    while (*checked != done && done - *checked <= kSlots) {
      uint8_t* slot = v.reply_slot(*checked);
      const uint32_t length = StepRingView::length(slot).load();
      FUZZ_CHECK(length <= StepRingView::reply_capacity(), "reply length %u",
                 length);
      v1::StepResponse reply;
      FUZZ_CHECK(reply.ParseFromArray(slot + kStepRingSlotHeaderBytes,
                                      static_cast<int>(length)),
                 "reply %u does not parse", *checked);
      const auto code = static_cast<absl::StatusCode>(reply.error_code());
      FUZZ_CHECK(code != absl::StatusCode::kInternal &&
                     code != absl::StatusCode::kUnknown &&
                     code != absl::StatusCode::kDataLoss,
                 "reply %u: %d %s", *checked, reply.error_code(),
                 reply.error_message().c_str());
      ++*checked;
    }
    if (state == kStepRingFailed) {
      const std::string why = v.Message();
      FUZZ_CHECK(absl::StrContains(why, "step_ring.submitted"), "%s",
                 why.c_str());
      return;
    }
    if (state != kStepRingOpen || done == submitted) return;
    if (submitted - done > kSlots) {
      // Published out of range: the daemon must fail the ring.
      FUZZ_CHECK(absl::Now() < deadline,
                 "a counter %u ahead of done %u "
                 "did not fail the ring",
                 submitted, done);
    } else {
      FUZZ_CHECK(absl::Now() < deadline, "no reply past %u of %u", done,
                 submitted);
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot;
  using namespace kvdepot::fuzz;
  World& w = TheWorld();
  FuzzInput in(data, size);
  step::StepRings* rings = w.rig->step()->rings();
  absl::StatusOr<Caller> caller =
      w.rig->sessions()->Authenticate(w.session.id, absl::Now());
  FUZZ_CHECK(caller.ok(), "%s", caller.status().ToString().c_str());
  v1::StepRingInfo info;
  absl::StatusOr<UniqueFd> fd = rings->OpenRing(
      *caller, w.session.id, kSlots, kRequestBytes, MemoryReservation(), &info);
  FUZZ_CHECK(fd.ok(), "%s", fd.status().ToString().c_str());
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = StepRingClient::Map(
      *std::move(fd), StepRingBytes(kSlots, kRequestBytes), info);
  FUZZ_CHECK(ring.ok(), "%s", ring.status().ToString().c_str());
  const StepRingView& v = (*ring)->view();
  uint32_t submitted = 0, checked = 0;
  bool tainted = false;  // the input wrote one of the daemon's words
  for (int op = 0; op < 24 && in.remaining() > 0; ++op) {
    bool publish = true;
    switch (in.Range(0, 5)) {
      case 0:
      case 1: {  // a rig-built request, a few bytes changed
        v1::StepRequest r =
            w.rig->Step(in.Bool() ? w.session.id : "", w.registration,
                        static_cast<uint64_t>(in.Range(0, 40)),
                        static_cast<int>(in.Range(1, 4)));
        std::string bytes = r.SerializeAsString();
        for (int64_t k = in.Range(0, 3); k > 0 && !bytes.empty(); --k) {
          bytes[static_cast<size_t>(
              in.Range(0, static_cast<int64_t>(bytes.size()) - 1))] =
              static_cast<char>(in.Byte());
        }
        uint8_t* slot = v.request_slot(submitted);
        const size_t n = std::min<size_t>(bytes.size(), v.request_capacity());
        std::memcpy(slot + kStepRingSlotHeaderBytes, bytes.data(), n);
        StepRingView::length(slot).store(static_cast<uint32_t>(n));
        ++submitted;
        break;
      }
      case 2: {  // raw bytes and any length word
        uint8_t* slot = v.request_slot(submitted);
        const std::string bytes = in.Bytes(64);
        std::memcpy(slot + kStepRingSlotHeaderBytes, bytes.data(),
                    bytes.size());
        StepRingView::length(slot).store(static_cast<uint32_t>(in.Int32()));
        ++submitted;
        break;
      }
      case 3:  // the counter set to anything
        submitted = static_cast<uint32_t>(in.Int32());
        break;
      case 4: {  // a byte anywhere in the request slots, no publish
        const int64_t at = in.Range(0, kSlots * kRequestBytes - 1);
        v.request_slot(0)[at] = in.Byte();
        publish = false;
        break;
      }
      case 5: {  // one of the daemon's words
        const int64_t offsets[] = {kStepRingDaemonSleepingOffset,
                                   kStepRingDoneOffset, kStepRingStateOffset,
                                   kStepRingMessageOffset};
        v.word(offsets[in.Range(0, 3)])
            .store(static_cast<uint32_t>(in.Int32()));
        tainted = true;
        publish = false;
        break;
      }
    }
    if (!publish) continue;
    v.submitted().store(submitted);
    StepRingWake(v.raw(kStepRingSubmittedOffset));
    // Once the input wrote the daemon's words they say nothing about the
    // daemon: the ring goes on being fed, unchecked, and must still close.
    if (tainted) continue;
    AwaitAndCheck(v, submitted, &checked);
    if (v.state().load() != kStepRingOpen) break;
  }
  // Closing always works, whatever the ring went through.
  FUZZ_CHECK(rings->CloseRing(*caller, info.ring_id()).ok(), "close");
  FUZZ_CHECK(tainted || v.state().load() != kStepRingOpen,
             "still open after close");
  return 0;
}
