// step_scheduler: a C++ scheduler in its own process, for step_benchmark's
// scheduler-CPU figure (docs/STEP_PATH.md). It reads one serialized
// kvdepot.v1.StepRequest (--request: session, registration, arrays) and then
// lines on stdin:
//   <step_id>   set the step id, rebuild the request's int32 arrays from the
//               scheduler's own vectors (as a real scheduler does each
//               step), send Step; answer "ok <queued>" or "err <code> <msg>"
//   q           answer "cpu_us <process CPU over the steps> steps <n>
//               retries <r>", exit
// A Step refused with RESOURCE_EXHAUSTED (the registration's two steps are
// in flight: the benchmark sends step s+2 when the worker finished step s,
// which can be before the daemon's completion report of s) is sent again
// with a short backoff for up to --in_flight_retry_ms (step_send_retry.h
// says why that, and not a wait); <r> counts those sends over all steps.
// The process CPU (every thread: gRPC's too) is counted from the end of the
// first step (which pays for lazy setup) to "q", over the steps after it;
// waiting on the pipe costs none. step_scheduler.py is the same
// in Python.
//
// Empty arrays stay empty: a request with slot_mappings_in_buffer or
// block_tables_in_buffer (step_benchmark --device_slot_mappings,
// --device_block_tables) carries only num_tokens / block_table_cols.
//
// What it does per step, and nothing else: the StepRequest, its arena of
// bytes fields and the reply are reused (their capacity stays; filling a
// field is one memcpy), and either one ClientContext per call (gRPC
// requires it) with the sync unary API (--api=sync) or the callback API
// waited on a notification (--api=callback), or one StepStream for the
// whole run (--api=stream): one Write and one Read per step, a refusal in
// the reply's error_code (the stream stays open; a stream that ended is
// opened again at the next step); --api=stream_spin is that stream through
// the async API, this thread polling for the Write and the Read instead of
// sleeping until they complete; --api=ring is one step ring for the whole
// run (client/step_ring.h): a companion connection of its own, whose
// session the request's session (the worker's, which handed this process
// the request) grants the registration once at start, then one Submit and
// one Collect per step, no gRPC call.
#include <dirent.h>
#include <poll.h>
#include <sys/resource.h>
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "client/companion_connection.h"
#include "client/step_ring.h"
#include "common/default_address.h"
#include "grpcpp/grpcpp.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "tests/gpu/step_send_retry.h"
#include "tests/malloc_flag.h"

ABSL_FLAG(std::string, socket, "", "kvdepotd's Unix socket");
ABSL_FLAG(std::string, request, "", "a serialized kvdepot.v1.StepRequest");
ABSL_FLAG(std::string, api, "sync",
          "sync, callback, stream, stream_spin or ring");
ABSL_FLAG(bool, ring_grant, true,
          "--api=ring: have the request's session grant the registration to "
          "the ring's session at start (false: the ring's session must "
          "already be allowed)");
ABSL_FLAG(int, in_flight_retry_ms, 10000,
          "how long a Step refused with RESOURCE_EXHAUSTED (two steps in "
          "flight) is sent again");
ABSL_FLAG(bool, bdp_probe, true,
          "gRPC's BDP probe pings on the channel (gRPC's default: on)");
ABSL_FLAG(bool, busy_between_steps, false,
          "spin on stdin between steps (a scheduler core that never idles); "
          "cpu_us then leaves the main thread's spinning out");

namespace kvdepot::testing {
namespace {

double ProcessCpuUs() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

double ThreadCpuUs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

// CPU us of each thread of this process ("name/tid"), from the scheduler's
// run-time accounting (/proc/self/task/*/schedstat, in ns): which threads'
// work a step's CPU is, gRPC's or the caller's.
std::map<std::string, double> ThreadsCpuUs() {
  std::map<std::string, double> out;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + e->d_name;
    std::ifstream comm(dir + "/comm"), stat(dir + "/schedstat");
    std::string name;
    double ns = 0;
    if (std::getline(comm, name) && (stat >> ns)) {
      out[name + "/" + e->d_name] = ns / 1e3;
    }
  }
  closedir(d);
  return out;
}

// Returns once std::cin has a line's bytes (or EOF) without sleeping: the
// benchmark writes one line and waits for its answer, so what is buffered
// is at most that line.
void SpinUntilReadable() {
  pollfd p{0, POLLIN, 0};
  while (std::cin.rdbuf()->in_avail() <= 0 && poll(&p, 1, 0) == 0) {
  }
}

// One int32 array field of the request: the scheduler's values and where
// they go.
struct Array {
  std::string* (v1::StepRequest::*mutable_field)();
  std::vector<int32_t> values;
};

std::vector<int32_t> Ints(const std::string& bytes) {
  std::vector<int32_t> v(bytes.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

// Refills `field` with `values` (little-endian int32, the host's order on
// every machine kvdepot runs on); the string keeps its capacity.
void Fill(std::string* field, const std::vector<int32_t>& values) {
  field->resize(values.size() * 4);
  if (!values.empty()) std::memcpy(field->data(), values.data(), field->size());
}

// --api=stream_spin: the run's StepStream through the async API, this
// thread polling its completion queue with zero timeouts until the step's
// Write and Read completed: a scheduler that never sleeps on a reply.
class SpinningStream {
 public:
  explicit SpinningStream(v1::Step::Stub* stub) : stub_(stub) {}
  SpinningStream(const SpinningStream&) = delete;
  SpinningStream& operator=(const SpinningStream&) = delete;
  ~SpinningStream() {
    if (stream_ != nullptr) {
      ctx_->TryCancel();
      grpc::Status ignored;
      stream_->Finish(&ignored, Tag(kFinish));
      Spin(1 << kFinish);
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // One step: the daemon's answer, or why the stream ended (it is opened
  // again at the next call).
  absl::Status Send(const v1::StepRequest& request, v1::StepResponse* reply) {
    if (stream_ == nullptr) {
      ctx_ = std::make_unique<grpc::ClientContext>();
      stream_ = stub_->AsyncStepStream(ctx_.get(), &cq_, Tag(kStart));
      if (Spin(1 << kStart) != (1 << kStart)) return Ended();
    }
    stream_->Write(request, Tag(kWrite));
    stream_->Read(reply, Tag(kRead));
    if (Spin((1 << kWrite) | (1 << kRead)) != ((1 << kWrite) | (1 << kRead))) {
      return Ended();
    }
    return absl::Status(static_cast<absl::StatusCode>(reply->error_code()),
                        reply->error_message());
  }

 private:
  enum Op { kStart, kWrite, kRead, kFinish };
  static void* Tag(Op op) { return reinterpret_cast<void*>(intptr_t{op} + 1); }

  // Polls until every operation in `want` completed; returns those that
  // completed with ok.
  int Spin(int want) {
    const gpr_timespec now = gpr_time_0(GPR_CLOCK_MONOTONIC);
    int done = 0, ok_mask = 0;
    while ((done & want) != want) {
      void* tag = nullptr;
      bool ok = false;
      const auto r = cq_.AsyncNext(&tag, &ok, now);
      if (r == grpc::CompletionQueue::SHUTDOWN) break;
      if (r != grpc::CompletionQueue::GOT_EVENT) continue;
      const int op = static_cast<int>(reinterpret_cast<intptr_t>(tag) - 1);
      done |= 1 << op;
      if (ok) ok_mask |= 1 << op;
    }
    return ok_mask & want;
  }

  absl::Status Ended() {
    grpc::Status s;
    stream_->Finish(&s, Tag(kFinish));
    Spin(1 << kFinish);
    stream_.reset();
    return absl::Status(s.ok() ? absl::StatusCode::kUnavailable
                               : static_cast<absl::StatusCode>(s.error_code()),
                        s.ok() ? "the step stream ended" : s.error_message());
  }

  v1::Step::Stub* const stub_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<
      grpc::ClientAsyncReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
};

// --api=ring: opens this process's companion connection, has the
// request's session grant the registration to it, opens a ring sized for
// the request twice over and clears the request's session id (a ring's
// requests run as the ring's session).
absl::Status OpenRing(v1::Step::Stub* stub, const std::string& socket,
                      v1::StepRequest* request,
                      std::unique_ptr<CompanionConnection>* companion,
                      std::unique_ptr<StepRingClient>* ring) {
  absl::StatusOr<std::unique_ptr<CompanionConnection>> c =
      CompanionConnection::Open(CompanionSocketPathOf(socket), -1,
                                "step_scheduler");
  if (!c.ok()) return c.status();
  *companion = *std::move(c);
  if (absl::GetFlag(FLAGS_ring_grant)) {
    v1::GrantRegistrationRequest g;
    g.set_session_id(request->session_id());
    g.set_registration_id(request->registration_id());
    g.add_sessions((*companion)->hello().session_number());
    v1::GrantRegistrationResponse out;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    if (grpc::Status s = stub->GrantRegistration(&ctx, g, &out); !s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          "GrantRegistration: " + s.error_message());
    }
  }
  const int64_t bytes = std::max<int64_t>(
      kStepRingMinRequestBytes,
      (2 * static_cast<int64_t>(request->ByteSizeLong()) + 63) / 64 * 64);
  absl::StatusOr<std::unique_ptr<StepRingClient>> r =
      StepRingClient::Open(companion->get(), 4, bytes);
  if (!r.ok()) return r.status();
  *ring = *std::move(r);
  request->clear_session_id();
  return absl::OkStatus();
}

int Run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  ApplyMallocKeepFreedFlag();
  std::ifstream f(absl::GetFlag(FLAGS_request), std::ios::binary);
  std::stringstream bytes;
  bytes << f.rdbuf();
  v1::StepRequest request;
  if (!request.ParseFromString(bytes.str())) {
    std::fprintf(stderr, "step_scheduler: cannot parse --request\n");
    return 2;
  }
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api != "sync" && api != "callback" && api != "stream" &&
      api != "stream_spin" && api != "ring") {
    std::fprintf(stderr,
                 "step_scheduler: --api=%s: use sync, callback, stream, "
                 "stream_spin or ring\n",
                 api.c_str());
    return 2;
  }
  const bool callback = api == "callback";
  std::vector<Array> arrays = {
      {&v1::StepRequest::mutable_slot_mapping, Ints(request.slot_mapping())},
      {&v1::StepRequest::mutable_compressed_slot_mapping,
       Ints(request.compressed_slot_mapping())},
      {&v1::StepRequest::mutable_seq_lens, Ints(request.seq_lens())},
      {&v1::StepRequest::mutable_query_lens, Ints(request.query_lens())},
      {&v1::StepRequest::mutable_swa_state_ids, Ints(request.swa_state_ids())},
      {&v1::StepRequest::mutable_swa_valid_starts,
       Ints(request.swa_valid_starts())},
      {&v1::StepRequest::mutable_block_tables, Ints(request.block_tables())},
  };
  // StepRequest.compressed (several ratios): each entry's mapping too.
  std::vector<std::vector<int32_t>> compressed;
  for (const v1::CompressedSlots& e : request.compressed()) {
    compressed.push_back(Ints(e.slot_mapping()));
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!absl::GetFlag(FLAGS_bdp_probe)) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel("unix:" + absl::GetFlag(FLAGS_socket),
                                grpc::InsecureChannelCredentials(), args);
  std::unique_ptr<v1::Step::Stub> stub = v1::Step::NewStub(channel);
  v1::StepResponse reply;
  // --api=stream: the run's stream (opened at the first step, and again
  // after one ended).
  std::unique_ptr<grpc::ClientContext> stream_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream;
  std::optional<SpinningStream> spinning;
  if (api == "stream_spin") spinning.emplace(stub.get());
  auto stream_send = [&]() -> absl::Status {
    if (spinning.has_value()) return spinning->Send(request, &reply);
    if (stream == nullptr) {
      stream_ctx = std::make_unique<grpc::ClientContext>();
      stream = stub->StepStream(stream_ctx.get());
    }
    if (stream->Write(request) && stream->Read(&reply)) {
      return absl::Status(static_cast<absl::StatusCode>(reply.error_code()),
                          reply.error_message());
    }
    const grpc::Status s = stream->Finish();
    stream.reset();
    return absl::Status(s.ok() ? absl::StatusCode::kUnavailable
                               : static_cast<absl::StatusCode>(s.error_code()),
                        s.ok() ? "the step stream ended" : s.error_message());
  };
  // --api=ring: the connection, the grant, the ring (before any step).
  std::unique_ptr<CompanionConnection> companion;
  std::unique_ptr<StepRingClient> ring;
  if (api == "ring") {
    absl::Status s = OpenRing(stub.get(), absl::GetFlag(FLAGS_socket), &request,
                              &companion, &ring);
    if (!s.ok()) {
      std::fprintf(stderr, "step_scheduler: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto ring_send = [&]() -> absl::Status {
    absl::StatusOr<v1::StepResponse> r = ring->Step(request, absl::Seconds(10));
    if (!r.ok()) return r.status();
    reply = *std::move(r);
    return absl::Status(static_cast<absl::StatusCode>(reply.error_code()),
                        reply.error_message());
  };
  InFlightRetry retry_policy;
  retry_policy.budget =
      absl::Milliseconds(absl::GetFlag(FLAGS_in_flight_retry_ms));
  const bool busy = absl::GetFlag(FLAGS_busy_between_steps);
  double cpu0 = -1, main0 = 0, main_in_steps = 0;
  std::map<std::string, double> threads0;
  int steps = 0, retries = 0;
  std::string line;
  for (;;) {
    if (busy) SpinUntilReadable();
    const double step_t0 = ThreadCpuUs();
    if (!std::getline(std::cin, line) || line == "q") break;
    uint64_t id = 0;
    if (!absl::SimpleAtoi(line, &id)) {
      std::printf("err 3 bad line\n");
      std::fflush(stdout);
      continue;
    }
    request.set_step_id(id);
    for (const Array& a : arrays) Fill((request.*a.mutable_field)(), a.values);
    for (size_t i = 0; i < compressed.size(); ++i) {
      Fill(request.mutable_compressed(static_cast<int>(i))
               ->mutable_slot_mapping(),
           compressed[i]);
    }
    // One call; a refusal consumes no step id, so a retry sends the same
    // request again (with a fresh ClientContext, as gRPC requires).
    auto send = [&]() -> absl::Status {
      if (api == "stream" || api == "stream_spin") return stream_send();
      if (api == "ring") return ring_send();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
      grpc::Status s;
      if (callback) {
        absl::Notification done;
        stub->async()->Step(&ctx, &request, &reply, [&](grpc::Status st) {
          s = std::move(st);
          done.Notify();
        });
        done.WaitForNotification();
      } else {
        s = stub->Step(&ctx, request, &reply);
      }
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          s.error_message());
    };
    int step_retries = 0;
    const absl::Status s =
        SendRespectingDepth(send, retry_policy, &step_retries);
    retries += step_retries;
    const bool first = cpu0 < 0;
    if (first) {
      cpu0 = ProcessCpuUs();  // the first step is not counted
      main0 = ThreadCpuUs();
      threads0 = ThreadsCpuUs();
    } else {
      ++steps;
    }
    if (s.ok()) {
      std::printf("ok %d\n", reply.queued());
    } else {
      std::printf("err %d %s\n", static_cast<int>(s.code()),
                  std::string(s.message()).c_str());
    }
    std::fflush(stdout);
    if (!first) main_in_steps += ThreadCpuUs() - step_t0;
  }
  if (stream != nullptr) {
    stream->WritesDone();
    stream->Finish();
  }
  double cpu = 0;
  if (cpu0 >= 0) {
    cpu = ProcessCpuUs() - cpu0;
    // Busy: the other threads' CPU, and the main thread's only inside steps.
    if (busy) cpu = cpu - (ThreadCpuUs() - main0) + main_in_steps;
  }
  // On stderr, per step: each thread's CPU (the main thread's spinning
  // included) and the main thread's inside its steps.
  if (steps > 0) {
    std::string by_thread;
    for (const auto& [name, us] : ThreadsCpuUs()) {
      const auto it = threads0.find(name);
      const double d = us - (it == threads0.end() ? 0.0 : it->second);
      if (d >= 0.05 * steps) {
        by_thread += absl::StrFormat(" %s %.1f", name, d / steps);
      }
    }
    std::fprintf(stderr,
                 "step_scheduler: CPU us per step by thread:%s; main thread "
                 "inside steps %.1f\n",
                 by_thread.c_str(), main_in_steps / steps);
  }
  std::printf("cpu_us %.1f steps %d retries %d\n", cpu, steps, retries);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace kvdepot::testing

int main(int argc, char** argv) { return kvdepot::testing::Run(argc, argv); }
