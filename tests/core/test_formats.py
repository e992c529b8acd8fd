"""Wire formats against independent element-by-element re-derivations.

The reference quantizers in ``mori_sglang.formats`` define the bytes every provider must produce, so
they are checked here against brute force rather than against themselves: fp8 codes by a nearest-even
search over all 256 codes, e2m1 codes over all 16, e8m0 exponents from ``math.frexp``, f32 scales and
multipliers by dividing in f64 and rounding once (correctly rounded, as an f32 division is). The payload
of the scaled fp8 formats is x * (fp8_max / amax): one division per block, then a multiply, as kernels do.
"""

from __future__ import annotations

import math

import pytest
import torch

from mori_sglang import formats
from mori_sglang.config import (
    CombineDtype,
    ConfigError,
    DispatchDtype,
    EpConfig,
    combine_block_from_scale_dim,
    default_combine_block,
)
from mori_sglang.formats import FormatError
from tests.helpers import FP8_TYPES, fp8_error_bound, generator, make_tokens, needs_cuda

FLAVOURS = list(FP8_TYPES)
FP8_COMBINES = (CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE, CombineDtype.FP8_DIRECT_CAST)


# ---------------------------------------------------------------------------------------------
# brute-force encoders
# ---------------------------------------------------------------------------------------------


def _nearest_code(v: torch.Tensor, values: torch.Tensor, codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Code of the nearest value; a tie goes to the even code, then to the code with the input's sign."""
    v = v.double().reshape(-1)
    dist = (v[:, None] - values[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = (codes & 1) == 0
    same_sign = ((codes & sign_bit) != 0)[None, :] == torch.signbit(v)[:, None]
    score = nearest.int() * (4 + 2 * even.int()[None, :] + same_sign.int())
    return codes[score.argmax(dim=1)].to(torch.uint8)


def brute_fp8(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even e4m3 codes: the nearest of all finite codes (so past max -> max)."""
    table = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).double()
    finite = ~table.isnan()
    codes = torch.arange(256)[finite]
    limit = table[finite].abs().max()
    # Past 2 * max the nearest finite code is +-max; clamping keeps f64 distances meaningful at 1e30.
    return _nearest_code(v.double().clamp(-2 * limit, 2 * limit), table[finite], codes, 0x80).view(v.shape)


def e2m1_value(code: int) -> float:
    """e2m1 by its definition: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def brute_e2m1(v: torch.Tensor) -> torch.Tensor:
    codes = torch.arange(16)
    values = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    return _nearest_code(v.double().clamp(-12, 12), values, codes, 0x8).view(v.shape)


def f32_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """Correctly rounded f32 a / b: f64 has more than 2 * 24 + 2 bits, so rounding twice is exact."""
    return (a.double() / float(torch.tensor(b, dtype=torch.float32))).float()


def f32_div_by(a: float, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded f32 ``a / b`` for a scalar numerator (what a kernel's ``fp8_max / amax`` gives)."""
    return (float(torch.tensor(a, dtype=torch.float32)) / b.double()).float()


def f32_mul(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded f32 product: the f64 product of two f32 values is exact."""
    return (a.float().double() * torch.as_tensor(b, dtype=torch.float32).double()).float()


def test_brute_force_encoders_on_known_values() -> None:
    """The oracles themselves: a few values with known encodings, including ties and saturation."""
    fn = torch.float8_e4m3fn
    v = torch.tensor([1.0, 1.0625, 1.1875, 448.0, 464.0, 1e6, -1e6, 2.0**-9, 2.0**-10, -(2.0**-11)])
    assert brute_fp8(v, fn).tolist() == [0x38, 0x38, 0x3A, 0x7E, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x80]
    assert brute_fp8(torch.tensor([300.0, 1e6, -1e6]), torch.float8_e4m3fnuz).tolist() == [0x7F, 0x7F, 0xFF]
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -5.0])
    assert brute_e2m1(v).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 14]


# ---------------------------------------------------------------------------------------------
# sizes and strides
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale_bytes", "stride"), [(224, 256), (32, 128), (256, 256), (260, 384), (4, 128), (0, 0)])
def test_scale_stride_rounds_up_to_128(scale_bytes: int, stride: int) -> None:
    assert formats.scale_stride_bytes(scale_bytes) == stride


@pytest.mark.parametrize("scale_bytes", [1, 2, 6, 225, 258])
def test_scale_row_not_whole_dwords_is_an_error(scale_bytes: int) -> None:
    with pytest.raises(FormatError, match="dwords"):
        formats.scale_stride_bytes(scale_bytes)


def test_row_sizes_at_deepseek_hidden() -> None:
    h = 7168
    assert formats.combine_row_bytes(CombineDtype.BF16, h) == 14336
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, h) == 7392
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE_NATIVE, h) == 7392
    assert formats.combine_row_bytes(CombineDtype.FP8_DIRECT_CAST, h) == 7168
    sizes = {d: (formats.dispatch_token_bytes(d, h), formats.dispatch_scale_bytes(d, h)) for d in DispatchDtype}
    assert sizes == {
        DispatchDtype.BF16: (14336, 0),
        DispatchDtype.FP8: (7168, 224),
        DispatchDtype.MXFP8: (7168, 224),
        DispatchDtype.MXFP4: (3584, 224),
    }
    assert all(formats.scale_stride_bytes(s) == 256 for _, s in list(sizes.values())[1:])


def test_row_sizes_at_4096() -> None:
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, 4096) == 4096 + 4 * 32
    assert formats.dispatch_scale_bytes(DispatchDtype.FP8, 4096) == 128
    assert formats.dispatch_scale_bytes(DispatchDtype.MXFP4, 4096) == 128


def test_hidden_not_a_block_multiple_ends_in_a_partial_block() -> None:
    """A partial last block or group has a scale of its own; MX scale rows are padded to whole dwords,
    and a blockwise row's scales start on a dword after the elements."""
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, 2880) == 2880 + 4 * 23
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, 200) == 200 + 4 * 2
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, 101) == 104 + 4 * 1
    assert formats.combine_row_bytes(CombineDtype.FP8_BLOCKWISE, 7168, block=100) == 7168 + 4 * 72
    assert formats.dispatch_scale_bytes(DispatchDtype.FP8, 2880) == 4 * 23
    assert formats.dispatch_scale_bytes(DispatchDtype.MXFP8, 2880) == 92  # 90 e8m0 bytes + 2 pad
    assert formats.dispatch_scale_bytes(DispatchDtype.MXFP4, 48) == 4  # 2 groups, padded
    assert formats.dispatch_scale_bytes(DispatchDtype.FP8, 200) == 8
    with pytest.raises(FormatError, match=r"hidden=101.*even"):
        formats.dispatch_token_bytes(DispatchDtype.MXFP4, 101)


def test_fp4_combine_has_no_reference_format() -> None:
    """Refused, naming the settable formats that have one (the table's rows with a kernel code)."""
    with pytest.raises(ConfigError, match=r"fp4_blockwise has no reference .*; use one of bf16, fp8, fp8_direct_cast$"):
        formats.combine_row_bytes(CombineDtype.FP4_BLOCKWISE, 7168)


@pytest.mark.parametrize(("hidden", "dim", "block"), [(7168, 56, 128), (4096, 56, 74), (7168, 64, 112)])
def test_combine_block_from_scale_dim_is_ceil(hidden: int, dim: int, block: int) -> None:
    assert combine_block_from_scale_dim(hidden, dim) == block


@pytest.mark.parametrize(
    ("dtype", "hidden", "block"),
    [
        (CombineDtype.FP8_BLOCKWISE_NATIVE, 7168, 128),  # MoRI's 56 scales per token
        (CombineDtype.FP8_BLOCKWISE_NATIVE, 4096, 74),
        (CombineDtype.FP8_BLOCKWISE, 4096, 128),  # ours
        (CombineDtype.BF16, 4096, 128),
    ],
)
def test_default_combine_block(dtype: CombineDtype, hidden: int, block: int) -> None:
    assert default_combine_block(dtype, hidden) == block
    assert EpConfig(8, 0, hidden, 256, 8, combine_dtype=dtype).combine_block == block


def test_fp8_flavours() -> None:
    assert formats.fp8_dtype_for_device("cpu") == torch.float8_e4m3fn
    assert formats.fp8_max(torch.float8_e4m3fn) == 448.0
    assert formats.fp8_max(torch.float8_e4m3fnuz) == 240.0


# ---------------------------------------------------------------------------------------------
# fp8 cast
# ---------------------------------------------------------------------------------------------


def _probe_values(fp8_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values over the whole range, plus every exact midpoint between neighbouring codes."""
    table = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    finite = table[~table.isnan()].unique()
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    limit = formats.fp8_max(fp8_dtype)
    rand = torch.exp(torch.rand(4096, generator=gen) * 20 - 14) * (torch.randint(0, 2, (4096,), generator=gen) * 2 - 1)
    beyond = torch.tensor([limit * 1.03, -limit * 1.07, limit * 5, 1e30, -1e30])
    return torch.cat([rand, mids.float(), finite, beyond])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_saturating_cast_is_nearest_even(flavour: str, seed: int) -> None:
    fp8 = FP8_TYPES[flavour]
    v = _probe_values(fp8, generator(seed))
    got = formats.saturating_fp8_cast(v, fp8).view(torch.uint8)
    want = brute_fp8(v, fp8)
    bad = (got != want).nonzero().view(-1)
    assert bad.numel() == 0, (
        f"{flavour}: {v[bad[:5]].tolist()} -> {got[bad[:5]].tolist()}, want {want[bad[:5]].tolist()}"
    )


@pytest.mark.parametrize(("flavour", "limit", "at_250"), [("e4m3fn", 448.0, 256.0), ("e4m3fnuz", 240.0, 240.0)])
def test_cast_saturates_and_keeps_nan(flavour: str, limit: float, at_250: float) -> None:
    """e4m3fnuz has no inf and torch's plain cast overflows to NaN: 250 must land on 240, not NaN."""
    fp8 = FP8_TYPES[flavour]
    v = torch.tensor([limit, limit + 1, 250.0, 1e9, float("inf"), -float("inf"), -1e9, float("nan")])
    got = formats.saturating_fp8_cast(v, fp8).float()
    assert got[:7].tolist() == [limit, limit, at_250, limit, limit, -limit, -limit]
    assert got[7].isnan()


# ---------------------------------------------------------------------------------------------
# combine formats
# ---------------------------------------------------------------------------------------------


def _combine_input(gen: torch.Generator, rows: int = 6, hidden: int = 512, block: int = 128) -> torch.Tensor:
    """Rows whose blocks span 1e-4 .. 1e3 in magnitude, so some blocks are under and some over fp8 max."""
    x = make_tokens("normal", rows, hidden, gen).float()
    mags = torch.pow(10.0, torch.randint(-4, 4, (rows, hidden // block, 1), generator=gen).float())
    return (x.view(rows, -1, block) * mags).view(rows, hidden).to(torch.bfloat16)


def _split_row(wire: torch.Tensor, hidden: int, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return wire[:, :hidden], wire[:, hidden:].contiguous().view(torch.float32)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("block", [128, 64])
def test_fp8_blockwise_matches_amax_over_max(flavour: str, block: int, seed: int) -> None:
    fp8 = FP8_TYPES[flavour]
    hidden = 512
    y = _combine_input(generator(seed), hidden=hidden, block=block)
    y[0, :block] = 0  # a block of zeros gets scale 1.0
    wire = formats.quantize_combine(y, CombineDtype.FP8_BLOCKWISE, fp8, block)
    assert wire.dtype == torch.uint8 and wire.shape == (y.shape[0], hidden + 4 * hidden // block)
    q, scales = _split_row(wire, hidden, fp8)
    yf = y.float()
    amax = yf.abs().view(y.shape[0], -1, block).amax(dim=2)
    want_scales = torch.where(amax > 0, f32_div(amax, formats.fp8_max(fp8)), torch.ones_like(amax))
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    assert scales[0, 0] == 1.0
    # One correctly rounded f32 division per block (max / amax, 1.0 for a block of zeros), then a multiply.
    inv = torch.where(amax > 0, f32_div_by(formats.fp8_max(fp8), amax), torch.ones_like(amax))
    scaled = f32_mul(yf.view(y.shape[0], -1, block), inv[:, :, None])
    assert torch.equal(q, brute_fp8(scaled, fp8).view(y.shape))
    back = formats.dequantize_combine(wire, CombineDtype.FP8_BLOCKWISE, hidden, fp8, block)
    want_back = f32_mul(q.contiguous().view(fp8).float().view(y.shape[0], -1, block), want_scales[:, :, None])
    assert torch.equal(back, want_back.view(y.shape))
    per_elem = want_scales.repeat_interleave(block, dim=1)
    assert ((back - yf).abs() <= fp8_error_bound(yf, per_elem, fp8)).all()


# (amax, x) where x * (max / amax) with a correctly rounded division (MoRI's fp8Max / maxAbs) and with
# torch's ``python_float / tensor`` (reciprocal, then multiply) land on different fp8 codes.
DIVISION_WITNESS = {"e4m3fn": (480.0, 45.0), "e4m3fnuz": (252.0, 105.0)}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fp8_blockwise_native_matches_mori(flavour: str, seed: int) -> None:
    """Scale amax * (1/max) only when amax > max, else exactly 1.0; payload x * (max / amax) or x;
    scales[0] negated when any block of the token is scaled."""
    fp8 = FP8_TYPES[flavour]
    limit = formats.fp8_max(fp8)
    hidden, block = 512, 128
    y = _combine_input(generator(seed), hidden=hidden, block=block)
    y[0] = y[0] / y[0].float().abs().max() * 10  # a token with no scaled block
    y[1, :block] = 0.5  # block 0 unscaled, a later block scaled: the flag rides on a 1.0
    y[1, -1] = 3000.0
    amax_witness, x_witness = DIVISION_WITNESS[flavour]
    y[2, :2] = torch.tensor([amax_witness, x_witness])
    y[2, 2:block] = 1.0
    wire = formats.quantize_combine(y, CombineDtype.FP8_BLOCKWISE_NATIVE, fp8, block)
    q, scales = _split_row(wire, hidden, fp8)
    yf = y.float().view(y.shape[0], -1, block)
    amax = yf.abs().amax(dim=2)
    scaled = amax > limit
    inv_max = float(torch.tensor(1.0) / torch.tensor(limit))
    want = torch.where(scaled, f32_mul(amax, inv_max), torch.ones_like(amax))
    flag = scaled.any(dim=1)
    want[:, 0] = torch.where(flag, -want[:, 0], want[:, 0])
    assert not flag[0] and flag[1] and want[1, 0] == -1.0
    assert torch.equal(scales.view(torch.int32), want.view(torch.int32))
    inv = f32_div_by(limit, amax)
    values = torch.where(scaled[:, :, None], f32_mul(yf, inv[:, :, None]), yf)
    assert torch.equal(q, brute_fp8(values, fp8).view(q.shape))
    back = formats.dequantize_combine(wire, CombineDtype.FP8_BLOCKWISE_NATIVE, hidden, fp8, block)
    per_elem = want.abs().repeat_interleave(block, dim=1)
    assert ((back - y.float()).abs() <= fp8_error_bound(y.float(), per_elem, fp8)).all()


@pytest.mark.parametrize("dtype", [CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE])
def test_nan_counts_as_zero_in_amax(dtype: CombineDtype) -> None:
    fp8 = torch.float8_e4m3fn
    y = torch.full((1, 128), 2.0)
    y[0, 5] = float("nan")
    wire = formats.quantize_combine(y, dtype, fp8, 128)
    scale = wire[:, 128:].contiguous().view(torch.float32).item()
    assert scale == (f32_div(torch.tensor(2.0), 448.0).item() if dtype is CombineDtype.FP8_BLOCKWISE else 1.0)
    back = formats.dequantize_combine(wire, dtype, 128, fp8, 128)
    assert back[0, 5].isnan() and torch.equal(back[0, :5], y[0, :5])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fp8_direct_cast_is_the_saturating_cast(flavour: str, seed: int) -> None:
    fp8 = FP8_TYPES[flavour]
    y = _combine_input(generator(seed))
    wire = formats.quantize_combine(y, CombineDtype.FP8_DIRECT_CAST, fp8)
    assert wire.shape == y.shape
    assert torch.equal(wire, brute_fp8(y.float(), fp8))
    back = formats.dequantize_combine(wire, CombineDtype.FP8_DIRECT_CAST, y.shape[1], fp8)
    assert torch.equal(back, wire.view(fp8).float())
    assert back.abs().max() <= formats.fp8_max(fp8)


def test_bf16_combine_is_round_to_nearest_even() -> None:
    y = torch.tensor([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-9)]]).repeat(1, 2)
    wire = formats.quantize_combine(y, CombineDtype.BF16, torch.float8_e4m3fn)
    assert wire.shape == (1, 12)
    back = formats.dequantize_combine(wire, CombineDtype.BF16, 6, torch.float8_e4m3fn)
    assert back[0, :3].tolist() == [1.0, 1.0 + 2.0**-6, -1.0]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_blockwise_keeps_small_blocks_that_direct_cast_flushes(flavour: str, seed: int) -> None:
    """Values ~1e-3 sit in (or under) e4m3's subnormals: a cast without scale (and native MoRI's 1.0 scale)
    loses most of their bits, our amax / max scale keeps 3 mantissa bits."""
    fp8 = FP8_TYPES[flavour]
    y = (make_tokens("normal", 4, 256, generator(seed)).float() * 1e-3).to(torch.bfloat16)
    yf = y.float()
    rel = {}
    for dtype in FP8_COMBINES:
        back = formats.dequantize_combine(formats.quantize_combine(y, dtype, fp8), dtype, 256, fp8)
        rel[dtype] = ((back - yf).abs() / yf.abs()).median().item()
        if dtype is CombineDtype.FP8_BLOCKWISE:
            # Half an ulp of e4m3 (2^-4 relative), or half the subnormal step (at most 2^-10 of the
            # block's scale) for the elements that land among the subnormals.
            scale = yf.abs().view(4, 2, 128).amax(dim=2, keepdim=True) / formats.fp8_max(fp8)
            bound = 2.0**-4 * yf.abs() + 2.0**-10 * scale.expand(4, 2, 128).reshape(4, 256)
            assert ((back - yf).abs() <= bound * (1 + 2.0**-16)).all()
    assert rel[CombineDtype.FP8_BLOCKWISE] < 0.04
    assert rel[CombineDtype.FP8_BLOCKWISE_NATIVE] > 0.2 and rel[CombineDtype.FP8_DIRECT_CAST] > 0.2


# ---------------------------------------------------------------------------------------------
# dispatch formats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("inputs", ["normal", "lognormal", "outliers"])
def test_fp8_dispatch_per_128_scales(flavour: str, inputs: str, seed: int) -> None:
    fp8 = FP8_TYPES[flavour]
    x = make_tokens(inputs, 5, 512, generator(seed))
    q, scales = formats.quantize_dispatch(x, DispatchDtype.FP8, fp8)
    assert q.dtype == fp8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (5, 4)
    xf = x.float().view(5, 4, 128)
    amax = xf.abs().amax(dim=2).clamp(min=1e-10)
    want = f32_div(amax, formats.fp8_max(fp8))
    assert torch.equal(scales.view(torch.int32), want.view(torch.int32))
    scaled = f32_mul(xf, f32_div_by(formats.fp8_max(fp8), amax)[:, :, None])  # x * (max / amax)
    assert torch.equal(q.view(torch.uint8), brute_fp8(scaled, fp8).view(5, 512))
    back = formats.dequantize_dispatch(q, scales, DispatchDtype.FP8, 512)
    assert torch.equal(back, f32_mul(q.float().view(5, 4, 128), want[:, :, None]).view(5, 512))
    assert ((back - x.float()).abs() <= fp8_error_bound(x.float(), want.repeat_interleave(128, 1), fp8)).all()


def _expected_e8m0(x: torch.Tensor, emax: int) -> list[list[int]]:
    """OCP MX shared exponent per 32 elements: floor(log2(amax)) - emax from frexp, clamped, biased by 127."""
    out = []
    for row in x.float().view(x.shape[0], -1, 32).abs().amax(dim=2).tolist():
        biased = []
        for amax in row:
            exp = math.frexp(amax)[1] - 1 - emax if amax > 0 else -127
            biased.append(min(max(exp, -127), 127) + 127)
        out.append(biased)
    return out


def _special_groups(x: torch.Tensor) -> torch.Tensor:
    """Groups whose amax is an exact power of two, tiny (exponent clamps at -127), or huge."""
    x = x.clone()
    x[0, :32] = x[0, :32].float().clamp(-1, 1).to(torch.bfloat16)
    x[0, 7] = 2.0
    x[1, 32:64] = 2.0**-126
    x[1, 64:96] = (x[1, 64:96].float() * 1e30).to(torch.bfloat16)
    return x


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_mxfp8_exponents_and_payload(flavour: str, seed: int) -> None:
    """The shared exponent leaves amax / 2^e in [2^emax, 2^(emax+1)) where 2^emax is the element format's
    largest power of two: 256 for e4m3fn (max 448), 128 for e4m3fnuz (max 240)."""
    fp8 = FP8_TYPES[flavour]
    emax = math.floor(math.log2(formats.fp8_max(fp8)))
    x = _special_groups(make_tokens("lognormal", 4, 256, generator(seed)))
    q, scales = formats.quantize_dispatch(x, DispatchDtype.MXFP8, fp8)
    assert q.dtype == fp8 and scales.dtype == torch.uint8 and scales.shape == (4, 8)
    want = _expected_e8m0(x, emax)
    assert scales.tolist() == want
    exps = torch.tensor(want) - 127
    scaled = (x.float().view(4, 8, 32).double() / torch.pow(2.0, exps.double())[:, :, None]).float()
    assert torch.equal(q.view(torch.uint8), brute_fp8(scaled, fp8).view(4, 256))
    back = formats.dequantize_dispatch(q, scales, DispatchDtype.MXFP8, 256)
    assert torch.equal(back.view(4, 8, 32), q.float().view(4, 8, 32) * torch.pow(2.0, exps.float())[:, :, None])
    assert back[0, 7] == 2.0  # a power-of-two amax round-trips exactly


@pytest.mark.parametrize("flavour", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype", [DispatchDtype.MXFP4, DispatchDtype.MXFP8])
def test_a_group_with_an_infinity_gets_the_nan_scale(dtype: DispatchDtype, flavour: str) -> None:
    """e4m3 and e2m1 hold no infinity: its group's scale is e8m0's NaN code and the whole group decodes
    to NaN. The groups around it keep their own scales; the scale row's pad byte is zero."""
    x = torch.ones(1, 96, dtype=torch.bfloat16)
    x[0, 40] = float("-inf")
    payload, scales = formats.quantize_dispatch(x, dtype, FP8_TYPES[flavour])
    ones = 127 - formats.mx_emax(dtype, FP8_TYPES[flavour])
    assert scales.tolist() == [[ones, formats.E8M0_NAN, ones, 0]]
    back = formats.dequantize_dispatch(payload, scales, dtype, 96)
    assert back[0, 32:64].isnan().all() and torch.equal(back[0, :32], torch.ones(32))


def _unsigned_zero(codes: torch.Tensor) -> torch.Tensor:
    return torch.where((codes & 7) == 0, torch.zeros_like(codes), codes)


@pytest.mark.parametrize("inputs", ["normal", "lognormal", "outliers"])
def test_mxfp4_codes_and_packing(inputs: str, seed: int) -> None:
    """e2m1 codes by brute force over all 16, packed two per byte, low nibble = even element. Zeros are
    compared by magnitude here; the sign of a zero has its own test."""
    x = _special_groups(make_tokens(inputs, 4, 256, generator(seed)))
    packed, scales = formats.quantize_dispatch(x, DispatchDtype.MXFP4, torch.float8_e4m3fn)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 128) and scales.shape == (4, 8)
    want = _expected_e8m0(x, 2)
    assert scales.tolist() == want
    exps = torch.tensor(want) - 127
    scaled = (x.float().view(4, 8, 32).double() / torch.pow(2.0, exps.double())[:, :, None]).float()
    codes = brute_e2m1(scaled).view(4, 256).int()
    got = torch.stack([packed & 0xF, packed >> 4], dim=2).view(4, 256).int()
    assert torch.equal(_unsigned_zero(got), _unsigned_zero(codes))
    back = formats.dequantize_dispatch(packed, scales, DispatchDtype.MXFP4, 256)
    values = torch.tensor([e2m1_value(c) for c in range(16)])[got.long()]
    assert torch.equal(back.view(4, 8, 32), values.view(4, 8, 32) * torch.pow(2.0, exps.float())[:, :, None])
    step = torch.pow(2.0, exps.float()).repeat_interleave(32, dim=1)
    xf = x.float()
    bound = 2.0**-2 * xf.abs() + 0.25 * step + (xf.abs() - 6 * step).clamp(min=0)
    assert ((back - xf).abs() <= bound).all()
    assert back[0, 7] == 2.0


def test_mxfp4_negative_values_rounding_to_zero_keep_their_sign() -> None:
    """-0.1 * 2^e encodes as -0 (code 8), as the fp8 cast does (-1e-4 -> 0x80) and as the hardware
    e2m1 converts and torchao / triton's MX quantizers do; the sign bit is never dropped."""
    x = torch.tensor([[4.0, -0.1, 0.1, -0.2] + [1.0] * 28], dtype=torch.bfloat16)
    packed, _ = formats.quantize_dispatch(x, DispatchDtype.MXFP4, torch.float8_e4m3fn)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=2).view(-1)
    assert codes[:4].tolist() == brute_e2m1(x.float()[0, :4]).tolist() == [6, 8, 0, 8]


def test_zero_group_gets_the_smallest_exponent() -> None:
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 32:] = 1.0
    for dtype in (DispatchDtype.MXFP8, DispatchDtype.MXFP4):
        payload, scales = formats.quantize_dispatch(x, dtype, torch.float8_e4m3fn)
        assert scales[0, 0] == 0
        assert not payload.view(torch.uint8)[0, : payload.shape[1] // 2].any()
        assert torch.equal(formats.dequantize_dispatch(payload, scales, dtype, 64), x.float())


def test_bf16_dispatch_has_no_scales() -> None:
    x = torch.randn(3, 128).to(torch.bfloat16)
    payload, scales = formats.quantize_dispatch(x, DispatchDtype.BF16, torch.float8_e4m3fn)
    assert scales is None and torch.equal(payload, x)


@needs_cuda
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_reference_quantizers_agree_on_cuda(flavour: str, seed: int) -> None:
    """The reference is the oracle for GPU kernels too, so it must give the CPU's bytes on CUDA (where,
    unlike on the CPU, torch turns a Python-scalar divisor into a multiply by its reciprocal)."""
    fp8 = FP8_TYPES[flavour]
    y = _combine_input(generator(seed), rows=64, hidden=512)
    for dtype in (CombineDtype.BF16, *FP8_COMBINES):
        cpu = formats.quantize_combine(y, dtype, fp8)
        gpu = formats.quantize_combine(y.cuda(), dtype, fp8)
        assert torch.equal(gpu.cpu(), cpu), dtype
        back = formats.dequantize_combine(gpu, dtype, 512, fp8).cpu()
        assert torch.equal(back.view(torch.int32), formats.dequantize_combine(cpu, dtype, 512, fp8).view(torch.int32))
    x = make_tokens("lognormal", 64, 512, generator(seed, 1))
    for dtype in (DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4):
        q_cpu, s_cpu = formats.quantize_dispatch(x, dtype, fp8)
        q_gpu, s_gpu = formats.quantize_dispatch(x.cuda(), dtype, fp8)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), dtype
        assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8)), dtype
        back = formats.dequantize_dispatch(q_gpu, s_gpu, dtype, 512).cpu()
        assert torch.equal(back, formats.dequantize_dispatch(q_cpu, s_cpu, dtype, 512)), dtype
    if not torch.version.hip:
        assert formats.fp8_dtype_for_device("cuda") == torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# packed dispatch row
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token_bytes", "scale_bytes", "topk"), [(512, 4, 8), (7168, 228, 9), (3584, 224, 8), (14, 0, 1)]
)
def test_dispatch_row_layout_round_trip(token_bytes: int, scale_bytes: int, topk: int, seed: int) -> None:
    gen = generator(seed)
    layout = formats.DispatchRowLayout(token_bytes, scale_bytes, topk)
    for offset in (layout.scale_offset, layout.weights_offset, layout.ids_offset, layout.row_bytes):
        assert offset % 16 == 0
    assert layout.scale_stride == formats.scale_stride_bytes(scale_bytes)
    assert layout.weights_offset >= layout.scale_offset + layout.scale_stride >= token_bytes
    tokens = torch.randint(0, 256, (3, token_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.randint(1, 256, (3, scale_bytes), dtype=torch.uint8, generator=gen)
    weights = torch.rand(3, topk, generator=gen)
    ids = torch.randint(-1, 100, (3, topk), generator=gen)
    rows = layout.pack(tokens, scales if scale_bytes else None, weights, ids)
    assert rows.shape == (3, layout.row_bytes)
    assert torch.equal(layout.tokens(rows), tokens)
    region = layout.scale_region(rows)
    assert torch.equal(region[:, :scale_bytes], scales) and not region[:, scale_bytes:].any()
    assert torch.equal(layout.weights(rows), weights) and torch.equal(layout.ids(rows), ids.int())
    assert not rows[:, token_bytes : layout.scale_offset].any()
