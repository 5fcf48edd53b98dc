#!/usr/bin/env bash
# run_unittest.sh's exit codes: a passing module passes; a failing module,
# a module that does not import, and a module with no tests all fail.
set -euo pipefail
runner="$(pwd)/client/python/tests/run_unittest.sh"
work="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }
mkdir -p "$work/mods"
cat >"$work/mods/one_test.py" <<'PY'
import unittest
class T(unittest.TestCase):
    def test_ok(self):
        self.assertTrue(True)
PY
cat >"$work/mods/red_test.py" <<'PY'
import unittest
class T(unittest.TestCase):
    def test_fails(self):
        self.assertEqual(1, 2)
PY
echo "import unittest" >"$work/mods/empty_test.py"
echo "import no_such_module_kvpy" >"$work/mods/broken_test.py"
export PYTHONPATH="$work/mods"
# Each run gets its own TEST_TMPDIR so the logs do not mix.
run() { TEST_TMPDIR="$(mktemp -d -p "$work")" "$runner" "$1" >"$work/out" 2>&1; }
run one_test.py || fail "a passing module failed: $(cat "$work/out")"
for m in red_test.py empty_test.py broken_test.py; do
  if run "$m"; then fail "$m passed: $(cat "$work/out")"; fi
done
run empty_test.py || true
grep -q "ran no tests" "$work/out" || fail "no 'ran no tests' message"
echo "runner_test: all checks passed"
