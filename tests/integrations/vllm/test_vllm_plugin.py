"""The vLLM plugin in one process: loading through vLLM's entry points, the patches it makes, how vLLM's
handle keywords and the ``SGLANG_MORI_*`` environment become an op config, and how received rows become
the experts' activations.

Every test that registers the plugin restores vLLM's module attributes afterwards.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

try:
    import vllm.plugins
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed.device_communicators import all2all
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe import config as moe_cfg
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"needs vllm 0.33.0 importable on CPU ({exc.name} is missing; .ci/install-vllm.sh installs it)",
        allow_module_level=True,
    )

from mori_sglang import formats
from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.env import EnvError
from mori_sglang.integrations.vllm import activations, plugin
from mori_sglang.integrations.vllm import all2all as ours
from mori_sglang.integrations.vllm.activations import ActivationPlan, expert_format
from mori_sglang.integrations.vllm.all2all import MoriSglangAll2AllManager, ep_config_from_vllm
from mori_sglang.integrations.vllm.prepare_finalize import MoriSglangPrepareAndFinalize
from mori_sglang.loopback import LoopbackWorld
from tests.helpers import generator, make_tokens

HIDDEN = 256
FP8 = torch.float8_e4m3fn
MISSING = object()


@pytest.fixture
def vllm_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo whatever the plugin rebinds in vLLM once the test ends."""
    targets = (
        (all2all, "MoriAll2AllManager"),
        (all2all_utils, "MoriPrepareAndFinalize"),  # bound only where native MoRI imports
        (moe_cfg.FusedMoEConfig, "__post_init__"),
    )
    saved = [(owner, name, owner.__dict__.get(name, MISSING)) for owner, name in targets]
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    yield
    for owner, name, value in saved:
        if value is MISSING:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, value)


def _installed() -> None:
    if not any(ep.name == "mori_sglang" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("the mori-sglang distribution is not installed (pip install -e .): no vllm.general_plugins entry")


def _routed_to_us() -> bool:
    return (
        all2all.MoriAll2AllManager is MoriSglangAll2AllManager
        and getattr(all2all_utils, "MoriPrepareAndFinalize", None) is MoriSglangPrepareAndFinalize
        and getattr(moe_cfg.FusedMoEConfig.__post_init__, plugin.PATCHED, False)
    )


def test_load_general_plugins_routes_both_names(vllm_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed()
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert not _routed_to_us()
    vllm.plugins.load_general_plugins()
    assert _routed_to_us()
    wrapped = moe_cfg.FusedMoEConfig.__post_init__
    plugin.register()  # vLLM may load plugins again in the same process
    assert moe_cfg.FusedMoEConfig.__post_init__ is wrapped
    assert not getattr(wrapped.__wrapped__, plugin.PATCHED, False), "__post_init__ was wrapped twice"


def test_vllm_plugins_allowlist_leaves_vllm_alone(vllm_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed()
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm.plugins.load_general_plugins()
    assert all2all.MoriAll2AllManager is not MoriSglangAll2AllManager
    assert getattr(all2all_utils, "MoriPrepareAndFinalize", None) is not MoriSglangPrepareAndFinalize


def _moe_config(backend: str, num_experts: int = 8, ep_size: int = 2) -> moe_cfg.FusedMoEConfig:
    """A layer's MoE config as vLLM builds it with data parallel ``ep_size`` and expert parallelism."""
    parallel = moe_cfg.FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=ep_size,
        ep_size=ep_size,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=0,
        ep_rank=0,
        sp_size=1,
        use_ep=True,
        all2all_backend=backend,
        enable_eplb=False,
    )
    return moe_cfg.FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=2,
        hidden_dim=HIDDEN,
        intermediate_size=64,
        num_local_experts=num_experts // ep_size,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=moe_cfg.RoutingMethodType.Default,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("backend", ["mori_high_throughput", "mori_low_latency"])
def test_mori_names_accept_any_experts(vllm_restored: None, backend: str) -> None:
    with pytest.raises(AssertionError, match="aiter"):
        _moe_config(backend)  # vLLM alone: MoRI only with AITER's experts
    plugin.register()
    moe = _moe_config(backend)
    assert moe.moe_parallel_config.all2all_backend == backend and moe.use_mori_kernels
    assert _moe_config("allgather_reducescatter").moe_parallel_config.all2all_backend == "allgather_reducescatter"


@pytest.mark.parametrize("backend", ["mori_high_throughput", "mori_low_latency"])
def test_experts_the_ranks_do_not_divide_are_refused(vllm_restored: None, backend: str) -> None:
    """128 experts on 6 GPUs: vLLM gives ranks 0 and 1 22 experts and the others 21, while the op routes by
    expert // 21 (the local count vLLM hands ``get_handle``); the layer is refused when it is built."""
    plugin.register()
    message = (
        f"--all2all-backend {backend} (mori-sglang) needs an expert count the expert-parallel ranks divide: this "
        "MoE layer has 128 experts over 6 ranks, which vLLM splits unevenly; serve on a number of GPUs "
        "(--data-parallel-size x --tensor-parallel-size) that divides 128, or pick another --all2all-backend"
    )
    with pytest.raises(ValueError) as refused:
        _moe_config(backend, num_experts=128, ep_size=6)
    assert str(refused.value) == message
    assert _moe_config(backend, num_experts=128, ep_size=8).num_local_experts == 16
    assert _moe_config("allgather_reducescatter", num_experts=128, ep_size=6).num_experts == 128  # vLLM's own


def test_aiter_fused_shared_experts_stay_refused(vllm_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a ROCm machine with VLLM_ROCM_USE_AITER_MOE and VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS on.
    for switch in ("is_fused_moe_enabled", "is_fusion_moe_shared_experts_enabled"):
        monkeypatch.setattr(rocm_aiter_ops, switch, lambda: True)
    plugin.register()
    with pytest.raises(ValueError, match="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"):
        _moe_config("mori_low_latency")


# ---------------------------------------------------------------------------------------------
# vLLM's handle keywords -> op config
# ---------------------------------------------------------------------------------------------


def handle_kwargs(quant_dtype: torch.dtype | str, scale_dim: int, **over: object) -> dict[str, object]:
    """The keywords vLLM's ``maybe_make_prepare_finalize`` passes native MoRI's ``get_handle``."""
    kwargs: dict[str, object] = {
        "rank": 1,
        "num_ep_ranks": 4,
        "quant_dtype": quant_dtype,
        "token_hidden_size": 7168,
        "scale_dim": scale_dim,
        "scale_type_size": 4,
        "max_num_tokens_per_dp_rank": 8192,
        "input_dtype": torch.bfloat16,
        "num_local_experts": 64,
        "num_experts_per_token": 8,
    }
    kwargs.update(over)
    return kwargs


@pytest.mark.parametrize(
    ("quant_dtype", "scale_dim", "dispatch", "combine"),
    [
        (torch.bfloat16, 0, DispatchDtype.BF16, CombineDtype.BF16),  # unquantized experts
        (FP8, 56, DispatchDtype.FP8, CombineDtype.BF16),  # 1x128 block fp8: our fp8 wire format
        (torch.float8_e4m3fnuz, 56, DispatchDtype.FP8, CombineDtype.BF16),
        (FP8, 1, DispatchDtype.BF16, CombineDtype.BF16),  # per-token / per-tensor: vLLM quantizes on arrival
        ("mxfp8", 1, DispatchDtype.BF16, CombineDtype.BF16),
        (torch.float4_e2m1fn_x2, 224, DispatchDtype.MXFP4, CombineDtype.BF16),  # SGLang's fp4 rule (EP v2)
    ],
)
def test_handle_keywords_pick_the_wire_format(
    quant_dtype: torch.dtype | str, scale_dim: int, dispatch: DispatchDtype, combine: CombineDtype
) -> None:
    for backend, mode in (("mori_high_throughput", Mode.INTRANODE), ("mori_low_latency", Mode.LOW_LATENCY)):
        cfg = ep_config_from_vllm(backend, handle_kwargs(quant_dtype, scale_dim), environ={})
        assert (cfg.dispatch_dtype, cfg.combine_dtype, cfg.mode) == (dispatch, combine, mode)
        assert (cfg.world_size, cfg.rank, cfg.hidden, cfg.num_experts, cfg.topk) == (4, 1, 7168, 256, 8)
        assert cfg.max_tokens_per_rank == 8192 and cfg.provider is Provider.AUTO
    # SGLang's v1 dispatcher combines fp4-weight layers in blockwise fp8; the others keep their combine
    v1 = ep_config_from_vllm("mori_high_throughput", handle_kwargs(quant_dtype, scale_dim), {"SGLANG_MORI_EP_V2": "0"})
    fp4 = quant_dtype == torch.float4_e2m1fn_x2
    assert (v1.dispatch_dtype, v1.combine_dtype) == (dispatch, CombineDtype.FP8_BLOCKWISE if fp4 else combine)


def test_environment_has_sglang_meaning() -> None:
    env = {
        "SGLANG_MORI_DISPATCH_DTYPE": "fp8",
        "SGLANG_MORI_COMBINE_DTYPE": "fp8_direct_cast",
        "SGLANG_MORI_SPLIT_DISPATCH_COMBINE": "1",
        "SGLANG_MORI_BACKEND": "torch",
        "SGLANG_MORI_FP8_TYPE": "e4m3fnuz",
        "MORI_FP8_COMBINE_SCALE_DIM": "28",
        "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "7",  # vLLM sizes the buffers, not this
    }
    cfg = ep_config_from_vllm("mori_high_throughput", handle_kwargs(torch.bfloat16, 0), environ=env)
    assert (cfg.dispatch_dtype, cfg.combine_dtype, cfg.mode) == (
        DispatchDtype.FP8,
        CombineDtype.FP8_DIRECT_CAST,
        Mode.SPLIT,
    )
    assert cfg.provider is Provider.TORCH and cfg.fp8_dtype == torch.float8_e4m3fnuz
    assert cfg.combine_block == 7168 // 28 and cfg.max_tokens_per_rank == 8192
    low_latency = ep_config_from_vllm("mori_low_latency", handle_kwargs(torch.bfloat16, 0), environ=env)
    assert low_latency.mode is Mode.LOW_LATENCY
    deprecated = {"SGLANG_MORI_FP4_DISP": "1", "SGLANG_MORI_FP8_COMB": "true"}
    cfg = ep_config_from_vllm("mori_high_throughput", handle_kwargs(FP8, 56), environ=deprecated)
    assert (cfg.dispatch_dtype, cfg.combine_dtype) == (DispatchDtype.MXFP4, CombineDtype.FP8_BLOCKWISE)


def test_bad_values_name_the_knob() -> None:
    with pytest.raises(EnvError, match="SGLANG_MORI_DISPATCH_DTYPE"):
        ep_config_from_vllm("mori_low_latency", handle_kwargs(FP8, 56), environ={"SGLANG_MORI_DISPATCH_DTYPE": "int8"})
    with pytest.raises(ValueError, match="mori_high_throughput, mori_low_latency"):
        ep_config_from_vllm("deepep_low_latency", handle_kwargs(FP8, 56), environ={})


# ---------------------------------------------------------------------------------------------
# received rows -> the experts' activations
# ---------------------------------------------------------------------------------------------

FP8_BLOCK = moe_cfg.fp8_w8a8_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1), block_shape=[128, 128])
FP8_PER_TOKEN = moe_cfg.fp8_w8a8_moe_quant_config(
    w1_scale=torch.ones(1), w2_scale=torch.ones(1), per_act_token_quant=True
)
MXFP4 = moe_cfg.mxfp4_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1))
MXFP8 = moe_cfg.FusedMoEQuantConfig.make("mxfp8", is_scale_swizzled=False)
UNQUANTIZED = moe_cfg.FUSED_MOE_UNQUANTIZED_CONFIG


@pytest.mark.parametrize(
    ("quant_config", "defer", "fp8", "want"),
    [
        (UNQUANTIZED, False, FP8, DispatchDtype.BF16),
        (FP8_BLOCK, True, FP8, DispatchDtype.BF16),  # the experts quantize themselves
        (FP8_BLOCK, False, FP8, DispatchDtype.FP8),
        (FP8_BLOCK, False, torch.float8_e4m3fnuz, None),  # another fp8 flavour on the wire
        (FP8_PER_TOKEN, False, FP8, None),
        (MXFP4, False, FP8, DispatchDtype.MXFP4),
        (MXFP8, False, FP8, None),  # vLLM's mxfp8 rounds its scales differently from OCP's
    ],
)
def test_expert_format(
    quant_config: moe_cfg.FusedMoEQuantConfig, defer: bool, fp8: torch.dtype, want: DispatchDtype | None
) -> None:
    assert expert_format(quant_config, defer, fp8) is want


def test_block_fp8_experts_with_power_of_two_scales_get_vllms_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepGEMM with UE8M0 activation scales would round the wire's amax / 448 scales to powers of two
    (a silent error of up to 2x per block): there vLLM's quantizer makes the experts' format."""
    from mori_sglang.integrations.vllm import activations

    monkeypatch.setattr(activations.deep_gemm, "is_deep_gemm_e8m0_used", lambda: True)
    assert expert_format(FP8_BLOCK, False, FP8) is None
    # and auto sends such tokens as bf16, so that only vLLM's quantizer rounds them
    cfg = ep_config_from_vllm("mori_high_throughput", handle_kwargs(FP8, 56), environ={})
    assert cfg.dispatch_dtype is DispatchDtype.BF16
    monkeypatch.setattr(activations.deep_gemm, "is_deep_gemm_e8m0_used", lambda: False)
    assert expert_format(FP8_BLOCK, False, FP8) is DispatchDtype.FP8
    cfg = ep_config_from_vllm("mori_high_throughput", handle_kwargs(FP8, 56), environ={})
    assert cfg.dispatch_dtype is DispatchDtype.FP8


def _received(x: torch.Tensor, wire: DispatchDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows a receiver holds for tokens ``x``: payload and uint8 scale rows."""
    payload, scales = formats.quantize_dispatch(x, wire, FP8)
    return payload, None if scales is None else scales.contiguous().view(torch.uint8).view(x.shape[0], -1)


def _plan(wire: DispatchDtype, quant_config: moe_cfg.FusedMoEQuantConfig, in_dtype: torch.dtype) -> ActivationPlan:
    return ActivationPlan(wire, expert_format(quant_config, False, FP8), HIDDEN, FP8, in_dtype, quant_config)


@pytest.mark.parametrize("wire", [DispatchDtype.FP8, DispatchDtype.MXFP4])
def test_matching_wire_rows_reach_the_experts_untouched(wire: DispatchDtype, seed: int) -> None:
    x = make_tokens("lognormal", 5, HIDDEN, generator(seed))
    payload, scales = _received(x, wire)
    plan = _plan(wire, FP8_BLOCK if wire is DispatchDtype.FP8 else MXFP4, torch.bfloat16)
    assert plan.passthrough
    a1q, a1q_scale = plan.to_experts(payload, scales)
    assert a1q.data_ptr() == payload.data_ptr() and a1q_scale is not None
    if wire is DispatchDtype.FP8:
        assert a1q.dtype == FP8 and a1q_scale.dtype == torch.float32 and a1q_scale.shape == (5, HIDDEN // 128)
    else:
        assert a1q.dtype == torch.float4_e2m1fn_x2 and a1q.shape == (5, HIDDEN // 2)
        assert a1q_scale.dtype == torch.float8_e8m0fnu and a1q_scale.shape == (5, HIDDEN // 32)
    assert torch.equal(a1q_scale.contiguous().view(torch.uint8), scales)


def test_experts_get_the_formats_scales_without_the_rows_padding(seed: int) -> None:
    """At hidden 2880 an MXFP4 scale row holds 90 e8m0 scales and two pad bytes (whole dwords), and the
    received rows sit at the receive buffer's 128 B stride: the experts get ``[N, 90]`` dense, as AITER's
    own quantizer makes them, whether the wire's rows pass through or the wire-format quantizer rebuilds them."""
    hidden, rows = 2880, 5
    x = make_tokens("lognormal", rows, hidden, generator(seed))
    payload, row = formats.quantize_dispatch(x, DispatchDtype.MXFP4, FP8)
    assert row.shape == (rows, 92)
    buffer = torch.full((rows, 128), 0x7F, dtype=torch.uint8)  # the pad bytes past the row: scales of 1.0
    buffer[:, :92] = row
    for wire, tokens, scales in ((DispatchDtype.MXFP4, payload, buffer[:, :92]), (DispatchDtype.BF16, x, None)):
        plan = ActivationPlan(wire, DispatchDtype.MXFP4, hidden, FP8, torch.bfloat16, MXFP4)
        a1q, a1q_scale = plan.to_experts(tokens, scales)
        assert a1q.dtype == torch.float4_e2m1fn_x2 and a1q.shape == (rows, hidden // 2)
        assert a1q_scale is not None and a1q_scale.dtype == torch.float8_e8m0fnu
        assert a1q_scale.shape == (rows, hidden // 32) and a1q_scale.is_contiguous()
        assert torch.equal(a1q_scale.view(torch.uint8), row[:, : hidden // 32])
    # fp8's f32 scales fill whole dwords: ceil(2880 / 128) = 23 of them, as the row holds
    payload, row = formats.quantize_dispatch(x, DispatchDtype.FP8, FP8)
    buffer = torch.zeros(rows, 128, dtype=torch.uint8)
    buffer[:, :92] = row.view(torch.uint8)
    plan = ActivationPlan(DispatchDtype.FP8, DispatchDtype.FP8, hidden, FP8, torch.bfloat16, FP8_BLOCK)
    _, a1q_scale = plan.to_experts(payload, buffer[:, :92])
    assert a1q_scale is not None and a1q_scale.shape == (rows, 23) and torch.equal(a1q_scale, row)


def test_other_formats_are_rebuilt_from_the_wire(seed: int) -> None:
    x = make_tokens("outliers", 6, HIDDEN, generator(seed))
    fp8_values = formats.dequantize_dispatch(
        *formats.quantize_dispatch(x, DispatchDtype.FP8, FP8), DispatchDtype.FP8, HIDDEN
    )

    # fp8 on the wire, unquantized fp16 experts: the dequantized tokens in the layer's dtype
    a1q, a1q_scale = _plan(DispatchDtype.FP8, UNQUANTIZED, torch.float16).to_experts(*_received(x, DispatchDtype.FP8))
    assert a1q_scale is None and a1q.dtype == torch.float16 and torch.equal(a1q, fp8_values.half())

    # bf16 on the wire, block-fp8 experts: the wire-format quantizer runs on arrival
    a1q, a1q_scale = _plan(DispatchDtype.BF16, FP8_BLOCK, torch.bfloat16).to_experts(x, None)
    want_q, want_s = formats.quantize_dispatch(x, DispatchDtype.FP8, FP8)
    assert torch.equal(a1q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(a1q_scale, want_s)

    # mxfp8 on the wire, vLLM's own mxfp8 experts: vLLM's quantizer on the dequantized tokens
    mx_values = formats.dequantize_dispatch(*_received(x, DispatchDtype.MXFP8), DispatchDtype.MXFP8, HIDDEN)
    a1q, a1q_scale = _plan(DispatchDtype.MXFP8, MXFP8, torch.bfloat16).to_experts(*_received(x, DispatchDtype.MXFP8))
    want_q, want_s = moe_kernel_quantize_input(
        mx_values.bfloat16(), None, "mxfp8", False, None, is_scale_swizzled=False
    )
    assert torch.equal(a1q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(a1q_scale, want_s)


# ---------------------------------------------------------------------------------------------
# the prepare/finalize on a loopback world, driven the way vLLM's modular kernel drives its hooks
# ---------------------------------------------------------------------------------------------


def test_low_latency_hooks_with_router_weight_on_input(seed: int) -> None:
    """Top-1 routing with the weight applied before dispatch; the experts multiply by 1 + expert id.

    Both ranks send before either receives (a loopback world runs in one thread), which is the order
    vLLM's hooks allow: prepare_async sends, the hook receives, the receiver builds the experts' inputs.
    """
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    world_size, experts, capacity = 2, 4, 8
    config = EpConfig(
        world_size=world_size,
        rank=0,
        hidden=HIDDEN,
        num_experts=experts,
        topk=1,
        max_tokens_per_rank=capacity,
        mode=Mode.LOW_LATENCY,
        provider="torch",
    )
    pfs = [MoriSglangPrepareAndFinalize(op, capacity, world_size) for op in LoopbackWorld(config).ops]
    gen = generator(seed)
    tokens = [make_tokens("normal", n, HIDDEN, gen) for n in (5, 3)]
    ids = [torch.randint(0, experts, (x.shape[0], 1), generator=gen, dtype=torch.int32) for x in tokens]
    weights = [torch.rand(x.shape[0], 1, generator=gen) + 0.5 for x in tokens]

    pending = [
        pf.prepare_async(x, w, i, experts, None, True, UNQUANTIZED, False)
        for pf, x, w, i in zip(pfs, tokens, weights, ids, strict=True)
    ]
    for hook, _ in pending:
        hook()
    local = experts // world_size
    finals = []
    for rank, (pf, (_, receiver)) in enumerate(zip(pfs, pending, strict=True)):
        a1q, a1q_scale, meta, recv_ids, recv_weights = receiver()
        assert a1q.shape == (world_size * capacity, HIDDEN) and a1q_scale is None and meta is None
        received = sum(int((i // local == rank).sum()) for i in ids)
        assert (recv_ids[:received] // local == rank).all(), "a top-1 token lands on its expert's rank"
        assert (recv_ids[received:] == pf.foreign_expert).all() and (recv_weights[received:] == 0).all()
        y = a1q.float() * (1 + recv_ids.float())  # the experts: the router weight is already applied
        out = torch.empty_like(tokens[rank])
        finals.append((out, pf.finalize_async(out, y, recv_weights, recv_ids, True, TopKWeightAndReduceNoOP())))
    for _, (hook, receiver) in finals:
        hook()
        receiver()
    for (out, _), x, w, i in zip(finals, tokens, weights, ids, strict=True):
        want = ((x * w.bfloat16()).float() * (1 + i.float())).bfloat16()
        assert torch.equal(out, want)


@pytest.mark.parametrize("defer", [False, True], ids=["ours_quantizes", "experts_quantize"])
def test_rows_past_the_received_count_reach_vllms_quantizer_as_zeros(
    monkeypatch: pytest.MonkeyPatch, seed: int, defer: bool
) -> None:
    """A low-latency prepare hands the experts the whole receive capacity, whose rows past the received
    count are unspecified (poisoned here with NaN and 1e4). vLLM's dynamic per-tensor quantizer takes its
    amax over every row it gets, so it must see those rows as zeros and the received rows as they came,
    whether the prepare runs it or the experts do (``defer_input_quant``: they get the bf16 rows)."""

    seen: list[torch.Tensor] = []

    def quantizer(values: torch.Tensor, scale: torch.Tensor | None, **kwargs: object) -> tuple:
        assert scale is None and kwargs["quant_dtype"] == FP8 and not kwargs["per_act_token_quant"]
        seen.append(values.clone())
        return values, torch.ones(1)

    monkeypatch.setattr(activations, "moe_kernel_quantize_input", quantizer)
    world_size, experts, capacity = 2, 4, 8
    config = EpConfig(
        world_size=world_size, rank=0, hidden=HIDDEN, num_experts=experts, topk=2,
        max_tokens_per_rank=capacity, mode=Mode.LOW_LATENCY, provider="torch",
    )  # fmt: skip
    ops = LoopbackWorld(config).ops
    for op, stale in zip(ops, (float("nan"), 1e4), strict=True):
        receive = op.dispatch_recv

        def poisoned(receive=receive, stale=stale):  # the unspecified rows, made as bad as they may be
            out = receive()
            out.tokens[int(out.num_recv) :] = stale
            return out

        op.dispatch_recv = poisoned
    pfs = [MoriSglangPrepareAndFinalize(op, capacity, world_size) for op in ops]
    per_tensor = moe_cfg.fp8_w8a8_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1))
    assert expert_format(per_tensor, False, FP8) is None  # vLLM's quantizer makes the experts' format
    gen = generator(seed)
    tokens = [make_tokens("normal", n, HIDDEN, gen) for n in (3, 2)]
    ids = [torch.rand(x.shape[0], experts, generator=gen).topk(2, dim=1).indices.int() for x in tokens]
    pending = [
        pf.prepare_async(x, torch.rand(x.shape[0], 2, generator=gen), i, experts, None, False, per_tensor, defer)
        for pf, x, i in zip(pfs, tokens, ids, strict=True)
    ]
    for hook, _ in pending:
        hook()
    for pf, (_, receiver) in zip(pfs, pending, strict=True):
        a1q, a1q_scale, *_ = receiver()
        received = int(pf._received.num_recv)
        values = a1q if defer else seen.pop(0)
        assert (a1q_scale is None) is defer and not (defer and seen)
        assert values.shape == (world_size * capacity, HIDDEN) and 0 < received < values.shape[0]
        assert torch.equal(values[:received], pf._received.tokens[:received])
        assert torch.equal(values[received:], torch.zeros_like(values[received:]))


# ---------------------------------------------------------------------------------------------
# the manager under elastic EP: the standby group's layers, and teardown
# ---------------------------------------------------------------------------------------------


def test_elastic_ep_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Elastic EP's groups are stateless process groups torch.distributed does not know, which the op's
    exchange and bootstraps look ranks up in: the manager refuses it when vLLM builds it."""
    for elastic in (True, False):
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(enable_elastic_ep=elastic),
            kernel_config=SimpleNamespace(moe_backend="triton"),
        )
        monkeypatch.setattr(ours, "get_current_vllm_config", lambda config=config: config)
        if elastic:
            with pytest.raises(ValueError, match="does not run with --enable-elastic-ep"):
                MoriSglangAll2AllManager(object(), "mori_low_latency")
        else:  # past the check, vLLM's base class needs its distributed state, which this test lacks
            with pytest.raises(AssertionError):
                MoriSglangAll2AllManager(object(), "mori_low_latency")


def test_a_manager_serves_the_ep_group_it_was_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = SimpleNamespace(cpu_group=object(), device_group=object())
    monkeypatch.setattr(ours, "get_ep_group", lambda: ep)
    manager, other = object.__new__(MoriSglangAll2AllManager), object.__new__(MoriSglangAll2AllManager)
    manager.cpu_group, other.cpu_group = ep.cpu_group, object()
    gpu = torch.device("cuda", 0)
    assert manager._group_for(gpu) is ep.device_group
    assert manager._group_for(torch.device("cpu")) is ep.cpu_group
    with pytest.raises(RuntimeError, match="this manager was built for another group"):
        other._group_for(gpu)


def test_destroy_closes_every_op_and_a_closed_op_refuses_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM destroys the manager at shutdown: every op it built is closed once (native MoRI EP v2 frees
    its window and communicator there), also those whose layers vLLM has dropped (its handle cache holds
    them weakly), and a closed op refuses the next call by name. Each op gets the manager's CPU group
    for native MoRI's bootstrap."""
    from vllm.distributed.device_communicators.base_device_communicator import Cache

    manager = object.__new__(MoriSglangAll2AllManager)
    manager.all2all_backend, manager.handle_cache, manager._ops = "mori_low_latency", Cache(), []
    manager.cpu_group = object()
    config = EpConfig(
        world_size=2, rank=0, hidden=HIDDEN, num_experts=4, topk=2, max_tokens_per_rank=4, provider="torch"
    )
    ops = [LoopbackWorld(config).ops[0] for _ in range(2)]
    closed: list[int] = []
    for index, op in enumerate(ops):
        monkeypatch.setattr(op.provider, "close", lambda index=index: closed.append(index))
    built = iter(ops)
    handed: list[dict] = []

    def make_op(config: EpConfig, group: object, **kwargs: object) -> object:
        handed.append({"group": group, **kwargs})
        return next(built)

    monkeypatch.setattr(ours, "EpDispatchCombineOp", make_op)
    monkeypatch.setattr(ours, "current_device", lambda: torch.device("cpu"))
    handles = [manager.get_handle(handle_kwargs(torch.bfloat16, 0, token_hidden_size=h)) for h in (7168, 4096)]
    assert handles == ops and manager.get_handle(handle_kwargs(torch.bfloat16, 0)) is ops[0]
    assert [h["cpu_group"] for h in handed] == [manager.cpu_group] * 2
    first = ops[0]
    del handles, ops
    gc.collect()  # vLLM's layers let go of their handles; the manager still closes both
    manager.destroy()
    assert sorted(closed) == [0, 1] and manager._ops == [] and len(manager.handle_cache._cache) == 0
    first.close()
    assert sorted(closed) == [0, 1]
    x, weights = torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.ones(1, 2)
    with pytest.raises(RuntimeError, match="dispatch_send on a closed op"):
        first.dispatch_send(x, weights, None, torch.zeros(1, 2, dtype=torch.int32))
    for receive in (first.dispatch_recv, first.combine_recv):
        with pytest.raises(RuntimeError, match=f"{receive.__name__} on a closed op"):
            receive()


def test_mega_moe_bootstraps_moris_shmem_when_the_manager_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--moe-backend aiter_mega_moe`` never asks for a handle but runs on MoRI's shmem: the manager
    bootstraps it over its CPU group with native MoRI's heap size (a size the user set is kept), refuses
    by name where MoRI does not import, and does nothing for other experts."""

    def vllm_config(backend: str, targets: dict | None = None) -> SimpleNamespace:
        return SimpleNamespace(
            kernel_config=SimpleNamespace(moe_backend=backend),
            model_config=SimpleNamespace(quantization_config=SimpleNamespace(targets=targets)),
        )

    handed: list[object] = []
    monkeypatch.setattr(ours, "init_shmem", handed.append)
    monkeypatch.delenv("MORI_SHMEM_HEAP_SIZE", raising=False)
    group = object()
    ours.bootstrap_mega_moe(group, vllm_config("triton"))
    assert handed == [] and "MORI_SHMEM_HEAP_SIZE" not in os.environ
    assert "mori" not in sys.modules
    with pytest.raises(RuntimeError, match="--moe-backend aiter_mega_moe runs on MoRI's shmem"):
        ours.bootstrap_mega_moe(group, vllm_config("aiter_mega_moe"))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "fake_mori"))
    try:
        cases = ((False, None, "8G"), (True, {"w13": "mxfp4"}, "16G"), (False, {"w13": "mxfp4"}, "8G"))
        for fused, targets, heap in cases:
            monkeypatch.delenv("MORI_SHMEM_HEAP_SIZE")
            monkeypatch.setattr(ours.envs, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS", fused, raising=False)
            ours.bootstrap_mega_moe(group, vllm_config("aiter_mega_moe", targets))
            assert handed.pop() is group and os.environ["MORI_SHMEM_HEAP_SIZE"] == heap
        monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", "12G")
        ours.bootstrap_mega_moe(group, vllm_config("aiter_mega_moe"))
        assert handed.pop() is group and os.environ["MORI_SHMEM_HEAP_SIZE"] == "12G"
    finally:
        for name in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
            del sys.modules[name]


def test_fp16_layers_are_told_their_activations_travel_as_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire carries bf16: an fp16 layer's activations are rounded both ways, said once, not silently."""

    warned: list[tuple] = []
    monkeypatch.setattr(ours, "logger", SimpleNamespace(warning_once=lambda *args: warned.append(args)))
    manager = object.__new__(MoriSglangAll2AllManager)
    manager.all2all_backend = "mori_low_latency"
    manager.handle_cache = SimpleNamespace(get_or_create=lambda kwargs, make: kwargs["config"])
    manager.get_handle(handle_kwargs(torch.bfloat16, 0))
    assert warned == []
    config = manager.get_handle(handle_kwargs(torch.bfloat16, 0, input_dtype=torch.float16))
    assert config.dispatch_dtype is DispatchDtype.BF16
    assert len(warned) == 1 and "--dtype bfloat16" in warned[0][0] and warned[0][1] == torch.float16
