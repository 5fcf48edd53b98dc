#!/usr/bin/env bash
# The Kubernetes probe against a real daemon (see deploy/BUILD.bazel).
#
# The probe's argv is read from the rendered sidecar manifest and the
# daemon's command line is the image's ENTRYPOINT plus the manifest's args,
# with only the paths moved into the test's folder (socket, config, a free
# metrics port; the pools of the overlay's config shrunk to 2 blocks) and,
# as this machine has no GPU, the overlay's --backend=cuda replaced by
# --backend=cpu and its pools' device: "cuda:N" dropped (the CPU backend's
# default device). Then:
#   no daemon yet            -> probe exits 3 (unreachable)
#   daemon serving           -> probe exits 0 (startup/readiness/liveness ok),
#                               its pools listed, /metrics served
#   SIGTERM, draining        -> probe exits 1 (NOT_SERVING: pod not ready)
#   daemon gone              -> probe exits 3
# and the daemon itself exits 0 after its drain, removing the socket.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in kubectl node python3; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (tools/deps.sh installs it)"
done

ctl="$PWD/client/kvcachectl/kvcachectl"
daemon="$PWD/server/kvdepotd"
check="$(readlink -f deploy/validate/check.mjs)"
[[ -d "$(dirname "$check")/node_modules/kubernetes-models" ]] ||
  fail "$(dirname "$check")/node_modules is missing: run tools/deps.sh (npm ci)"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/probe.XXXXXX")"
# sun_path holds 107 bytes: a short socket path of our own.
sockdir="$(mktemp -d /tmp/kvprobe.XXXXXX)"
sock="$sockdir/kvdepotd.sock"
pid=""
cleanup() {
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$sockdir"
}
trap cleanup EXIT

cp -rL deploy/k8s "$work/k8s"
kubectl kustomize "$work/k8s/overlays/sidecar" >"$work/sidecar.yaml" 2>"$work/kustomize.err" ||
  { cat "$work/kustomize.err" >&2; fail "kubectl kustomize overlays/sidecar"; }

manifest_socket="unix:/run/kvdepot/daemon/kvdepotd.sock"
mapfile -t argv < <(node "$check" probe-argv sidecar "$work/sidecar.yaml")
[[ "${argv[0]:-}" == kvcachectl ]] || fail "probe argv[0] is \"${argv[0]:-}\", want kvcachectl"
probe=("$ctl")
substituted=0
for a in "${argv[@]:1}"; do
  if [[ "$a" == "$manifest_socket" ]]; then
    probe+=("unix:$sock")
    substituted=$((substituted + 1))
  else
    probe+=("$a")
  fi
done
[[ "$substituted" -eq 1 ]] || fail "probe argv ${argv[*]} names $manifest_socket $substituted times"

# The image's ENTRYPOINT (exec form) and the manifest's args.
mapfile -t entrypoint < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("ENTRYPOINT "):
        print("\n".join(json.loads(line[len("ENTRYPOINT "):])))
' deploy/docker/Dockerfile)
[[ "${entrypoint[0]:-}" == /usr/local/bin/kvdepotd ]] || fail "ENTRYPOINT is \"${entrypoint[*]}\""
mapfile -t margs < <(node "$check" daemon-args sidecar "$work/sidecar.yaml")
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# The overlay's pools, each shrunk to 2 blocks (the real ones are ~1.3 GB)
# and moved from the GPU to the CPU backend's default device.
sed -E -e 's/num_blocks: [0-9]+/num_blocks: 2/' -e 's/device: "cuda:[0-9]+" //' \
  "$work/k8s/overlays/sidecar/kvdepotd.textproto" >"$work/kvdepotd.textproto"
grep -q 'pools {' "$work/kvdepotd.textproto" || fail "the sidecar config has no pools"
! grep -q 'device:' "$work/kvdepotd.textproto" || fail "a pool device is left in $work/kvdepotd.textproto"
cmd=("$daemon")
for a in "${entrypoint[@]:1}" "${margs[@]}"; do
  case "$a" in
    "--listen=$manifest_socket") cmd+=("--listen=unix:$sock") ;;
    --config=/etc/kvdepot/kvdepotd.textproto) cmd+=("--config=$work/kvdepotd.textproto") ;;
    --metrics_address=0.0.0.0:9400) cmd+=("--metrics_address=127.0.0.1:$port") ;;
    --backend=cuda) cmd+=("--backend=cpu") ;;
    --listen=* | --config=* | --metrics_address=* | --backend=*) fail "unexpected daemon flag $a" ;;
    *) cmd+=("$a") ;;
  esac
done
# A long grace keeps the daemon draining (NOT_SERVING) for a while after
# SIGTERM; the last --drain_grace_ms wins over the manifest's.
cmd+=("--drain_grace_ms=6000")

run_probe() {
  set +e
  "${probe[@]}" >"$work/probe.out" 2>"$work/probe.err"
  rc=$?
  set -e
}

passed=0
run_probe
[[ "$rc" -eq 3 ]] || { cat "$work/probe.err" >&2; fail "no daemon: probe exit $rc, want 3"; }
passed=$((passed + 1))

echo "starting: ${cmd[*]}"
"${cmd[@]}" >"$work/daemon.log" 2>&1 &
pid=$!

# Like the startupProbe: poll until the probe passes (60 s at most).
deadline=$((SECONDS + 60))
while :; do
  kill -0 "$pid" 2>/dev/null || { cat "$work/daemon.log" >&2; fail "kvdepotd exited at start"; }
  run_probe
  [[ "$rc" -eq 0 ]] && break
  [[ "$rc" -eq 3 ]] || { cat "$work/probe.err" >&2; fail "starting: probe exit $rc, want 3 then 0"; }
  ((SECONDS < deadline)) || fail "probe still failing after 60 s (exit $rc)"
  sleep 0.2
done
cat "$work/probe.out"
# Ready means its configured pools exist.
while read -r pool; do
  grep -qE -- "^${pool}[[:space:]]" "$work/probe.out" || fail "status output does not list pool $pool"
done < <(sed -nE 's/.*name: "([^"]+)".*/\1/p' "$work/kvdepotd.textproto")
passed=$((passed + 1))
# The manifest's --metrics_address serves Prometheus text (the scrape
# annotations and the ServiceMonitor point at it).
python3 - "$port" <<'PY' || fail "GET /metrics on the manifest's metrics port"
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5) as r:
    body = r.read().decode()
    sys.exit(0 if r.status == 200 and "# TYPE " in body else 1)
PY
passed=$((passed + 1))
# And again: liveness keeps passing.
run_probe
[[ "$rc" -eq 0 ]] || fail "serving: second probe exit $rc, want 0"
passed=$((passed + 1))

kill -TERM "$pid"
# Draining: NOT_SERVING must show as exit 1 before the daemon goes away.
deadline=$((SECONDS + 5))
while :; do
  run_probe
  [[ "$rc" -eq 1 ]] && break
  [[ "$rc" -eq 0 ]] || { cat "$work/probe.err" >&2; fail "draining: probe exit $rc, want 1"; }
  ((SECONDS < deadline)) || fail "probe still exits 0 5 s after SIGTERM"
  sleep 0.1
done
kill -0 "$pid" 2>/dev/null || fail "kvdepotd exited before the drain grace ended"
passed=$((passed + 1))

# Gone: the drain ends on its own and the daemon exits 0.
set +e
timeout 60 tail --pid="$pid" -f /dev/null
wait "$pid"
drc=$?
set -e
pid=""
[[ "$drc" -eq 0 ]] || { cat "$work/daemon.log" >&2; fail "kvdepot exit $drc after SIGTERM, want 0"; }
[[ ! -e "$sock" ]] || fail "the socket $sock is left behind"
run_probe
[[ "$rc" -eq 3 ]] || { cat "$work/probe.err" >&2; fail "daemon gone: probe exit $rc, want 3"; }
passed=$((passed + 1))

echo "probe_live_test: $passed passed, 0 failed"
