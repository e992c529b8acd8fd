"""Error measures of a combine output against the exact (f32) sum of its expert outputs."""

from __future__ import annotations

import torch

from mori_sglang import formats
from mori_sglang.config import CombineDtype


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over all elements, accumulated in f64."""
    diff = out.double() - ref.double()
    return float(diff.norm() / ref.double().norm())


def median_element_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Median of ``|out - ref| / |ref|`` over nonzero references: the bulk's precision, which the
    norm-wise error (dominated by the few largest elements) does not show."""
    nonzero = ref != 0
    return float(((out[nonzero].double() - ref[nonzero].double()).abs() / ref[nonzero].double().abs()).median())


def flushed_fraction(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Of the elements whose exact sum is nonzero, the fraction the combine returned as exactly 0."""
    nonzero = ref != 0
    return float(((out == 0) & nonzero).sum() / nonzero.sum().clamp(min=1))


def saturated_fraction(y: torch.Tensor, dtype: CombineDtype, fp8_dtype: torch.dtype, block: int) -> float:
    """The fraction of combine inputs beyond what the format can carry, so the cast clamps them.

    For fp8 that is ``|y| > fp8_max * scale``: scale 1 for the direct cast, the block's scale as the
    wire format encodes it (the core's reference encoder) for the blockwise modes; for bf16, beyond
    bf16's maximum.
    """
    magnitude = y.float().abs()
    if dtype is CombineDtype.BF16:
        return float((magnitude > torch.finfo(torch.bfloat16).max).float().mean())
    limit = torch.full_like(magnitude, formats.fp8_max(fp8_dtype))
    if dtype is not CombineDtype.FP8_DIRECT_CAST:
        hidden = y.shape[1]
        wire = formats.quantize_combine(y, dtype, fp8_dtype, block)
        at = formats.combine_scale_offset(hidden)  # past the fp8 token and its pad to whole f32s
        scales = wire[:, at:].contiguous().view(torch.float32).abs()  # native flags a sign on scales[0]
        limit *= scales.repeat_interleave(block, dim=1)[:, :hidden]  # the last block may be short
    return float((magnitude > limit * (1 + 2**-20)).float().mean())
