#!/usr/bin/env bash
# Gathers binaries and the non-system shared libraries they load into the
# layout of the container image's /usr/local (deploy/docker/Dockerfile):
#
#   OUT/bin/NAME             each binary, debug info stripped
#   OUT/lib/kvdepot/*.so*   every library ldd lists for them, except the C
#                            and C++ runtime that the base image provides and
#                            the NVIDIA driver's libcuda (mounted at run time)
#
# Binaries get RUNPATH $ORIGIN/../lib/kvdepot and libraries RUNPATH
# $ORIGIN (patchelf), so the image resolves them without LD_LIBRARY_PATH or
# ldconfig and no other program in the image sees them.
#
# Usage: deploy/docker/bundle.sh OUT BINARY...
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 OUT BINARY..." >&2
  exit 2
fi
out=$1
shift
command -v patchelf >/dev/null || { echo "bundle.sh: patchelf is required" >&2; exit 1; }

# Provided by the runtime base image (same or newer than the build's).
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libstdc++.so* | \
      libgcc_s.so* | libpthread.so* | libdl.so* | librt.so* | libutil.so* | \
      libresolv.so* | libcuda.so* | libnvidia-*.so*)
      return 0 ;;
  esac
  return 1
}

mkdir -p "$out/bin" "$out/lib/kvdepot"
for bin in "$@"; do
  name=$(basename "$bin")
  cp -L "$bin" "$out/bin/$name"
  chmod 0755 "$out/bin/$name"
  strip --strip-debug "$out/bin/$name"
  if ldd "$bin" | grep -q 'not found'; then
    echo "bundle.sh: $bin has unresolved libraries:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  while read -r lib; do
    is_system_lib "$lib" && continue
    dest="$out/lib/kvdepot/$(basename "$lib")"
    [[ -e "$dest" ]] && continue
    cp -L "$lib" "$dest"
    chmod 0644 "$dest"
    # shellcheck disable=SC2016  # a literal $ORIGIN, for the loader
    patchelf --set-rpath '$ORIGIN' "$dest"
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
  # shellcheck disable=SC2016
  patchelf --set-rpath '$ORIGIN/../lib/kvdepot' "$out/bin/$name"
done
echo "bundle.sh: $# binaries, $(find "$out/lib/kvdepot" -type f | wc -l) libraries," \
  "$(du -sk "$out" | cut -f1) KiB in $out"
