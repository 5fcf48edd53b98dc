#!/usr/bin/env python3
"""An independent implementation of SPEC §2-§3 (records and quantization),
and of SPEC §2.1's DS_MLA_FP8 (FlashMLA tests/quant.py @ 9241ae3).

Written from the specification alone, in a different style from the C++
(kernels/quant.h): casts pick the nearest representable value from a table
of every code point (ties to the even code), fp32 arithmetic is emulated by
rounding exact float64 results through struct, and ceil(log2) uses frexp.
Used by format_cmd_test.sh to check `kvcachectl format encode/decode` byte
for byte.

  spec3.py check KVCACHECTL WORKDIR   runs the whole comparison
"""

import bisect
import math
import random
import struct
import subprocess
import sys

# name: (dtype, elements, group, sf, do_cast)
FORMATS = {
    "V41": ("e4m3", 512, 32, "ue8m0", True),
    "V41_FP4": ("e2m1", 512, 16, "e4m3", True),
    "FP4_INDEX": ("e2m1", 128, 32, "ue8m0", False),
    "FP8_FP32SF_INDEX": ("e4m3", 128, 128, "fp32", False),
    "MXFP8_INDEX": ("e4m3", 128, 32, "ue8m0", False),
    "BF16(6)": (None, 6, 0, None, True),
    "BF16(512)": (None, 512, 0, None, True),
    # SPEC §2.1: scales rounded up to powers of two, then a BF16 tail.
    "DS_MLA_FP8": ("e4m3", 512, 128, "fp32_pow2", True),
}
TAIL = {"DS_MLA_FP8": 64}  # BF16 values after the scales, copied as is


def width(fmt):
    """BF16 input values per token (quantized + tail)."""
    return FORMATS[fmt][1] + TAIL.get(fmt, 0)


def f32(x):
    """Rounds a float64 to the nearest fp32 (ties to even, overflow to Inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # struct refuses exactly when rounding gives Inf
        return math.copysign(math.inf, x)


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def bf16_to_f32(h):
    return bits_f32(h << 16)


def f32_to_bf16(x):
    """Nearest bf16 of an fp32 value, ties to even; NaN stays NaN."""
    b = f32_bits(x)
    if math.isnan(x):
        return 0x7FC0  # canonical NaN
    lo = b >> 16
    rem = b & 0xFFFF
    if rem > 0x8000 or (rem == 0x8000 and lo & 1):
        lo += 1
    return lo & 0xFFFF


def decode_e4m3(c):
    s = -1.0 if c & 0x80 else 1.0
    e = (c >> 3) & 0xF
    m = c & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def decode_e2m1(c):
    s = -1.0 if c & 8 else 1.0
    e = (c >> 1) & 3
    m = c & 1
    if e == 0:
        return s * m * 0.5
    return s * (1 + m / 2) * 2.0 ** (e - 1)


def make_table(decode, codes):
    pos = sorted((decode(c), c) for c in codes)
    return [v for v, _ in pos], [c for _, c in pos]


E4M3_VALUES, E4M3_CODES = make_table(decode_e4m3, range(0x7F))  # 0..0x7E
E2M1_VALUES, E2M1_CODES = make_table(decode_e2m1, range(8))


def nearest(values, codes, a):
    """Nearest table value to a >= 0; ties go to the even code; saturates."""
    if a >= values[-1]:
        return codes[-1]
    i = bisect.bisect_left(values, a)
    if values[i] == a:
        return codes[i]
    lo, hi = i - 1, i
    dlo, dhi = a - values[lo], values[hi] - a
    if dlo < dhi:
        return codes[lo]
    if dhi < dlo:
        return codes[hi]
    return codes[lo] if codes[lo] % 2 == 0 else codes[hi]


def encode_e4m3(x):
    if math.isnan(x):
        return 0x7F  # canonical NaN, sign dropped
    sign = 0x80 if math.copysign(1, x) < 0 else 0
    return sign | nearest(E4M3_VALUES, E4M3_CODES, abs(x))


def encode_e2m1(x):
    if math.isnan(x):
        return 0
    sign = 8 if math.copysign(1, x) < 0 else 0
    return sign | nearest(E2M1_VALUES, E2M1_CODES, abs(x))


def ceil_log2(v):
    if math.isinf(v):
        return 128
    m, e = math.frexp(v)  # v = m * 2^e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def amax_of(xs):
    a = 0.0
    for x in xs:
        if not math.isnan(x):
            a = max(a, abs(x))
    return a


ONE_SIXTH = f32(1.0 / 6.0)


def encode_pow2_tile(part):
    """SPEC §2.1 tile: (codes, fp32 scale bytes)."""
    if any(math.isnan(x) for x in part):
        return [0x7F] * len(part), struct.pack("<I", 0x7FFFFFFF)
    if any(math.isinf(x) for x in part):
        codes = [0x7F if math.isinf(x) else
                 (0x80 if math.copysign(1, x) < 0 else 0) for x in part]
        return codes, struct.pack("<f", math.inf)
    v = max(f32(amax_of(part) / 448.0), f32(1e-4))
    scale = 2.0 ** ceil_log2(v)
    return [encode_e4m3(f32(x / scale)) for x in part], struct.pack("<f", scale)


def encode_token(fmt, xs, raw=None):
    """fp32 values (raw: their BF16 bits) -> record bytes [data | scales]
    (| tail)."""
    dtype, n, group, sf, _ = FORMATS[fmt]
    if sf == "fp32_pow2":
        codes, scales = [], b""
        for g in range(n // group):
            c, s = encode_pow2_tile(xs[g * group:(g + 1) * group])
            codes += c
            scales += s
        tail = struct.pack("<%dH" % TAIL[fmt], *raw[n:])
        return bytes(codes) + scales + tail
    if dtype is None:
        out = bytearray()
        for x in xs:
            out += struct.pack("<H", f32_to_bf16(x))
        return bytes(out)
    codes, scales = [], bytearray()
    qmax = 448.0 if dtype == "e4m3" else 6.0
    enc = encode_e4m3 if dtype == "e4m3" else encode_e2m1
    for g in range(n // group):
        part = xs[g * group:(g + 1) * group]
        a = amax_of(part)
        if sf == "ue8m0":
            v = f32(max(a, f32(1e-4)) / qmax)
            e = min(max(ceil_log2(v), -127), 127)
            scales.append(e + 127)
            mul = 2.0 ** (-e)
        elif sf == "e4m3":
            s = f32(max(a, 2.0 ** -9 * 6) * ONE_SIXTH)
            code = encode_e4m3(min(s, 448.0))
            scales.append(code)
            mul = f32(1.0 / decode_e4m3(code))
        else:  # fp32
            s = f32(max(a, f32(1e-4)) / 448.0)
            scales += struct.pack("<f", s)
            mul = f32(1.0 / s) if s != math.inf else 0.0
        for x in part:
            codes.append(enc(f32(x * mul)))
    if dtype == "e4m3":
        data = bytes(codes)
    else:
        data = bytes(codes[2 * i] | (codes[2 * i + 1] << 4)
                     for i in range(n // 2))
    return data + bytes(scales)


def decode_token(fmt, rec):
    """record -> fp32 values (before the BF16 rounding of the load)."""
    dtype, n, group, sf, _ = FORMATS[fmt]
    if dtype is None:
        return [bf16_to_f32(struct.unpack_from("<H", rec, 2 * i)[0])
                for i in range(n)]
    if sf == "fp32_pow2":  # BF16 bits of the load's row: q * s, then tail
        out = []
        for i in range(n):
            s = struct.unpack_from("<f", rec, n + 4 * (i // group))[0]
            out.append(f32_to_bf16(f32(decode_e4m3(rec[i]) * s)))
        return out + list(struct.unpack_from(
            "<%dH" % TAIL[fmt], rec, n + 4 * (n // group)))
    qbytes = n if dtype == "e4m3" else n // 2
    data, sc = rec[:qbytes], rec[qbytes:]
    if dtype == "e4m3":
        qs = [decode_e4m3(b) for b in data]
    else:
        qs = []
        for b in data:
            qs += [decode_e2m1(b & 0xF), decode_e2m1(b >> 4)]
    out = []
    for i, q in enumerate(qs):
        g = i // group
        if sf == "ue8m0":
            scale = bits_f32(sc[g] << 23)
        elif sf == "e4m3":
            scale = decode_e4m3(sc[g])
        else:
            scale = struct.unpack_from("<f", sc, 4 * g)[0]
        out.append(f32(q * scale))
    return out


def random_tokens(rng, fmt, count):
    """BF16 bit patterns: random magnitudes per group plus edge cases."""
    n = width(fmt)
    edge = [0x0000, 0x8000, 0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x7F7F, 0x0001,
            0x8001, 0x3F80, 0x43E0, 0x43E8, 0xC3E8, 0x40C0, 0x4050, 0x3A83]
    toks = []
    for t in range(count):
        kind = t % 6
        row = []
        for i in range(n):
            if kind == 0:
                row.append(rng.randrange(0x10000))  # any pattern
            elif kind == 1:
                row.append(edge[(i + t) % len(edge)])
            elif kind == 2:
                row.append(0x0000 if i % 7 else 0x8000)  # all-zero groups
            elif kind == 3 and fmt in TAIL and i < 256:  # an Inf tile, a NaN tile
                row.append(0xFF80 if i == 5 else (0x7FC1 if i == 200
                           else f32_to_bf16(f32(rng.gauss(0, 1)))))
            else:
                scale = 2.0 ** rng.randint(-30, 30)
                row.append(f32_to_bf16(f32(rng.gauss(0, 1) * scale)))
        toks.append(row)
    return toks


def check(ctl, work):
    rng = random.Random(301)
    failures = 0
    for fmt, (dtype, n, _, sf, cast) in FORMATS.items():
        toks = random_tokens(rng, fmt, 48)
        n = width(fmt)
        raw = b"".join(struct.pack("<%dH" % n, *row) for row in toks)
        src, rec_path, out_path, sc_path = (f"{work}/{fmt}.{s}" for s in
                                            ("in", "rec", "out", "sc"))
        open(src, "wb").write(raw)
        subprocess.run([ctl, "format", "encode", fmt, "--in", src, "--out",
                        rec_path], check=True)
        got = open(rec_path, "rb").read()
        want = b"".join(encode_token(fmt, [bf16_to_f32(h) for h in row],
                                     row) for row in toks)
        if got != want:
            failures += 1
            i = next(i for i in range(len(want)) if got[i] != want[i])
            print(f"FAIL encode {fmt}: first difference at byte {i}: "
                  f"got {got[i]:#x} want {want[i]:#x}")
            continue
        rlen = len(want) // len(toks)
        args = [ctl, "format", "decode", fmt, "--in", rec_path, "--out",
                out_path]
        if not cast:
            args += ["--scales_out", sc_path]
        subprocess.run(args, check=True)
        got = open(out_path, "rb").read()
        if sf == "fp32_pow2":
            want_out = b"".join(
                struct.pack("<%dH" % n, *decode_token(
                    fmt, want[t * rlen:(t + 1) * rlen]))
                for t in range(len(toks)))
        elif cast:
            vals = []
            for t in range(len(toks)):
                vals += decode_token(fmt, want[t * rlen:(t + 1) * rlen])
            want_out = b"".join(struct.pack("<H", f32_to_bf16(v))
                                for v in vals)
        else:
            qbytes = n if dtype == "e4m3" else n // 2
            want_out = b"".join(want[t * rlen:t * rlen + qbytes]
                                for t in range(len(toks)))
            sbytes = rlen - qbytes
            pad = (-sbytes) % 4
            want_sc = b"".join(want[t * rlen + qbytes:(t + 1) * rlen] +
                               b"\0" * pad for t in range(len(toks)))
            if open(sc_path, "rb").read() != want_sc:
                failures += 1
                print(f"FAIL decode {fmt}: scales differ")
        if got != want_out:
            failures += 1
            print(f"FAIL decode {fmt}: output differs")
            continue
        print(f"ok {fmt}: {len(toks)} tokens, {len(want)} record bytes")
    return failures


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "check":
        sys.exit(__doc__)
    sys.exit(1 if check(sys.argv[2], sys.argv[3]) else 0)
