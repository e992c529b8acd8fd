"""What vLLM's experts receive: a mori-sglang wire format turned into the experts' activation format.

vLLM's experts state the activations they consume in their ``FusedMoEQuantConfig``, or quantize
themselves (``defer_input_quant``). The op carries one wire format, fixed when vLLM asked for the
layer's handle. Where the two coincide the received payload and scale rows go to the experts untouched;
otherwise the receiver dequantizes and rebuilds the experts' format, with the wire-format quantizer for
formats of ours and with vLLM's own quantizer for the rest (per-token, per-tensor, nvfp4, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
from vllm.utils import deep_gemm

from mori_sglang import formats
from mori_sglang.config import DispatchDtype
from mori_sglang.wire_formats import FP8_BLOCK


def expert_format(
    quant_config: FusedMoEQuantConfig, defer_input_quant: bool, fp8_dtype: torch.dtype
) -> DispatchDtype | None:
    """The wire format the experts consume as it is; None where only vLLM's quantizer makes their format.

    BF16 stands for unquantized activations in the layer's dtype. fp8 must be row-major 1x128 blocks of
    the op's fp8 flavour, with scales as the wire has them (amax / fp8_max): where vLLM's DeepGEMM uses
    power-of-two (UE8M0) activation scales it would round ours, so vLLM's quantizer makes them instead;
    MXFP4 is AITER's w4a4 input (packed e2m1 + e8m0 per 32, unshuffled).
    """
    if defer_input_quant or quant_config.quant_dtype is None:
        return DispatchDtype.BF16
    if quant_config.use_mxfp4_w4a4:
        return DispatchDtype.MXFP4
    block = quant_config.block_shape
    if (
        quant_config.quant_dtype == fp8_dtype
        and block is not None
        and block[1] == FP8_BLOCK
        and not quant_config.is_scale_transposed
        and not deep_gemm.is_deep_gemm_e8m0_used()
    ):
        return DispatchDtype.FP8
    return None


def _typed(
    payload: torch.Tensor, scales: torch.Tensor, fmt: DispatchDtype, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized payload and its scale rows (any dtype, whole rows) typed the way the experts take them.

    fp8: e4m3 ``[N, H]`` + f32 ``[N, ceil(H/128)]``; fp4: ``float4_e2m1fn_x2`` ``[N, H/2]`` +
    ``float8_e8m0fnu`` ``[N, ceil(H/32)]``; mxfp8 keeps its uint8 e8m0 bytes (it only reaches the
    dequantizer). A scale row is padded to whole dwords (92 B for the 90 e8m0 scales at hidden 2880), and
    the received rows sit at the receive buffer's row stride: the experts get the format's own scales, in
    the dense ``[N, scales]`` layout vLLM's and AITER's quantizers make, not the padding as extra scales.
    """
    raw = scales.view(torch.uint8)[:, : formats.dispatch_scale_width(fmt, hidden)].contiguous()
    if fmt is DispatchDtype.FP8:
        return payload, raw.view(torch.float32)
    if fmt is DispatchDtype.MXFP4:
        return payload.view(torch.float4_e2m1fn_x2), raw.view(torch.float8_e8m0fnu)
    return payload, raw


@dataclass(frozen=True)
class ActivationPlan:
    """How tokens of one prepare call go from the wire to the experts.

    ``wire``: the op's dispatch dtype; ``target``: ``expert_format`` of the experts (None: vLLM's
    quantizer makes it); ``in_dtype``: the layer's activation dtype, which unquantized experts get back.
    """

    wire: DispatchDtype
    target: DispatchDtype | None
    hidden: int
    fp8_dtype: torch.dtype
    in_dtype: torch.dtype
    quant_config: FusedMoEQuantConfig

    @property
    def passthrough(self) -> bool:
        """The received rows are already what the experts consume."""
        return self.wire is self.target

    def to_experts(
        self, payload: torch.Tensor, scales: torch.Tensor | None, received: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Received rows (payload, uint8 scale rows or None) -> the experts' ``(a1q, a1q_scale)``.

        ``received``: which rows hold tokens (bool ``[rows]``), where the experts get the whole receive
        capacity; the other rows' contents are unspecified. vLLM's quantizer, ours here or the experts'
        own (``defer_input_quant``), sees them as zeros: its per-tensor scales take the amax of every row,
        which a stale row would set (or make NaN). Formats of ours scale each row (or block) on its own,
        and unquantized experts take no amax, so their rows need no mask."""
        if self.wire is DispatchDtype.BF16:
            values = payload
        else:
            assert scales is not None, "a quantized wire format always carries scale rows"
            if self.passthrough:
                return _typed(payload, scales, self.wire, self.hidden)
            wire_payload, wire_scales = _typed(payload, scales, self.wire, self.hidden)
            values = formats.dequantize_dispatch(wire_payload, wire_scales, self.wire, self.hidden)
        vllm_quantizes = self.target is None or (
            self.target is DispatchDtype.BF16 and self.quant_config.quant_dtype is not None
        )
        if received is not None and vllm_quantizes:
            values = values.masked_fill(~received[:, None], 0)
        if self.target is DispatchDtype.BF16:
            return values.to(self.in_dtype), None
        if self.target is not None:
            q, q_scales = formats.quantize_dispatch(values, self.target, self.fp8_dtype)
            assert q_scales is not None, "quantized formats always have scales"
            return _typed(q, q_scales, self.target, self.hidden)
        qc = self.quant_config
        return moe_kernel_quantize_input(
            values.to(self.in_dtype),
            qc.a1_gscale if qc.quant_dtype == "nvfp4" else qc.a1_scale,
            quant_dtype=qc.quant_dtype,
            per_act_token_quant=qc.per_act_token_quant,
            block_shape=qc.block_shape,
            is_scale_swizzled=qc.is_scale_swizzled,
            is_scale_transposed=qc.is_scale_transposed,
            mx_alignment=qc.mx_alignment,
        )
