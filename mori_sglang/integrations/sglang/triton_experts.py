"""SGLang's Triton fused experts on a MoRI dispatch output: the fused function of (mori, triton).

SGLang's ``MoeRunner`` looks a fused function up by a2a backend and runner backend and, where one is
registered, hands it the dispatch output, the quant method's ``TritonMoeQuantInfo`` and the layer's
runner config instead of running its pre-permute / runner / post-permute chain (which has no entry for
MoRI's outputs on the Triton runner). ``mori_to_triton`` masks and bounds the received rows
(``expert_input``), calls SGLang's own ``fused_experts`` on them with local expert ids, and returns the
output rows as the combine input: router weights applied once, by the down GEMM (or on the input where
the model asks for it), one row per received row, which combine sums per token without weighting.
``routed_scaling_factor`` is left to the model, which applies it after the combine on its a2a path.
"""

from __future__ import annotations

from dataclasses import replace

from sglang.srt.layers.moe.moe_runner.base import FusedOpPool, MoeRunnerConfig
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo
from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputFormat
from sglang.srt.layers.moe.token_dispatcher.moriep import (
    MoriEPLLCombineInput,
    MoriEPLLDispatchOutput,
    MoriEPNormalCombineInput,
    MoriEPNormalDispatchOutput,
)
from sglang.srt.layers.moe.topk import StandardTopKOutput

from mori_sglang.integrations.sglang.expert_input import (
    PRE_QUANTIZED_GROUP,
    expert_input,
    expert_rows,
    local_expert_ids,
)

A2A_BACKEND = "mori"
RUNNER_BACKEND = "triton"


def register() -> None:
    """Register ``mori_to_triton`` for (mori, triton); a second call in the same process is a no-op."""
    if FusedOpPool.get_fused_func(A2A_BACKEND, RUNNER_BACKEND) is None:
        FusedOpPool.register_fused_func(A2A_BACKEND, RUNNER_BACKEND, mori_to_triton)


def _takes_pre_quantized_fp8(quant_info: TritonMoeQuantInfo) -> bool:
    """Block-fp8 experts whose blocks span 128 hidden elements read the fp8 dispatch payload as is."""
    block = quant_info.block_shape
    return quant_info.use_fp8_w8a8 and block is not None and block[1] == PRE_QUANTIZED_GROUP


def _quantizes_per_tensor(quant_info: TritonMoeQuantInfo) -> bool:
    """Experts that scale their activations by one amax over every row handed to them: dynamic
    per-tensor fp8 (no block, no per-token scale, no static scale; SGLang's int8 experts without a
    block always scale per token)."""
    return (
        quant_info.use_fp8_w8a8
        and quant_info.block_shape is None
        and not quant_info.per_channel_quant
        and quant_info.a13_scale is None
    )


def _check_supported(quant_info: TritonMoeQuantInfo, runner_config: MoeRunnerConfig) -> None:
    if quant_info.use_mxfp8:
        raise NotImplementedError(
            "mori-sglang's Triton expert path cannot run MXFP8 experts (SGLang's Triton MoE kernels "
            "have no MXFP8 path on NVIDIA); serve this checkpoint with another --moe-a2a-backend"
        )
    if runner_config.no_combine:
        raise NotImplementedError(
            "mori-sglang's Triton expert path sums each token's local experts before combine; "
            "no_combine MoE layers are not supported with --moe-a2a-backend mori"
        )


def mori_to_triton(
    dispatch_output: MoriEPNormalDispatchOutput | MoriEPLLDispatchOutput,
    quant_info: TritonMoeQuantInfo,
    runner_config: MoeRunnerConfig,
) -> MoriEPNormalCombineInput | MoriEPLLCombineInput:
    """This rank's experts on the received rows; the output has one bf16 row per handed-on row."""
    _check_supported(quant_info, runner_config)
    out = dispatch_output
    hidden = quant_info.w2_weight.shape[1]
    rows = expert_rows(out.hidden_states.shape[0], out.recv_cap)
    num_local = runner_config.num_local_experts
    first_expert = runner_config.moe_ep_rank * num_local
    ids = local_expert_ids(out.topk_ids[:rows], out.num_recv_tokens_per_expert, first_expert, num_local)
    pre_quantized = _takes_pre_quantized_fp8(quant_info)
    zero_past = out.num_recv_tokens_per_expert if _quantizes_per_tensor(quant_info) else None
    activations = expert_input(out.hidden_states, out.hidden_states_scale, rows, hidden, pre_quantized, zero_past)
    a1_scale = quant_info.a13_scale if activations.a1_q is None else activations.a1_scale
    output = fused_experts(
        hidden_states=activations.hidden_states,
        w1=quant_info.w13_weight,
        w2=quant_info.w2_weight,
        topk_output=StandardTopKOutput(out.topk_weights[:rows], ids, None),
        # Out of place: in place would write into the dispatch receive buffer. Unscaled, as every a2a
        # backend's experts return their output: the model's a2a forward (DeepSeek's forward_deepep,
        # GLM's) multiplies by routed_scaling_factor after the combine, and scaling here too counted it twice.
        moe_runner_config=replace(runner_config, inplace=False, routed_scaling_factor=None),
        b1=quant_info.b13,
        b2=quant_info.b2,
        use_fp8_w8a8=quant_info.use_fp8_w8a8,
        use_int8_w8a8=quant_info.use_int8_w8a8,
        use_int8_w8a16=quant_info.use_int8_w8a16,
        use_int4_w4a16=quant_info.use_int4_w4a16,
        per_channel_quant=quant_info.per_channel_quant,
        w1_scale=quant_info.w13_scale,
        w2_scale=quant_info.w2_scale,
        w1_zp=quant_info.w13_zp,
        w2_zp=quant_info.w2_zp,
        a1_scale=a1_scale,
        a2_scale=quant_info.a2_scale,
        block_shape=quant_info.block_shape,
        a1_q=activations.a1_q,
        fuse_swiglu_interleaved=quant_info.fuse_swiglu_interleaved,
    )
    combine_class = MoriEPLLCombineInput if out.format is DispatchOutputFormat.DEEPEP_LL else MoriEPNormalCombineInput
    return combine_class(hidden_states=output, topk_ids=out.topk_ids, topk_weights=out.topk_weights)
