#!/usr/bin/env bash
# Runs the Python test named first (a file next to this script) with the
# arguments Bazel passes after it (see BUILD.bazel).
set -euo pipefail
script="$1"
shift
exec python3 "$(dirname "$0")/$script" "$@"
