"""The dispatch send's MX helpers against the torch reference, value by value.

The send kernel rounds to e2m1 with integer arithmetic on the f32 bits and scales by the exact inverse
of the e8m0 power of two (a multiplication where the reference divides): both must give the
reference's bits for every input, not only for the rows a round trip happens to draw.
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from mori_sglang import formats
from mori_sglang.config import DispatchDtype
from mori_sglang.kernels import transport

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 1024


@triton.jit
def _e2m1_codes_kernel(v_ptr, codes_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(codes_ptr + offs, transport._e2m1(tl.load(v_ptr + offs, mask=mask)).to(tl.uint8), mask=mask)


@triton.jit
def _mx_scale_kernel(x_ptr, amax_ptr, exponent_ptr, scaled_ptr, n, EMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    exponent, inverse = transport._e8m0(tl.load(amax_ptr + offs, mask=mask, other=1.0), EMAX)
    tl.store(exponent_ptr + offs, exponent, mask=mask)
    tl.store(scaled_ptr + offs, tl.load(x_ptr + offs, mask=mask) * inverse, mask=mask)


def _every_bf16_value() -> torch.Tensor:
    """All 65536 bf16 bit patterns but NaN, as f32: every magnitude, sign, subnormal and infinity."""
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return values[~values.isnan()]


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def test_e2m1_codes_match_the_reference_for_every_value(rng: random.Random) -> None:
    """Every bf16 value, each e2m1 midpoint and its two f32 neighbours, and random f32 values with a full
    mantissa up to 8 (the range an MX-scaled element falls in)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(8.0))])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    fine = torch.rand(1 << 16, generator=gen) * 8.0
    values = torch.cat([_every_bf16_value(), near, -near, fine, -fine])
    codes = torch.full(values.shape, 0xFF, dtype=torch.uint8, device=DEVICE)
    _e2m1_codes_kernel[_grid(values.numel())](values.to(DEVICE), codes, values.numel(), BLOCK=BLOCK)
    want = formats._e2m1_encode(values)
    assert torch.equal(codes.cpu(), want), values[codes.cpu() != want][:8]


def test_scaling_by_the_inverse_power_of_two_matches_the_reference_division(rng: random.Random) -> None:
    """Each element of a group times the inverse of its e8m0 power of two, against the reference's
    exponent and division: groups whose largest magnitude runs over every bf16 value (subnormal ones
    clamp to the smallest scale, 2^-127; an infinite one takes the largest), with elements from that
    magnitude down to 2^-160 of it, so that quotients reach the subnormals too."""
    amax = _every_bf16_value().abs().unique()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    top = torch.where(amax.isinf(), torch.finfo(torch.float32).max, amax)
    # 2^-160 is no f32: shrink in two halves so that a large magnitude keeps its small quotient.
    steps = torch.randint(0, 161, amax.shape, generator=gen)
    sign = torch.randn(amax.shape, generator=gen).sign()
    x = top * torch.rand(amax.shape, generator=gen) * sign
    x = x * torch.exp2(-(steps // 2).float()) * torch.exp2(-(steps - steps // 2).float())
    x = torch.where(amax.isinf(), amax * sign, x).bfloat16().float()
    mx_formats = [(DispatchDtype.MXFP4, torch.float8_e4m3fn)]
    mx_formats += [(DispatchDtype.MXFP8, fp8) for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)]
    for dtype, fp8_dtype in mx_formats:
        emax = formats.mx_emax(dtype, fp8_dtype)
        exponent = torch.full(amax.shape, -1000, dtype=torch.int32, device=DEVICE)
        scaled = torch.full(amax.shape, float("nan"), device=DEVICE)
        _mx_scale_kernel[_grid(amax.numel())](
            x.to(DEVICE), amax.to(DEVICE), exponent, scaled, amax.numel(), EMAX=emax, BLOCK=BLOCK
        )
        want_exponent = formats._e8m0_exponent(amax, emax)
        assert torch.equal(exponent.cpu(), want_exponent.int())
        want = x / formats._e8m0_scale(want_exponent)
        assert torch.equal(scaled.cpu().view(torch.int32), want.view(torch.int32))
        quotients = want[want != 0].abs()
        assert (quotients < torch.finfo(torch.float32).tiny).any() and quotients.isinf().any()
