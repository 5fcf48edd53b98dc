#!/usr/bin/env bash
# Runs one unittest module of client/python/tests with Debian's python3
# (python3-grpcio, python3-protobuf), the package (stubs included) on
# PYTHONPATH, unless KVDEPOT_PYTHON names another interpreter (the wheel
# test's virtual environment, where the package is installed). Fails when
# the module fails OR when it ran no test at all (python3 < 3.12 exits 0 on
# "Ran 0 tests").
set -euo pipefail
module="${1:?usage: run_unittest.sh MODULE_test.py}"
root="$(pwd)"
pkg="$root/client/python"
python="${KVDEPOT_PYTHON:-/usr/bin/python3}"
if [ -n "${KVDEPOT_PYTHON:-}" ]; then
  export PYTHONPATH="$pkg/tests${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$pkg:$pkg/tests${PYTHONPATH:+:$PYTHONPATH}"
fi
export KVDEPOT_BIN="$root/server/kvdepotd"
export KVCACHECTL_BIN="$root/client/kvcachectl/kvcachectl"
export PYTHONDONTWRITEBYTECODE=1
log="${TEST_TMPDIR:-$(mktemp -d)}/unittest.log"
set +e
"$python" -m unittest -v "${module%.py}" 2>&1 | tee "$log"
rc="${PIPESTATUS[0]}"
set -e
if [ "$rc" -ne 0 ]; then
  echo "FAIL: $module: python3 -m unittest exited $rc" >&2
  exit "$rc"
fi
if ! grep -qE '^Ran [1-9][0-9]* tests? in ' "$log"; then
  echo "FAIL: $module ran no tests" >&2
  exit 1
fi
if grep -qE '^OK \(.*skipped' "$log"; then
  echo "note: $module skipped some tests (see above)" >&2
fi
