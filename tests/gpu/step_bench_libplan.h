// step_benchmark mode (a'): library mode on the daemon's step metadata
// (Step.PlanStep, docs/LIBRARY_MODE.md). Per step the scheduler thread
// sends PlanStep and copies the reply into pinned memory; the worker's
// stream uploads it with one copy and runs kvdepot's CUDA entry points
// (libkvdepot_kernels) on pointers into it: per layer the three stores
// and convert_topk, once per step the SWA decode index, with `work_us` of
// worker GPU work before every phase as in mode (a). The entry points
// check their device arrays in a kernel of their own before the store or
// index kernel (LIBRARY_MODE.md); mode (a) launches the daemon's
// launchers without it, so (a') - (a) is what an engine pays for the
// checks, the upload and the in-place convert's input copy below.
// With the rig's device-resident block tables (the default, as mode (c)
// runs) the request carries none and convert_topk reads the worker's own
// copy of them. kvdk_convert_topk_cuda converts in place: each layer's top-k
// rows are first copied (device to device) into its index rows, the rows the
// other modes write, so the benchmark can compare them.
#ifndef KVDEPOT_TESTS_GPU_STEP_BENCH_LIBPLAN_H_
#define KVDEPOT_TESTS_GPU_STEP_BENCH_LIBPLAN_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvdepot/v1/step.pb.h"
#include "libkvdepot/kvdepot_kernels.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_harness.h"

namespace kvdepot::testing {

class PlanLibraryMode {
 public:
  // `in` is the step replayed every time (its rows are in the rig's
  // buffer, as modes (a) and (c) left them).
  static absl::StatusOr<std::unique_ptr<PlanLibraryMode>> Create(
      StepRig* rig, const StepInput& in);
  ~PlanLibraryMode();

  // One step; `start` (may be null) is recorded on `s` once PlanStep
  // replied, before the step's first work; `events` (may be null): [2 *
  // phases] around each phase's kernels. Adds the scheduler thread's CPU
  // and wall time in PlanStep (the call and the copy into pinned memory)
  // to *plan_cpu_us and *plan_wall_us.
  absl::Status Step(cudaStream_t s, int work_us, cudaEvent_t start,
                    std::vector<cudaEvent_t>* events, double* plan_cpu_us,
                    double* plan_wall_us);

 private:
  PlanLibraryMode() = default;
  absl::Status Launch(cudaStream_t s, int work_us, cudaEvent_t start,
                      std::vector<cudaEvent_t>* events);

  StepRig* rig_ = nullptr;
  int n_ = 0;
  v1::StepRequest request_;
  v1::PlanStepResponse reply_;
  kvdk_layout* main_ = nullptr;
  kvdk_layout* swa_ = nullptr;
  kvdk_layout* index_ = nullptr;
  std::unique_ptr<Pinned> staging_;  // the reply's metadata
  void* metadata_ = nullptr;         // its device copy
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;
  unsigned long long* invalid_ = nullptr;  // device counter
  // The worker's own block tables ([seqs][cols]) when the rig keeps them
  // in device memory; else the reply's row tables.
  void* tables_ = nullptr;
};

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_BENCH_LIBPLAN_H_
