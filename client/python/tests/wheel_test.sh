#!/usr/bin/env bash
# The Python client as a user installs it: a wheel built offline
# (pip wheel --no-build-isolation), installed with --no-index --no-deps into
# a virtual environment that takes grpcio and protobuf from the system, then
# the whole client test run with that environment's interpreter against a
# real kvdepotd, the source tree off the path.
set -euo pipefail
root="$(pwd)"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export HOME="$tmp/home" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$HOME"
unset PYTHONPATH

# A writable copy of the package's sources (runfiles are read-only links).
mkdir -p "$tmp/src"
cp -rL "$root/client/python/pyproject.toml" "$root/client/python/README.md" \
  "$root/client/python/kvdepot" "$tmp/src/"

/usr/bin/python3 -m pip wheel --no-build-isolation --no-deps --no-index \
  -w "$tmp/dist" "$tmp/src" >"$tmp/wheel.log" 2>&1 || {
  cat "$tmp/wheel.log" >&2
  echo "FAIL: pip wheel" >&2
  exit 1
}
version="$(sed -n 's/.*kKvdepotVersion\[\] = "\(.*\)";.*/\1/p' "$root/common/version.h")"
[ -n "$version" ] || { echo "FAIL: no version in common/version.h" >&2; exit 1; }
wheel="$tmp/dist/kvdepot-$version-py3-none-any.whl"
[ -f "$wheel" ] || {
  ls -l "$tmp/dist" >&2
  echo "FAIL: expected $wheel (version of common/version.h)" >&2
  exit 1
}
# The stubs and the typing marker travel in the wheel.
contents="$(/usr/bin/python3 -m zipfile -l "$wheel")"
for f in kvdepot/__init__.py kvdepot/py.typed kvdepot/v1/__init__.py \
  kvdepot/v1/kvdepot_pb2.py kvdepot/v1/kvdepot_pb2_grpc.py \
  kvdepot/v1/step_pb2.py kvdepot/v1/step_pb2_grpc.py; do
  grep -q " *$f " <<<"$contents" || grep -q "^$f" <<<"$contents" || {
    echo "$contents" >&2
    echo "FAIL: $f missing from the wheel" >&2
    exit 1
  }
done

/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/pip" install --no-index --no-deps "$wheel" >"$tmp/install.log" \
  2>&1 || {
  cat "$tmp/install.log" >&2
  echo "FAIL: pip install" >&2
  exit 1
}
# Imported from the environment, not from the source tree.
where="$(cd "$tmp" && "$tmp/venv/bin/python" -c \
  'import kvdepot, kvdepot.v1.kvdepot_pb2_grpc as g; print(kvdepot.__file__, kvdepot.__version__)')"
case "$where" in
  "$tmp/venv/"*" $version") echo "installed: $where" ;;
  *)
    echo "FAIL: kvdepot imported as '$where', expected the venv's, $version" >&2
    exit 1
    ;;
esac

KVDEPOT_PYTHON="$tmp/venv/bin/python" \
  "$root/client/python/tests/run_unittest.sh" client_test.py
