#!/usr/bin/env bash
# Runs on the GPU host, from the bundle built by tools/gpu_bundle.sh:
#   gpu_bundle/run_all.sh OUTDIR
# Every test (gtest JSON), the tests again under compute-sanitizer memcheck
# and racecheck with a smaller filter, then the benchmarks (JSON). Logs and
# results go to OUTDIR; summary.txt has one line per step. Exits non-zero if
# any step failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run_all.sh OUTDIR}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
step_timeout=${STEP_TIMEOUT:-300}
summary="$out/summary.txt"
: >"$summary"
failed=0

step() {  # step NAME COMMAND...
  local name=$1
  shift
  local start=$SECONDS rc=0
  timeout "$step_timeout" "$@" >"$out/$name.log" 2>&1 || rc=$?
  local line="$name: $([[ $rc == 0 ]] && echo PASS || echo "FAIL rc=$rc") $((SECONDS - start))s"
  echo "$line" | tee -a "$summary"
  [[ $rc == 0 ]] || failed=1
}

nvidia-smi >"$out/nvidia-smi.log" 2>&1 || true
while read -r kind name extra; do
  bin="$here/bin/$name"
  case "$kind" in
    test)
      step "$name" "$bin" --gtest_output="json:$out/$name.json"
      if [[ -n "$extra" && "$extra" != "-" ]]; then
        if [[ -x "$sanitizer" ]]; then
          for tool in memcheck racecheck; do
            step "$name.$tool" "$sanitizer" --tool "$tool" --error-exitcode 3 \
              "$bin" --gtest_filter="$extra"
          done
        else
          echo "$name.sanitizer: SKIP (no $sanitizer)" | tee -a "$summary"
        fi
      fi
      ;;
    bench)
      # A benchmark listed again (other flags) logs as NAME.2, NAME.3, ...
      tag=$name
      n=2
      while [[ -e "$out/$tag.log" ]]; do
        tag="$name.$n"
        n=$((n + 1))
      done
      # shellcheck disable=SC2086
      step "$tag" "$bin" --json="$out/$tag.json" $extra
      ;;
  esac
done <"$here/manifest.txt"
exit "$failed"
