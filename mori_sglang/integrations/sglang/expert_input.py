"""From a MoRI dispatch output to the input of SGLang's Triton fused experts, without a host sync.

The received buffer holds ``W * max_tokens`` rows; only the first ``num_recv`` (a device tensor) are
real, and each carries all K global expert ids of its token. SGLang's Triton path takes local expert
ids, -1 where an expert is not this rank's (its kernels write zeros there and read nothing), so every
row past ``num_recv`` and every other rank's expert becomes -1 by device arithmetic alone. The rows
handed on can be bounded on the host first (``expert_rows``): the expert path sorts ``rows * K`` ids
and sizes its grids by them, so a decode batch should not pay for a prefill-sized buffer.

Payloads: bf16 goes through; fp8 with f32 scales per 128 elements goes through as SGLang's
pre-quantized activation where the weights are block-128 fp8 (no second quantization); any other
quantized payload (fp8 for other weights, mxfp8, fp4, e4m3fnuz) is dequantized to bf16 with the
format's own reference, and the expert path quantizes it as it would a bf16 activation.

Nothing here imports SGLang, so the same code runs where SGLang does not (the device tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mori_sglang import formats, wire_formats
from mori_sglang.config import DispatchDtype

# Elements per f32 scale of the fp8 dispatch format: block-128 fp8 experts take such tokens as they are.
PRE_QUANTIZED_GROUP = wire_formats.DISPATCH_BY_NAME[DispatchDtype.FP8.value].scale_group


def expert_rows(capacity: int, recv_bound: int) -> int:
    """Rows of the receive buffer handed to the experts: ``recv_bound`` where it is a real bound
    (positive and below the capacity), otherwise the whole buffer."""
    return recv_bound if 0 < recv_bound < capacity else capacity


def _row_mask(rows: int, num_recv: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: the row was received (index < num_recv), computed on the device."""
    index = torch.arange(rows, device=num_recv.device, dtype=torch.int32)
    return (index < num_recv.to(torch.int32).view(1)).view(rows, 1)


def local_expert_ids(topk_ids: torch.Tensor, num_recv: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """int32 ``[rows, K]``: ``id - first_expert`` for this rank's experts in received rows, else -1.

    ``topk_ids`` are the received global ids (-1 for dropped slots); rows past ``num_recv`` hold
    whatever an earlier batch left and are masked whole.
    """
    rows = topk_ids.shape[0]
    local = topk_ids.to(torch.int32) - first_expert
    keep = (local >= 0) & (local < num_local) & _row_mask(rows, num_recv)
    return torch.where(keep, local, torch.full_like(local, -1))


def local_expert_counts(local_ids: torch.Tensor, num_local: int) -> torch.Tensor:
    """int32 ``[num_local]``: how many (token, slot) pairs each local expert received.

    A scatter into one extra bin for the -1 entries, so the output size never depends on the data
    (``bincount`` would read the maximum back to the host)."""
    flat = local_ids.reshape(-1).to(torch.int64)
    bins = torch.where(flat >= 0, flat, torch.full_like(flat, num_local))
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=local_ids.device)
    counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
    return counts[:num_local]


def dispatch_dtype_of(payload: torch.Tensor, scales: torch.Tensor | None) -> DispatchDtype:
    """The wire format of a received payload, from its dtype and its scales' dtype."""
    if scales is None:
        if payload.dtype != torch.bfloat16:
            raise ValueError(f"a {payload.dtype} payload without scales is not a mori-sglang dispatch format")
        return DispatchDtype.BF16
    if payload.dtype in (torch.float4_e2m1fn_x2, torch.uint8):
        return DispatchDtype.MXFP4
    if scales.dtype == torch.float32:
        return DispatchDtype.FP8
    if scales.dtype == torch.float8_e8m0fnu:
        return DispatchDtype.MXFP8
    raise ValueError(f"received {payload.dtype} tokens with {scales.dtype} scales: not a mori-sglang dispatch format")


@dataclass
class ExpertInput:
    """What SGLang's ``fused_experts`` takes for the activations.

    ``hidden_states`` is bf16 ``[rows, hidden]``: the activations, or, with ``a1_q``, only the shape
    and dtype of the output (its contents are never read). ``a1_q`` / ``a1_scale``: the fp8 payload
    and its f32 per-128 scales, handed to the up GEMM as they arrived.
    """

    hidden_states: torch.Tensor
    a1_q: torch.Tensor | None = None
    a1_scale: torch.Tensor | None = None


def expert_input(
    payload: torch.Tensor,
    scales: torch.Tensor | None,
    rows: int,
    hidden: int,
    block_fp8_weights: bool,
    zero_past: torch.Tensor | None = None,
) -> ExpertInput:
    """The first ``rows`` received rows as SGLang's Triton path takes them.

    ``block_fp8_weights``: the experts are fp8 with 128-wide blocks along the hidden dimension, so the
    up GEMM reads e4m3fn activations with one f32 scale per 128 elements, exactly the fp8 format.
    ``zero_past``: the received count, for experts that quantize their activations per tensor: their
    scale is the amax of every row handed on, which a row past the count (an earlier batch's, or never
    written: NaN) would set, so those rows reach them as zeros (a new tensor, on the device).
    """
    dtype = dispatch_dtype_of(payload, scales)
    tokens = payload[:rows]
    if dtype is DispatchDtype.BF16:
        values = tokens
    else:
        assert scales is not None
        row_scales = scales[:rows]
        if dtype is DispatchDtype.FP8 and block_fp8_weights and tokens.dtype == torch.float8_e4m3fn:
            output_like = torch.empty(rows, hidden, dtype=torch.bfloat16, device=tokens.device)
            return ExpertInput(output_like, a1_q=tokens, a1_scale=row_scales)
        if dtype is DispatchDtype.MXFP4:
            tokens = tokens.view(torch.uint8)
        values = formats.dequantize_dispatch(tokens, row_scales, dtype, hidden).to(torch.bfloat16)
    if zero_past is not None:
        values = torch.where(
            _row_mask(rows, zero_past), values, torch.zeros((), dtype=values.dtype, device=values.device)
        )
    return ExpertInput(values)
