#!/usr/bin/env bash
# Installs the Debian 12 packages kvdepot needs. Idempotent and quiet when
# everything is present; needs root (or sudo) only when something is missing.
#   kvdepot_install_deps       build and run (tools/run.sh, the image)
#   kvdepot_install_test_deps  that, plus what the tests use (tools/test.sh)
#   kvdepot_install_fuzz_deps  clang and its runtimes (tools/fuzz.sh)
#   kvdepot_install_image_deps mmdebstrap and podman (deploy/image)
set -euo pipefail

KVDEPOT_PACKAGES=(
  bazel-bootstrap bazel-rules-java g++ git python3
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev
  libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev
  nlohmann-json3-dev
)

# Test-only: the Python client's tests (grpcio, protobuf), promtool
# (prometheus) for the metrics test, openssl to make the TLS test's
# certificates; pip, venv, setuptools and wheel to build and install the
# Python client as a wheel (offline); python3-torch (1.13, CPU only) for the
# CPU tests of kvdepot.torch (//client/python:torch_test) and the
# reference worker (examples/ref_worker).
KVDEPOT_TEST_PACKAGES=(python3-grpcio python3-protobuf prometheus openssl
  python3-pip python3-venv python3-setuptools python3-wheel python3-torch)

# Test-only, for deploy/: its tests (deploy/BUILD.bazel) lint with yamllint and shellcheck, bundle
# with patchelf, render with any `kubectl` on PATH (Debian's is in
# kubernetes-client) and validate with Node.js packages that `npm ci`
# installs into deploy/validate/node_modules from its package-lock.json.
KVDEPOT_DEPLOY_PACKAGES=(yamllint shellcheck patchelf)

# Fuzzing and the sanitizer builds (tools/fuzz.sh, --config=fuzz): Debian's
# clang with its libFuzzer/ASan/UBSan runtimes, and lld to link.
KVDEPOT_FUZZ_PACKAGES=(clang libclang-rt-14-dev lld)

# The container image's build and smoke test (deploy/image; CI): a Debian
# base from mmdebstrap, podman for the COPY-only build and the export.
KVDEPOT_IMAGE_PACKAGES=(mmdebstrap podman uidmap)

kvdepot_install_image_deps() {
  _kvdepot_install "${KVDEPOT_IMAGE_PACKAGES[@]}"
}

kvdepot_install_fuzz_deps() {
  _kvdepot_install "${KVDEPOT_FUZZ_PACKAGES[@]}"
}

kvdepot_install_deps() {
  _kvdepot_install "${KVDEPOT_PACKAGES[@]}"
}

kvdepot_install_test_deps() {
  _kvdepot_install "${KVDEPOT_PACKAGES[@]}" "${KVDEPOT_TEST_PACKAGES[@]}"
  _kvdepot_install_deploy_validation
}

# Installs the Debian packages given that are not installed yet.
_kvdepot_install() {
  local missing=()
  local p
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$p")
    fi
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "kvdepot: installing missing Debian packages: ${missing[*]}" >&2
    local sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq >/dev/null
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

_kvdepot_install_deploy_validation() {
  local packages=("${KVDEPOT_DEPLOY_PACKAGES[@]}")
  local validate
  validate="$(dirname "${BASH_SOURCE[0]}")/../deploy/validate"
  command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client)
  command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
  _kvdepot_install "${packages[@]}"
  if ! [ "$validate/node_modules/.package-lock.json" -nt "$validate/package-lock.json" ]; then
    echo "kvdepot: installing deploy/validate's npm packages" >&2
    npm ci --prefix "$validate" --no-audit --no-fund --loglevel=error >/dev/null
  fi
}
