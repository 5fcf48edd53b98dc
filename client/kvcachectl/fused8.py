#!/usr/bin/env python3
"""An independent implementation of SPEC §8 steps 1-4 (the fused store's
RMSNorm, RoPE and Hadamard before quantization), written from the
specification alone: fp32 arithmetic is emulated by rounding each exact
float64 result to fp32 (spec3.f32; double rounding is harmless for one
+, -, *, / or sqrt of fp32 operands), and the RMSNorm sum follows the
documented tree (8-element chunks, 32 slots by chunk index mod 32,
pairwise h = 16...1). The quantization and records come from spec3.py.

  fused8.py check KVCACHECTL WORKDIR   compares `kvcachectl format encode`
                                       with its fused flags, byte for byte
"""

import math
import random
import struct
import subprocess
import sys

import spec3
from spec3 import bf16_to_f32, bits_f32, f32, f32_to_bf16

# len^(-1/2) as fp32 bits (SPEC §8 table).
HADAMARD_SCALE = {64: 0x3E000000, 128: 0x3DB504F3, 256: 0x3D800000,
                  512: 0x3D3504F3}


def div(a, b):
    if b == 0:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def transform(row, p, pos, cos_sin):
    """BF16 bits of one token -> BF16 bits after steps 1-4."""
    y = [bf16_to_f32(h) for h in row]
    if p.get("norm"):
        b, e, w, eps = p["norm"]
        slots = [0.0] * 32
        for c in range(b // 8, e // 8):
            v = y[8 * c:8 * c + 8]
            s = f32(v[0] * v[0])
            for k in range(1, 8):
                s = f32(s + f32(v[k] * v[k]))
            slots[c % 32] = f32(slots[c % 32] + s)
        h = 16
        while h >= 1:
            for j in range(h):
                slots[j] = f32(slots[j] + slots[j + h])
            h //= 2
        mean = div(slots[0], float(e - b))
        m = f32(mean + eps)
        r = div(1.0, f32(math.sqrt(m)) if not math.isnan(m) else math.nan)
        for i in range(b, e):
            y[i] = f32(f32(y[i] * r) * bf16_to_f32(w[i - b]))
    if p.get("rope"):
        style, off, dim = p["rope"]
        half = dim // 2
        cs = cos_sin[pos * dim:(pos + 1) * dim]
        for k in range(half):
            ia, ib = (k, k + half) if style == "neox" else (2 * k, 2 * k + 1)
            a, bb = y[off + ia], y[off + ib]
            c, s = cs[k], cs[half + k]
            y[off + ia] = f32(f32(a * c) - f32(bb * s))
            y[off + ib] = f32(f32(bb * c) + f32(a * s))
    if p.get("hadamard"):
        begin, n = p["hadamard"]
        v = y[begin:begin + n]
        h = 1
        while h < n:
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a, bb = v[j], v[j + h]
                    v[j], v[j + h] = f32(a + bb), f32(a - bb)
            h *= 2
        scale = bits_f32(HADAMARD_SCALE[n])
        y[begin:begin + n] = [f32(x * scale) for x in v]
    return [f32_to_bf16(x) for x in y]


def pack(fmt_code, values):
    return struct.pack("<%d%s" % (len(values), fmt_code), *values)


CASES = [
    # (format, norm (begin, end) or None, rope (style, offset, dim) or None,
    #  hadamard (begin, len) or None)
    ("DS_MLA_FP8", (0, 512), ("interleaved", 512, 64), None),
    ("V41", (0, 512), ("neox", 448, 64), (128, 256)),
    ("MXFP8_INDEX", None, None, (0, 128)),
    ("BF16(512)", (8, 504), ("interleaved", 0, 64), (0, 512)),
    ("V41_FP4", (0, 512), None, (0, 64)),
]
MAX_POSITION = 32


def check(ctl, work):
    rng = random.Random(1407)
    failures = 0
    for fmt, norm, rope, had in CASES:
        n = spec3.width(fmt)
        toks = spec3.random_tokens(rng, fmt, 18)
        base = f"{work}/fused-{fmt}"
        open(base + ".in", "wb").write(
            b"".join(pack("H", row) for row in toks))
        args = [ctl, "format", "encode", fmt, "--in", base + ".in", "--out",
                base + ".rec", "--cast_back", base + ".cb"]
        p = {}
        positions = [rng.randrange(MAX_POSITION) for _ in toks]
        cos_sin = []
        if norm:
            w = [f32_to_bf16(f32(0.5 + rng.random())) for _ in
                 range(norm[1] - norm[0])]
            open(base + ".w", "wb").write(pack("H", w))
            args += ["--norm_weight", base + ".w", "--norm_begin",
                     str(norm[0]), "--norm_end", str(norm[1]), "--eps",
                     "1e-6"]
            p["norm"] = (norm[0], norm[1], w, f32(1e-6))
        if rope:
            dim = rope[2]
            cos_sin = [f32(math.cos(0.1 * i)) for i in
                       range(MAX_POSITION * dim)]
            open(base + ".pos", "wb").write(pack("q", positions))
            open(base + ".cs", "wb").write(pack("f", cos_sin))
            args += ["--rope", rope[0], "--rope_offset", str(rope[1]),
                     "--rope_dim", str(dim), "--positions", base + ".pos",
                     "--cos_sin", base + ".cs"]
            p["rope"] = rope
        if had:
            args += ["--hadamard_begin", str(had[0]), "--hadamard_len",
                     str(had[1])]
            p["hadamard"] = had
        subprocess.run(args, check=True)
        got = open(base + ".rec", "rb").read()
        ys = [transform(row, p, positions[t], cos_sin)
              for t, row in enumerate(toks)]
        want = b"".join(spec3.encode_token(fmt, [bf16_to_f32(h) for h in y], y)
                        for y in ys)
        if got != want:
            failures += 1
            i = next(i for i in range(min(len(got), len(want)))
                     if got[i] != want[i])
            print(f"FAIL fused encode {fmt}: first difference at byte {i} "
                  f"(token {i // (len(want) // len(toks))})")
            continue
        # cast_back: the record decoded as a load does (BF16 of x').
        rlen = len(want) // len(toks)
        cb = []
        for t in range(len(toks)):
            vals = spec3.decode_token(fmt, want[t * rlen:(t + 1) * rlen])
            if spec3.FORMATS[fmt][3] == "fp32_pow2":
                cb += vals  # decode_token already gives the BF16 bits
            else:
                cb += [f32_to_bf16(v) for v in vals]
        if open(base + ".cb", "rb").read() != pack("H", cb):
            failures += 1
            print(f"FAIL fused cast_back {fmt}")
            continue
        print(f"ok fused {fmt}: {len(toks)} tokens")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
