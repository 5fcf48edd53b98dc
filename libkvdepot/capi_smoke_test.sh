#!/usr/bin/env bash
# Runs capi_smoke_test.py with Debian's /usr/bin/python3 against the built
# libkvdepot_kernels.so. Fails when no test ran.
set -euo pipefail
dir="libkvdepot"
export KVDEPOT_KERNELS_LIB="$(pwd)/$dir/libkvdepot_kernels.so"
export PYTHONDONTWRITEBYTECODE=1
log="${TEST_TMPDIR:-$(mktemp -d)}/smoke.log"
set +e
/usr/bin/python3 "$dir/capi_smoke_test.py" -v 2>&1 | tee "$log"
rc="${PIPESTATUS[0]}"
set -e
[ "$rc" -eq 0 ] || exit "$rc"
grep -qE '^Ran [1-9][0-9]* tests? in ' "$log" || { echo "no test ran" >&2; exit 1; }
