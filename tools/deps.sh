#!/usr/bin/env bash
# Installs the Debian 12 packages kvcached needs to build, test and run.
# Idempotent and quiet when everything is present; needs root (or sudo) only
# when something is missing. Sourced by tools/test.sh and tools/run.sh.
set -euo pipefail

KVCACHED_PACKAGES=(
  bazel-bootstrap bazel-rules-java g++ git python3 python3-grpcio python3-protobuf
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev
  libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev prometheus
)

kvcached_install_deps() {
  local missing=()
  local p
  for p in "${KVCACHED_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$p")
    fi
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  echo "kvcached: installing missing Debian packages: ${missing[*]}" >&2
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
