// The scheduler's CPU per step (issue 13): unary sync Step, unary callback
// Step, StepStream and a step ring (docs/STEP_PATH.md "Step ring"; opened
// as the companion socket opens it, mapped as a scheduler maps it) against
// the Step service in this process with
// FakeEngine registrations (step_test_rig.h: a CPU backend, no GPU; each
// step reported finished after its reply, outside the measured time), at
// each batch
// of --batches, in one run. Requests are sized like step_benchmark's
// decode steps (B tokens and sequences: slot mapping, seq_lens,
// query_lens, SWA states, block tables [B][64]). As a scheduler does it
// (tests/gpu/step_scheduler.cc): one StepRequest reused, its step id set
// per step; one ClientContext per unary call; one stream for the whole
// run, one Write and one Read per step; one ring for the whole run, one
// Submit and one Collect per step.
//
//   bazel run -c opt //server/step:step_stream_benchmark -- --steps=3000
//
// Per mode: the sending thread's CPU per step (CLOCK_THREAD_CPUTIME_ID
// around the call; the callback API's completion runs on a gRPC thread
// and is not in it), the process CPU per step (client and server
// threads: the server runs here; over the calls only), wall-clock p50 and
// p99 per step, and how often a step was sent again because two were in
// flight (0: each is reported finished before the next). Then the ratios
// stream / unary sync, stream / unary callback and ring / stream of the
// same run.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/step_ring.h"
#include "grpcpp/grpcpp.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "server/step/step_test_rig.h"
#include "spdlog/spdlog.h"
#include "tests/malloc_flag.h"

ABSL_FLAG(std::string, batches, "1,256", "B values (decode tokens)");
ABSL_FLAG(int, steps, 3000, "measured steps per mode and batch");
ABSL_FLAG(int, warmup, 300, "unmeasured steps first");
ABSL_FLAG(int, idle_us, 0,
          "the scheduler sleeps this long after each step (outside the "
          "measured time), as it idles while the GPU runs an engine step");
ABSL_FLAG(bool, idle_spin, false,
          "spend --idle_us spinning on the clock (no system calls) instead "
          "of sleeping: a scheduler whose core never idles");

namespace kvdepot::step {
namespace {

double Clock(clockid_t id) {
  timespec t;
  clock_gettime(id, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

struct Result {
  double thread_cpu_us = 0;  // mean
  double process_cpu_us = 0;
  double wall_p50_us = 0;
  double wall_p99_us = 0;
  int retries = 0;
};

// Sends one step (the request's step id set); the reply's status.
using SendFn = std::function<grpc::Status(const v1::StepRequest&)>;

// Runs warmup + steps sends, step ids from *next_step on. After each
// reply (outside the measured time) the step is reported finished, as the
// GPU would have finished it by the next engine step, so no step finds two
// in flight; a refusal would be sent again (counted).
absl::StatusOr<Result> Measure(const SendFn& send, FakeEngine* engine,
                               v1::StepRequest* request, uint64_t* next_step) {
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int steps = absl::GetFlag(FLAGS_steps);
  std::vector<double> wall;
  wall.reserve(steps);
  Result r;
  double thread_us = 0, process_us = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    request->set_step_id((*next_step)++);
    const double c0 = Clock(CLOCK_THREAD_CPUTIME_ID);
    const double p0 = Clock(CLOCK_PROCESS_CPUTIME_ID);
    const double t0 = Clock(CLOCK_MONOTONIC);
    grpc::Status s;
    for (int attempt = 0; attempt < 100000; ++attempt) {
      s = send(*request);
      if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
      if (i >= warmup) ++r.retries;
    }
    const double t1 = Clock(CLOCK_MONOTONIC);
    const double p1 = Clock(CLOCK_PROCESS_CPUTIME_ID);
    const double c1 = Clock(CLOCK_THREAD_CPUTIME_ID);
    if (!s.ok()) {
      return absl::InternalError(
          absl::StrCat("step ", request->step_id(), ": ", s.error_message()));
    }
    engine->FinishOne();
    if (const int idle = absl::GetFlag(FLAGS_idle_us); idle > 0) {
      if (absl::GetFlag(FLAGS_idle_spin)) {
        const double until = Clock(CLOCK_MONOTONIC) + idle;
        while (Clock(CLOCK_MONOTONIC) < until) {
        }
      } else {
        absl::SleepFor(absl::Microseconds(idle));
      }
    }
    if (i < warmup) continue;
    wall.push_back(t1 - t0);
    thread_us += c1 - c0;
    process_us += p1 - p0;
  }
  r.thread_cpu_us = thread_us / steps;
  r.process_cpu_us = process_us / steps;
  std::sort(wall.begin(), wall.end());
  r.wall_p50_us = wall[wall.size() / 2];
  r.wall_p99_us = wall[std::min(wall.size() - 1, wall.size() * 99 / 100)];
  return r;
}

void Print(const char* mode, int batch, const Result& r) {
  std::printf("%-15s %5d %10.1f %10.1f %10.1f %10.1f %8d\n", mode, batch,
              r.thread_cpu_us, r.process_cpu_us, r.wall_p50_us, r.wall_p99_us,
              r.retries);
}

int Run() {
  std::vector<int> batches;
  for (absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_batches), ',', absl::SkipEmpty())) {
    int b = 0;
    if (!absl::SimpleAtoi(p, &b) || b < 1 || b > 4096) {
      std::fprintf(stderr, "--batches: \"%s\" is not in [1, 4096]\n",
                   std::string(p).c_str());
      return 2;
    }
    batches.push_back(b);
  }
  if (absl::GetFlag(FLAGS_steps) < 1 || absl::GetFlag(FLAGS_warmup) < 1) {
    std::fprintf(stderr, "--steps and --warmup must be >= 1\n");
    return 2;
  }
  StepTestRigOptions o;
  o.auto_finish = false;  // Measure reports each step finished
  o.max_batch = *std::max_element(batches.begin(), batches.end());
  absl::StatusOr<std::unique_ptr<StepTestRig>> rig = StepTestRig::Start(o);
  if (!rig.ok()) {
    std::fprintf(stderr, "%s\n", rig.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<OpenedSession> session =
      (*rig)->OpenSession("scheduler", StepTestRig::kWorkerUid);
  if (!session.ok()) return 1;
  std::unique_ptr<v1::Step::Stub> stub =
      v1::Step::NewStub((*rig)->NewChannel());
  std::printf("%-15s %5s %10s %10s %10s %10s %8s\n", "mode", "B", "thread_us",
              "process_us", "wall_p50", "wall_p99", "retries");
  for (int batch : batches) {
    absl::StatusOr<uint64_t> reg = (*rig)->Register(session->id);
    if (!reg.ok()) {
      std::fprintf(stderr, "%s\n", reg.status().ToString().c_str());
      return 1;
    }
    v1::StepRequest request = (*rig)->Step(session->id, *reg, 1, batch);
    std::fprintf(stderr, "B=%d: request %zu bytes\n", batch,
                 request.ByteSizeLong());
    uint64_t next = 1;
    v1::StepResponse reply;
    SendFn sync = [&](const v1::StepRequest& r) {
      grpc::ClientContext ctx;
      return stub->Step(&ctx, r, &reply);
    };
    SendFn callback = [&](const v1::StepRequest& r) {
      grpc::ClientContext ctx;
      grpc::Status status;
      absl::Notification done;
      stub->async()->Step(&ctx, &r, &reply, [&](grpc::Status s) {
        status = std::move(s);
        done.Notify();
      });
      done.WaitForNotification();
      return status;
    };
    grpc::ClientContext stream_ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
        stream = stub->StepStream(&stream_ctx);
    SendFn streamed = [&](const v1::StepRequest& r) {
      if (!stream->Write(r) || !stream->Read(&reply)) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended");
      }
      return grpc::Status(static_cast<grpc::StatusCode>(reply.error_code()),
                          reply.error_message());
    };
    // The ring: sized for this request, twice over.
    const int64_t request_bytes = std::max<int64_t>(
        kStepRingMinRequestBytes,
        (2 * static_cast<int64_t>(request.ByteSizeLong()) + 63) / 64 * 64);
    absl::StatusOr<Caller> caller =
        (*rig)->sessions()->Authenticate(session->id, absl::Now());
    v1::StepRingInfo info;
    absl::StatusOr<UniqueFd> fd =
        caller.ok() ? (*rig)->step()->rings()->OpenRing(
                          *caller, session->id, 4, request_bytes,
                          MemoryReservation(), &info)
                    : absl::StatusOr<UniqueFd>(caller.status());
    absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
        fd.ok() ? StepRingClient::Map(*std::move(fd),
                                      StepRingBytes(4, request_bytes), info)
                : absl::StatusOr<std::unique_ptr<StepRingClient>>(fd.status());
    if (!ring.ok()) {
      std::fprintf(stderr, "ring: %s\n", ring.status().ToString().c_str());
      return 1;
    }
    SendFn ringed = [&](const v1::StepRequest& r) {
      absl::StatusOr<v1::StepResponse> out =
          (*ring)->Step(r, absl::Seconds(10));
      if (!out.ok()) {
        return grpc::Status(static_cast<grpc::StatusCode>(out.status().code()),
                            std::string(out.status().message()));
      }
      return grpc::Status(static_cast<grpc::StatusCode>(out->error_code()),
                          out->error_message());
    };
    std::vector<std::pair<const char*, SendFn*>> modes = {
        {"unary_sync", &sync},
        {"unary_callback", &callback},
        {"stream", &streamed},
        {"ring", &ringed}};
    std::vector<Result> results;
    for (auto& [name, send] : modes) {
      absl::StatusOr<Result> r =
          Measure(*send, (*rig)->factory()->last(), &request, &next);
      if (!r.ok()) {
        std::fprintf(stderr, "%s B=%d: %s\n", name, batch,
                     r.status().ToString().c_str());
        return 1;
      }
      Print(name, batch, *r);
      results.push_back(*r);
    }
    stream->WritesDone();
    grpc::Status end = stream->Finish();
    if (!end.ok()) {
      std::fprintf(stderr, "stream: %s\n", end.error_message().c_str());
    }
    std::printf(
        "B=%d stream/sync: thread %.2f wall %.2f; stream/callback: thread "
        "%.2f wall %.2f; ring/stream: thread %.2f process %.2f wall %.2f\n",
        batch, results[2].thread_cpu_us / results[0].thread_cpu_us,
        results[2].wall_p50_us / results[0].wall_p50_us,
        results[2].thread_cpu_us / results[1].thread_cpu_us,
        results[2].wall_p50_us / results[1].wall_p50_us,
        results[3].thread_cpu_us / results[2].thread_cpu_us,
        results[3].process_cpu_us / results[2].process_cpu_us,
        results[3].wall_p50_us / results[2].wall_p50_us);
  }
  return 0;
}

}  // namespace
}  // namespace kvdepot::step

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvdepot::testing::ApplyMallocKeepFreedFlag();
  spdlog::set_level(spdlog::level::warn);
  return kvdepot::step::Run();
}
