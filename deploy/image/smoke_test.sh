#!/usr/bin/env bash
# The image's smoke test (CI): build it (build.sh), export its filesystem
# and run the entrypoint in a chroot as uid 65532, as a container runtime
# would: --version, start, health SERVING, drain on SIGTERM, exit 0.
#   deploy/image/smoke_test.sh [TAG]     (builds TAG when not given)
# Needs root (chroot). This sandbox cannot run containers, so the chroot
# stands in for the runtime; an image missing a library fails at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=${1:-$(deploy/image/build.sh | tail -n 1)}
podman=(podman --storage-driver=vfs)
work=$(mktemp -d)
root=$work/root
pid=
cleanup() {
  [[ -n "$pid" ]] && kill -9 "$pid" 2>/dev/null || true
  umount "$root/proc" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: image smoke test: $*" >&2; exit 1; }

cid=$("${podman[@]}" create "$tag")
"${podman[@]}" export "$cid" >"$work/image.tar"
"${podman[@]}" rm "$cid" >/dev/null
mkdir "$root"
tar -xf "$work/image.tar" -C "$root"
mount -t proc proc "$root/proc"
as_user=(chroot --userspec=65532:65532 "$root")

# The entrypoint as the image declares it.
entrypoint=$("${podman[@]}" image inspect --format '{{json .Config.Entrypoint}}' "$tag")
[[ "$entrypoint" == '["/usr/local/bin/kvdepotd","--listen=unix:/run/kvdepot/daemon/kvdepotd.sock"]' ]] ||
  fail "unexpected entrypoint $entrypoint"
user=$("${podman[@]}" image inspect --format '{{.Config.User}}' "$tag")
[[ "$user" == 65532:65532 ]] || fail "image user is \"$user\", not 65532:65532"

"${as_user[@]}" /usr/local/bin/kvdepotd --version >"$work/version" 2>&1 ||
  { cat "$work/version" >&2; fail "kvdepotd --version"; }
grep -q "$(sed -n 's/.*kKvdepotVersion\[\] = "\(.*\)";/\1/p' common/version.h)" "$work/version" ||
  fail "--version printed: $(cat "$work/version")"
"${as_user[@]}" /usr/local/bin/kvcachectl --version >/dev/null ||
  fail "kvcachectl --version"

"${as_user[@]}" /usr/local/bin/kvdepotd --listen=unix:/run/kvdepot/daemon/kvdepotd.sock \
  --backend=cpu >"$work/daemon.log" 2>&1 &
pid=$!
ctl=("${as_user[@]}" /usr/local/bin/kvcachectl --addr unix:/run/kvdepot/daemon/kvdepotd.sock)
for _ in $(seq 1 100); do
  "${ctl[@]}" status >"$work/status" 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/daemon.log" >&2; fail "daemon exited at start"; }
  sleep 0.1
done
grep -q 'SERVING' "$work/status" || { cat "$work/status" "$work/daemon.log" >&2; fail "health is not SERVING"; }
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=
[[ $rc == 0 ]] || { cat "$work/daemon.log" >&2; fail "drain exited $rc"; }
grep -q 'stopped' "$work/daemon.log" || fail "no 'stopped' in the daemon's log"
echo "ok: image $tag: --version, SERVING as uid 65532 in a chroot, drained (exit 0)"
