#!/usr/bin/env bash
# Runs one libFuzzer target of tests/fuzz for a time budget:
#   tools/fuzz.sh TARGET MINUTES [libFuzzer flags...]
# e.g. tools/fuzz.sh index_fuzz 5. TARGETs: the kvdepot_fuzz_test names in
# tests/fuzz/BUILD.bazel (wire_fuzz, plan_fuzz, index_fuzz, kernels_fuzz,
# service_fuzz, config_fuzz, companion_fuzz, step_fuzz, step_ring_fuzz).
#
# Builds //tests/fuzz:TARGET with --config=fuzz (Debian's clang, libFuzzer,
# ASan + UBSan) in its own output base, then fuzzes a scratch copy of the
# committed corpus tests/fuzz/corpus/TARGET on one core. When the time is up
# the inputs that add coverage are merged back into the committed corpus
# (-merge=1; set KVDEPOT_FUZZ_MERGE=0 to skip); a crash leaves its input in
# the work directory (KVDEPOT_FUZZ_DIR, default /tmp/kvdepot-fuzz/TARGET)
# and the script exits non-zero. The replay test (bazel test
# //tests/fuzz:TARGET) runs the committed corpus in the normal build: add a
# crash input to the corpus together with its fix.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$#" -lt 2 ]; then
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
target=$1
minutes=$2
shift 2
case "$target" in
  *[!a-z0-9_]* | "") echo "fuzz.sh: bad target name \"$target\"" >&2; exit 2 ;;
esac
case "$minutes" in
  *[!0-9]* | "") echo "fuzz.sh: MINUTES must be a whole number" >&2; exit 2 ;;
esac
corpus=tests/fuzz/corpus/$target
[ -d "$corpus" ] || { echo "fuzz.sh: no corpus directory $corpus" >&2; exit 2; }

source tools/deps.sh
kvdepot_install_fuzz_deps

output_base=${KVDEPOT_FUZZ_OUTPUT_BASE:-$HOME/.cache/bazel_fuzz}
bazel --output_base="$output_base" build --config=fuzz "//tests/fuzz:$target"
bin=$(bazel --output_base="$output_base" info --config=fuzz bazel-bin 2>/dev/null)/tests/fuzz/$target

work=${KVDEPOT_FUZZ_DIR:-/tmp/kvdepot-fuzz/$target}
mkdir -p "$work/corpus" "$work/crashes"
cp -n "$corpus"/* "$work/corpus/" 2>/dev/null || true

echo "fuzz.sh: $target for $minutes min; work dir $work" >&2
set +e
"$bin" -max_total_time=$((minutes * 60)) -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$work/crashes/" "$@" \
  "$work/corpus" >"$work/log" 2>&1
rc=$?
set -e
grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::|^SUMMARY|runtime error|ERROR:' "$work/log" | tail -n 20 >&2
if [ "$rc" -ne 0 ]; then
  echo "fuzz.sh: $target failed (exit $rc); crash inputs in $work/crashes, log $work/log" >&2
  exit "$rc"
fi
if [ "${KVDEPOT_FUZZ_MERGE:-1}" = 1 ]; then
  before=$(ls "$corpus" | wc -l)
  "$bin" -merge=1 -timeout=10 -rss_limit_mb=2048 "$corpus" "$work/corpus" >"$work/merge.log" 2>&1
  echo "fuzz.sh: corpus $corpus: $before -> $(ls "$corpus" | wc -l) inputs" >&2
fi
