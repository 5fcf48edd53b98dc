// Latency measurement shared by the RPC benchmarks (server/rpc_benchmark,
// tests/gpu/rpc_device_benchmark): p50 / p99 / mean of a call, and the
// floor every request over a Unix socket pays, measured in the same run.
#ifndef KVDEPOT_TESTS_RPC_TIMING_H_
#define KVDEPOT_TESTS_RPC_TIMING_H_

#include <functional>
#include <string>

#include "absl/status/status.h"

namespace kvdepot::testing {

struct Timing {
  std::string name;
  double p50_us = 0, p99_us = 0, mean_us = 0;
};

// Calls `call` warmup times unmeasured, then iterations times, each timed
// alone. A failed call ends the process with its status on stderr (a
// benchmark has nothing sensible to report then).
Timing MeasureCalls(const std::string& name, int warmup, int iterations,
                    const std::function<absl::Status()>& call);

// A 1-byte ping-pong between this thread and an echo thread on a
// socketpair(AF_UNIX, SOCK_STREAM).
Timing SocketPingPong(int warmup, int iterations);

// The same ping-pong with this thread spinning on its reply (non-blocking
// reads) instead of sleeping in read; the echo thread still sleeps, as a
// server does. The floor for a client that spins on its replies.
Timing SocketPingPongSpinning(int warmup, int iterations);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_RPC_TIMING_H_
