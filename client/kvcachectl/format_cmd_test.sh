#!/usr/bin/env bash
# kvcachectl format: CLI behaviour, and encode/decode byte for byte against
# spec3.py, an independent implementation of SPEC §3 (fused8.py: §8).
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

# The fused store's stages (SPEC §8) against fused8.py, an independent
# implementation, byte for byte (records and cast_back).
python3 "$(pwd)/client/kvcachectl/fused8.py" check "$ctl" "$work"

# Fused refusals exit 1 naming the field: a position beyond the cos/sin
# cache, a Hadamard length that is not a power of two or not supported,
# ranges outside the token, a weight file of the wrong size.
head -c $((2 * 576 * 2)) /dev/zero >"$work/two.bf16"
printf '\x01\0\0\0\0\0\0\0\x04\0\0\0\0\0\0\0' >"$work/pos.i64"  # 1, 4
head -c $((4 * 64 * 4)) /dev/zero >"$work/cs4.f32"                 # 4 rows
head -c 1024 /dev/zero >"$work/w512.bf16"
refused() {  # refused MESSAGE ARGS...
  local want="$1"; shift
  set +e
  "$ctl" format encode DS_MLA_FP8 --in "$work/two.bf16" --out "$work/x" "$@" \
    2>"$work/err"; local rc=$?
  set -e
  [ "$rc" -eq 1 ] || fail "$want: exit $rc, want 1"
  grep -qF -- "$want" "$work/err" || fail "$want: got $(cat "$work/err")"
}
refused "positions[1] = 4 is outside [0, 4)" --rope interleaved \
  --rope_offset 512 --rope_dim 64 --positions "$work/pos.i64" --cos_sin "$work/cs4.f32"
refused "hadamard_len = 96 is not a power of two" --hadamard_len 96
refused "hadamard_len = 1024 is a power of two the fused store does not support" \
  --hadamard_len 1024
refused "hadamard range [128, 640) is not inside" --hadamard_begin 128 --hadamard_len 512
refused "rope range [544, 608) is not inside" --rope neox --rope_offset 544 \
  --rope_dim 64 --positions "$work/pos.i64" --cos_sin "$work/cs4.f32"
refused "norm range [0, 584) is not inside" --norm_weight "$work/w512.bf16" \
  --norm_end 584
refused "--norm_weight holds 1024 bytes, want 1152" --norm_weight "$work/w512.bf16"
refused "--rope = \"spiral\"" --rope spiral
echo "format_cmd_test: all checks passed"
