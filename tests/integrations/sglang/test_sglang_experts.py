"""SGLang's own MoE layer with ``--moe-a2a-backend mori`` on its Triton runner, against the same layer
without expert parallelism, on CPU.

The layer is SGLang 0.5.23's ``FusedMoE`` with its own ``TopK``, quant methods (unquantized bf16 and
block-128 fp8 experts) and runner; SGLang's factory builds our dispatcher, and SGLang's ``MoeRunner``
finds our fused function for (mori, triton). On 2 and 4 gloo ranks, in normal, low-latency and split
modes, every rank's output must equal the non-EP layer's: bit for bit per destination rank (the layer
restricted to that rank's experts), and as their sum overall; one step routes nothing to the last
rank, and one rank of the 4 has no tokens. The expert-distribution recorder must see the true
per-expert counts, and SGLang's bound on the received rows must shrink the rows the experts sort
(``SGLANG_MORI_RECV_BOUND=0``: the whole buffer).

SGLang's Triton kernels run in Triton's interpreter (tiny shapes), with stand-ins that exist only here,
each for something with no CPU build: exact float conversions in the interpreter (the project's
``install_exact_casts``) and exact dot products of bf16 operands (``exact_interpreter_dot``), a torch
reference of sgl_kernel's ``moe_align_block_size``, CPU registrations
of SGLang's ``sglang::*_fused_experts`` custom ops (registered for CUDA only) that call the same Python
function, and the CPU as the device of SGLang's expert-distribution recorder.

Run with the environment ``.ci/install-sglang.sh VENV`` builds; elsewhere the module is skipped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import triton.language as tl

from tests.integrations.sglang.cpu_import import prepare_sglang_cpu_import

prepare_sglang_cpu_import()
pytest.importorskip(
    "sglang", reason="needs the sglang package: .ci/install-sglang.sh VENV installs SGLang 0.5.23 for CPU tests"
)

from sglang.srt.distributed.parallel_state import GroupCoordinator  # noqa: E402
from sglang.srt.eplb import expert_distribution  # noqa: E402
from sglang.srt.eplb.expert_distribution import (  # noqa: E402
    ExpertDistributionRecorder,
    set_global_expert_distribution_recorder,
)
from sglang.srt.eplb.expert_location import (  # noqa: E402
    ExpertLocationMetadata,
    set_global_expert_location_metadata,
)
from sglang.srt.layers.dp_attention import set_dp_buffer_len  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe, override_config  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.moriep import MoriEPNormalDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput, TopK  # noqa: E402
from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context, get_flags, get_parallel  # noqa: E402

from mori_sglang import formats  # noqa: E402
from mori_sglang.config import DispatchDtype  # noqa: E402
from mori_sglang.integrations.sglang import dispatcher as dispatcher_module  # noqa: E402
from mori_sglang.integrations.sglang import triton_experts  # noqa: E402
from mori_sglang.integrations.sglang.dispatcher import MoriSglangDispatcher, release_shared_ops  # noqa: E402
from mori_sglang.kernels.interpreter import install_exact_casts  # noqa: E402
from tests.helpers import SEED_ENV, generator, run_gloo  # noqa: E402

HIDDEN = 256
INTERMEDIATE = 128
EXPERTS = 8
TOPK = 3
DEEPSEEK_ROUTED_SCALING_FACTOR = 2.5  # DeepSeek V3 / R1
CAP = 24  # SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK
BLOCK = 128  # fp8 weight blocks
TOKENS = {2: (7, 5), 4: (6, 0, 5, 4)}  # one rank of the 4 sends nothing
# Tokens per rank as SGLang's tensor split deals them (SGLANG_MORI_RECV_BOUND's bound assumes it).
SPLIT_TOKENS = {2: (6, 5), 4: (5, 5, 4, 4)}
# One Triton config for both layers: the blocking fixes the f32 accumulation order, so a row's result
# does not depend on how many rows share the call.
TRITON_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
MODES = {
    "normal": (DeepEPMode.NORMAL, "0"),
    "low_latency": (DeepEPMode.LOW_LATENCY, "0"),
    "split": (DeepEPMode.NORMAL, "1"),
}
# (expert weights, SGLANG_MORI_DISPATCH_DTYPE): the weights' own format (auto) and the ones that the
# fused function dequantizes (fp8 on bf16 experts, mxfp8 and fp4).
# gpt_oss: bf16 experts with gpt-oss's biases and clamped SwiGLU (alpha 1.702, limit 7).
COMBOS = [("bf16", "auto"), ("fp8", "auto"), ("bf16", "fp8"), ("fp8", "mxfp8"), ("bf16", "fp4"), ("gpt_oss", "auto")]
GPT_OSS_SWIGLU = {"activation": "silu", "gemm1_alpha": 1.702, "gemm1_clamp_limit": 7.0}
COMBOS_4_RANKS = [("bf16", "auto"), ("fp8", "auto")]
STEPS = ("random", "starve_last_rank")


# ---------------------------------------------------------------------------------------------
# stand-ins for compiled ops with no CPU build (test only)
# ---------------------------------------------------------------------------------------------


def moe_align_block_size_reference(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, *args: object, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of sgl_kernel's ``moe_align_block_size``: the flat (token, slot) indices grouped
    by expert, each group padded to ``block_size`` with the sentinel ``numel``; one expert id per
    block, -1 for the group of invalid (-1) ids; and the padded length."""
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    groups = [(flat == e).nonzero().flatten() for e in range(num_experts)] + [(flat < 0).nonzero().flatten()]
    sorted_ids, expert_ids = [], []
    for expert, members in enumerate(groups):
        if members.numel() == 0:
            continue
        padded = torch.full((-(-members.numel() // block_size) * block_size,), numel, dtype=torch.int64)
        padded[: members.numel()] = members
        sorted_ids.append(padded)
        expert_ids += [expert if expert < num_experts else -1] * (padded.numel() // block_size)
    ids = torch.cat(sorted_ids) if sorted_ids else torch.empty(0, dtype=torch.int64)
    return (
        ids.to(torch.int32),
        torch.tensor(expert_ids, dtype=torch.int32),
        torch.tensor([ids.numel()], dtype=torch.int32),
    )


def _operand_values(handle) -> np.ndarray:
    """A dot operand's values as f32: bf16 / fp16 / fp8 through the exact conversions, f32 unchanged."""
    from triton.runtime import interpreter

    dtype = handle.dtype.scalar
    if dtype.is_floating() and dtype.primitive_bitwidth < 32:
        return interpreter._convert_float(handle.data, dtype, tl.float32, None).view(np.float32)
    return handle.data


def _exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """Drop-in for ``InterpreterBuilder.create_dot``: the product of the operands' values in f32."""
    from triton.runtime.interpreter import TensorHandle

    product = np.matmul(_operand_values(a), _operand_values(b), dtype=np.float32).astype(d.data.dtype)
    return TensorHandle(product + d.data, d.dtype.scalar)


def exact_interpreter_dot() -> None:
    """Triton 3.7's interpreter multiplies bf16 dot operands as their raw 16-bit integers (it stores bf16
    as uint16), which makes SGLang's bf16 expert GEMMs garbage on CPU; the GPU multiplies the values.
    Every bf16 / fp8 value is exact in f32, so decoding the operands first gives the tensor cores'
    products."""
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_dot = _exact_dot


_cpu_ops: list[torch.library.Library] = []


def install_cpu_stand_ins() -> None:
    """What the Triton expert path needs on CPU beyond the interpreter itself."""
    install_exact_casts()
    exact_interpreter_dot()
    fused_moe.moe_align_block_size = moe_align_block_size_reference
    if not _cpu_ops:
        library = torch.library.Library("sglang", "IMPL")
        for op in (fused_moe.inplace_fused_experts, fused_moe.outplace_fused_experts):
            library.impl(op.__name__, op.__wrapped__, "CPU")
        _cpu_ops.append(library)


# ---------------------------------------------------------------------------------------------
# SGLang context
# ---------------------------------------------------------------------------------------------


def tp_coordinator(world_size: int, rank: int) -> GroupCoordinator:
    return GroupCoordinator([list(range(world_size))], rank, "gloo", *[False] * 6, group_name="tp")


@contextlib.contextmanager
def placement(
    tp: GroupCoordinator, ep_size: int, ep_rank: int, a2a: MoeA2ABackend, deepep_mode: DeepEPMode, dp_attention: bool
):
    """What SGLang's launcher sets up for one layer: the tp group, the MoE placement, attention either
    data parallel over the ranks (``--enable-dp-attention``, each rank its own batch) or tensor parallel
    (the batch dealt out by SGLang's tensor split), and the MoE flags."""
    world, rank = tp.world_size, tp.rank_in_group
    with (
        get_parallel().override(
            tp_group=tp,
            tp_size=world,
            moe_ep_size=ep_size,
            moe_ep_rank=ep_rank,
            moe_dp_size=world // ep_size,  # the reference: each rank its own whole layer
            moe_tp_size=1,
            moe_tp_rank=0,
            attn_tp_size=1 if dp_attention else world,
            attn_tp_rank=0 if dp_attention else rank,
            attn_dp_size=world if dp_attention else 1,
            attn_dp_rank=rank if dp_attention else 0,
            attn_cp_size=1,
        ),
        get_flags().moe.override(a2a_backend=a2a, deepep_mode=deepep_mode, tbo_enabled=False),
    ):
        yield


# ---------------------------------------------------------------------------------------------
# the model: router and experts, built and filled as SGLang's loader would
# ---------------------------------------------------------------------------------------------


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 weights and f32 ``scale_inv`` per 128x128 block, as block-fp8 checkpoints hold."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return q, scale


@dataclass
class Model:
    """One MoE layer's router and expert weights (bf16, or block-fp8 with their scales; gpt_oss: bf16
    with per-expert biases, run with gpt-oss's clamped SwiGLU)."""

    weights: str
    gate: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    biases: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def build(seed: int, weights: str) -> Model:
        gen = generator(seed, "model", weights)
        gate = torch.randn(HIDDEN, EXPERTS, generator=gen)
        w13 = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5).to(torch.bfloat16)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5).to(torch.bfloat16)
        if weights == "bf16":
            return Model(weights, gate, w13, w2, None, None)
        if weights == "gpt_oss":
            biases = (
                torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=gen).to(torch.bfloat16),
                torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16),
            )
            return Model(weights, gate, w13, w2, None, None, biases)
        (w13, w13_scale), (w2, w2_scale) = block_fp8(w13), block_fp8(w2)
        return Model(weights, gate, w13, w2, w13_scale, w2_scale)

    def layer(self, first_expert: int, num_experts: int, routed_scaling_factor: float | None = None) -> FusedMoE:
        """SGLang's FusedMoE over the placement in force, holding experts [first, first + local)."""
        quant = None if self.weights != "fp8" else Fp8Config(True, "dynamic", weight_block_size=[BLOCK, BLOCK])
        layer = FusedMoE(
            num_experts=num_experts,
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            layer_id=0,
            top_k=TOPK,
            params_dtype=torch.bfloat16,
            quant_config=quant,
            routed_scaling_factor=routed_scaling_factor,
            **({"with_bias": True, **GPT_OSS_SWIGLU} if self.biases is not None else {}),
        )
        local = slice(first_expert, first_expert + layer.num_local_experts)
        layer.w13_weight.data.copy_(self.w13[local])
        layer.w2_weight.data.copy_(self.w2[local])
        if self.biases is not None:
            layer.w13_weight_bias.data.copy_(self.biases[0][local])
            layer.w2_weight_bias.data.copy_(self.biases[1][local])
        if self.w13_scale is not None:
            layer.w13_weight_scale_inv.data.copy_(self.w13_scale[local])
            layer.w2_weight_scale_inv.data.copy_(self.w2_scale[local])
        else:
            # On CPU SGLang picks its native torch path for unquantized experts; pin the path it takes
            # on NVIDIA, the Triton runner.
            layer.quant_method._forward_method = layer.quant_method.forward_cuda
        # What process_weights_after_loading tells the dispatcher on NVIDIA (its CPU branch repacks
        # the weights for AMX instead).
        layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype, "use_mxfp8": False})
        return layer

    def route(self, x: torch.Tensor, step: str, world_size: int) -> StandardTopKOutput:
        """SGLang's TopK on the router logits; ``starve_last_rank`` keeps every token off the last
        rank's experts (so that rank receives nothing)."""
        logits = x.float() @ self.gate
        if step == "starve_last_rank":
            logits[:, EXPERTS - EXPERTS // world_size :] = float("-inf")
        return TopK(top_k=TOPK, layer_id=0, renormalize=True)(x, logits)


def batch(seed: int, world_size: int, rank: int, step: str, tokens: dict[int, tuple[int, ...]]) -> torch.Tensor:
    gen = generator(seed, world_size, rank, step)
    return torch.randn(tokens[world_size][rank], HIDDEN, generator=gen).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the non-EP reference, per destination rank
# ---------------------------------------------------------------------------------------------


def wire_activations(x: torch.Tensor, dispatch: DispatchDtype, block_fp8_weights: bool):
    """The activations the experts see after the wire: (bf16 input, pre-quantized fp8 or None)."""
    if dispatch is DispatchDtype.BF16:
        return x, None
    payload, scales = formats.quantize_dispatch(x, dispatch, torch.float8_e4m3fn)
    if dispatch is DispatchDtype.FP8 and block_fp8_weights:
        return x, (payload, scales)
    return formats.dequantize_dispatch(payload, scales, dispatch, HIDDEN).to(torch.bfloat16), None


def reference_partials(
    reference: FusedMoE,
    x: torch.Tensor,
    topk: StandardTopKOutput,
    world_size: int,
    dispatch: DispatchDtype,
    block_fp8_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-EP layer on all experts, and restricted to each rank's experts: ``[n, H]``, ``[W, n, H]``.

    One call on ``W + 1`` copies of the tokens, copy r + 1 with every other rank's experts dropped
    (-1), so each row is computed exactly as the EP rank computes it."""
    n, local = x.shape[0], EXPERTS // world_size
    ids = [topk.topk_ids]
    for r in range(world_size):
        mine = (topk.topk_ids >= r * local) & (topk.topk_ids < (r + 1) * local)
        ids.append(torch.where(mine, topk.topk_ids, -1))
    copies = len(ids)
    routing = StandardTopKOutput(topk.topk_weights.repeat(copies, 1), torch.cat(ids), topk.router_logits)
    activations, pre_quant = wire_activations(x, dispatch, block_fp8_weights)
    if pre_quant is not None:
        pre_quant = (pre_quant[0].repeat(copies, 1), pre_quant[1].repeat(copies, 1))
    with override_config(TRITON_CONFIG):
        out = reference(activations.repeat(copies, 1), routing, pre_quant_input=pre_quant)
    out = out.view(copies, n, HIDDEN)
    return out[0], out[1:]


# ---------------------------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------------------------


def setup_worker() -> None:
    for name in list(os.environ):
        if name.startswith(("SGLANG_MORI_", "MORI_")) and name != SEED_ENV:
            del os.environ[name]
    os.environ["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(CAP)
    install_cpu_stand_ins()
    load_plugins()
    get_context().override_server_args(
        device="cpu",
        moe_a2a_backend="mori",
        expert_distribution_recorder_mode="stat",
        expert_distribution_recorder_buffer_size=-1,  # keep every forward pass
    ).install()


def start_recorder(rank: int, world_size: int) -> ExpertDistributionRecorder:
    """SGLang's recorder in 'stat' mode with a trivial expert placement, recording.

    The recorder assumes an accelerator: it allocates its counts on ``get_device()`` (which raises
    on CPU) and empties the device cache on its first dump. Stand-ins here: the CPU, and no cache."""
    expert_distribution.get_device = lambda: "cpu"
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
    physical = torch.arange(EXPERTS).view(1, EXPERTS)
    # Each logical expert's physical copies, padded with -1 to the number of physical experts.
    logical = torch.full((1, EXPERTS, EXPERTS), -1, dtype=torch.int64)
    logical[0, :, 0] = physical[0]
    metadata = ExpertLocationMetadata(
        physical_to_logical_map=physical,
        physical_to_logical_map_cpu=physical,
        logical_to_all_physical_map=logical,
        logical_to_all_physical_map_cpu=logical,
        logical_to_all_physical_map_num_valid=torch.ones(1, EXPERTS, dtype=torch.int64),
        ep_size=world_size,
        logical_to_rank_dispatch_physical_map=None,
    )
    set_global_expert_location_metadata(metadata, allow_overwrite=True)
    recorder = ExpertDistributionRecorder.init_new(metadata, rank)
    set_global_expert_distribution_recorder(recorder)
    recorder.start_record()
    return recorder


@dataclass
class Check:
    seed: int
    rank: int
    world_size: int
    tp: GroupCoordinator


def run_layer(
    check: Check, model: Model, mode: str, dispatch_value: str, tokens: dict, dp_attention: bool, recorder=None
) -> list[int]:
    """One EP layer (fresh dispatcher and op, as a launch builds) through both steps; every rank's
    output checked against the reference; returns the rows the fused function handed to the experts.
    Under DP attention every rank's batch size is published as SGLang's scheduler does."""
    rank, world_size, seed = check.rank, check.world_size, check.seed
    deepep_mode, split = MODES[mode]
    os.environ["SGLANG_MORI_SPLIT_DISPATCH_COMBINE"] = split
    os.environ["SGLANG_MORI_DISPATCH_DTYPE"] = dispatch_value
    with placement(check.tp, 1, 0, MoeA2ABackend.NONE, deepep_mode, dp_attention):
        reference = model.layer(0, EXPERTS)
    local = EXPERTS // world_size
    sizes = list(tokens[world_size])
    set_dp_buffer_len(sum(sizes), sizes[rank], False, global_num_tokens=sizes if dp_attention else None)
    with placement(check.tp, world_size, rank, MoeA2ABackend.MORI, deepep_mode, dp_attention):
        # The model's a2a forward multiplies by the factor after the combine: the EP layer's output is
        # the unscaled one, the reference's (no factor), whatever factor the layer carries.
        layer = model.layer(rank * local, EXPERTS, routed_scaling_factor=DEEPSEEK_ROUTED_SCALING_FACTOR)
        inner = layer.dispatcher._inners[0]
        assert isinstance(inner, MoriSglangDispatcher)
        dispatch = inner.dispatch_dtype
        block_fp8_weights = model.weights == "fp8"
        rows_seen: list[int] = []
        rows_counted: list[int] = []
        pre_quantized: list[bool] = []
        for step in STEPS:
            where = f"{mode} weights={model.weights} dispatch={dispatch.value} {step} rank {rank}/{world_size}"
            x = batch(seed, world_size, rank, step, tokens)
            topk = model.route(x, step, world_size)
            with (
                override_config(TRITON_CONFIG),
                spy_rows(rows_seen, pre_quantized),
                spy_counted_rows(rows_counted),
                recording(recorder),
            ):
                got = layer(x, topk)
            full, partials = reference_partials(reference, x, topk, world_size, dispatch, block_fp8_weights)
            check_output(got, full, partials, topk, world_size, where)
    # No second quantization: block-fp8 experts take the fp8 payload as it arrived.
    assert pre_quantized == [block_fp8_weights and dispatch is DispatchDtype.FP8] * len(STEPS), pre_quantized
    # The recorder counts the rows the experts get (a decode batch's bound), not the whole buffer; a
    # recorder started by an earlier run may still be recording.
    assert rows_counted == rows_seen or (recorder is None and rows_counted == []), (rows_counted, rows_seen)
    return rows_seen


@contextlib.contextmanager
def spy_counted_rows(rows_counted: list[int]) -> Iterator[None]:
    """Records how many id rows each expert-distribution count reads."""
    original = dispatcher_module.local_expert_ids

    def counting(ids, *args):
        rows_counted.append(ids.shape[0])
        return original(ids, *args)

    dispatcher_module.local_expert_ids = counting
    try:
        yield
    finally:
        dispatcher_module.local_expert_ids = original


@contextlib.contextmanager
def recording(recorder) -> Iterator[None]:
    if recorder is None:
        yield
        return
    with recorder.with_forward_pass(0, None), recorder.with_current_layer(0):
        yield


@contextlib.contextmanager
def spy_rows(rows_seen: list[int], pre_quantized: list[bool]) -> Iterator[None]:
    """Records how many rows (top-k id rows) each call hands to SGLang's fused_experts, and whether
    it hands the fp8 payload on as the pre-quantized activation."""
    original = triton_experts.fused_experts

    def counting(**kwargs):
        rows_seen.append(kwargs["topk_output"].topk_ids.shape[0])
        pre_quantized.append(kwargs["a1_q"] is not None)
        return original(**kwargs)

    triton_experts.fused_experts = counting
    try:
        yield
    finally:
        triton_experts.fused_experts = original


def check_output(
    got: torch.Tensor,
    full: torch.Tensor,
    partials: torch.Tensor,
    topk: StandardTopKOutput,
    world_size: int,
    where: str,
) -> None:
    """Per destination rank the EP rows are the reference's bit for bit, so the EP output is the f32
    sum of the reference partials rounded once to bf16 (up to one bf16 step for the order of that
    sum); tokens whose experts sit on one rank equal that rank's reference partial exactly (the non-EP
    layer's own rows can differ from it by a bf16 step: SGLang's kernels round a token's row at one
    position of a batch differently from the same token at another, one element in thousands)."""
    assert got.shape == full.shape and got.dtype == torch.bfloat16, where
    assert torch.isfinite(got).all(), where
    expected = partials.float().sum(dim=0)
    # one bf16 step of the result, plus f32's error for summing the partials in another order: where
    # they cancel, that error is not small against the sum itself
    order_error = partials.shape[0] * 2.0**-24 * partials.float().abs().sum(dim=0)
    bound = 2.0**-7 * expected.abs() + order_error
    excess = float(((got.float() - expected).abs() - bound).max()) if got.numel() else 0.0
    assert excess <= 0, f"{where}: EP output differs from the summed partials by {excess} over the bound"
    local = EXPERTS // world_size
    kept = topk.topk_ids >= 0
    ranks = torch.where(kept, topk.topk_ids // local, -1)
    destination = ranks.max(dim=1).values
    one_rank = ((ranks == destination[:, None]) | ~kept).all(dim=1)
    tokens = torch.arange(got.shape[0])
    own_partial = torch.where((destination >= 0)[:, None], partials[destination.clamp(min=0), tokens], 0.0)
    assert torch.equal(got[one_rank], own_partial[one_rank].to(got.dtype)), f"{where}: single-destination tokens differ"
    if got.numel():
        relative = float((got.float() - full.float()).norm() / full.float().norm())
        assert relative <= 2.0**-7, f"{where}: ||EP - no EP|| / ||no EP|| = {relative}"


def true_counts(seed: int, world_size: int, model: Model, step: str, tokens: dict) -> torch.Tensor:
    """Per-expert (token, slot) counts over every rank's routing of one step."""
    counts = torch.zeros(EXPERTS, dtype=torch.int64)
    for r in range(world_size):
        ids = model.route(batch(seed, world_size, r, step, tokens), step, world_size).topk_ids.flatten()
        counts += torch.bincount(ids[ids >= 0].long(), minlength=EXPERTS)
    return counts


def bounded_rows(bound: int) -> int:
    """The rows ``SGLANG_MORI_RECV_BOUND`` hands on: SGLang's bound rounded up to a multiple of 32."""
    return max(32, -(-bound // 32) * 32)


def _experts_worker(rank: int, world_size: int, seed: int, combos: list[tuple[str, str]]) -> None:
    """DP attention, every rank its own batch: the experts get the bound's rows (all ranks' tokens),
    not the whole receive buffer, by default."""
    setup_worker()
    check = Check(seed, rank, world_size, tp_coordinator(world_size, rank))
    models = {weights: Model.build(seed, weights) for weights in {w for w, _ in combos}}
    rows_bound = bounded_rows(sum(TOKENS[world_size]))
    assert rows_bound < world_size * CAP
    try:
        for mode in MODES:
            for weights, dispatch_value in combos:
                first = (weights, dispatch_value) == combos[0]
                recorder = start_recorder(rank, world_size) if first else None
                rows = run_layer(check, models[weights], mode, dispatch_value, TOKENS, True, recorder)
                assert rows == [rows_bound] * len(STEPS), f"{mode}: rows {rows}, the bound's {rows_bound}"
                if recorder is not None:
                    counts = recorder.dump_record(output_mode="object")["logical_count"].sum(dim=0)[0]
                    want = sum(true_counts(seed, world_size, models[weights], s, TOKENS) for s in STEPS)
                    assert counts.tolist() == want.tolist(), f"{mode}: recorded {counts.tolist()}, want {want.tolist()}"
    finally:
        release_shared_ops()


def _bound_worker(rank: int, world_size: int, seed: int) -> None:
    """Attention tensor parallel, the batch dealt out by SGLang's tensor split: the bound is this rank's
    share times the ranks (SGLANG_MORI_RECV_BOUND=1 said explicitly). With SGLANG_MORI_RECV_BOUND=0 the
    experts get the whole receive buffer. The output is the same either way."""
    setup_worker()
    check = Check(seed, rank, world_size, tp_coordinator(world_size, rank))
    model = Model.build(seed, "bf16")
    try:
        for value, modes in (("1", ("normal", "low_latency")), ("0", ("split",))):
            os.environ["SGLANG_MORI_RECV_BOUND"] = value
            for mode in modes:
                rows = run_layer(check, model, mode, "auto", SPLIT_TOKENS, False)
                bound = world_size * SPLIT_TOKENS[world_size][rank] + rank
                want = bounded_rows(bound) if value == "1" else world_size * CAP
                assert rows == [want] * len(STEPS), f"SGLANG_MORI_RECV_BOUND={value} {mode}: rows {rows}, want {want}"
    finally:
        release_shared_ops()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_through_the_triton_runner_equals_the_layer_without_ep(
    world_size: int, seed: int, tmp_path: Path
) -> None:
    combos = COMBOS if world_size == 2 else COMBOS_4_RANKS
    run_gloo(world_size, _experts_worker, (seed, combos), tmp_path, timeout_s=900)


@pytest.mark.slow
def test_recv_bound_limits_the_rows_the_experts_sort(seed: int, tmp_path: Path) -> None:
    run_gloo(2, _bound_worker, (seed,), tmp_path, timeout_s=600)


def test_cpu_alignment_stand_in_matches_the_documented_example() -> None:
    """The example in SGLang's ``moe_align_block_size`` docstring (experts counted from 0), with one
    slot dropped (-1)."""
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32) - 1
    ids[3, 2] = -1
    sorted_ids, expert_ids, padded = moe_align_block_size_reference(ids, 4, 4)
    assert sorted_ids.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 12, 12, 2, 5, 8, 12, 11, 12, 12, 12]
    assert expert_ids.tolist() == [0, 1, 2, 3, -1] and padded.tolist() == [20]


def _bf16_dispatch_output(hidden_states: torch.Tensor, received: int) -> MoriEPNormalDispatchOutput:
    """A normal-mode dispatch output of bf16 rows, ``received`` of them received, all to expert 0."""
    rows = hidden_states.shape[0]
    return MoriEPNormalDispatchOutput(
        hidden_states=hidden_states,
        hidden_states_scale=None,
        topk_ids=torch.zeros(rows, TOPK, dtype=torch.int32),
        topk_weights=torch.ones(rows, TOPK),
        num_recv_tokens_per_expert=torch.tensor([received], dtype=torch.int32),
        origin_topk_ids=torch.zeros(rows, TOPK, dtype=torch.int32),
        origin_topk_weights=torch.ones(rows, TOPK),
        out_dtype=torch.bfloat16,
    )


def _quant_info(**quant: object) -> TritonMoeQuantInfo:
    return TritonMoeQuantInfo(
        w13_weight=torch.zeros(2, 2 * INTERMEDIATE, HIDDEN), w2_weight=torch.zeros(2, HIDDEN, INTERMEDIATE), **quant
    )


@pytest.mark.parametrize(
    ("quant", "config", "message"),
    [
        ({"use_mxfp8": True}, {}, "cannot run MXFP8 experts"),
        ({}, {"no_combine": True}, "no_combine MoE layers are not supported with --moe-a2a-backend mori"),
    ],
)
def test_experts_the_triton_path_cannot_run_are_refused_by_name(quant: dict, config: dict, message: str) -> None:
    output = _bf16_dispatch_output(torch.zeros(4, HIDDEN, dtype=torch.bfloat16), 4)
    weights = _quant_info(**quant)
    runner_config = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=2, hidden_size=HIDDEN, **config)
    with pytest.raises(NotImplementedError, match=message):
        triton_experts.mori_to_triton(output, weights, runner_config)


@pytest.mark.parametrize(
    ("quant", "zeroed"),
    [
        ({"use_fp8_w8a8": True}, True),  # dynamic per-tensor fp8 (--quantization fp8 online)
        ({"use_fp8_w8a8": True, "a13_scale": torch.ones(1)}, False),  # a static scale: no amax
        ({"use_fp8_w8a8": True, "per_channel_quant": True}, False),  # per token: one scale per row
        ({}, False),  # bf16 experts quantize nothing
    ],
    ids=["per-tensor", "static", "per-token", "bf16"],
)
def test_rows_past_the_received_reach_per_tensor_experts_as_zeros(
    monkeypatch: pytest.MonkeyPatch, quant: dict, zeroed: bool
) -> None:
    """Per-tensor experts take one amax over every row handed on: a row past the received count (an
    earlier batch's, or never written) set it, or made it NaN. Those rows reach them as zeros; other
    experts get the receive buffer's rows as they are (their ids are -1 there)."""
    rows, received = 6, 2
    hidden_states = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    hidden_states[received:] = torch.tensor([float("nan"), 3e38]).repeat(HIDDEN // 2).to(torch.bfloat16)
    output = _bf16_dispatch_output(hidden_states, received)
    weights = _quant_info(**quant)
    seen = {}

    def fused_experts(hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen["x"] = hidden_states
        return torch.zeros_like(hidden_states)

    monkeypatch.setattr(triton_experts, "fused_experts", fused_experts)
    layer = torch.nn.Module()
    layer.moe_ep_rank = 0
    runner_config = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=2, hidden_size=HIDDEN, layer=layer)
    triton_experts.mori_to_triton(output, weights, runner_config)
    x = seen["x"]
    assert torch.equal(x[:received], hidden_states[:received])
    if zeroed:
        assert not x[received:].any()
        assert hidden_states[received:].isnan().any()  # the receive buffer itself is left alone
    else:
        assert x.data_ptr() == hidden_states.data_ptr()
