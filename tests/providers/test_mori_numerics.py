"""The MoRI stand-in's combine numerics (tests/fake_mori/mori/_numerics.py) equal a scalar
transliteration of MoRI's kernels (tests/mori_transliteration.py) bit for bit, for e4m3fn / 448
(gfx950) and e4m3fnuz / 240 (gfx942), on the edge cases: a block's amax at, just below and just above
the fp8 max, zero blocks, bf16 and fp8 subnormals, NaN, ±Inf, short and empty blocks, odd block sizes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mori_sglang import formats
from mori_sglang.config import CombineDtype, EpConfig
from tests.helpers import generator
from tests.providers import mori_transliteration as mt

# The stand-in's numerics module alone (importing the stand-in as ``mori`` would shadow MoRI for the
# rest of the session).
NUMERICS = Path(__file__).parents[1] / "fake_mori" / "mori" / "_numerics.py"
_SPEC = importlib.util.spec_from_file_location("fake_mori_numerics", NUMERICS)
_numerics = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_numerics)

FORMATS = [(torch.float8_e4m3fn, mt.E4M3FN), (torch.float8_e4m3fnuz, mt.E4M3FNUZ)]


def _bf16_bits(values: torch.Tensor) -> list[int]:
    return [int(b) & 0xFFFF for b in values.to(torch.bfloat16).view(torch.int16).tolist()]


def _edge_blocks(fmax: float, block: int, gen: torch.Generator) -> list[list[float]]:
    """Blocks of ``block`` values, each built around one edge case, padded with random values that
    keep the case's amax."""
    below = float(torch.tensor(fmax).to(torch.bfloat16).float()) * (1 - 2**-7)  # the bf16 just below
    above = fmax * (1 + 2**-7)
    cases = [
        [fmax],  # amax exactly the max: not scaled
        [-fmax],
        [below],
        [above],  # just above: scaled
        [-above, 1.0],
        [0.0, -0.0],  # a zero block
        [1e-40, -3e-39],  # bf16 subnormals
        [2.0**-9, 3 * 2.0**-10, 2.0**-11, -(2.0**-8)],  # fp8 subnormals and below
        [math.nan, 3.0],  # NaN in an unscaled block
        [math.nan, 1000.0],  # NaN in a scaled block
        [math.inf, 2.0],
        [-math.inf, -5.0],
        [3.0e38, -1.0],  # a scale near the top of f32
        [1.0e-30, -2.0e-30],  # a tiny, unscaled block
    ]
    blocks = []
    for case in cases:
        amax = max((abs(v) for v in case if not math.isnan(v)), default=0.0)
        filler = (torch.rand(block, generator=gen) * 2 - 1) * (amax if math.isfinite(amax) and amax else 1.0)
        filler = filler if amax else torch.zeros(block)
        values = filler.tolist()
        values[: len(case)] = case[:block]
        blocks.append(values)
    blocks.append((torch.randn(block, generator=gen) * 300).tolist())  # ordinary data
    return blocks


def _rows(fmax: float, hidden: int, scale_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of ``hidden`` bf16 values whose blocks cycle through the edge cases."""
    block = math.ceil(hidden / scale_dim)
    edges = _edge_blocks(fmax, block, gen)
    rows = []
    for start in range(0, len(edges), max(1, scale_dim)):
        flat: list[float] = []
        for b in range(scale_dim):
            flat += edges[(start + b) % len(edges)]
        rows.append(flat[:hidden])
    return torch.tensor(rows).to(torch.bfloat16)


def _same_floats(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True)) and len(a) == len(b)


def _codes(q: torch.Tensor, fmt: mt.Fp8Format) -> list[float]:
    return [fmt.value(int(c)) for c in q.view(torch.uint8).tolist()]


# (hidden, scale_dim): even blocks (MoRI's 56 at 7168 gives 128), odd ones, a short last block, empty blocks.
SHAPES = [(64, 8), (60, 8), (24, 8), (10, 8), (7168 // 16, 56)]


@pytest.mark.parametrize(("hidden", "scale_dim"), SHAPES)
@pytest.mark.parametrize(("fp8", "fmt"), FORMATS)
def test_blockwise_quantization_equals_the_transliteration(
    fp8: torch.dtype, fmt: mt.Fp8Format, hidden: int, scale_dim: int, seed: int
) -> None:
    rows = _rows(fmt.max, hidden, scale_dim, generator(seed, hidden, scale_dim))
    q, scales = _numerics.quantize_blockwise(rows, fp8, scale_dim)
    for r in range(rows.shape[0]):
        codes, want_scales = mt.quantize(_bf16_bits(rows[r]), scale_dim, fmt)
        assert _same_floats(_codes(q[r], fmt), [fmt.value(c) for c in codes]), f"row {r}: values"
        got_codes = q[r].view(torch.uint8).tolist()
        for i, (g, w) in enumerate(zip(got_codes, codes, strict=True)):
            assert g == w or (math.isnan(fmt.value(g)) and math.isnan(fmt.value(w))), (r, i, g, w)
        want = np.array(want_scales, dtype=np.float32).view(np.uint32).tolist()
        assert scales[r].view(torch.int32).tolist() == [w - 2**32 if w >= 2**31 else w for w in want], r


@pytest.mark.parametrize(("hidden", "scale_dim"), SHAPES)
@pytest.mark.parametrize(("fp8", "fmt"), FORMATS)
def test_dequant_accumulate_equals_the_transliteration(
    fp8: torch.dtype, fmt: mt.Fp8Format, hidden: int, scale_dim: int, seed: int
) -> None:
    gen = generator(seed, hidden, scale_dim)
    base = _rows(fmt.max, hidden, scale_dim, gen)
    copies = [base, (base.float() * (torch.rand(base.shape, generator=gen) + 0.5)).to(torch.bfloat16), base.flip(0)]
    staged = [_numerics.quantize_blockwise(c, fp8, scale_dim) for c in copies]
    acc = torch.zeros(base.shape)
    for q, scales in staged:
        acc = _numerics.accumulate(acc, q, scales, hidden)
    got = acc.to(torch.bfloat16)
    for r in range(base.shape[0]):
        scalar = [mt.quantize(_bf16_bits(c[r]), scale_dim, fmt) for c in copies]
        want = mt.accumulate(scalar, hidden, fmt)
        got_bits = _bf16_bits(got[r])
        for i, (g, w) in enumerate(zip(got_bits, want, strict=True)):
            both_nan = (g & 0x7F80) == 0x7F80 and g & 0x7F and (w & 0x7F80) == 0x7F80 and w & 0x7F
            assert g == w or both_nan, (r, i, hex(g), hex(w))


@pytest.mark.parametrize(("fp8", "fmt"), FORMATS)
def test_direct_cast_equals_the_transliteration(fp8: torch.dtype, fmt: mt.Fp8Format, seed: int) -> None:
    rows = _rows(fmt.max, 64, 8, generator(seed))
    q = _numerics.direct_cast(rows, fp8)
    for r in range(rows.shape[0]):
        want = [mt.scalar_convert(float(mt.bf16_to_f32(b)), fmt) for b in _bf16_bits(rows[r])]
        assert _same_floats(_codes(q[r], fmt), [fmt.value(c) for c in want]), r


def test_the_fused_multiply_add_rounds_once() -> None:
    """(1 + 2^-23)(1 - 2^-24) = 1 + 2^-24 - 2^-47 lies just below the f32 tie 1 + 2^-24: with 2^-46
    added before rounding, ``fma`` rounds up, while the rounded product plus 2^-46 stays 1."""
    a, b, c = np.float32(1 + 2**-23), np.float32(1 - 2**-24), np.float32(2**-46)
    exact = mt.fma_f32(a, b, c)
    fused = _numerics._fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))
    assert float(fused[0]) == float(exact) == 1 + 2**-23
    assert float(np.float32(np.float32(a * b) + c)) == 1.0


@pytest.mark.parametrize("hidden", [256, 4096, 7168])
@pytest.mark.parametrize(("fp8", "fmt"), FORMATS)
def test_our_fp8_blockwise_native_is_moris_format(fp8: torch.dtype, fmt: mt.Fp8Format, hidden: int, seed: int) -> None:
    """At its default block (ceil(hidden / 56)) our reference of MoRI's format writes MoRI's fp8 values
    and scales, also where the blocks do not divide hidden (MoRI's trailing empty blocks carry a 1.0)."""
    gen = generator(seed, hidden)
    y = (torch.randn(3, hidden, generator=gen) * torch.tensor([1.0, 100.0, 1e-3])[:, None]).to(torch.bfloat16)
    block = EpConfig(8, 0, hidden, 256, 8, combine_dtype=CombineDtype.FP8_BLOCKWISE_NATIVE).combine_block
    wire = formats.quantize_combine(y, CombineDtype.FP8_BLOCKWISE_NATIVE, fp8, block)
    q, scales = _numerics.quantize_blockwise(y, fp8, _numerics.DEFAULT_SCALE_DIM)
    ours = wire[:, hidden:].contiguous().view(torch.float32)
    assert torch.equal(wire[:, :hidden], q.view(torch.uint8))
    assert torch.equal(ours.view(torch.int32), scales[:, : ours.shape[1]].view(torch.int32))
    assert (scales[:, ours.shape[1] :].abs() == 1.0).all()
    back = formats.dequantize_combine(wire, CombineDtype.FP8_BLOCKWISE_NATIVE, hidden, fp8, block)
    moris = _numerics.accumulate(torch.zeros(y.shape), q, scales, hidden)
    assert torch.equal(back, moris)


@pytest.mark.parametrize(("hidden", "scale_dim"), [(64, 8), (60, 8), (7168 // 16, 56)])
def test_fp4_blockwise_combine_equals_the_transliteration(hidden: int, scale_dim: int, seed: int) -> None:
    """MoRI's fp4 combine (gfx950): every block scaled to e2m1's 6, zero blocks, ties of e2m1's grid,
    blocks far below 1 and above the fp8 range; finite values (its NaN handling is not modelled)."""
    gen = generator(seed, hidden, scale_dim)
    block = math.ceil(hidden / scale_dim)
    rows = torch.randn(4, hidden, generator=gen) * torch.tensor([1.0, 1e3, 1e-6, 1.0])[:, None]
    rows[0, :block] = 0.0  # a zero block
    rows[3, :block] = torch.tensor([6.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 3.0] * block)[:block]  # e2m1 ties
    rows = rows.to(torch.bfloat16)
    copies = [rows, rows.flip(0), (rows.float() * 0.5).to(torch.bfloat16)]
    acc = torch.zeros(rows.shape)
    for copy in copies:
        values, scales = _numerics.quantize_fp4_blockwise(copy, scale_dim)
        for r in range(rows.shape[0]):
            want_values, want_scales = mt.quantize_fp4(_bf16_bits(copy[r]), scale_dim)
            assert values[r].tolist() == want_values, r
            assert scales[r].tolist() == [float(s) for s in want_scales], r
        acc = _numerics.accumulate(acc, values, scales, hidden)
    got = acc.to(torch.bfloat16)
    for r in range(rows.shape[0]):
        scalar = [mt.quantize_fp4(_bf16_bits(c[r]), scale_dim) for c in copies]
        assert _bf16_bits(got[r]) == mt.accumulate(scalar, hidden, None), r
