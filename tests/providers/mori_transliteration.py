"""MoRI's blockwise fp8 combine, element by element, as its kernel sources spell it.

A scalar reading of ``WarpQuantizeToFp8Blockwise`` and ``WarpAccumFp8DequantSegment`` (amd-mori 1.2.4,
``core/transport/p2p/device_primitives.hpp``), independent of torch's casts: f32 arithmetic through
numpy scalars, the fp8 grids built from the formats' definitions, the fused multiply-add computed
exactly with fractions and rounded once. tests/providers/test_mori_numerics.py holds the stand-in's whole-tensor
numerics (tests/fake_mori/mori/_numerics.py) to it bit for bit.

The reading: per block of ``ceil(hidden / scale_dim)`` elements, amax is the largest |bf16| bit
pattern with NaN counted as 0; a block is scaled when amax > max, storing ``amax * (1/max)`` and
multiplying by ``max / amax``; the vector conversion clamps with ``fmed3(v, max, -max)`` (the ISA's
med3 returns min3 when an input is NaN: -max), odd-sized blocks take HIP's scalar conversion (NaN and
±Inf become NaN, finite values saturate); scale 0 is negated when any block was scaled, and the
receiver multiplies by |scale| only for such tokens; it accumulates ``fma(value, scale, acc)`` from
+0 in top-k order and rounds to bf16 to nearest even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class Fp8Format:
    """An e4m3 flavour: exponent bias, whether it has a negative zero, its NaN codes."""

    name: str
    bias: int
    fnuz: bool  # no -0 and no Inf; 0x80 is the only NaN

    @property
    def max(self) -> float:
        return 240.0 if self.fnuz else 448.0

    def value(self, code: int) -> float:
        if self.fnuz and code == 0x80:
            return math.nan
        if not self.fnuz and code & 0x7F == 0x7F:
            return math.nan
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 7
        if exponent == 0:
            return sign * mantissa / 8 * 2.0 ** (1 - self.bias)
        return sign * (1 + mantissa / 8) * 2.0 ** (exponent - self.bias)

    def nan(self) -> int:
        return 0x80 if self.fnuz else 0x7F

    def round(self, v: float) -> int:
        """Round a finite value within ±max to the nearest code, ties to an even mantissa."""
        magnitude = Fraction(abs(v))
        best, best_distance = 0, None
        for code in range(0x7F if not self.fnuz else 0x80):
            if math.isnan(self.value(code)):
                continue
            distance = abs(Fraction(self.value(code)) - magnitude)
            if best_distance is None or distance < best_distance or (distance == best_distance and code % 2 == 0):
                best, best_distance = code, distance
        negative = math.copysign(1.0, v) < 0
        if self.fnuz:
            return best | 0x80 if negative and best else best
        return best | 0x80 if negative else best


E4M3FN = Fp8Format("e4m3fn", 7, fnuz=False)
E4M3FNUZ = Fp8Format("e4m3fnuz", 8, fnuz=True)


def bf16_to_f32(bits: int) -> F32:
    return np.array([bits << 16], dtype=np.uint32).view(np.float32)[0]


def _abs_bits_ignoring_nan(bits: int) -> int:
    magnitude = bits & 0x7FFF
    return 0 if (magnitude & 0x7F80) == 0x7F80 and magnitude & 0x7F else magnitude


def _vector_convert(v: F32, fmt: Fp8Format) -> int:
    clamped = -fmt.max if math.isnan(v) else min(max(float(v), -fmt.max), fmt.max)
    return fmt.round(clamped)


def scalar_convert(v: float, fmt: Fp8Format) -> int:
    """HIP's saturating conversion: NaN and ±Inf to NaN, finite values clamped, then rounded."""
    if not math.isfinite(v):
        return fmt.nan()
    return fmt.round(min(max(v, -fmt.max), fmt.max))


def quantize(bits: list[int], scale_dim: int, fmt: Fp8Format) -> tuple[list[int], list[F32]]:
    """One bf16 row (bit patterns) -> (fp8 codes, f32 scales) as MoRI stages it."""
    hidden = len(bits)
    block = -(-hidden // scale_dim)
    limit = F32(fmt.max)
    inverse_limit = F32(1.0) / limit
    codes: list[int] = []
    scales: list[F32] = []
    any_scaled = False
    with np.errstate(all="ignore"):
        for sb in range(scale_dim):
            part = bits[sb * block : min(sb * block + block, hidden)]
            amax = bf16_to_f32(max((_abs_bits_ignoring_nan(b) for b in part), default=0))
            scaled = bool(amax > limit)
            any_scaled |= scaled
            scales.append(F32(amax * inverse_limit) if scaled else F32(1.0))
            inverse = F32(limit / amax) if scaled else F32(1.0)
            for b in part:
                v = bf16_to_f32(b)
                if inverse != F32(1.0):
                    v = F32(v * inverse)
                codes.append(scalar_convert(float(v), fmt) if block % 2 else _vector_convert(v, fmt))
    if any_scaled:
        scales[0] = F32(-scales[0])
    return codes, scales


def _round_f32(exact: Fraction) -> F32:
    """The f32 nearest to ``exact``, ties to even; overflow to ±Inf."""
    if exact == 0:
        return F32(0.0)
    with np.errstate(over="ignore"):
        guess = F32(float(exact)) if abs(exact) < 2**200 else F32(math.copysign(math.inf, exact))
    finite_max = Fraction(float(np.finfo(np.float32).max))
    half_ulp_at_max = Fraction(2) ** 103
    if abs(exact) >= finite_max + half_ulp_at_max:
        return F32(math.copysign(math.inf, exact))
    if not np.isfinite(guess):
        guess = F32(math.copysign(float(np.finfo(np.float32).max), exact))
    candidates = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]
    candidates = [c for c in candidates if np.isfinite(c)]

    def key(c: F32) -> tuple[Fraction, int]:
        return abs(Fraction(float(c)) - exact), int(np.array([c], dtype=np.float32).view(np.uint32)[0]) & 1

    return min(candidates, key=key)


def fma_f32(a: F32, b: F32, c: F32) -> F32:
    """``a * b + c`` with one rounding to f32."""
    if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
        with np.errstate(all="ignore"):
            return F32(float(a) * float(b) + float(c))
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def f32_to_bf16_bits(v: F32) -> int:
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    if math.isnan(v):
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _round_e2m1(v: float) -> float:
    """Nearest e2m1 value to a finite ``v``, ties to the even code, saturating at ±6."""
    magnitude = min(Fraction(abs(v)), Fraction(6))
    best = min(range(8), key=lambda code: (abs(Fraction(E2M1_VALUES[code]) - magnitude), code % 2))
    return math.copysign(E2M1_VALUES[best], v)


def quantize_fp4(bits: list[int], scale_dim: int) -> tuple[list[float], list[F32]]:
    """One bf16 row -> (e2m1 values, f32 scales) as MoRI's fp4 blockwise combine stages it: every
    block scaled by amax / 6 (a zero block: scale 1, values 0), scale 0 always negated."""
    hidden = len(bits)
    block = -(-hidden // scale_dim)
    limit = F32(6.0)
    values: list[float] = []
    scales: list[F32] = []
    for sb in range(scale_dim):
        part = bits[sb * block : min(sb * block + block, hidden)]
        amax = bf16_to_f32(max((_abs_bits_ignoring_nan(b) for b in part), default=0))
        nonzero = amax > F32(0.0)
        scales.append(F32(amax / limit) if nonzero else F32(1.0))
        inverse = F32(limit / amax) if nonzero else F32(0.0)
        values.extend(_round_e2m1(float(F32(bf16_to_f32(b) * inverse))) for b in part)
    scales[0] = F32(-scales[0])
    return values, scales


def accumulate(copies: list[tuple[list[int], list[F32] | None]], hidden: int, fmt: Fp8Format | None) -> list[int]:
    """The receiver: each copy's fp8 codes (or, with ``fmt`` None, e2m1 values) and scales (None for
    the direct cast) added in order; bf16 bits."""
    out = []
    with np.errstate(all="ignore"):
        for i in range(hidden):
            acc = F32(0.0)
            for codes, scales in copies:
                x = F32(fmt.value(codes[i]) if fmt is not None else codes[i])
                if scales is None or not scales[0] < 0:
                    acc = F32(acc + x)
                    continue
                block = -(-hidden // len(scales))
                sb = i // block
                s = scales[sb]
                if sb == 0 and s < 0:
                    s = F32(-s)
                acc = fma_f32(x, s, acc)
            out.append(f32_to_bf16_bits(acc))
    return out
