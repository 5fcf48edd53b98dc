#!/usr/bin/env bash
# Builds the kvdepot OCI image from Debian's packages alone, with podman:
#   deploy/image/build.sh [TAG]          (default localhost/kvdepot:VERSION)
# 1. bazel builds kvdepotd and kvcachectl;
# 2. their shared libraries are mapped to Debian packages (ldd + dpkg -S);
# 3. mmdebstrap makes a Debian 12 base with those packages (cached under
#    ${XDG_CACHE_HOME:-~/.cache}/kvdepot/image, keyed by the package list);
# 4. podman imports the base and builds deploy/image/Containerfile on it
#    (COPY-only; storage driver vfs, isolation chroot: works in containers).
# Prints the image tag on the last line. Needs root (mmdebstrap, podman).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/.*kKvdepotVersion\[\] = "\(.*\)";/\1/p' common/version.h)
tag=${1:-localhost/kvdepot:${version:?no version in common/version.h}}
podman=(podman --storage-driver=vfs)

bazel build --symlink_prefix=/ //server:kvdepotd //client/kvcachectl >&2
bin=$(bazel info --symlink_prefix=/ bazel-bin 2>/dev/null)
binaries=("$bin/server/kvdepotd" "$bin/client/kvcachectl/kvcachectl")

# Runtime packages: whatever package owns each library the binaries load.
packages=$(for b in "${binaries[@]}"; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  real=$(readlink -f "$lib")
  dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null ||
    dpkg -S "/usr$lib" 2>/dev/null || { echo "build.sh: no package owns $lib" >&2; exit 1; }
done | cut -d: -f1 | sort -u | tr '\n' ',')
packages=${packages%,}
echo "build.sh: runtime packages: $packages" >&2

cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvdepot/image
mkdir -p "$cache"
key=$(printf '%s\n' bookworm essential "$packages" | sha256sum | cut -c1-16)
base_tar=$cache/base-$key.tar
if [[ ! -f "$base_tar" || ! -s "$base_tar" ]]; then
  rm -rf "$base_tar"
  echo "build.sh: mmdebstrap bookworm base ($key)" >&2
  # mmdebstrap picks the output format from the extension: keep ".tar".
  mmdebstrap --quiet --variant=essential --include="$packages" bookworm \
    "$cache/partial-$key.tar" >&2
  mv "$cache/partial-$key.tar" "$base_tar"
fi
base=localhost/kvdepot-base:$key
if ! "${podman[@]}" image exists "$base"; then
  "${podman[@]}" import "$base_tar" "$base" >&2
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/socket-dir"
for b in "${binaries[@]}"; do
  install -m 0755 "$b" "$ctx/rootfs/usr/local/bin/"
  strip --strip-debug "$ctx/rootfs/usr/local/bin/$(basename "$b")"
done
cp deploy/image/Containerfile "$ctx/Containerfile"
"${podman[@]}" build --quiet --isolation=chroot --build-arg "BASE=$base" \
  -t "$tag" "$ctx" >&2
echo "$tag"
