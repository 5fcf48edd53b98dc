#!/usr/bin/env bash
# Renders every overlay of deploy/k8s with `kubectl kustomize` and checks the
# result offline (see deploy/BUILD.bazel): yamllint on the sources and the
# rendered objects, schema and reference validation, the restricted Pod
# Security Standard and the kvcachectl probes, and a self-test that breaks
# the objects one way at a time and expects each check to report it.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }

for tool in kubectl yamllint node; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (tools/deps.sh installs it)"
done
# node_modules lives next to the real sources (git-ignored, npm ci).
check="$(readlink -f deploy/validate/check.mjs)"
[[ -d "$(dirname "$check")/node_modules/kubernetes-models" ]] ||
  fail "$(dirname "$check")/node_modules is missing: run tools/deps.sh (npm ci)"
lint_config="$PWD/deploy/.yamllint.yaml"

work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/k8s.XXXXXX")"
# A plain copy: kustomize refuses files that resolve outside the
# kustomization root, as runfiles symlinks do.
cp -rL deploy/k8s "$work/k8s"

passed=0
yamllint --strict -c "$lint_config" "$work/k8s" || fail "yamllint of deploy/k8s"
passed=$((passed + 1))

# yamllint with this config does reject what it should.
printf 'a: yes\nb:  1\nc: [1,2]\n' >"$work/bad.yaml"
if yamllint --strict -c "$lint_config" "$work/bad.yaml" >"$work/bad.out" 2>&1; then
  fail "yamllint accepted $work/bad.yaml"
fi
grep -q 'truthy value should be one of' "$work/bad.out" || fail "yamllint: no truthy error"
passed=$((passed + 1))

for overlay in sidecar daemonset; do
  rendered="$work/$overlay.yaml"
  kubectl kustomize "$work/k8s/overlays/$overlay" >"$rendered" 2>"$work/$overlay.err" || {
    cat "$work/$overlay.err" >&2
    fail "kubectl kustomize overlays/$overlay"
  }
  [[ -s "$rendered" ]] || fail "overlays/$overlay rendered nothing"
  yamllint --strict -c "$lint_config" "$rendered" || fail "yamllint of rendered $overlay"
  for mode in schema policy selftest; do
    node "$check" "$mode" "$overlay" "$rendered" || fail "$mode $overlay"
    passed=$((passed + 1))
  done
  # The probe is exactly the command of the interface (docs/DEPLOY.md).
  probe="$(node "$check" probe-argv "$overlay" "$rendered" | tr '\n' ' ')"
  [[ "$probe" == "kvcachectl status --addr unix:/run/kvdepot/daemon/kvdepotd.sock " ]] ||
    fail "$overlay probe is \"$probe\""
  passed=$((passed + 1))
done

# The sidecar's kvdepot really is a native sidecar in the rendered output,
# and the daemonset's socket really is the host directory.
grep -q 'restartPolicy: Always' "$work/sidecar.yaml" || fail "sidecar: no restartPolicy: Always"
grep -q 'path: /run/kvdepot' "$work/daemonset.yaml" || fail "daemonset: no hostPath /run/kvdepot"
passed=$((passed + 1))

echo "k8s_manifests_test: $passed passed, 0 failed"
