// step_benchmark mode (b): the step driven as per-layer RPCs by a C++
// scheduler, the way a per-layer connector drives kvdepot today (the
// CUDA backend's GPU ordering, SPEC §9):
//   once per step  SwaDecodeIndex (inline reply; the daemon computes it on
//                  the host) copied into the worker's SWA index rows;
//   phase A(l)     the worker's stream records an interprocess event after
//                  its K/V; Store main (wait_event = that event, which the
//                  daemon awaits on the host, record_event), Store SWA and
//                  Store index (record_event; the same session stream keeps
//                  them in order); the worker's stream waits on the
//                  daemon's recorded event;
//   phase B(l)     the scheduler copies the worker's top-k rows to the host
//                  (it must wait for them), ConvertTopk (inline, the host's
//                  planner), and copies the reply into the index rows on
//                  the worker's stream.
// Requests are built once and reused, so the scheduler CPU reported is a
// lower bound for such a connector.
#ifndef KVDEPOT_TESTS_GPU_STEP_BENCH_RPC_H_
#define KVDEPOT_TESTS_GPU_STEP_BENCH_RPC_H_

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/cuda/cuda_events.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_harness.h"

namespace kvdepot::testing {

class PerLayerRpcMode {
 public:
  // `in` is the step replayed every time (its rows are in the rig's buffer).
  absl::Status Init(StepRig* rig, const StepInput& in);
  // One step on the worker's stream `s` with `work_us` of worker GPU work
  // before every phase; `events` (may be null): [2 * phases], recorded
  // before the phase's work is handed over and after it is back.
  absl::Status Step(cudaStream_t s, int work_us,
                    std::vector<cudaEvent_t>* events);

 private:
  absl::Status Call(const char* what, const grpc::Status& s) const;
  absl::Status StoreLayer(int l, cudaStream_t s);
  absl::Status ConvertLayer(int l, cudaStream_t s);
  absl::Status SwaIndex(cudaStream_t s);
  // The daemon's recorded event (opened once per handle).
  absl::StatusOr<cudaEvent_t> DaemonEvent(const std::string& handle);

  StepRig* rig_ = nullptr;
  int n_ = 0;
  std::unique_ptr<CudaIpcEvent> worker_event_;
  std::map<std::string, CudaIpcEvent> daemon_events_;
  std::vector<v1::StoreRequest> stores_;  // [layers][main, swa, index]
  v1::SwaDecodeIndexRequest swa_;
  v1::ConvertTopkRequest convert_;  // topk refilled per layer
  std::unique_ptr<Pinned> topk_host_, out_host_, swa_host_;
};

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_BENCH_RPC_H_
