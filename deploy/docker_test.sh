#!/usr/bin/env bash
# The Dockerfile without a Docker engine (see deploy/BUILD.bazel):
#  1. check_dockerfile.py on it, and on broken copies (each must be caught);
#  2. shellcheck on every RUN body and on bundle.sh;
#  3. bundle.sh run on the real binaries, as the build stage runs it, and the
#     result checked the way the runtime stage uses it: every library the
#     binaries load resolves inside the bundle (RUNPATH), except the C/C++
#     runtime and the driver that the CUDA base image and the NVIDIA
#     Container Toolkit provide; the bundled kvcachectl runs.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in python3 shellcheck patchelf ldd; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (tools/deps.sh installs it)"
done

dockerfile="$(readlink -f deploy/docker/Dockerfile)"
root="$(cd "$(dirname "$dockerfile")/../.." && pwd)"
checker="$PWD/deploy/docker/check_dockerfile.py"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/docker.XXXXXX")"
passed=0

python3 "$checker" "$dockerfile" "$root" "$work/runs" || fail "check_dockerfile.py"
passed=$((passed + 1))
shellcheck -s sh "$work"/runs/*.sh || fail "shellcheck of the Dockerfile's RUN steps"
shellcheck "$PWD/deploy/docker/bundle.sh" || fail "shellcheck of bundle.sh"
passed=$((passed + 1))

# Each broken copy must be reported with the expected message (copies in
# the test's own folder, each with the original .dockerignore beside it).
mutate() { # NAME EXPECTED_MESSAGE PYTHON_EXPRESSION_ON_s
  local copy="$work/$1.Dockerfile"
  python3 -c "import sys; s=open(sys.argv[1]).read(); s=$3; open(sys.argv[2],'w').write(s)" \
    "$dockerfile" "$copy"
  cmp -s "$dockerfile" "$copy" && fail "mutation $1 changed nothing"
  cp "$dockerfile.dockerignore" "$copy.dockerignore"
  if python3 "$checker" "$copy" "$root" >"$work/$1.out" 2>&1; then
    fail "mutation $1 passed the check"
  fi
  grep -q -- "$2" "$work/$1.out" || { cat "$work/$1.out" >&2; fail "mutation $1: no \"$2\""; }
  passed=$((passed + 1))
}
mutate root-user "must end as USER 65532:65532" "s.replace('USER 65532:65532', 'USER root')"
mutate add-url "not ADD" "s.replace('COPY . .', 'ADD https://example.com/x.tgz /src/')"
mutate no-set-e "does not start with" "s.replace('RUN set -eux; \\\\\n    bazel', 'RUN bazel', 1)"
mutate shell-entrypoint "ENTRYPOINT is not an exec-form" \
  "s.replace('ENTRYPOINT [\"/usr/local/bin/kvdepotd\", \"--listen=unix:/run/kvdepot/daemon/kvdepotd.sock\"]', 'ENTRYPOINT /usr/local/bin/kvdepotd')"
mutate wrong-socket "does not run /usr/local/bin/kvdepotd --listen" "s.replace('--listen=unix:/run/kvdepot/daemon/kvdepotd.sock', '--listen=/tmp/x.sock')"
mutate bad-stage "names no earlier stage" "s.replace('--from=build', '--from=builder')"
mutate short-timeout "must exceed kvcachectl" "s.replace('--timeout=7s', '--timeout=5s')"
mutate probe "HEALTHCHECK CMD is not" "s.replace('\"status\", \"--addr\"', '\"ping\", \"--addr\"')"
mutate latest "is not a pinned tag" "s.replace('debian:12', 'debian:latest')"
mutate target "builds \\[" "s.replace('//client/kvcachectl:kvcachectl', '//client/kvcachectl:nope')"
mutate missing-src "does not exist in the repository" "s.replace('COPY tools/deps.sh tools/deps.sh', 'COPY tools/nope.sh tools/deps.sh')"
mutate ignored-src "is excluded by" "s.replace('COPY tools/deps.sh tools/deps.sh', 'COPY deploy/validate/node_modules x')"

# The runtime stage's /usr/local, from the real binaries.
out="$work/usr-local"
deploy/docker/bundle.sh "$out" server/kvdepotd client/kvcachectl/kvcachectl >"$work/bundle.log"
cat "$work/bundle.log"
libdir="$(readlink -f "$out/lib/kvdepot")"
for bin in kvdepotd kvcachectl; do
  [[ -x "$out/bin/$bin" ]] || fail "bundle has no bin/$bin"
  runpath="$(patchelf --print-rpath "$out/bin/$bin")"
  # shellcheck disable=SC2016  # a literal $ORIGIN
  [[ "$runpath" == '$ORIGIN/../lib/kvdepot' ]] || fail "$bin RUNPATH is \"$runpath\""
  env -u LD_LIBRARY_PATH ldd "$out/bin/$bin" >"$work/$bin.ldd"
  if grep -q 'not found' "$work/$bin.ldd"; then
    cat "$work/$bin.ldd" >&2
    fail "$bin: unresolved libraries in the bundle"
  fi
  outside=0
  while read -r name path; do
    case "$name" in
      linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libstdc++.so* | libgcc_s.so* | \
        libpthread.so* | libdl.so* | librt.so* | libutil.so* | libresolv.so* | libcuda.so*) ;;
      *)
        if [[ "$(readlink -f "$path")" != "$libdir/"* ]]; then
          echo "$bin: $name resolves to $path, outside the bundle" >&2
          outside=$((outside + 1))
        fi
        ;;
    esac
  done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' "$work/$bin.ldd")
  [[ "$outside" -eq 0 ]] || fail "$bin loads $outside libraries from outside the bundle"
  passed=$((passed + 1))
done
libs=$(find "$out/lib/kvdepot" -name '*.so*' | wc -l)
[[ "$libs" -gt 0 ]] || fail "the bundle has no libraries (the binaries link gRPC dynamically)"
# The bundled kvcachectl runs, and computes the docs' pool-sizing figure.
"$out/bin/kvcachectl" format layout V41 --block_size 64 -o json >"$work/layout.json"
grep -q '"block_stride": 33792' "$work/layout.json" || fail "bundled kvcachectl layout"
passed=$((passed + 1))

echo "docker_test: $passed passed, 0 failed"
