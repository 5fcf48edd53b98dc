// A scheduler in a child process for step_benchmark (step_scheduler.cc and
// step_scheduler.py speak this protocol): the benchmark writes one step id
// per line when the worker is ready for it, the child sends the Step and
// answers (a step refused because two are in flight is sent again by the
// child: step_send_retry.h); at the end the child reports its own process
// CPU over the steps and how often it sent a step again.
#ifndef KVDEPOT_TESTS_GPU_STEP_BENCH_SCHED_H_
#define KVDEPOT_TESTS_GPU_STEP_BENCH_SCHED_H_

#include <stdio.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvdepot::testing {

class SchedulerProcess {
 public:
  // Spawns argv[0] with argv (stdin and stdout are pipes to this process).
  static absl::StatusOr<std::unique_ptr<SchedulerProcess>> Start(
      const std::vector<std::string>& argv);
  SchedulerProcess(const SchedulerProcess&) = delete;
  SchedulerProcess& operator=(const SchedulerProcess&) = delete;
  // Closes the pipes, SIGKILLs and reaps a child that is still running.
  ~SchedulerProcess();

  // Sends step `step_id`: OK when the daemon accepted it, else the daemon's
  // code and message (or INTERNAL when the child died).
  absl::Status Send(uint64_t step_id);
  // Ends the child: its process CPU per step in us, over the steps after
  // the first (which pays for the channel's lazy setup).
  absl::StatusOr<double> Finish();
  // After Finish: how many times the child sent a step again because two
  // were in flight (0 from a child that does not report it).
  int retries() const { return retries_; }

 private:
  SchedulerProcess() = default;
  absl::StatusOr<std::string> Line();

  pid_t pid_ = -1;
  FILE* to_ = nullptr;    // the child's stdin
  FILE* from_ = nullptr;  // the child's stdout
  int retries_ = 0;       // reported by Finish
};

// Where the scheduler programs are: beside this binary (the GPU bundle's
// bin/) or, under bazel, in the runfiles tree.
std::string BesideSelf(const std::string& name);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_BENCH_SCHED_H_
