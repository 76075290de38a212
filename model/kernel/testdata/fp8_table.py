#!/usr/bin/env python3
"""Writes fp8_roundtrip.txt: float32 → FP8 → float32 round trips of E4M3 (torch.float8_e4m3fn)
and E5M2 (torch.float8_e5m2) as vLLM writes an FP8 KV cache: the value clamped to the format's
largest finite magnitude (448, 57344), then rounded to the nearest FP8 value, ties to the even
code. (torch's cast alone does not saturate: c10's fp8e4m3fn_from_fp32_value turns |x| >= 480
into NaN; vLLM clamps first.)

An independent derivation for kernel/fp8.go's tests: every FP8 code's value is derived from the
format's definition with exact rationals, and each input's code is the nearest one found by
searching them all — no bit tricks, no float rounding. Debian's python3-torch (1.13) has no
float8 dtypes, so torch itself could not produce the table.

Run: python3 fp8_table.py > fp8_roundtrip.txt
Each line: input float32 bits, E4M3 code, its float32 bits, E5M2 code, its float32 bits (hex).
"""
import math
import random
import struct
from fractions import Fraction

FORMATS = {  # name: (exponent bits, mantissa bits, bias, has infinities)
    "e4m3": (4, 3, 7, False),
    "e5m2": (5, 2, 15, True),
}


def decode(fmt, code):
    """The exact value of code (a Fraction), or 'nan' / 'inf' / '-inf'."""
    eb, mb, bias, ieee = FORMATS[fmt]
    sign = -1 if code & 0x80 else 1
    e = (code >> mb) & ((1 << eb) - 1)
    m = code & ((1 << mb) - 1)
    top = (1 << eb) - 1
    if ieee and e == top:
        return "nan" if m else ("inf" if sign > 0 else "-inf")
    if not ieee and e == top and m == (1 << mb) - 1:
        return "nan"
    if e == 0:
        return sign * Fraction(m, 1 << mb) * Fraction(2) ** (1 - bias)
    return sign * (1 + Fraction(m, 1 << mb)) * Fraction(2) ** (e - bias)


def finite_codes(fmt):
    return [(c, decode(fmt, c)) for c in range(256) if isinstance(decode(fmt, c), Fraction)]


def encode(fmt, x):
    """The code vLLM writes for the float x: clamp, then nearest, ties to the even code."""
    neg = math.copysign(1, x) < 0
    if math.isnan(x):  # 0x7F, with the NaN's sign, as in c10 (a NaN in both formats)
        return 0x7F | (0x80 if neg else 0)
    codes = finite_codes(fmt)
    biggest = max(v for _, v in codes)
    if math.isinf(x):
        v = biggest
    else:
        v = min(abs(Fraction(x)), biggest)
    best = None
    for c, cv in codes:
        if c & 0x80:
            continue
        d = abs(cv - v)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return best[1] | (0x80 if neg else 0)


def f32(x):
    """x rounded to float32 (exact for every value here)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def value_bits(fmt, code):
    v = decode(fmt, code)
    if v == "nan":
        return 0x7FC00000 | ((code & 0x80) << 24)
    if v in ("inf", "-inf"):
        return 0x7F800000 | ((code & 0x80) << 24)
    return bits(float(v)) | ((code & 0x80) << 24 if v == 0 else 0)


def inputs():
    xs = set()
    for fmt in FORMATS:
        vals = sorted({v for _, v in finite_codes(fmt) if v >= 0})
        for v in vals:
            xs.add(bits(float(v)))
        for a, b in zip(vals, vals[1:]):
            mid = bits(float((a + b) / 2))  # an exact tie
            xs.update({mid, mid - 1, mid + 1})
    for x in [449, 460, 464, 465, 479, 480, 500, 1e6, 57344, 57345, 61440, 61441, 65536, 1e10,
              3.4e38, math.inf, 2 ** -10, 2 ** -11, 2 ** -17, 2 ** -18, 1e-30, 1.4e-45]:
        xs.add(bits(f32(x)))
    rng = random.Random(8)
    for _ in range(2000):
        xs.add(bits(f32(math.ldexp(rng.random() + 0.5, rng.randint(-20, 18)))))
    xs |= {b | 0x80000000 for b in xs}
    return sorted(xs) + [0x7FC00000, 0xFFC00000]


def main():
    for b in inputs():
        x = from_bits(b)
        e4, e5 = encode("e4m3", x), encode("e5m2", x)
        print(f"{b:08x} {e4:02x} {value_bits('e4m3', e4):08x} {e5:02x} {value_bits('e5m2', e5):08x}")


if __name__ == "__main__":
    main()
