#!/usr/bin/env bash
# The test command (README, CI): installs missing Debian packages, then runs
# every test that needs no GPU. Extra arguments go to `bazel test`.
#
# With --asan (or CI=true) it then runs the CPU tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (--config=asan, .bazelrc) in
# a separate output base, so neither build evicts the other. Skipped there:
#   //deploy/...      manifests, image bundling and Node.js validation: no
#                     C++ of ours runs
#   //client/python/... the Python client: an uninstrumented interpreter
#                     would need the ASan runtime LD_PRELOADed
#   //tests/deps/...  Bazel queries of the dependency graph: nothing runs
#   //examples/...    the reference worker: Python and torch driving a
#                     kvdepotd, minutes of model math for RPC paths that
#                     //server/... and //client/... already cover under ASan
# With --image (or CI=true, as root) it then builds the container image from
# Debian's packages and runs its smoke test (deploy/image/smoke_test.sh).
# The exit status is the first failing run's.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/deps.sh
kvdepot_install_test_deps

asan=0
image=0
if [ "${CI:-}" = true ]; then
  asan=1
  [ "$(id -u)" -eq 0 ] && image=1
fi
args=()
for a in "$@"; do
  case "$a" in
    --asan) asan=1 ;;
    --image) image=1 ;;
    *) args+=("$a") ;;
  esac
done

# The C++ packages by name rather than //... minus the rest: //... would
# also walk the normal output base's bazel-<dir> symlink in this tree.
asan_targets=(//client/... //common/... //kernels/... //planner/... //proto/...
  //server/... //tests/... -//client/python/... -//tests/deps/...)

rc=0
bazel test //... "${args[@]}" || rc=$?
if [ "$asan" = 1 ]; then
  echo "tools/test.sh: the CPU tests under ASan + UBSan (--config=asan)" >&2
  start=$(date +%s)
  bazel --output_base="${KVDEPOT_ASAN_OUTPUT_BASE:-$HOME/.cache/bazel_asan}" \
    test --config=asan --build_tests_only "${args[@]}" -- \
    "${asan_targets[@]}" || {
    r=$?
    [ "$rc" -ne 0 ] || rc=$r
  }
  echo "tools/test.sh: ASan + UBSan run took $(($(date +%s) - start)) s" >&2
fi
if [ "$image" = 1 ]; then
  echo "tools/test.sh: the container image and its smoke test" >&2
  start=$(date +%s)
  kvdepot_install_image_deps
  if deploy/image/smoke_test.sh; then
    echo "image smoke test: passed"
  else
    r=$?
    echo "image smoke test: FAILED"
    [ "$rc" -ne 0 ] || rc=$r
  fi
  echo "tools/test.sh: image build and smoke test took $(($(date +%s) - start)) s" >&2
fi
exit "$rc"
