#!/usr/bin/env bash
# The test command (README, CI): installs missing Debian packages, then runs
# every test that needs no GPU. Extra arguments go to `bazel test`.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/deps.sh
kvdepot_install_test_deps
exec bazel test //... "$@"
