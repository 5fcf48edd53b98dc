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

# Only where deploy/ is checked out (not in the image's dependency layer):
# its tests (deploy/BUILD.bazel) lint with yamllint and shellcheck, bundle
# with patchelf, render with any `kubectl` on PATH (Debian's is in
# kubernetes-client) and validate with Node.js packages that `npm ci`
# installs into deploy/validate/node_modules from its package-lock.json.
KVCACHED_DEPLOY_PACKAGES=(yamllint shellcheck patchelf)

kvcached_install_deps() {
  local missing=()
  local p
  local packages=("${KVCACHED_PACKAGES[@]}")
  local validate
  validate="$(dirname "${BASH_SOURCE[0]}")/../deploy/validate"
  if [ -f "$validate/package-lock.json" ]; then
    packages+=("${KVCACHED_DEPLOY_PACKAGES[@]}")
    command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client)
    command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
  fi
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$p")
    fi
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "kvcached: installing missing Debian packages: ${missing[*]}" >&2
    local sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq >/dev/null
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ -f "$validate/package-lock.json" ] &&
    ! [ "$validate/node_modules/.package-lock.json" -nt "$validate/package-lock.json" ]; then
    echo "kvcached: installing deploy/validate's npm packages" >&2
    npm ci --prefix "$validate" --no-audit --no-fund --loglevel=error >/dev/null
  fi
}
