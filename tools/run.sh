#!/usr/bin/env bash
# The run command (README): installs missing Debian packages, builds the
# daemon and starts it with its embedded defaults (Unix socket
# $XDG_RUNTIME_DIR/kvdepot/kvdepotd.sock or /tmp/kvdepot-$UID/kvdepotd.sock, CPU backend
# when no GPU is visible). Extra arguments go to the daemon, e.g.
#   ./tools/run.sh --listen=/tmp/kv.sock --log_level=debug
# See docs/DAEMON.md. Ctrl-C (SIGINT) or SIGTERM drains it and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/deps.sh
kvdepot_install_deps
# KVDEPOT_BAZEL_STARTUP: optional bazel startup options (e.g.
# --output_base=...), unquoted on purpose so that several can be given.
# shellcheck disable=SC2086
bazel ${KVDEPOT_BAZEL_STARTUP:-} build //server:kvdepotd >&2
# shellcheck disable=SC2086
exec "$(bazel ${KVDEPOT_BAZEL_STARTUP:-} info bazel-bin 2>/dev/null)/server/kvdepotd" "$@"
