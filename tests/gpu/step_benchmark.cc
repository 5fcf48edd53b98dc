// step_benchmark (issue 13 item 1): a DeepSeek-V3.2-like decode step of L
// layers, per layer phase A (V41 main store, V41 SWA store, index-cache
// store in FP4_INDEX or MXFP8_INDEX) and phase B (convert_topk, B queries
// x top-k), the SWA decode index once per step; side by side in one run:
//   (a) library mode: the same kernels launched by the worker on its own
//       stream (the floor);
//   (a') library mode on the daemon's metadata (step_bench_libplan.h):
//       PlanStep per step, the reply uploaded, the kvdk CUDA entry points;
//       its index rows checked against the step path's;
//   (c) the step path: kvdepotd (child process) on a registration, the
//       worker's stream marking and waiting per phase;
// each with X us of synthetic worker GPU work before every phase. Reported
// per step: worker-stream time (GPU events), per-phase handoff (events
// around mark..wait) minus the same phase's kernel time in library mode,
// the bare doorbell round trip of the same run (a registration whose
// phases run only the gate kernel), the daemon's CPU time (/proc, with the
// busiest daemon threads by name) and the scheduler's (this thread's CPU
// clock around Step);
//   (b) per-layer RPCs (step_bench_rpc.h): Store x3 with the CUDA backend's
//       events per layer, ConvertTopk and SwaDecodeIndex inline, fewer
//       steps (--steps_b: it is slow);
// and for (c) the process CPU of schedulers in their own process
// (step_scheduler.cc with the sync and the callback API and a StepStream,
// step_scheduler.py)
// sending the same StepRequests. Subsets: --modes, --batches, --work_us,
// --index_formats, --external_schedulers. --malloc_keep_freed_mb applies
// to this process and its scheduler processes (the daemon takes its own
// flag of that name through --daemon_flags). The first line says whether
// MPS is on (the step path's rows mean little without it).
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "kernels/cuda/kernels.h"
#include "planner/plan.h"
#include "server/step/step_kernels.h"
#include "tests/daemon_process.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_bench_kernels.h"
#include "tests/gpu/step_bench_libplan.h"
#include "tests/gpu/step_bench_rpc.h"
#include "tests/gpu/step_bench_sched.h"
#include "tests/gpu/step_harness.h"
#include "tests/gpu/step_send_retry.h"
#include "tests/malloc_flag.h"

ABSL_FLAG(int, layers, 61, "layers per step");
ABSL_FLAG(std::string, batches, "1,64,256,1024", "B values (decode tokens)");
ABSL_FLAG(std::string, work_us, "0,50,200", "synthetic worker work per phase");
ABSL_FLAG(std::string, index_formats, "FP4_INDEX,MXFP8_INDEX",
          "index-cache formats");
ABSL_FLAG(int, top_k, 2048, "top-k per query");
ABSL_FLAG(int, steps, 30, "measured steps per configuration");
ABSL_FLAG(std::string, json, "", "also write the rows as JSON here");
ABSL_FLAG(std::string, modes, "a,p,b,c",
          "modes to run: a = library, p = library on PlanStep's metadata "
          "(a'), b = per-layer RPCs, c = step path");
ABSL_FLAG(int, steps_b, 5, "measured steps of mode (b) per configuration");
ABSL_FLAG(
    std::string, external_schedulers, "cpp_sync,cpp_callback,cpp_stream,python",
    "schedulers in their own process measured on (c): cpp_sync, "
    "cpp_callback, cpp_stream, cpp_stream_spin, cpp_ring (step_scheduler "
    "--api=sync, callback, stream, stream_spin, ring), each also with the "
    "suffixes _busy (--busy_between_steps: "
    "a scheduler core that never idles) and then _nobdp (--bdp_probe="
    "false); python, python_ring (step_scheduler.py --api=unary, ring)");
ABSL_FLAG(std::string, python, "python3", "the interpreter of python");
ABSL_FLAG(bool, device_block_tables, true,
          "the registrations keep their block tables in device memory "
          "(StepRequest.block_tables_in_buffer: the Steps carry none); false "
          "= every Step carries [B][64] int32 tables inline");
ABSL_FLAG(bool, device_slot_mappings, false,
          "the registrations keep their slot mappings in device memory "
          "(StepRequest.slot_mappings_in_buffer: the Steps carry none, the "
          "schedulers send num_tokens only)");
ABSL_FLAG(std::string, scheduler_api, "stream",
          "how this process's scheduler (sch_c) sends Steps on (c): stream "
          "(one StepStream), unary (a sync Step call each) or ring (one step "
          "ring on the rig's companion connection)");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "extra kvdepotd flags, comma-separated (e.g. --step_graphs=false)");

namespace kvdepot::testing {
namespace {

std::vector<int> Ints(const std::string& csv) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(csv, ',')) {
    int v = 0;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

double ThreadCpuUs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

// utime + stime of `pid` in microseconds.
double ProcessCpuUs(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  if (fields.size() < 13) return 0;
  double ut = 0, st = 0;
  absl::SimpleAtod(fields[11], &ut);
  absl::SimpleAtod(fields[12], &st);
  return (ut + st) * 1e6 / sysconf(_SC_CLK_TCK);
}

// CPU us of each thread of `pid`, summed by thread name.
std::map<std::string, double> ThreadCpuUs(pid_t pid) {
  std::map<std::string, double> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(dir + "/" + e->d_name + "/stat");
    std::string line;
    std::getline(f, line);
    const size_t open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::vector<std::string> fields =
        absl::StrSplit(line.substr(close + 2), ' ');
    double ut = 0, st = 0;
    if (fields.size() < 13 || !absl::SimpleAtod(fields[11], &ut) ||
        !absl::SimpleAtod(fields[12], &st)) {
      continue;
    }
    out[line.substr(open + 1, close - open - 1)] +=
        (ut + st) * 1e6 / sysconf(_SC_CLK_TCK);
  }
  closedir(d);
  return out;
}

// "name us, ..." of the busiest thread names between two samples, per step.
std::string BusiestThreads(const std::map<std::string, double>& before,
                           const std::map<std::string, double>& after,
                           int steps) {
  std::vector<std::pair<double, std::string>> d;
  for (const auto& [name, us] : after) {
    auto it = before.find(name);
    const double delta = us - (it == before.end() ? 0.0 : it->second);
    if (delta > 0) d.push_back({delta / steps, name});
  }
  std::sort(d.rbegin(), d.rend());
  std::string out;
  for (size_t i = 0; i < d.size() && i < 4; ++i) {
    absl::StrAppend(&out, i ? ", " : "", d[i].second, " ",
                    static_cast<int>(d[i].first));
  }
  return out.empty() ? "-" : out;
}

struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(size_t n) : e(n) {
    for (cudaEvent_t& x : e) cudaEventCreate(&x);
  }
  ~Events() {
    for (cudaEvent_t x : e) cudaEventDestroy(x);
  }
  float Ms(size_t a, size_t b) const {
    float ms = 0;
    cudaEventElapsedTime(&ms, e[a], e[b]);
    return ms;
  }
};

// Mean of (after wait - before mark) over the A and B phases, in us.
double MeanPhaseUs(const Events& ev, int phases) {
  double sum = 0;
  for (int p = 1; p < phases; ++p) sum += ev.Ms(2 * p, 2 * p + 1);
  return 1000.0 * sum / (phases - 1);
}

absl::Status Spin(int us, cudaStream_t s) {
  return Cuda(static_cast<cudaError_t>(LaunchSpin(int64_t{us} * 1000, s)),
              "spin");
}

// Library mode: the step's kernels launched by the worker on its stream.
class LibraryMode {
 public:
  absl::Status Init(StepRig* rig, const StepInput& in) {
    rig_ = rig;
    const RigOptions& o = rig->options();
    n_ = in.num_tokens();
    SequenceBatch batch;
    batch.seqlen_k = in.seq_lens;
    batch.seqlen_q = in.query_lens;
    batch.state_ids = in.states;
    std::vector<int32_t> swa(n_), state(n_), start(n_), valid(n_), row(n_);
    RETURN_IF_ERROR(BuildSwaStoreSlots(batch, {o.ring, o.ring, o.states},
                                       absl::MakeSpan(swa)));
    RETURN_IF_ERROR(ComputeSwaDecodeWindows(
        batch, {o.window, o.ring, o.states}, absl::MakeSpan(state),
        absl::MakeSpan(start), absl::MakeSpan(valid)));
    int r = 0;
    for (size_t b = 0; b < in.query_lens.size(); ++b) {
      for (int j = 0; j < in.query_lens[b]; ++j) row[r++] = b;
    }
    std::vector<int32_t> blob;
    auto add = [&](const std::vector<int32_t>& v) {
      const size_t at = blob.size();
      blob.insert(blob.end(), v.begin(), v.end());
      blob.resize((blob.size() + 3) / 4 * 4, 0);
      return at;
    };
    off_slots_ = add(in.slots);
    off_swa_ = add(swa);
    off_state_ = add(state);
    off_start_ = add(start);
    off_valid_ = add(valid);
    off_row_ = add(row);
    off_lens_ = add(in.seq_lens);
    off_tables_ = add(in.block_tables);
    off_gate_ = add({1, 0, 0, 0});
    off_scratch_ = add(std::vector<int32_t>(128, 0));
    RETURN_IF_ERROR(
        Cuda(cudaMalloc(reinterpret_cast<void**>(&dev_), blob.size() * 4),
             "cudaMalloc"));
    return Cuda(
        cudaMemcpy(dev_, blob.data(), blob.size() * 4, cudaMemcpyHostToDevice),
        "upload");
  }
  ~LibraryMode() {
    if (dev_ != nullptr) cudaFree(dev_);
  }

  // One step; ev (may be null) gets [2 * phases] events around the kernels.
  absl::Status Step(cudaStream_t s, int work_us, Events* ev) {
    const RigOptions& o = rig_->options();
    int32_t* d = dev_;
    auto rec = [&](size_t i) {
      if (ev != nullptr) cudaEventRecord(ev->e[i], s);
    };
    gpu::LaunchOptions lo;
    lo.stream = s;
    RETURN_IF_ERROR(Spin(work_us, s));
    rec(0);
    RETURN_IF_ERROR(
        Cuda(static_cast<cudaError_t>(step::device::LaunchSwaIndex(
                 d + off_gate_, d + off_state_, d + off_start_, d + off_valid_,
                 n_, o.window, o.ring,
                 reinterpret_cast<int32_t*>(rig_->io() + rig_->swa_out()),
                 o.window, s)),
             "swa index"));
    rec(1);
    for (int l = 0; l < o.layers; ++l) {
      const int a = 1 + 2 * l, b = 2 + 2 * l;
      RETURN_IF_ERROR(Spin(work_us, s));
      rec(2 * a);
      RETURN_IF_ERROR(
          gpu::Store(rig_->main_layout(),
                     rig_->main_pool() + rig_->main_layout().layer_offset(l),
                     rig_->io() + rig_->main_in(l), InputDtype::kBF16,
                     d + off_slots_, n_, lo));
      RETURN_IF_ERROR(
          gpu::Store(rig_->swa_layout(),
                     rig_->swa_pool() + rig_->swa_layout().layer_offset(l),
                     rig_->io() + rig_->swa_in(l), InputDtype::kBF16,
                     d + off_swa_, n_, lo));
      RETURN_IF_ERROR(
          gpu::Store(rig_->index_layout(),
                     rig_->index_pool() + rig_->index_layout().layer_offset(l),
                     rig_->io() + rig_->index_in(l), InputDtype::kBF16,
                     d + off_slots_, n_, lo));
      rec(2 * a + 1);
      RETURN_IF_ERROR(Spin(work_us, s));
      rec(2 * b);
      RETURN_IF_ERROR(Cuda(
          static_cast<cudaError_t>(step::device::LaunchConvertTopk(
              d + off_gate_,
              reinterpret_cast<const int32_t*>(rig_->io() + rig_->topk_off(l)),
              o.top_k,
              reinterpret_cast<int32_t*>(rig_->io() + rig_->out_off(l)),
              o.top_k, n_, o.top_k, d + off_row_, d + off_lens_, 1,
              d + off_tables_, o.max_blocks_per_seq, o.max_blocks_per_seq,
              static_cast<int32_t>(rig_->index_layout().block_size),
              static_cast<int32_t>(rig_->index_layout().num_blocks),
              reinterpret_cast<uint64_t*>(d + off_scratch_), s)),
          "convert_topk"));
      rec(2 * b + 1);
    }
    return absl::OkStatus();
  }

 private:
  StepRig* rig_ = nullptr;
  int32_t* dev_ = nullptr;
  int n_ = 0;
  size_t off_slots_ = 0, off_swa_ = 0, off_state_ = 0, off_start_ = 0,
         off_valid_ = 0, off_row_ = 0, off_lens_ = 0, off_tables_ = 0,
         off_gate_ = 0, off_scratch_ = 0;
};

struct Row {
  double lib_step_us = 0, lib_phase_us = 0;
  // (a') library mode on PlanStep's metadata: worker-stream time per step,
  // the scheduler thread's CPU and wall time in PlanStep per step.
  double plan_step_us = 0, plan_cpu_us = 0, plan_wall_us = 0;
  // (c) the step path and (b) per-layer RPCs: worker-stream time per step,
  // mean mark..wait (or hand-over..back) per phase, daemon process CPU and
  // scheduler thread CPU per step, the daemon's busiest threads.
  double path_step_us = 0, handoff_us = 0, daemon_cpu_us = 0, sched_cpu_us = 0;
  double rpc_step_us = 0, rpc_phase_us = 0, rpc_daemon_cpu_us = 0,
         rpc_sched_cpu_us = 0;
  std::string path_threads, rpc_threads, path_phases;
  // (c): steps sent again because two were in flight (step_send_retry.h).
  int path_retries = 0;
  // (c) with a scheduler in its own process: name, process CPU per step,
  // steps it sent again.
  struct External {
    std::string name;
    double cpu_us = 0;
    int retries = 0;
  };
  std::vector<External> external;
};

// How (c) gets its steps sent.
using Sender = std::function<absl::Status(StepInput&)>;

// The index rows of layers 0 and L-1 and the SWA index rows (n tokens).
absl::StatusOr<std::vector<uint8_t>> ReadRows(StepRig* rig, int n) {
  const RigOptions& o = rig->options();
  const int64_t topk = int64_t{n} * o.top_k * 4,
                swa = int64_t{n} * o.window * 4;
  std::vector<uint8_t> out(2 * topk + swa);
  RETURN_IF_ERROR(Cuda(cudaMemcpy(out.data(), rig->io() + rig->out_off(0), topk,
                                  cudaMemcpyDeviceToHost),
                       "reading rows"));
  RETURN_IF_ERROR(
      Cuda(cudaMemcpy(out.data() + topk, rig->io() + rig->out_off(o.layers - 1),
                      topk, cudaMemcpyDeviceToHost),
           "reading rows"));
  RETURN_IF_ERROR(
      Cuda(cudaMemcpy(out.data() + 2 * topk, rig->io() + rig->swa_out(), swa,
                      cudaMemcpyDeviceToHost),
           "reading rows"));
  return out;
}

// Fills those rows with 0xFF bytes (what no mode writes there).
absl::Status ClearRows(StepRig* rig, const StepInput& in) {
  const RigOptions& o = rig->options();
  const int64_t n = in.num_tokens();
  RETURN_IF_ERROR(
      Cuda(cudaMemset(rig->io() + rig->out_off(0), 0xFF, n * o.top_k * 4),
           "clearing rows"));
  RETURN_IF_ERROR(Cuda(
      cudaMemset(rig->io() + rig->out_off(o.layers - 1), 0xFF, n * o.top_k * 4),
      "clearing rows"));
  return Cuda(cudaMemset(rig->io() + rig->swa_out(), 0xFF, n * o.window * 4),
              "clearing rows");
}

// The bare doorbell round trip: a registration of `layers` empty layers.
absl::StatusOr<double> BareRoundTripUs(const std::string& socket, int layers,
                                       int steps, cudaStream_t s) {
  RigOptions o;
  o.prefix = "bench_bare";
  o.layers = layers;
  o.bare = true;
  o.delete_pools = true;
  ASSIGN_OR_RETURN(std::unique_ptr<StepRig> rig, StepRig::Create(socket, o));
  std::mt19937 rng(7);
  StepInput in = rig->RandomStep(1, rng);
  const int phases = 1 + 2 * layers;
  Events ev(2 * phases);
  WorkerHooks hooks;
  hooks.phase_events = &ev.e;
  double sum = 0;
  for (int i = 0; i < steps + 1; ++i) {
    in.step_id = i + 1;
    RETURN_IF_ERROR(rig->SendStep(in).status());
    RETURN_IF_ERROR(rig->EnqueueWorker(s, false, hooks));
    RETURN_IF_ERROR(SyncWithin(s, absl::Seconds(60)));
    if (i > 0) sum += MeanPhaseUs(ev, phases);  // the first one warms up
  }
  return sum / steps;
}

// (a'): as MeasureLibrary, PlanStep on this thread before each step.
absl::Status MeasurePlanLibrary(PlanLibraryMode* plan, int phases, int work_us,
                                int steps, cudaStream_t s, Row* row) {
  Events step_ev(2), ev(2 * phases);
  double cpu = 0, wall = 0;
  for (int i = 0; i < steps + 1; ++i) {
    if (i == 1) cpu = wall = 0;  // the first one warms up
    // The step's stream time from before its first work to after its last
    // kernel, as (a)'s; PlanStep's time is the scheduler's, counted apart.
    RETURN_IF_ERROR(plan->Step(s, work_us, step_ev.e[0], &ev.e, &cpu, &wall));
    cudaEventRecord(step_ev.e[1], s);
    RETURN_IF_ERROR(SyncWithin(s, absl::Seconds(60)));
    if (i == 0) continue;
    row->plan_step_us += 1000.0 * step_ev.Ms(0, 1) / steps;
  }
  row->plan_cpu_us = cpu / steps;
  row->plan_wall_us = wall / steps;
  return absl::OkStatus();
}

absl::Status MeasureLibrary(LibraryMode* lib, int phases, int work_us,
                            int steps, cudaStream_t s, Row* row) {
  Events step_ev(2), lib_ev(2 * phases);
  for (int i = 0; i < steps + 1; ++i) {
    cudaEventRecord(step_ev.e[0], s);
    RETURN_IF_ERROR(lib->Step(s, work_us, &lib_ev));
    cudaEventRecord(step_ev.e[1], s);
    RETURN_IF_ERROR(SyncWithin(s, absl::Seconds(60)));
    if (i == 0) continue;
    row->lib_step_us += 1000.0 * step_ev.Ms(0, 1) / steps;
    row->lib_phase_us += MeanPhaseUs(lib_ev, phases) / steps;
  }
  return absl::OkStatus();
}

// (c) the step path: step s+1 is sent while the worker runs step s. The
// first step warms up and is not timed; CPU is counted over all of them.
// Step s+1 goes out once the worker's stream finished step s-1, which can
// be before the daemon stops counting s-1 in flight (its completion report
// comes after that): `send` sends a refused step again (step_send_retry.h).
struct PathResult {
  double step_us = 0, phase_us = 0, daemon_cpu_us = 0;
  std::string threads;
  // The phases' shape: the median over phases of their mean time, and the
  // slowest phases with their means (a few slow phases or all of them).
  std::string phase_profile;
};

// "median M us; slowest: A_0 S0 us, B_3 S1 us, ..." from per-phase sums.
std::string PhaseProfile(const std::vector<double>& sum_ms, int steps) {
  std::vector<std::pair<double, int>> us;
  for (size_t p = 1; p < sum_ms.size(); ++p) {
    us.push_back({1000.0 * sum_ms[p] / steps, static_cast<int>(p)});
  }
  if (us.empty()) return "";
  std::vector<std::pair<double, int>> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  std::string out = absl::StrFormat("median %.1f us; slowest:",
                                    sorted[sorted.size() / 2].first);
  for (size_t i = 0; i < 3 && i < sorted.size(); ++i) {
    const auto& [t, p] = sorted[sorted.size() - 1 - i];
    // Phase 0 is the step's begin; then A_l = 2l + 1, B_l = 2l + 2.
    absl::StrAppend(
        &out, i ? "," : "",
        absl::StrFormat(" %s_%d %.1f us", p % 2 ? "A" : "B", (p - 1) / 2, t));
  }
  return out;
}
absl::StatusOr<PathResult> MeasurePath(StepRig* rig, StepInput& in,
                                       uint64_t* next_step, int work_us,
                                       int steps, pid_t daemon, cudaStream_t s,
                                       const Sender& send) {
  const int phases = 1 + 2 * rig->options().layers;
  PathResult out;
  Events step_ev(2), path_ev(2 * phases);
  WorkerHooks hooks;
  hooks.phase_events = &path_ev.e;
  if (work_us > 0) {
    hooks.work = [work_us](cudaStream_t st) { return Spin(work_us, st); };
  }
  const double daemon0 = ProcessCpuUs(daemon);
  const std::map<std::string, double> threads0 = ThreadCpuUs(daemon);
  in.step_id = (*next_step)++;
  if (absl::Status first = send(in); !first.ok()) {
    // Nothing is on the GPU yet: the id was not used, the run can go on.
    --*next_step;
    return absl::Status(first.code(),
                        absl::StrCat("first step: ", first.message()));
  }
  std::vector<double> phase_sum_ms(phases, 0.0);
  for (int i = 0; i < steps + 1; ++i) {
    cudaEventRecord(step_ev.e[0], s);
    RETURN_IF_ERROR(rig->EnqueueWorker(s, false, hooks));
    cudaEventRecord(step_ev.e[1], s);
    if (i < steps) {
      in.step_id = (*next_step)++;
      RETURN_IF_ERROR(send(in));
    }
    RETURN_IF_ERROR(SyncWithin(s, absl::Seconds(60)));
    if (i == 0) continue;
    out.step_us += 1000.0 * step_ev.Ms(0, 1) / steps;
    out.phase_us += MeanPhaseUs(path_ev, phases) / steps;
    for (int p = 1; p < phases; ++p) {
      phase_sum_ms[p] += path_ev.Ms(2 * p, 2 * p + 1);
    }
  }
  out.daemon_cpu_us = (ProcessCpuUs(daemon) - daemon0) / (steps + 1);
  out.threads = BusiestThreads(threads0, ThreadCpuUs(daemon), steps + 1);
  out.phase_profile = PhaseProfile(phase_sum_ms, steps);
  return out;
}

// (b) per-layer RPCs (the scheduler is this thread).
absl::Status MeasureRpc(PerLayerRpcMode* rpc, int phases, int work_us,
                        int steps, pid_t daemon, cudaStream_t s, Row* row) {
  Events step_ev(2), ev(2 * phases);
  const double daemon0 = ProcessCpuUs(daemon);
  const std::map<std::string, double> threads0 = ThreadCpuUs(daemon);
  double sched = 0;
  for (int i = 0; i < steps + 1; ++i) {
    const double t0 = ThreadCpuUs();
    cudaEventRecord(step_ev.e[0], s);
    RETURN_IF_ERROR(rpc->Step(s, work_us, &ev.e));
    cudaEventRecord(step_ev.e[1], s);
    sched += ThreadCpuUs() - t0;
    RETURN_IF_ERROR(SyncWithin(s, absl::Seconds(120)));
    if (i == 0) continue;
    row->rpc_step_us += 1000.0 * step_ev.Ms(0, 1) / steps;
    row->rpc_phase_us += MeanPhaseUs(ev, phases) / steps;
  }
  row->rpc_daemon_cpu_us = (ProcessCpuUs(daemon) - daemon0) / (steps + 1);
  row->rpc_sched_cpu_us = sched / (steps + 1);
  row->rpc_threads = BusiestThreads(threads0, ThreadCpuUs(daemon), steps + 1);
  return absl::OkStatus();
}

// The argv of an external scheduler by name, or empty when unknown.
std::vector<std::string> SchedulerArgv(const std::string& name,
                                       const std::string& socket,
                                       const std::string& request) {
  const std::vector<std::string> common = {"--socket=" + socket,
                                           "--request=" + request};
  std::vector<std::string> argv;
  // cpp_<api>[_busy][_nobdp]: the suffixes add step_scheduler flags.
  absl::string_view api = name;
  std::vector<std::string> flags;
  if (absl::ConsumeSuffix(&api, "_nobdp")) flags.push_back("--bdp_probe=false");
  if (absl::ConsumeSuffix(&api, "_busy")) {
    flags.push_back("--busy_between_steps");
  }
  if (api == "cpp_sync" || api == "cpp_callback" || api == "cpp_stream" ||
      api == "cpp_stream_spin" || api == "cpp_ring") {
    argv = {BesideSelf("step_scheduler"), absl::StrCat("--api=", api.substr(4)),
            absl::StrCat("--malloc_keep_freed_mb=", MallocKeepFreedMb())};
    argv.insert(argv.end(), flags.begin(), flags.end());
  } else if (name == "python" || name == "python_ring") {
    argv = {absl::GetFlag(FLAGS_python), BesideSelf("step_scheduler.py"),
            absl::StrCat("--malloc_keep_freed_mb=", MallocKeepFreedMb())};
    if (name == "python_ring") argv.push_back("--api=ring");
  } else {
    return {};
  }
  argv.insert(argv.end(), common.begin(), common.end());
  return argv;
}

bool Has(const std::string& csv, const std::string& item) {
  for (absl::string_view p : absl::StrSplit(csv, ',')) {
    if (p == item) return true;
  }
  return false;
}

absl::StatusOr<Row> Measure(StepRig* rig, LibraryMode* lib,
                            PlanLibraryMode* plan,
                            const std::vector<uint8_t>& rows_c,
                            PerLayerRpcMode* rpc, StepInput& in,
                            uint64_t* next_step, int work_us, int steps,
                            pid_t daemon, const std::string& socket,
                            cudaStream_t s) {
  const int phases = 1 + 2 * rig->options().layers;
  const std::string modes = absl::GetFlag(FLAGS_modes);
  Row row;
  if (Has(modes, "a")) {
    RETURN_IF_ERROR(MeasureLibrary(lib, phases, work_us, steps, s, &row));
  }
  if (Has(modes, "p")) {
    RETURN_IF_ERROR(ClearRows(rig, in));
    RETURN_IF_ERROR(MeasurePlanLibrary(plan, phases, work_us, steps, s, &row));
    ASSIGN_OR_RETURN(std::vector<uint8_t> rows_p,
                     ReadRows(rig, in.num_tokens()));
    if (rows_p != rows_c) {
      return absl::InternalError(
          "mode (a') wrote other index rows than the step path");
    }
  }
  if (Has(modes, "c")) {
    double sched_cpu = 0;
    Sender inproc = [&](StepInput& step) {
      const double t0 = ThreadCpuUs();
      int retries = 0;
      const std::string api = absl::GetFlag(FLAGS_scheduler_api);
      absl::Status st = SendRespectingDepth(
          [&] {
            if (api == "ring") return rig->SendStepOnRing(step).status();
            return (api == "stream" ? rig->SendStepOnStream(step)
                                    : rig->SendStep(step))
                .status();
          },
          {}, &retries);
      row.path_retries += retries;
      sched_cpu += ThreadCpuUs() - t0;
      return st;
    };
    ASSIGN_OR_RETURN(PathResult c, MeasurePath(rig, in, next_step, work_us,
                                               steps, daemon, s, inproc));
    row.path_step_us = c.step_us;
    row.handoff_us = c.phase_us;
    row.daemon_cpu_us = c.daemon_cpu_us;
    row.path_threads = c.threads;
    row.path_phases = c.phase_profile;
    // The daemon's own view: its phases' GPU time (flag seen .. done
    // written), the median over this registration's timed steps so far.
    if (absl::StatusOr<v1::RegistrationInfo> info = rig->Status(); info.ok()) {
      absl::StrAppend(&row.path_phases, "; daemon-side phase p50 ",
                      absl::SixDigits(info->handoff_p50_us()), " us");
    }
    row.sched_cpu_us = sched_cpu / (steps + 1);
    // The same with a scheduler in its own process (its process CPU).
    const std::string request = absl::StrCat(
        "/tmp/kvdepot_step_request_", getpid(), "_", rig->options().prefix);
    {
      std::ofstream f(request, std::ios::binary);
      f << rig->Request(in).SerializeAsString();
    }
    for (const std::string& name : std::vector<std::string>(
             absl::StrSplit(absl::GetFlag(FLAGS_external_schedulers), ',',
                            absl::SkipEmpty()))) {
      std::vector<std::string> argv = SchedulerArgv(name, socket, request);
      if (argv.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--external_schedulers: unknown ", name));
      }
      ASSIGN_OR_RETURN(std::unique_ptr<SchedulerProcess> p,
                       SchedulerProcess::Start(argv));
      Sender external = [&](StepInput& step) { return p->Send(step.step_id); };
      absl::StatusOr<PathResult> r =
          MeasurePath(rig, in, next_step, work_us, steps, daemon, s, external);
      if (!r.ok() && absl::StartsWith(r.status().message(), "first step: ")) {
        // E.g. no grpc module in this python: reported, the row goes on.
        std::fprintf(stderr, "scheduler %s: %s\n", name.c_str(),
                     r.status().ToString().c_str());
        row.external.push_back({name + "(failed)", -1, 0});
        continue;
      }
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            absl::StrCat(name, ": ", r.status().message()));
      }
      ASSIGN_OR_RETURN(double cpu, p->Finish());
      row.external.push_back({name, cpu, p->retries()});
    }
    unlink(request.c_str());
  }
  if (Has(modes, "b")) {
    // What (b) writes is compared with the step path's rows afterwards.
    RETURN_IF_ERROR(ClearRows(rig, in));
    RETURN_IF_ERROR(MeasureRpc(rpc, phases, work_us,
                               absl::GetFlag(FLAGS_steps_b), daemon, s, &row));
  }
  return row;
}

int Run(int argc, char** argv) {
  SetStepEnvironment();
  absl::ParseCommandLine(argc, argv);
  ApplyMallocKeepFreedFlag();
  if (const std::string api = absl::GetFlag(FLAGS_scheduler_api);
      api != "stream" && api != "unary" && api != "ring") {
    std::fprintf(stderr,
                 "step_benchmark: --scheduler_api = \"%s\": stream, "
                 "unary or ring\n",
                 api.c_str());
    return 2;
  }
  // The scheduler's host waits (mode (b)) sleep instead of spinning, as
  // the daemon's do: its CPU figure is then what it works, not what it waits.
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess) {
    std::fprintf(stderr, "step_benchmark: no CUDA device\n");
    return 1;
  }
  // The step path is deployed with MPS (docs/STEP_PATH.md): without it the
  // doorbell round trip time-slices two contexts. Said first, so no row is
  // read without knowing.
  int mps = 0;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, 0) != cudaSuccess) {
    mps = -1;
  }
  std::printf("MPS: %s (cudaDevAttrMpsEnabled)\n",
              mps == 1 ? "on"
                       : (mps == 0 ? "OFF: the step path's rows "
                                     "time-slice two contexts"
                                   : "unknown"));
  std::vector<std::string> daemon_args = {"--backend=cuda", "--log_level=warn"};
  for (const std::string& f : absl::GetFlag(FLAGS_daemon_flags)) {
    daemon_args.push_back(f);
  }
  absl::StatusOr<std::unique_ptr<DaemonProcess>> daemon =
      DaemonProcess::Start(daemon_args, DaemonBinary());
  if (!daemon.ok()) {
    std::fprintf(stderr, "starting kvdepotd: %s\n",
                 daemon.status().ToString().c_str());
    return 1;
  }
  const std::string socket = (*daemon)->socket_path();
  absl::StatusOr<Stream> stream = Stream::Create();
  if (!stream.ok()) return 1;
  cudaStream_t s = stream->get();
  const int layers = absl::GetFlag(FLAGS_layers);
  const int steps = absl::GetFlag(FLAGS_steps);
  int rc = 0;
  std::string json = absl::StrCat("{\"mps\": ", mps, ", \"rows\": [");
  absl::StatusOr<double> bare = BareRoundTripUs(socket, layers, steps, s);
  if (!bare.ok()) {
    std::fprintf(stderr, "bare round trip: %s\n",
                 bare.status().ToString().c_str());
    rc = 1;
  } else {
    std::printf(
        "bare doorbell round trip (mark..wait, gate kernel only): "
        "%.2f us\n",
        *bare);
  }
  std::printf(
      "%-12s %5s %4s | %9s %9s %10s %6s %7s | %8s %8s %8s %6s %9s | %8s %8s "
      "%8s %8s\n",
      "index", "B", "X", "lib_us", "path_us", "rpc_us", "c/a", "b/a",
      "phase_us", "kern_us", "handoff", "/bare", "rpc_hand", "dmn_c", "sch_c",
      "dmn_b", "sch_b");
  for (const std::string& fmt : std::vector<std::string>(absl::StrSplit(
           absl::GetFlag(FLAGS_index_formats), ',', absl::SkipEmpty()))) {
    for (int b : Ints(absl::GetFlag(FLAGS_batches))) {
      RigOptions o;
      o.prefix = "bench_" + fmt + "_" + std::to_string(b);
      o.layers = layers;
      o.index_format = fmt;
      o.decode_only = true;
      o.max_tokens = b;
      o.max_seqs = b;
      o.states = b;
      o.block_size = 64;
      o.max_blocks_per_seq = 64;
      o.num_blocks = std::max(64, 2 * b / 64 + 64);
      o.ring = 128;
      o.window = 128;
      o.top_k = absl::GetFlag(FLAGS_top_k);
      o.delete_pools = true;
      o.watchdog_ms = 60000;
      o.device_block_tables = absl::GetFlag(FLAGS_device_block_tables);
      o.device_slot_mappings = absl::GetFlag(FLAGS_device_slot_mappings);
      absl::StatusOr<std::unique_ptr<StepRig>> rig = StepRig::Create(socket, o);
      if (!rig.ok()) {
        std::fprintf(stderr, "%s B=%d: %s\n", fmt.c_str(), b,
                     rig.status().ToString().c_str());
        rc = 1;
        continue;
      }
      std::mt19937 rng(1300 + b);
      StepInput in = (*rig)->RandomStep(1, rng);
      (*rig)->StageInputs(in);
      absl::Status st = (*rig)->SendStep(in).status();
      if (st.ok()) st = (*rig)->EnqueueWorker(s, true);
      if (st.ok()) st = SyncWithin(s, absl::Seconds(60));
      LibraryMode lib;
      if (st.ok()) st = lib.Init(rig->get(), in);
      PerLayerRpcMode rpc;
      if (st.ok() && Has(absl::GetFlag(FLAGS_modes), "b")) {
        st = rpc.Init(rig->get(), in);
      }
      std::unique_ptr<PlanLibraryMode> plan;
      if (st.ok() && Has(absl::GetFlag(FLAGS_modes), "p")) {
        absl::StatusOr<std::unique_ptr<PlanLibraryMode>> p =
            PlanLibraryMode::Create(rig->get(), in);
        if (p.ok()) {
          plan = *std::move(p);
        } else {
          st = p.status();
        }
      }
      // The step path's index rows of this step: mode (b) must write the
      // same (checked after the last configuration).
      absl::StatusOr<std::vector<uint8_t>> rows_c =
          st.ok() ? ReadRows(rig->get(), in.num_tokens())
                  : absl::StatusOr<std::vector<uint8_t>>(st);
      if (st.ok() && !rows_c.ok()) st = rows_c.status();
      uint64_t next = 2;
      for (int x : Ints(absl::GetFlag(FLAGS_work_us))) {
        if (!st.ok()) break;
        absl::StatusOr<Row> r =
            Measure(rig->get(), &lib, plan.get(), *rows_c, &rpc, in, &next, x,
                    steps, (*daemon)->pid(), socket, s);
        if (!r.ok()) {
          st = r.status();
          break;
        }
        if (Has(absl::GetFlag(FLAGS_modes), "b") && rows_c.ok()) {
          absl::StatusOr<std::vector<uint8_t>> rows_b =
              ReadRows(rig->get(), in.num_tokens());
          if (!rows_b.ok() || *rows_b != *rows_c) {
            st = absl::InternalError(
                "mode (b) wrote other index rows than the step path");
            break;
          }
        }
        const double handoff = r->handoff_us - r->lib_phase_us;
        const double rpc_handoff = r->rpc_phase_us - r->lib_phase_us;
        auto ratio = [](double x, double y) { return y > 0 ? x / y : 0.0; };
        std::printf(
            "%-12s %5d %4d | %9.1f %9.1f %10.1f %6.3f %7.2f | %8.2f %8.2f "
            "%8.2f %6.2f %9.1f | %8.1f %8.1f %8.1f %8.1f\n",
            fmt.c_str(), b, x, r->lib_step_us, r->path_step_us, r->rpc_step_us,
            ratio(r->path_step_us, r->lib_step_us),
            ratio(r->rpc_step_us, r->lib_step_us), r->handoff_us,
            r->lib_phase_us, handoff, bare.ok() ? ratio(handoff, *bare) : 0.0,
            rpc_handoff, r->daemon_cpu_us, r->sched_cpu_us,
            r->rpc_daemon_cpu_us, r->rpc_sched_cpu_us);
        std::string ext;
        for (const Row::External& e : r->external) {
          absl::StrAppend(&ext, ext.empty() ? "" : ", ", e.name, " ",
                          absl::SixDigits(e.cpu_us));
          if (e.retries > 0) {
            absl::StrAppend(&ext, " (", e.retries, " retries)");
          }
          absl::StrAppend(
              &json, json.back() == '[' ? "" : ",", "{\"index\": \"", fmt,
              "\", \"B\": ", b, ", \"X_us\": ", x, ", \"scheduler\": \"",
              e.name, "\", \"scheduler_process_cpu_us\": ", e.cpu_us,
              ", \"scheduler_in_flight_retries\": ", e.retries, "}");
        }
        std::printf(
            "      (c) daemon threads us/step: %s; steps sent again (2 in "
            "flight): %d\n",
            r->path_threads.c_str(), r->path_retries);
        std::printf("      (c) phases: %s\n", r->path_phases.c_str());
        if (r->plan_step_us > 0) {
          std::printf(
              "      (a') library mode on PlanStep metadata: %.1f us/step = "
              "%.3f x (a); PlanStep on the scheduler thread %.1f us CPU, "
              "%.1f us wall per step\n",
              r->plan_step_us, ratio(r->plan_step_us, r->lib_step_us),
              r->plan_cpu_us, r->plan_wall_us);
        }
        if (!r->rpc_threads.empty()) {
          std::printf("      (b) daemon threads us/step: %s\n",
                      r->rpc_threads.c_str());
        }
        if (!ext.empty()) {
          std::printf("      (c) scheduler process CPU us/step: %s\n",
                      ext.c_str());
        }
        std::fflush(stdout);
        absl::StrAppend(&json, json.back() == '[' ? "" : ",", "{\"index\": \"",
                        fmt, "\", \"B\": ", b, ", \"X_us\": ", x,
                        ", \"library_step_us\": ", r->lib_step_us,
                        ", \"plan_library_step_us\": ", r->plan_step_us,
                        ", \"plan_step_cpu_us\": ", r->plan_cpu_us,
                        ", \"plan_step_wall_us\": ", r->plan_wall_us,
                        ", \"step_path_step_us\": ", r->path_step_us,
                        ", \"phase_us\": ", r->handoff_us,
                        ", \"library_phase_kernel_us\": ", r->lib_phase_us,
                        ", \"handoff_us\": ", handoff,
                        ", \"bare_round_trip_us\": ", bare.ok() ? *bare : 0.0,
                        ", \"daemon_cpu_us\": ", r->daemon_cpu_us,
                        ", \"scheduler_cpu_us\": ", r->sched_cpu_us,
                        ", \"step_path_in_flight_retries\": ", r->path_retries,
                        ", \"rpc_step_us\": ", r->rpc_step_us,
                        ", \"rpc_phase_us\": ", r->rpc_phase_us,
                        ", \"rpc_handoff_us\": ", rpc_handoff,
                        ", \"rpc_daemon_cpu_us\": ", r->rpc_daemon_cpu_us,
                        ", \"rpc_scheduler_cpu_us\": ", r->rpc_sched_cpu_us,
                        "}");
      }
      if (!st.ok()) {
        std::fprintf(stderr, "%s B=%d: %s\n", fmt.c_str(), b,
                     st.ToString().c_str());
        rc = 1;
      }
      uint64_t bits = 0;
      kvd_status((*rig)->worker(), &bits, nullptr, nullptr, nullptr);
      if ((bits & ~uint64_t{KVD_STATUS_OUT_OF_RANGE}) != 0) {
        std::fprintf(stderr, "%s B=%d: status bits %llu\n", fmt.c_str(), b,
                     static_cast<unsigned long long>(bits));
        rc = 1;
      }
    }
  }
  std::printf(
      "columns: lib_us/path_us/rpc_us = worker-stream time per step, library "
      "mode (a), step path (c), per-layer RPCs (b); c/a, b/a their ratios "
      "(goal c/a <= 1.10 at X=200); phase_us = mean mark..wait per phase on "
      "the step path; kern_us = the same phase's kernels in library mode; "
      "handoff = phase_us - kern_us; /bare = handoff over the bare round "
      "trip (goal <= 1.1); rpc_hand = the same handoff for (b); dmn_c, sch_c "
      "= daemon process and scheduler thread CPU us per step on (c) (goal "
      "sch_c <= 150 at B=256; --scheduler_api: this thread's Steps on a "
      "StepStream, unary or a step ring), dmn_b, sch_b the same on (b); the "
      "scheduler "
      "process CPU lines are (c) driven by step_scheduler / "
      "step_scheduler.py in their own process (every thread counted)\n");
  json += "]}\n";
  if (!absl::GetFlag(FLAGS_json).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json)) << json;
  }
  absl::StatusOr<int> code = (*daemon)->Signal(SIGTERM, absl::Seconds(60));
  if (!code.ok() || *code != 0) rc = 1;
  return rc;
}

}  // namespace
}  // namespace kvdepot::testing

int main(int argc, char** argv) { return kvdepot::testing::Run(argc, argv); }
