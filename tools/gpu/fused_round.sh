#!/usr/bin/env bash
# A short GPU round for the fused store and DS_MLA_FP8 kernels (issue 14),
# for when device time is scarce: the kernel suites with compute-sanitizer
# on the shared-memory kernels, the fused Store through the CUDA daemon and
# the step path, then fused_benchmark over the bulk thresholds and
# cuda_benchmark. It took 229 s on an H100 (2026-12-06, every step
# passed; docs/BENCHMARKS.md), 258 s with the load-ahead kernel's tests
# (fused_cuda_test 149 s of it, since trimmed). Run it from the unpacked
# bundle (tools/gpu_bundle.sh):
#   gpu_bundle/fused_round.sh OUTDIR
# OUTDIR/summary.txt gets one line per step as it goes (PASS/FAIL, gtest
# and sanitizer verdicts) and the benchmark tables; logs beside it. Steps
# that would start after $FUSED_ROUND_BUDGET_S seconds (default 400) are
# skipped, so a call with little device time left still returns.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: fused_round.sh OUTDIR}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
budget=${FUSED_ROUND_BUDGET_S:-400}
summary="$out/summary.txt"
: >"$summary"
start=$SECONDS
failed=0

step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2
  shift 2
  if ((SECONDS - start > budget)); then
    echo "$name: SKIP (past ${budget}s)" >>"$summary"
    return
  fi
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  ((rc == 0)) || failed=1
  echo "$name: $( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $((SECONDS - t0))s" \
    "$(grep -E '^\[  PASSED|^\[  FAILED|ERROR SUMMARY|RACECHECK SUMMARY' \
      "$out/$name.log" | head -3 | tr '\n' ' ')" >>"$summary"
}

{ nvidia-smi -L || true; } >>"$summary" 2>&1
bin=$here/bin
step fused_cuda_test 240 "$bin/fused_cuda_test"
step fused_memcheck 120 "$sanitizer" --tool memcheck --error-exitcode 3 \
  "$bin/fused_cuda_test" \
  --gtest_filter='*MlaKernelsByName/DS_MLA_FP8_bs7:*ManyTokensLoop/BF16_512__bs64'
step fused_racecheck 120 "$sanitizer" --tool racecheck --error-exitcode 3 \
  "$bin/fused_cuda_test" --gtest_filter='*MlaKernelsByName/DS_MLA_FP8_bs7'
step cuda_test_ds_mla 120 "$bin/cuda_test" --gtest_filter='*DS_MLA*:*DsMla*'
step cuda_fused_e2e 120 "$bin/cuda_e2e_test" --gtest_filter='*Fused*:*dsmla*'
step step_fused 120 "$bin/step_fused_test"
step fused_sweep 120 "$bin/fused_benchmark" \
  --configs=mla,mla+cast_back,norm+rope,all_stages,hadamard \
  --bandwidth_tokens=16384,32768,65536,131072,1048576
grep -E '%|cudaMemcpy' "$out/fused_sweep.log" >>"$summary" 2>/dev/null
step cuda_benchmark 150 "$bin/cuda_benchmark"
grep -E 'cudaMemcpy|DS_MLA_FP8 .*(store|load) ' "$out/cuda_benchmark.log" \
  >>"$summary" 2>/dev/null
echo "total $((SECONDS - start))s" >>"$summary"
exit "$failed"
