#!/bin/bash
# One RPC round on the GPU host (issue 13 item 2): rpc_benchmark three times
# (CPU backend: Unix-socket ping-pong, the gRPC floor, Ping, Store/Load
# overhead; each run's ratios are computed within that run) and
# rpc_benchmark_cuda once. Run it from the unpacked bundle directory
# (binaries in bin/, libraries in lib/); everything goes to stdout:
#   cd gpu_bundle && bash path/to/rpc_round.sh > rpc_round.txt 2>&1
# Extra arguments go to every run (e.g. --server_process=false).
set -u
for b in bin/rpc_benchmark bin/rpc_benchmark_cuda; do
  if [ ! -x "$b" ]; then
    echo "rpc_round.sh: no $b here ($PWD): run it from the bundle directory" >&2
    exit 2
  fi
done
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ITERATIONS=2000
status=0
echo "=== host $(hostname) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for run in 1 2 3; do
  echo "=== rpc_benchmark run $run of 3 (--iterations=$ITERATIONS) $(date -Is)"
  bin/rpc_benchmark --iterations=$ITERATIONS "$@" || status=1
  echo
done
echo "=== rpc_benchmark_cuda (--iterations=$ITERATIONS) $(date -Is)"
bin/rpc_benchmark_cuda --iterations=$ITERATIONS "$@" || status=1
exit $status
