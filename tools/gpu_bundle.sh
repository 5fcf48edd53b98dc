#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries listed in tools/gpu/manifest.txt
# and gathers them, with the non-system shared libraries they load, into the
# git-ignored folder gpu_bundle/, together with the driver
# gpu_bundle/run_all.sh OUTDIR that runs them on the GPU host (GPU_HOST.md),
# and packs it into gpu_pack/bundle.txz (git-ignored, at most 64 MiB: what
# the device tool carries) with the host-side scripts.
#
# Usage: tools/gpu_bundle.sh [--output_base=DIR]   (default: bazel's own)
set -euo pipefail
cd "$(dirname "$0")/.."

bazel_cmd=(bazel)
if [[ $# -gt 0 && "$1" == --output_base=* ]]; then
  bazel_cmd=(bazel "$1")
  shift
fi
# No convenience symlinks: other people's bazel-bin stays theirs.
build_flags=(--symlink_prefix=/)

manifest=tools/gpu/manifest.txt
mapfile -t entries < <(grep -Ev '^\s*(#|$)' "$manifest")
labels=()
for e in "${entries[@]}"; do
  read -r _ label _ <<<"$e"
  labels+=("$label")
done

"${bazel_cmd[@]}" build "${build_flags[@]}" "${labels[@]}"
bin_root=$("${bazel_cmd[@]}" info "${build_flags[@]}" bazel-bin 2>/dev/null)

bundle=gpu_bundle
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"

# The host's own libc, libm, libstdc++, libgcc_s and loader are newer: never ship.
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libstdc++.so* | \
      libgcc_s.so* | libpthread.so* | libdl.so* | librt.so* | libcuda.so*)
      return 0 ;;
  esac
  return 1
}

: >"$bundle/manifest.txt"
for e in "${entries[@]}"; do
  read -r kind label extra <<<"$e"
  pkg=${label#//}
  pkg=${pkg%%:*}
  name=${label##*:}
  cp -L "$bin_root/$pkg/$name" "$bundle/bin/$name"
  chmod u+w "$bundle/bin/$name"
  strip --strip-debug "$bundle/bin/$name"
  echo "$kind $name ${extra:-}" >>"$bundle/manifest.txt"
  while read -r lib; do
    [[ -z "$lib" ]] && continue
    is_system_lib "$lib" && continue
    cp -L -n "$lib" "$bundle/lib/" 2>/dev/null || true
  done < <(ldd "$bundle/bin/$name" | awk '/=> \// {print $3}')
done
cp tools/gpu/run_all.sh "$bundle/run_all.sh"
# The short round of the fused store and DS_MLA_FP8 kernels (a few minutes).
cp tools/gpu/fused_round.sh "$bundle/fused_round.sh"
# step_benchmark's Python scheduler (beside the binaries) and the committed
# stubs it imports (bin/../python).
cp tests/gpu/step_scheduler.py "$bundle/bin/"
mkdir -p "$bundle/python"
cp -r client/python/kvdepot "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
chmod +x "$bundle/run_all.sh" "$bundle/fused_round.sh"

size_kib=$(du -sk "$bundle" | cut -f1)
echo "gpu_bundle: $(ls "$bundle/bin" | wc -l) binaries, $(ls "$bundle/lib" | wc -l) libraries, ${size_kib} KiB"
# What travels to the GPU host (at most 64 MiB per carried path): the
# bundle compressed, plus the scripts run there beside it. There:
#   tar xJf gpu_pack/bundle.txz && gpu_bundle/run_all.sh OUT
# xz, not gzip: the device tool's 64 MiB counts the working tree too, and
# the gzip bundle (~54 MiB) beside it was refused as over the limit
# (2026-12-04); in xz it is ~34 MiB.
mkdir -p gpu_pack
rm -f gpu_pack/bundle.tgz
tar cf - gpu_bundle | xz -T0 -6 >gpu_pack/bundle.txz
cp kernels/cuda/fused_torch_bench.py gpu_pack/
# The Python client as a wheel (pure Python; it carries the worker library
# next to the package, where kvdepot.torch looks for it) and its CUDA test.
# There: the wheel unpacked onto PYTHONPATH (docs/PYTHON.md: the host's
# python3 is a venv, so a new venv would not see its grpcio).
wheel_src=$(mktemp -d)
cp -r client/python/pyproject.toml client/python/README.md \
  client/python/kvdepot "$wheel_src/"
find "$wheel_src" -name __pycache__ -prune -exec rm -rf {} +
if [[ -f "$bundle/bin/libkvdepot_worker.so" ]]; then
  cp "$bundle/bin/libkvdepot_worker.so" "$wheel_src/kvdepot/"
fi
rm -f gpu_pack/kvdepot-*.whl
PIP_NO_CACHE_DIR=1 /usr/bin/python3 -m pip wheel --no-build-isolation \
  --no-deps --no-index -q -w gpu_pack "$wheel_src" >/dev/null
rm -rf "$wheel_src"
cp client/python/tests/gpu_torch_test.py gpu_pack/
# Library mode from torch (run by hand: docs/LIBRARY_MODE.md):
#   LD_LIBRARY_PATH=gpu_bundle/lib python3 gpu_pack/capi_torch_check.py \
#     gpu_bundle/bin/libkvdepot_kernels.so
cp libkvdepot/kvdepot_kernels.py libkvdepot/capi_torch_check.py gpu_pack/
# The reference worker (examples/ref_worker, docs/INTEGRATION.md) with the
# Python client beside it (run.py imports both from its own folder):
#   LD_LIBRARY_PATH=gpu_bundle/lib python3 gpu_pack/ref_worker/run.py \
#     --device cuda --daemon gpu_bundle/bin/kvdepotd ...
# Its `library` scenario (daemon vs library mode, libmode.py) loads
# gpu_bundle/bin/libkvdepot_kernels.so (manifest: bin) through
# gpu_pack/kvdepot_kernels.py (both found from run.py's folder; or set
# KVDEPOT_KERNELS_LIB).
rm -rf gpu_pack/ref_worker
mkdir -p gpu_pack/ref_worker
cp examples/ref_worker/*.py gpu_pack/ref_worker/
cp -r client/python/kvdepot gpu_pack/ref_worker/kvdepot
find gpu_pack/ref_worker -name __pycache__ -prune -exec rm -rf {} +
if [[ ! -f "$bundle/bin/libkvdepot_kernels.so" ]]; then
  echo "gpu_bundle: no bin/libkvdepot_kernels.so (ref_worker's library" \
    "scenario needs it; tools/gpu/manifest.txt)" >&2
  exit 1
fi
pack_kib=$(du -sk gpu_pack | cut -f1)
echo "gpu_pack: ${pack_kib} KiB (carry gpu_pack)"
if ((pack_kib > 64 * 1024)); then
  echo "gpu_pack: larger than 64 MiB" >&2
  exit 1
fi
