"""What MoRI's combine kernels do to the numbers, per GPU architecture, as whole-tensor torch code.

Read from ``amd-mori`` 1.2.4's kernel sources (``core/transport/p2p/device_primitives.hpp``) and
never run on an AMD GPU:

- the combine's internal fp8 is e4m3fnuz (max 240) on gfx942 and OCP e4m3 (max 448) on gfx950;
- blockwise quantization: ``scale_dim`` blocks of ``ceil(hidden / scale_dim)`` elements (the last
  ones short or empty); a block's amax ignores NaN; a block is scaled only when its amax exceeds the
  fp8 max, by ``amax * (1 / max)`` stored and ``max / amax`` applied; the sign of scale 0 marks a
  token with any scaled block, and an unmarked token is read back unscaled;
- the vector conversion clamps with ``fmed3(v, max, -max)``, which the ISA defines as ``min3`` when
  an input is NaN: NaN becomes -max. Blocks of odd length go through HIP's scalar conversion, which
  leaves NaN alone;
- the receiver adds ``fp8 * scale`` into an f32 accumulator starting at +0 in top-k order (a fused
  multiply-add: HIP contracts by default), then rounds once to bf16;
- the direct cast saturates finite values, keeps NaN and turns ±Inf into NaN (HIP's conversion does
  not clamp non-finite values);
- the fp4 blockwise combine (gfx950) scales every block by ``amax / 6`` (``6 / amax`` applied, 0 for
  a zero block whose scale is 1), rounds to e2m1 to nearest even saturating at ±6, always marks the
  token, and the receiver adds ``fma(value, scale, acc)``. Non-finite inputs to it are not modelled
  (the conversion instruction's NaN handling is not in the sources).
"""

from __future__ import annotations

import math
import os

import torch

ARCH_ENV = "FAKE_MORI_ARCH"  # which GPU the stand-in pretends to run on
FP8_BY_ARCH = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
DEFAULT_SCALE_DIM = 56
SCALE_DIM_ENV = "MORI_FP8_COMBINE_SCALE_DIM"


def arch() -> str:
    value = os.environ.get(ARCH_ENV, "gfx942")
    if value not in FP8_BY_ARCH:
        raise ValueError(f"{ARCH_ENV}={value!r}: the stand-in models {sorted(FP8_BY_ARCH)}")
    return value


def combine_fp8() -> torch.dtype:
    return FP8_BY_ARCH[arch()]


def fp8_max(fp8: torch.dtype) -> float:
    return float(torch.finfo(fp8).max)


def scale_dim_from_env() -> int:
    """MoRI's blockwise scale count: ``MORI_FP8_COMBINE_SCALE_DIM`` if positive, else 56."""
    raw = os.environ.get(SCALE_DIM_ENV, "")
    try:
        value = int(raw)
    except ValueError:
        return DEFAULT_SCALE_DIM
    return value if value > 0 else DEFAULT_SCALE_DIM


def _vector_cast(v: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    limit = fp8_max(fp8)
    return torch.where(v.isnan(), -limit, v.clamp(-limit, limit)).to(fp8)


def _scalar_cast(v: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    limit = fp8_max(fp8)
    finite = v.isfinite()
    clamped = torch.where(finite, v.clamp(-limit, limit), torch.full_like(v, float("nan")))
    return clamped.to(fp8)


def direct_cast(y: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """bf16 rows -> fp8 rows (``fp8_direct_cast``)."""
    return _scalar_cast(y.to(torch.bfloat16).float(), fp8)


def quantize_blockwise(y: torch.Tensor, fp8: torch.dtype, scale_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows ``[R, H]`` -> (fp8 ``[R, H]``, f32 scales ``[R, scale_dim]``) as MoRI stages them."""
    rows, hidden = y.shape
    block = math.ceil(hidden / scale_dim)
    padded = torch.zeros(rows, block * scale_dim)
    padded[:, :hidden] = y.to(torch.bfloat16).float()
    blocks = padded.view(rows, scale_dim, block)
    magnitude = blocks.abs()
    amax = torch.where(magnitude.isnan(), 0.0, magnitude).amax(dim=2)  # +Inf stays: it is a bit pattern
    limit = torch.tensor(fp8_max(fp8))
    scaled = amax > limit
    stored = torch.where(scaled, amax * (1.0 / limit), torch.ones_like(amax))
    inv = torch.where(scaled, limit / amax, torch.ones_like(amax))
    values = torch.where(scaled[:, :, None], blocks * inv[:, :, None], blocks)
    cast = _scalar_cast if block % 2 else _vector_cast
    q = cast(values, fp8).view(rows, block * scale_dim)[:, :hidden]
    flagged = scaled.any(dim=1)
    stored[:, 0] = torch.where(flagged, -stored[:, 0], stored[:, 0])
    return q.contiguous(), stored


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0


def quantize_fp4_blockwise(y: torch.Tensor, scale_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows -> (the e2m1 values as f32 ``[R, H]``, f32 scales ``[R, scale_dim]``) as MoRI stages them."""
    rows, hidden = y.shape
    block = math.ceil(hidden / scale_dim)
    padded = torch.zeros(rows, block * scale_dim)
    padded[:, :hidden] = y.to(torch.bfloat16).float()
    blocks = padded.view(rows, scale_dim, block)
    magnitude = blocks.abs()
    amax = torch.where(magnitude.isnan(), 0.0, magnitude).amax(dim=2)
    limit = torch.tensor(FP4_MAX)
    nonzero = amax > 0
    scales = torch.where(nonzero, amax / limit, torch.ones_like(amax))
    inv = torch.where(nonzero, limit / torch.where(nonzero, amax, 1.0), torch.zeros_like(amax))
    v = blocks * inv[:, :, None]
    table = torch.tensor(E2M1_VALUES)
    mids = (table[1:] + table[:-1]) / 2
    mag = v.abs().clamp(max=FP4_MAX)
    code = torch.bucketize(mag, mids)  # a value on a midpoint takes the lower code
    tie = (mag[..., None] == mids).any(-1) & (code % 2 == 1)
    code = torch.where(tie, code + 1, code)
    values = torch.where(torch.signbit(v), -table[code], table[code]).view(rows, block * scale_dim)[:, :hidden]
    scales[:, 0] = -scales[:, 0]
    return values.contiguous(), scales


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """f32 ``a * b + c`` rounded once: the product is exact in f64 and the f64 sum is rounded to odd
    (exact error by TwoSum, then one step towards it), which makes the final f32 rounding correct."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))
    mantissa_even = (s.view(torch.int64) & 1) == 0
    nudge = (err != 0) & mantissa_even & s.isfinite()
    towards = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where(nudge, torch.nextafter(s, towards), s)
    return s.float()


def accumulate(acc: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, hidden: int) -> torch.Tensor:
    """One top-k step of the receiver: ``acc`` f32 ``[N, H]`` plus one returned copy per row, ``values``
    (bf16 or fp8) with its blockwise ``scales`` ``[N, scale_dim]`` (None: added as they are)."""
    values = values.float()
    if scales is None:
        return acc + values
    block = math.ceil(hidden / scales.shape[1])
    marked = scales[:, :1] < 0
    per_block = torch.where(marked, scales.abs(), torch.ones_like(scales))
    return _fma_f32(values, per_block.repeat_interleave(block, dim=1)[:, :hidden], acc)
