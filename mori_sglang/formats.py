"""Byte layouts of every wire format, with torch reference quantizers and dequantizers.

These functions define the formats: every provider (torch.distributed, Triton kernels, native MoRI
where it is compatible) must produce the same bytes. They run on any device.

Combine rows (expert output travelling back to its source):
  bf16                  [hidden x bf16]
  fp8_direct_cast       [hidden x fp8]                       saturating round-to-nearest-even cast
  fp8_blockwise         [hidden x fp8 | n_blocks x f32]      scale = amax / fp8_max per block
  fp8_blockwise_native  same layout, native MoRI's scales    1.0 unless amax > fp8_max; sign of
                                                             scales[0] set when any block is scaled
  (n_blocks = ceil(hidden / block): the last block may be short)
Dispatch payloads (the sender quantizes once; the scale row is opaque to the transport):
  bf16   [hidden x bf16]
  fp8    [hidden x fp8]         + f32 per 128 elements   (scale row 4 * hidden / 128 B)
  mxfp8  [hidden x fp8]         + e8m0 byte per 32
  fp4    [hidden / 2 x uint8]   + e8m0 byte per 32       (e2m1, low nibble = even element)
"""

from __future__ import annotations

import math

import torch

from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype

SCALE_ROW_ALIGN = 128
DISPATCH_FP8_GROUP = 128
MX_GROUP = 32
E8M0_BIAS = 127
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
    """Round to nearest even and saturate at ±max (torch's e4m3fnuz cast overflows to NaN without it)."""
    limit = fp8_max(fp8_dtype)
    return x.float().clamp(-limit, limit).to(fp8_dtype)


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


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of a 2-D tensor."""
    return t.shape[1] * t.element_size()


# ---------------------------------------------------------------------------------------------
# combine formats
# ---------------------------------------------------------------------------------------------


def _check_blocks(hidden: int, block: int, knob: str) -> int:
    if hidden % block:
        raise FormatError(f"hidden={hidden} is not a multiple of the {knob} block ({block} elements)")
    return hidden // block


def combine_blocks(hidden: int, block: int) -> int:
    """Blocks of a blockwise combine row (the last one short where ``block`` does not divide ``hidden``);
    the f32 scales follow the fp8 values, so ``hidden`` must be a multiple of 4."""
    if hidden % 4:
        raise FormatError(f"a blockwise fp8 combine row needs hidden ({hidden}) to be a multiple of 4")
    return math.ceil(hidden / block)


def combine_row_bytes(dtype: CombineDtype, hidden: int, block: int = 128) -> int:
    """Bytes one expert output occupies on the wire: 14336 (bf16), 7392 (blockwise), 7168 (cast) at 7168."""
    if dtype is CombineDtype.BF16:
        return 2 * hidden
    if dtype is CombineDtype.FP8_DIRECT_CAST:
        return hidden
    if dtype in (CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE):
        return hidden + 4 * combine_blocks(hidden, block)
    raise ConfigError(f"combine dtype {dtype.value} has no reference wire format; use bf16, fp8 or fp8_direct_cast")


def _padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[R, hidden]`` -> f32 ``[R, n_blocks, block]``, zeros past ``hidden`` (they change no amax)."""
    rows, hidden = x.shape
    n_blocks = combine_blocks(hidden, block)
    padded = torch.zeros(rows, n_blocks * block, dtype=torch.float32, device=x.device)
    padded[:, :hidden] = x.float()
    return padded.view(rows, n_blocks, block)


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block max |y| in f32 with NaN counted as 0 (as native MoRI's bit-pattern max does)."""
    return blocks.abs().nan_to_num(nan=0.0).amax(dim=2)


def quantize_combine(y: torch.Tensor, dtype: CombineDtype, fp8_dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """Expert outputs ``[R, hidden]`` -> wire rows ``[R, combine_row_bytes]`` as uint8."""
    rows, hidden = y.shape
    if dtype is CombineDtype.BF16:
        return y.to(torch.bfloat16).contiguous().view(torch.uint8)
    if dtype is CombineDtype.FP8_DIRECT_CAST:
        return saturating_fp8_cast(y, fp8_dtype).view(torch.uint8)
    xf = _padded_blocks(y, block)
    n_blocks = xf.shape[1]
    amax = _block_amax(xf)
    limit = fp8_max(fp8_dtype)
    if dtype is CombineDtype.FP8_BLOCKWISE:
        # Divide by a tensor, never a Python scalar: torch turns a scalar divisor into a multiply by its
        # reciprocal on GPUs (not on CPUs), which rounds differently from the kernels' true division.
        scales = torch.where(amax > 0, amax / torch.full_like(amax, limit), torch.ones_like(amax))
        safe_amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        inv = torch.where(amax > 0, torch.full_like(amax, limit) / safe_amax, torch.ones_like(amax))
        q = saturating_fp8_cast(xf * inv[:, :, None], fp8_dtype)
    else:
        scaled = amax > limit
        scales = torch.where(scaled, amax * (1.0 / limit), torch.ones_like(amax))
        inv = torch.where(scaled, torch.full_like(amax, limit) / amax, torch.ones_like(amax))
        q = saturating_fp8_cast(torch.where(scaled[:, :, None], xf * inv[:, :, None], xf), fp8_dtype)
        flag = scaled.any(dim=1)
        scales[:, 0] = torch.where(flag, -scales[:, 0], scales[:, 0])
    out = torch.empty(rows, hidden + 4 * n_blocks, dtype=torch.uint8, device=y.device)
    out[:, :hidden] = q.view(rows, n_blocks * block)[:, :hidden].view(torch.uint8)
    out[:, hidden:] = scales.contiguous().view(torch.uint8)
    return out


def dequantize_combine(
    rows: torch.Tensor, dtype: CombineDtype, hidden: int, fp8_dtype: torch.dtype, block: int = 128
) -> torch.Tensor:
    """Wire rows -> f32 ``[R, hidden]``, the values the receiver accumulates."""
    if dtype is CombineDtype.BF16:
        return rows.contiguous().view(torch.bfloat16).float()
    q = rows[:, :hidden].contiguous().view(fp8_dtype).float()
    if dtype is CombineDtype.FP8_DIRECT_CAST:
        return q
    n_blocks = combine_blocks(hidden, block)
    scales = rows[:, hidden : hidden + 4 * n_blocks].contiguous().view(torch.float32)
    if dtype is CombineDtype.FP8_BLOCKWISE_NATIVE:
        has_scales = scales[:, :1] < 0
        scales = torch.where(has_scales, scales.abs(), torch.ones_like(scales))
    return q * scales.repeat_interleave(block, dim=1)[:, :hidden]


# ---------------------------------------------------------------------------------------------
# dispatch formats
# ---------------------------------------------------------------------------------------------


def dispatch_token_bytes(dtype: DispatchDtype, hidden: int) -> int:
    if dtype is DispatchDtype.BF16:
        return 2 * hidden
    if dtype is DispatchDtype.MXFP4:
        return hidden // 2
    return hidden


def dispatch_scale_bytes(dtype: DispatchDtype, hidden: int) -> int:
    """Natural scale row of a dispatch format: 224 B for fp8, mxfp8 and fp4 at hidden 7168."""
    if dtype is DispatchDtype.BF16:
        return 0
    if dtype is DispatchDtype.FP8:
        return 4 * _check_blocks(hidden, DISPATCH_FP8_GROUP, "fp8 dispatch")
    return _check_blocks(hidden, MX_GROUP, f"{dtype.value} dispatch")


def dispatch_payload_dtype(dtype: DispatchDtype, fp8_dtype: torch.dtype) -> torch.dtype:
    if dtype is DispatchDtype.BF16:
        return torch.bfloat16
    if dtype is DispatchDtype.MXFP4:
        return torch.uint8
    return fp8_dtype


def mx_emax(dtype: DispatchDtype, fp8_dtype: torch.dtype) -> int:
    """Exponent of the element type's largest power of two: 8 for e4m3fn, 7 for e4m3fnuz, 2 for e2m1."""
    if dtype is DispatchDtype.MXFP4:
        return FP4_E2M1_EMAX
    return math.floor(math.log2(fp8_max(fp8_dtype)))


def _e8m0_exponent(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX shared exponent: floor(log2(amax)) - emax, clamped to e8m0's range; amax 0 -> -127. An
    infinite amax counts as 2^128 (its f32 exponent field, which is what a kernel reading the bits sees):
    its group gets the largest scale the format reaches."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = torch.frexp(safe).exponent - 1  # exact floor(log2) for finite f32
    exp = torch.where(safe.isinf(), torch.full_like(exp, 128), exp)
    exp = torch.where(amax > 0, exp - emax, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


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
    mxfp8 / fp4: OCP MX (shared exponent floor(log2 amax) - emax, e8m0 byte, saturating cast).
    """
    n, hidden = x.shape
    if dtype is DispatchDtype.BF16:
        return x.to(torch.bfloat16), None
    dispatch_scale_bytes(dtype, hidden)  # validates the group size
    xf = x.float()
    if dtype is DispatchDtype.FP8:
        groups = xf.view(n, hidden // DISPATCH_FP8_GROUP, DISPATCH_FP8_GROUP)
        amax = groups.abs().amax(dim=2).clamp(min=1e-10)
        scales = amax / torch.full_like(amax, fp8_max(fp8_dtype))
        inv = torch.full_like(amax, fp8_max(fp8_dtype)) / amax
        q = saturating_fp8_cast(groups * inv[:, :, None], fp8_dtype).view(n, hidden)
        return q, scales
    groups = xf.view(n, hidden // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(dim=2)
    emax = mx_emax(dtype, fp8_dtype)
    exp = _e8m0_exponent(amax, emax)
    scaled = groups / _e8m0_scale(exp)[:, :, None]
    scale_bytes = (exp + E8M0_BIAS).to(torch.uint8)
    if dtype is DispatchDtype.MXFP8:
        return saturating_fp8_cast(scaled, fp8_dtype).view(n, hidden), scale_bytes
    codes = _e2m1_encode(scaled.view(n, hidden))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale_bytes


def dequantize_dispatch(
    payload: torch.Tensor, scales: torch.Tensor | None, dtype: DispatchDtype, hidden: int
) -> torch.Tensor:
    """Payload + scale row -> f32 ``[N, hidden]`` (what the expert GEMM effectively sees)."""
    n = payload.shape[0]
    if dtype is DispatchDtype.BF16:
        return payload.float()
    if dtype is DispatchDtype.FP8:
        n_groups = hidden // DISPATCH_FP8_GROUP
        groups = payload.float().view(n, n_groups, DISPATCH_FP8_GROUP)
        return (groups * scales.float().view(n, n_groups)[:, :, None]).view(n, hidden)
    exp = scales.contiguous().view(torch.uint8).view(n, hidden // MX_GROUP).long() - E8M0_BIAS
    if dtype is DispatchDtype.MXFP8:
        values = payload.float()
    else:
        packed = payload.contiguous().view(torch.uint8)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=2).view(n, hidden)
        values = _e2m1_decode(codes)
    return (values.view(n, hidden // MX_GROUP, MX_GROUP) * _e8m0_scale(exp)[:, :, None]).view(n, hidden)


# ---------------------------------------------------------------------------------------------
# packed dispatch row (what the torch provider sends; the Triton kernels use the same sections)
# ---------------------------------------------------------------------------------------------


def _align(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


class DispatchRowLayout:
    """One dispatched copy as a byte row: ``[token | scale row padded to its stride | K f32 weights |
    K i32 ids]``, each section 16 B aligned so kernels can move it with vector loads."""

    def __init__(self, token_bytes: int, scale_bytes: int, topk: int) -> None:
        self.token_bytes = token_bytes
        self.scale_bytes = scale_bytes
        self.scale_stride = scale_stride_bytes(scale_bytes)
        self.topk = topk
        self.scale_offset = _align(token_bytes)
        self.weights_offset = self.scale_offset + self.scale_stride
        self.ids_offset = _align(self.weights_offset + 4 * topk)
        self.row_bytes = _align(self.ids_offset + 4 * topk)

    def pack(
        self, tokens: torch.Tensor, scales: torch.Tensor | None, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows of already-gathered copies -> ``[R, row_bytes]`` uint8 with zeroed pads."""
        rows = torch.zeros(tokens.shape[0], self.row_bytes, dtype=torch.uint8, device=tokens.device)
        rows[:, : self.token_bytes] = tokens.contiguous().view(torch.uint8)
        if self.scale_bytes:
            assert scales is not None
            rows[:, self.scale_offset : self.scale_offset + self.scale_bytes] = scales
        rows[:, self.weights_offset : self.weights_offset + 4 * self.topk] = (
            weights.float().contiguous().view(torch.uint8)
        )
        rows[:, self.ids_offset : self.ids_offset + 4 * self.topk] = ids.int().contiguous().view(torch.uint8)
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
