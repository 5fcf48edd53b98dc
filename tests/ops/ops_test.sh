#!/usr/bin/env bash
# Runs ops_test.py with the binaries Bazel passes (see BUILD.bazel).
set -euo pipefail
pkg="$(pwd)/client/python"
export PYTHONPATH="$pkg/gen:$pkg${PYTHONPATH:+:$PYTHONPATH}"
exec python3 "$(dirname "$0")/ops_test.py" "$@"
