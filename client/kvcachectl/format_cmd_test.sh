#!/usr/bin/env bash
# kvcachectl format: CLI behaviour, and encode/decode byte for byte against
# spec3.py, an independent implementation of SPEC §3.
set -euo pipefail
ctl="$(pwd)/client/kvcachectl/kvcachectl"
spec3="$(pwd)/client/kvcachectl/spec3.py"
work="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }

# Usage errors exit 2, help exits 0.
"$ctl" format layout V41 --help | grep -q -- '--block_size' || fail "layout --help"
set +e
"$ctl" format layout NOPE >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" -eq 2 ] || fail "unknown format: exit $rc, want 2"
grep -q 'unknown format "NOPE"' "$work/err" || fail "unknown format message"
set +e
"$ctl" format layout V41 --bogus 1 >/dev/null 2>"$work/err"; rc=$?
set -e
[ "$rc" -eq 2 ] || fail "unknown flag: exit $rc, want 2"

# Layout figures of SPEC §2 (V41: 528-byte records, lcm(32, 528) = 1056).
"$ctl" format layout V41 --block_size 64 -o json >"$work/l.json"
grep -q '"bytes_per_token": 528' "$work/l.json" || fail "V41 bytes_per_token"
grep -q '"block_stride": 33792' "$work/l.json" || fail "V41 block_stride"
"$ctl" format layout FP4_INDEX --block_size 133 | grep -qE 'block_stride +9056' \
  || fail "FP4_INDEX block_stride for 133 tokens"
"$ctl" format list -o json | grep -q '"name": "MXFP8_INDEX"' || fail "list json"

# A truncated input is an error naming the sizes, exit 1.
head -c 1000 /dev/zero >"$work/short.bf16"
set +e
"$ctl" format encode V41 --in "$work/short.bf16" --out "$work/x" 2>"$work/err"; rc=$?
set -e
[ "$rc" -eq 1 ] || fail "truncated input: exit $rc, want 1"
grep -q 'not a multiple of one token' "$work/err" || fail "truncated message"

python3 "$spec3" check "$ctl" "$work"
echo "format_cmd_test: all checks passed"
