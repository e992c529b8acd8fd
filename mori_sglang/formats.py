"""Byte layouts of every wire format, with torch reference quantizers and dequantizers.

These functions define the formats: every provider (torch.distributed, Triton kernels, native MoRI
where it is compatible) must produce the same bytes. They run on any device.

Combine rows (expert output travelling back to its source):
  bf16                  [hidden x bf16]
  fp8_direct_cast       [hidden x fp8]                       saturating round-to-nearest-even cast
  fp8_blockwise         [hidden x fp8 | pad to 4 B | n_blocks x f32]   scale = amax / fp8_max per block
  fp8_blockwise_native  same layout, native MoRI's scales    1.0 unless amax > fp8_max; sign of
                                                             scales[0] set when any block is scaled
Dispatch payloads (the sender quantizes once; the scale row is opaque to the transport):
  bf16   [hidden x bf16]
  fp8    [hidden x fp8]         + f32 per 128 elements   (scale row 4 * ceil(hidden / 128) B)
  mxfp8  [hidden x fp8]         + e8m0 byte per 32       (scale row ceil(hidden / 32) B, zero-padded to dwords)
  fp4    [hidden / 2 x uint8]   + e8m0 byte per 32       (e2m1, low nibble = even element; hidden even)

A hidden size that is not a multiple of the block (or group) ends in a partial last block with its own
scale, computed from the elements it holds (2880 = 22.5 x 128: 23 fp8 scales, the last for 64 elements).

Non-finite values (docs/api.md, "NaN and infinity"): a block's or group's scale comes from its largest
magnitude with NaN counted as 0. A NaN stays a NaN in its own element wherever the element type holds
one (the canonical quiet NaN of the fp8 flavour); an infinity makes its whole block or group decode to
NaN (f32 scales become +inf over zeroed elements, e8m0 scales the NaN code 0xFF); fp4 has no NaN, so
a NaN makes its group's scale 0xFF too. bf16 passes everything through; fp8_direct_cast saturates
±inf to ±fp8_max. A block whose largest magnitude is tiny takes the scale of fp8_max * 2^-126, so that
its inverse stays finite: it decodes to its values as far as fp8 resolves them, never to NaN.
"""

from __future__ import annotations

import math

import torch

from mori_sglang import wire_formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype
from mori_sglang.wire_formats import FP8_BLOCK

SCALE_ROW_ALIGN = 128
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # the e8m0 NaN code: its whole group decodes to NaN
FP4_E2M1_EMAX = 2  # exponent of the largest e2m1 power of two (4)
FP4_E2M1_MAX = 6.0
# Non-negative e2m1 values by code 0..7.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class FormatError(ValueError):
    """An input does not fit the wire format; the message names what to change."""


# ---------------------------------------------------------------------------------------------
# fp8 flavour
# ---------------------------------------------------------------------------------------------


def fp8_dtype_for_device(device: torch.device | str | None = None) -> torch.dtype:
    """e4m3fnuz (max 240) on gfx942 (MI300), e4m3fn (max 448) on NVIDIA, gfx950 and CPU."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if "gfx942" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def saturating_fp8_cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest even and saturate at ±max (torch's e4m3fnuz cast overflows to NaN without it).
    Every NaN becomes the flavour's canonical NaN (a NaN's sign and payload depend on the hardware that
    made it: x86 makes negative ones)."""
    limit = fp8_max(fp8_dtype)
    v = x.float().clamp(-limit, limit)
    return torch.where(v.isnan(), torch.full_like(v, math.nan), v).to(fp8_dtype)


def min_block_amax(fp8_dtype: torch.dtype) -> float:
    """The smallest largest-magnitude a scaled fp8 block is quantized with: fp8_max * 2^-126, whose
    scale (2^-126) and inverse (2^126) are exact normal f32 numbers; a smaller one would make the
    inverse overflow to inf and the block decode to NaN (0 x inf)."""
    return fp8_max(fp8_dtype) * 2.0**-126


def num_blocks(hidden: int, block: int) -> int:
    """Blocks (or groups) of a row: the last one is partial when ``block`` does not divide ``hidden``."""
    return -(-hidden // block)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[R, hidden]`` -> f32 ``[R, n_blocks, block]``, the partial last block padded with zeros."""
    rows, hidden = x.shape
    blocks = num_blocks(hidden, block)
    xf = x.float()
    pad = blocks * block - hidden
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.view(rows, blocks, block)


def _unblocked(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """Inverse of ``_blocked``: drop the padding of the last block."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2])[:, :hidden]


def _finite_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block max |x| with NaN counted as 0 (as native MoRI's bit-pattern max does); inf stays."""
    a = blocks.abs()
    return torch.where(a.isnan(), torch.zeros_like(a), a).amax(dim=-1)


# ---------------------------------------------------------------------------------------------
# scale rows
# ---------------------------------------------------------------------------------------------


def scale_stride_bytes(scale_bytes: int) -> int:
    """Receive-side stride of an opaque scale row: rounded up to 128 B (224 -> 256, 260 -> 384)."""
    if scale_bytes < 0 or scale_bytes % 4:
        raise FormatError(
            f"scale row of {scale_bytes} B is not a whole number of dwords; "
            "pass scales whose row is a multiple of 4 bytes"
        )
    return math.ceil(scale_bytes / SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in dense row-major memory, copied only where it is not, so that a dtype view of it works.
    ``Tensor.contiguous`` is not enough: it keeps the strides of a tensor it counts as contiguous whose
    last stride is not 1 (a column-major buffer sliced to no rows, a ``[N, 1]`` column of a wider one),
    and a view as a dtype of another size refuses those."""
    if t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of a 2-D tensor."""
    return t.shape[1] * t.element_size()


# ---------------------------------------------------------------------------------------------
# combine formats
# ---------------------------------------------------------------------------------------------


def combine_scale_offset(hidden: int) -> int:
    """Where a blockwise fp8 row's f32 scales start: after the fp8 elements, aligned to 4 bytes."""
    return align(hidden, 4)


def check_combine_reference(dtype: CombineDtype) -> None:
    """Refuse a combine format this module has no reference for (native MoRI's fp4, carried by MoRI alone)."""
    if not wire_formats.COMBINE_BY_NAME[dtype.value].has_reference:
        accepted = ", ".join(wire_formats.REFERENCE_COMBINE_ENV_NAMES)
        raise ConfigError(f"combine dtype {dtype.value} has no reference wire format; use one of {accepted}")


def combine_row_bytes(dtype: CombineDtype, hidden: int, block: int = FP8_BLOCK) -> int:
    """Bytes one expert output occupies on the wire: 14336 (bf16), 7392 (blockwise), 7168 (cast) at 7168."""
    check_combine_reference(dtype)
    fmt = wire_formats.COMBINE_BY_NAME[dtype.value]
    elements = hidden * fmt.element_bits // 8
    if not fmt.block_scaled:
        return elements
    return align(elements, 4) + 4 * num_blocks(hidden, block)


def quantize_combine(
    y: torch.Tensor, dtype: CombineDtype, fp8_dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Expert outputs ``[R, hidden]`` -> wire rows ``[R, combine_row_bytes]`` as uint8."""
    rows, hidden = y.shape
    if dtype is CombineDtype.BF16:
        return dense(y.to(torch.bfloat16)).view(torch.uint8)
    if dtype is CombineDtype.FP8_DIRECT_CAST:
        return saturating_fp8_cast(y, fp8_dtype).view(torch.uint8)
    row_bytes = combine_row_bytes(dtype, hidden, block)
    xf = _blocked(y, block)
    amax = _finite_amax(xf)
    limit = torch.full_like(amax, fp8_max(fp8_dtype))
    ones = torch.ones_like(amax)
    if dtype is CombineDtype.FP8_BLOCKWISE:
        # Divide by a tensor, never a Python scalar: torch turns a scalar divisor into a multiply by its
        # reciprocal on GPUs (not on CPUs), which rounds differently from the kernels' true division.
        nonzero = amax > 0
        clamped = amax.clamp(min=min_block_amax(fp8_dtype))
        scales = torch.where(nonzero, clamped / limit, ones)
        inv = torch.where(nonzero, limit / clamped, ones)
        q = saturating_fp8_cast(xf * inv[:, :, None], fp8_dtype)
    else:
        scaled = amax > limit
        scales = torch.where(scaled, amax * (1.0 / fp8_max(fp8_dtype)), ones)
        inv = torch.where(scaled, limit / amax, ones)
        q = saturating_fp8_cast(torch.where(scaled[:, :, None], xf * inv[:, :, None], xf), fp8_dtype)
        flag = scaled.any(dim=1)
        scales[:, 0] = torch.where(flag, -scales[:, 0], scales[:, 0])
    out = torch.zeros(rows, row_bytes, dtype=torch.uint8, device=y.device)
    out[:, :hidden] = _unblocked(q.view(torch.uint8), hidden)
    out[:, combine_scale_offset(hidden) :] = scales.contiguous().view(torch.uint8)
    return out


def dequantize_combine(
    rows: torch.Tensor, dtype: CombineDtype, hidden: int, fp8_dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Wire rows -> f32 ``[R, hidden]``, the values the receiver accumulates."""
    if dtype is CombineDtype.BF16:
        return rows.contiguous().view(torch.bfloat16).float()
    q = rows[:, :hidden].contiguous().view(fp8_dtype).float()
    if dtype is CombineDtype.FP8_DIRECT_CAST:
        return q
    blocks = num_blocks(hidden, block)
    offset = combine_scale_offset(hidden)
    scales = rows[:, offset : offset + 4 * blocks].contiguous().view(torch.float32)
    if dtype is CombineDtype.FP8_BLOCKWISE_NATIVE:
        has_scales = scales[:, :1] < 0
        scales = torch.where(has_scales, scales.abs(), torch.ones_like(scales))
    return _unblocked(_blocked(q, block) * scales[:, :, None], hidden)


# ---------------------------------------------------------------------------------------------
# dispatch formats
# ---------------------------------------------------------------------------------------------


def check_dispatch_hidden(dtype: DispatchDtype, hidden: int) -> None:
    """The one hidden-size rule of the dispatch formats: fp4 packs two elements per byte."""
    fmt = wire_formats.DISPATCH_BY_NAME[dtype.value]
    if hidden % fmt.hidden_multiple:
        raise FormatError(f"hidden={hidden}: {fmt.name} dispatch {fmt.hidden_rule}")


def dispatch_token_bytes(dtype: DispatchDtype, hidden: int) -> int:
    check_dispatch_hidden(dtype, hidden)
    return wire_formats.DISPATCH_BY_NAME[dtype.value].token_bytes(hidden)


def dispatch_scale_groups(dtype: DispatchDtype, hidden: int) -> int:
    """Scales per token: ceil(hidden / 128) f32 for fp8, ceil(hidden / 32) e8m0 bytes for mxfp8 / fp4."""
    group = wire_formats.DISPATCH_BY_NAME[dtype.value].scale_group
    return num_blocks(hidden, group) if group else 0


def dispatch_scale_width(dtype: DispatchDtype, hidden: int) -> int:
    """Bytes of a token's scales themselves, no padding: 92 B for fp8, 90 B for mxfp8 and fp4 at 2880."""
    return dispatch_scale_groups(dtype, hidden) * wire_formats.DISPATCH_BY_NAME[dtype.value].scale_bytes


def dispatch_scale_bytes(dtype: DispatchDtype, hidden: int) -> int:
    """Natural scale row of a dispatch format, whole dwords: 224 B for fp8, mxfp8 and fp4 at hidden 7168;
    92 B at 2880 (23 f32 scales, or 90 e8m0 bytes and two zero pad bytes)."""
    return align(dispatch_scale_width(dtype, hidden), 4)


def dispatch_payload_dtype(dtype: DispatchDtype, fp8_dtype: torch.dtype) -> torch.dtype:
    """The element type of a wire token: the op's fp8 flavour for fp8 formats, bytes for packed fp4."""
    fmt = wire_formats.DISPATCH_BY_NAME[dtype.value]
    if fmt.fp8 == wire_formats.OP_FP8:
        return fp8_dtype
    return torch.bfloat16 if fmt.element_bits == 16 else torch.uint8


def mx_emax(dtype: DispatchDtype, fp8_dtype: torch.dtype) -> int:
    """Exponent of the element type's largest power of two: 8 for e4m3fn, 7 for e4m3fnuz, 2 for e2m1."""
    if dtype is DispatchDtype.MXFP4:
        return FP4_E2M1_EMAX
    return math.floor(math.log2(fp8_max(fp8_dtype)))


def _e8m0_exponent(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX shared exponent: floor(log2(amax)) - emax, clamped to e8m0's range; amax 0 -> -127. An
    infinite amax counts as 2^128 (its f32 exponent field, which is what a kernel reading the bits
    sees); its group's scale byte is then replaced by the NaN code (``_e8m0_bytes``)."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = torch.frexp(safe).exponent - 1  # exact floor(log2) for finite f32
    exp = torch.where(safe.isinf(), torch.full_like(exp, 128), exp)
    exp = torch.where(amax > 0, exp - emax, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def _e8m0_bytes(exp: torch.Tensor, poisoned: torch.Tensor) -> torch.Tensor:
    """Biased e8m0 bytes; E8M0_NAN where the group holds what its elements cannot carry."""
    return torch.where(poisoned, torch.full_like(exp, E8M0_NAN), exp + E8M0_BIAS).to(torch.uint8)


def _e8m0_scale(exp: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """f32 -> e2m1 codes (uint8 0..15): round to nearest even, saturate at ±6."""
    mag = v.abs().clamp(max=FP4_E2M1_MAX)
    # Midpoints between neighbouring e2m1 values; a tie goes to the even code.
    table = torch.tensor(FP4_E2M1_VALUES, device=v.device)
    mids = (table[1:] + table[:-1]) / 2
    code = torch.bucketize(mag, mids, right=False)  # mag == mid -> lower code
    tie = (mag[..., None] == mids).any(-1)
    lower_odd = (code % 2) == 1
    code = torch.where(tie & lower_odd, code + 1, code)
    sign = torch.signbit(v)  # -0 keeps its sign, as the fp8 casts do
    return (code + sign.to(code.dtype) * 8).to(torch.uint8)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_E2M1_VALUES, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def quantize_dispatch(
    x: torch.Tensor, dtype: DispatchDtype, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16 tokens ``[N, hidden]`` -> (payload, scale row) of the dispatch format.

    fp8: DeepSeek's per-token-group quant (scale = max(amax, 1e-10) / fp8_max, f32; q = x * (fp8_max / amax),
    one division per group, as the kernels do);
    mxfp8 / fp4: OCP MX (shared exponent floor(log2 amax) - emax, e8m0 byte, saturating cast), the
    scale row zero-padded to whole dwords. Non-finite values: the module docstring.
    """
    n, hidden = x.shape
    if dtype is DispatchDtype.BF16:
        return x.to(torch.bfloat16), None
    check_dispatch_hidden(dtype, hidden)
    groups = _blocked(x, wire_formats.DISPATCH_BY_NAME[dtype.value].scale_group)
    if dtype is DispatchDtype.FP8:
        amax = _finite_amax(groups).clamp(min=1e-10)
        limit = torch.full_like(amax, fp8_max(fp8_dtype))
        scales = amax / limit
        q = saturating_fp8_cast(groups * (limit / amax)[:, :, None], fp8_dtype)
        return _unblocked(q.view(torch.uint8), hidden).contiguous().view(fp8_dtype), scales
    amax = _finite_amax(groups)
    exp = _e8m0_exponent(amax, mx_emax(dtype, fp8_dtype))
    scaled = groups / _e8m0_scale(exp)[:, :, None]
    infinite = groups.isinf().any(dim=2)
    scale_row = torch.zeros(n, dispatch_scale_bytes(dtype, hidden), dtype=torch.uint8, device=x.device)
    if dtype is DispatchDtype.MXFP8:
        scale_row[:, : exp.shape[1]] = _e8m0_bytes(exp, infinite)
        q = saturating_fp8_cast(scaled, fp8_dtype)
        return _unblocked(q.view(torch.uint8), hidden).contiguous().view(fp8_dtype), scale_row
    scale_row[:, : exp.shape[1]] = _e8m0_bytes(exp, infinite | groups.isnan().any(dim=2))
    finite = torch.where(scaled.isnan(), torch.zeros_like(scaled), scaled)
    codes = _e2m1_encode(_unblocked(finite, hidden))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale_row


def _scale_columns(scales: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """The first ``groups`` scales of each of the ``n`` rows (a scale row may carry more after them)."""
    if n == 0:
        return scales.new_zeros(0, groups)
    return scales.reshape(n, -1)[:, :groups]


def dequantize_dispatch(
    payload: torch.Tensor, scales: torch.Tensor | None, dtype: DispatchDtype, hidden: int
) -> torch.Tensor:
    """Payload + scale row -> f32 ``[N, hidden]`` (what the expert GEMM effectively sees). ``scales``:
    f32 rows for fp8, byte rows for mxfp8 / fp4; columns past the format's scales are ignored."""
    n = payload.shape[0]
    if dtype is DispatchDtype.BF16:
        return payload.float()
    groups = dispatch_scale_groups(dtype, hidden)
    group = wire_formats.DISPATCH_BY_NAME[dtype.value].scale_group
    if dtype is DispatchDtype.FP8:
        values = _blocked(payload.float(), group)
        return _unblocked(values * _scale_columns(scales.float(), n, groups)[:, :, None], hidden)
    codes = _scale_columns(dense(scales).view(torch.uint8), n, groups)
    scale = torch.where(codes == E8M0_NAN, math.nan, _e8m0_scale(codes.long() - E8M0_BIAS))
    if dtype is DispatchDtype.MXFP8:
        values = payload.float()
    else:
        packed = dense(payload).view(torch.uint8)
        nibbles = torch.stack((packed & 0xF, packed >> 4), dim=2).view(n, hidden)
        values = _e2m1_decode(nibbles)
    return _unblocked(_blocked(values, group) * scale[:, :, None], hidden)


# ---------------------------------------------------------------------------------------------
# packed dispatch row (what the torch provider sends; the Triton kernels use the same sections)
# ---------------------------------------------------------------------------------------------


def align(n: int, to: int = 16) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def wire_ids(ids: torch.Tensor) -> torch.Tensor:
    """Top-k ids as they travel (int32): every negative id, whatever its width, is a dropped slot and
    travels as -1. Ids past the last expert never travel (refused, or sent as dropped and raised)."""
    return torch.where(ids < 0, torch.full_like(ids, -1), ids).int()


class DispatchRowLayout:
    """One dispatched copy as a byte row: ``[token | scale row padded to its stride | K f32 weights |
    K i32 ids]``, each section 16 B aligned so kernels can move it with vector loads."""

    def __init__(self, token_bytes: int, scale_bytes: int, topk: int) -> None:
        self.token_bytes = token_bytes
        self.scale_bytes = scale_bytes
        self.scale_stride = scale_stride_bytes(scale_bytes)
        self.topk = topk
        self.scale_offset = align(token_bytes)
        self.weights_offset = self.scale_offset + self.scale_stride
        self.ids_offset = align(self.weights_offset + 4 * topk)
        self.row_bytes = align(self.ids_offset + 4 * topk)

    def pack(
        self, tokens: torch.Tensor, scales: torch.Tensor | None, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows of already-gathered copies -> ``[R, row_bytes]`` uint8 with zeroed pads."""
        rows = torch.zeros(tokens.shape[0], self.row_bytes, dtype=torch.uint8, device=tokens.device)
        rows[:, : self.token_bytes] = dense(tokens).view(torch.uint8)
        if self.scale_bytes:
            assert scales is not None
            rows[:, self.scale_offset : self.scale_offset + self.scale_bytes] = scales
        rows[:, self.weights_offset : self.weights_offset + 4 * self.topk] = dense(weights.float()).view(torch.uint8)
        rows[:, self.ids_offset : self.ids_offset + 4 * self.topk] = dense(wire_ids(ids)).view(torch.uint8)
        return rows

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, : self.token_bytes]

    def scale_region(self, rows: torch.Tensor) -> torch.Tensor:
        """The whole padded scale region, ``[R, scale_stride]``."""
        return rows[:, self.scale_offset : self.scale_offset + self.scale_stride]

    def weights(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.weights_offset : self.weights_offset + 4 * self.topk].contiguous().view(torch.float32)

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.ids_offset : self.ids_offset + 4 * self.topk].contiguous().view(torch.int32)
