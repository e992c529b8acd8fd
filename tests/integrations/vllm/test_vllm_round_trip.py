"""vLLM's own selection builds our objects, and a prepare -> experts -> finalize step over 2 gloo ranks
equals the non-parallel MoE, for both MoRI backend names and every wire dtype.

Each rank loads the plugin through ``vllm.plugins.load_general_plugins``, builds vLLM's expert-parallel
``CudaCommunicator`` (whose MoRI branch must make our manager), asks vLLM's ``maybe_make_prepare_finalize``
for the prepare/finalize (which must be ours) and runs one step through vLLM's modular kernel with
reference experts. The experts are linear-ReLU-linear maps with small dyadic weights, evaluated in f64
and rounded once to bf16, so the per-rank partial sums and their combine are reproducible bit for bit: the
expected output is built token by token from the dequantized inputs, independently of any routing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

try:
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm.plugins
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.model_executor.layers.fused_moe import config as moe_cfg
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        FusedMoEQuantConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
    from vllm.v1.worker.workspace import init_workspace_manager
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"needs vllm 0.33.0 importable on CPU ({exc.name} is missing; .ci/install-vllm.sh installs it)",
        allow_module_level=True,
    )

from mori_sglang import formats
from mori_sglang.config import CombineDtype, DispatchDtype, Mode
from mori_sglang.integrations.vllm.all2all import MoriSglangAll2AllManager
from mori_sglang.integrations.vllm.prepare_finalize import MoriSglangPrepareAndFinalize
from tests.helpers import BASE_SEED, generator, make_tokens, run_gloo

BACKENDS = ("mori_high_throughput", "mori_low_latency")
WORLD = 2
HIDDEN = 256
INTERMEDIATE = 64
NUM_EXPERTS = 8
TOPK = 4
MAX_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One step: the experts' activation format, the environment, and what the experts must be fed.

    ``feed(x)``: the f32 values the experts must see for bf16 tokens ``x`` (independent of the plugin).
    """

    quant: str  # none | fp8 (1x128 blocks) | mxfp4 (w4a4) | mxfp8 (vLLM's own layout)
    feed: Callable[[torch.Tensor], torch.Tensor]
    dispatch: DispatchDtype
    combine: CombineDtype = CombineDtype.BF16
    env: dict[str, str] = field(default_factory=dict)
    tokens: tuple[int, ...] = (11, 6)
    backends: tuple[str, ...] = BACKENDS
    tolerance: float = 0.01  # relative error allowed against the unquantized f64 MoE


def _wire(x: torch.Tensor, dtype: DispatchDtype) -> torch.Tensor:
    payload, scales = formats.quantize_dispatch(x, dtype, torch.float8_e4m3fn)
    return formats.dequantize_dispatch(payload, scales, dtype, HIDDEN)


def _vllm_mxfp8(x: torch.Tensor) -> torch.Tensor:
    q, scales = moe_kernel_quantize_input(x, None, "mxfp8", False, None, is_scale_swizzled=False)
    return formats.dequantize_dispatch(q, scales, DispatchDtype.MXFP8, HIDDEN)


CASES: dict[str, Case] = {
    "bf16": Case("none", lambda x: x.float(), DispatchDtype.BF16),
    "fp8": Case("fp8", lambda x: _wire(x, DispatchDtype.FP8), DispatchDtype.FP8, tolerance=0.08),
    "fp4": Case(  # SGLang's v1 rule: fp4 weights combine in blockwise fp8 (EP v2 combines in bf16)
        "mxfp4",
        lambda x: _wire(x, DispatchDtype.MXFP4),
        DispatchDtype.MXFP4,
        CombineDtype.FP8_BLOCKWISE,
        env={"SGLANG_MORI_EP_V2": "0"},
        tolerance=0.3,
    ),
    "fp8-wire-bf16-experts": Case(
        "none",
        lambda x: _wire(x, DispatchDtype.FP8).bfloat16().float(),
        DispatchDtype.FP8,
        env={"SGLANG_MORI_DISPATCH_DTYPE": "fp8"},
        tolerance=0.08,
    ),
    "bf16-wire-fp8-experts": Case(
        "fp8",
        lambda x: _wire(x, DispatchDtype.FP8),
        DispatchDtype.BF16,
        env={"SGLANG_MORI_DISPATCH_DTYPE": "bf16"},
        tolerance=0.08,
    ),
    "mxfp8-wire-vllm-mxfp8-experts": Case(
        "mxfp8",
        lambda x: _vllm_mxfp8(_wire(x, DispatchDtype.MXFP8).bfloat16()),
        DispatchDtype.MXFP8,
        env={"SGLANG_MORI_DISPATCH_DTYPE": "mxfp8"},
        tolerance=0.1,
    ),
    "fp8-direct-cast-combine": Case(
        "none",
        lambda x: x.float(),
        DispatchDtype.BF16,
        CombineDtype.FP8_DIRECT_CAST,
        env={"SGLANG_MORI_COMBINE_DTYPE": "fp8_direct_cast"},
        tolerance=0.08,
    ),
    "idle-rank": Case("none", lambda x: x.float(), DispatchDtype.BF16, tokens=(9, 0)),
    "split": Case(
        "fp8",
        lambda x: _wire(x, DispatchDtype.FP8),
        DispatchDtype.FP8,
        env={"SGLANG_MORI_SPLIT_DISPATCH_COMBINE": "1"},
        backends=("mori_high_throughput",),
        tolerance=0.08,
    ),
}
RUNS = [(backend, name) for name, case in CASES.items() for backend in case.backends]


# ---------------------------------------------------------------------------------------------
# reference experts
# ---------------------------------------------------------------------------------------------


def expert_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's weights (the same on every rank): w1 ``[E, I, H]`` integers, w2 ``[E, H, I]`` integers
    times 2^-6, which keeps expert outputs of N(0, 1) tokens well inside the fp8 range (no saturation)."""
    gen = generator(seed, 1000)
    w1 = torch.randint(-2, 3, (NUM_EXPERTS, INTERMEDIATE, HIDDEN), generator=gen).double()
    w2 = torch.randint(-2, 3, (NUM_EXPERTS, HIDDEN, INTERMEDIATE), generator=gen).double() * 2.0**-6
    return w1, w2


def expert_output(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on rows ``x`` (f32): exact in f64, rounded once to bf16, as f32."""
    hidden = torch.relu(x.double() @ w1.T)
    return (hidden @ w2.T).bfloat16().float()


def dequantize_for_experts(quant: str, a1q: torch.Tensor, a1q_scale: torch.Tensor | None) -> torch.Tensor:
    """What the expert GEMM sees, read from the tensors vLLM hands experts of each activation format."""
    if quant == "none":
        assert a1q_scale is None
        return a1q.float()
    assert a1q_scale is not None
    if quant == "fp8":
        assert a1q.dtype == torch.float8_e4m3fn and a1q_scale.dtype == torch.float32
        return formats.dequantize_dispatch(a1q, a1q_scale, DispatchDtype.FP8, HIDDEN)
    if quant == "mxfp4":
        assert a1q.dtype == torch.float4_e2m1fn_x2 and a1q_scale.dtype == torch.float8_e8m0fnu
        assert a1q.shape[1] == HIDDEN // 2
        return formats.dequantize_dispatch(a1q.view(torch.uint8), a1q_scale, DispatchDtype.MXFP4, HIDDEN)
    assert a1q.dtype == torch.float8_e4m3fn and a1q_scale.dtype == torch.uint8
    return formats.dequantize_dispatch(a1q, a1q_scale, DispatchDtype.MXFP8, HIDDEN)


class ReferenceExperts(mk.FusedMoEExpertsModular):
    """Standard-format experts that weight and reduce their local top-k slots (ascending k, f32)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig, quant: str) -> None:
        super().__init__(moe_config, quant_config)
        self.quant = quant

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True

    @staticmethod
    def _supports_quant_scheme(weight_key: object, activation_key: object) -> bool:
        return True

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return True

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True

    def workspace_shapes(self, num_tokens: int, *shape: object) -> tuple[tuple[int, ...], ...]:
        return (0,), (0,), (num_tokens, self.moe_config.hidden_dim)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        assert expert_tokens_meta is None and not apply_router_weight_on_input and expert_map is not None
        assert topk_ids.dtype == torch.int32 and bool((topk_ids >= 0).all()), "experts must see valid global ids"
        x = dequantize_for_experts(self.quant, hidden_states, a1q_scale)
        acc = torch.zeros(x.shape[0], HIDDEN)
        local = expert_map[topk_ids.long()]
        for k in range(topk_ids.shape[1]):
            for e in range(w1.shape[0]):
                rows = (local[:, k] == e).nonzero().view(-1)
                if rows.numel():
                    acc[rows] += topk_weights[rows, k, None] * expert_output(x[rows], w1[e], w2[e])
        output.copy_(acc)


def expected_output(
    case: Case, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(contract-exact bf16 output, unquantized f64 MoE) for one rank's tokens.

    Exact: each destination rank's partial is the f32 sum of its slots in ascending k, cast to bf16 (the
    experts' output), sent through the combine format, and the partials are summed in f32 and cast once.
    """
    local = NUM_EXPERTS // WORLD
    fed = case.feed(x)
    exact = torch.zeros(x.shape[0], HIDDEN)
    plain = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(x.shape[0]):
        partials = torch.zeros(WORLD, HIDDEN)
        for k in range(TOPK):
            e = int(ids[t, k])
            if e < 0:
                continue
            partials[e // local] += weights[t, k] * expert_output(fed[t : t + 1], w1[e], w2[e])[0]
            plain[t] += float(weights[t, k]) * (torch.relu(x[t].double() @ w1[e].T) @ w2[e].T)
        for dest in sorted({int(e) // local for e in ids[t] if e >= 0}):
            part = partials[dest : dest + 1].bfloat16()
            if case.combine is not CombineDtype.BF16:
                wire = formats.quantize_combine(part, case.combine, torch.float8_e4m3fn)
                part = formats.dequantize_combine(wire, case.combine, HIDDEN, torch.float8_e4m3fn)
            exact[t] += part[0].float()
    return exact.bfloat16(), plain


def rank_inputs(case: Case, seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, int32 top-k ids (distinct experts, about 1 slot in 8 dropped as -1) and f32 weights."""
    n = case.tokens[rank]
    gen = generator(seed, rank)
    x = make_tokens("normal", n, HIDDEN, gen)
    ids = torch.rand(n, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK]
    ids = torch.where(torch.rand(n, TOPK, generator=gen) < 0.125, -1, ids).int()
    weights = torch.rand(n, TOPK, generator=gen) + 0.5
    return x, ids, weights


# ---------------------------------------------------------------------------------------------
# the ranks
# ---------------------------------------------------------------------------------------------


def quant_config_for(quant: str) -> FusedMoEQuantConfig:
    ones = torch.ones(1)
    if quant == "none":
        return moe_cfg.FUSED_MOE_UNQUANTIZED_CONFIG
    if quant == "fp8":
        return moe_cfg.fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, block_shape=[128, 128])
    if quant == "mxfp4":
        return moe_cfg.mxfp4_moe_quant_config(w1_scale=ones, w2_scale=ones)
    return moe_cfg.FusedMoEQuantConfig.make("mxfp8", is_scale_swizzled=False)


def moe_config_for(backend: str, rank: int) -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=WORLD,
        ep_size=WORLD,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=rank,
        ep_rank=rank,
        sp_size=1,
        use_ep=True,
        all2all_backend=backend,
        enable_eplb=False,
    )
    return FusedMoEConfig(
        num_experts=NUM_EXPERTS,
        experts_per_token=TOPK,
        hidden_dim=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_local_experts=NUM_EXPERTS // WORLD,
        num_logical_experts=NUM_EXPERTS,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Default,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        max_num_tokens=MAX_TOKENS,
    )


def run_case(backend: str, name: str, rank: int, seed: int, manager: MoriSglangAll2AllManager, out_dir: Path) -> None:
    """One case on one rank: vLLM builds the prepare/finalize, its modular kernel runs the step."""
    case = CASES[name]
    saved = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    try:
        moe = moe_config_for(backend, rank)
        quant_config = quant_config_for(case.quant)
        pf = maybe_make_prepare_finalize(moe, quant_config, allow_new_interface=True, all2all_manager=manager)
        again = maybe_make_prepare_finalize(moe, quant_config, allow_new_interface=True, all2all_manager=manager)
        assert type(pf) is MoriSglangPrepareAndFinalize
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    config = pf.op.config
    kernel = mk.FusedMoEKernel(pf, ReferenceExperts(moe, quant_config, case.quant))

    local = NUM_EXPERTS // WORLD
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    expert_map[rank * local : (rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    w1, w2 = expert_weights(seed)
    x, ids, weights = rank_inputs(case, seed, rank)
    out = kernel.apply(
        hidden_states=x,
        w1=w1[rank * local : (rank + 1) * local],
        w2=w2[rank * local : (rank + 1) * local],
        topk_weights=weights,
        topk_ids=ids,
        activation=MoEActivation.SILU,
        global_num_experts=NUM_EXPERTS,
        expert_map=expert_map,
        apply_router_weight_on_input=False,
    )
    exact, plain = expected_output(case, x, ids, weights, w1, w2)
    torch.save(
        {
            "out": out,
            "exact": exact,
            "plain": plain,
            "dispatch": config.dispatch_dtype,
            "combine": config.combine_dtype,
            "mode": config.mode,
            "async": pf.supports_async(),
            "cached": again.op is pf.op,
        },
        out_dir / f"{backend}-{name}-rank{rank}.pt",
    )


def rank_main(rank: int, world_size: int, seed: int, out_dir: str) -> None:
    """One rank: load the plugin the way vLLM does, let vLLM build our objects, run every case."""
    vllm.plugins.load_general_plugins()
    init_workspace_manager(torch.device("cpu"))
    # The modular kernel's workspace manager empties the accelerator cache before it grows; this
    # machine has no accelerator, and there is nothing to empty.
    torch.accelerator.empty_cache = lambda: None
    selection = {}
    try:
        for i, backend in enumerate(BACKENDS):
            parallel = ParallelConfig(all2all_backend=backend, enable_expert_parallel=True)
            device = DeviceConfig(device="cpu")
            with set_current_vllm_config(VllmConfig(parallel_config=parallel, device_config=device)):
                if i == 0:
                    parallel_state.init_distributed_environment(world_size, rank, local_rank=rank, backend="gloo")
                    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
                ep = parallel_state.get_ep_group()
                comm = CudaCommunicator(ep.cpu_group, torch.device("cpu"), unique_name="ep:mori", use_all2all=True)
                manager = comm.all2all_manager
                selection[backend] = type(manager) is MoriSglangAll2AllManager and manager.all2all_backend == backend
                for name in (n for b, n in RUNS if b == backend):
                    run_case(backend, name, rank, seed, manager, Path(out_dir))
                comm.destroy()  # vLLM's teardown: the manager drops its ops, which hold the EP group
    finally:
        # vLLM's groups (its coordinators hold them) go before the launcher destroys the default group.
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    torch.save(selection, Path(out_dir) / f"selection-rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    if not any(ep.name == "mori_sglang" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("the mori-sglang distribution is not installed (pip install -e .): no vllm.general_plugins entry")
    out_dir = tmp_path_factory.mktemp("vllm_round_trip")
    seed = BASE_SEED % 2**31
    run_gloo(WORLD, rank_main, (seed, str(out_dir)), out_dir, timeout_s=300)
    return out_dir, seed


def test_vllm_builds_our_manager_for_both_names(results: tuple[Path, int]) -> None:
    out_dir, _ = results
    for rank in range(WORLD):
        selection = torch.load(out_dir / f"selection-rank{rank}.pt")
        assert selection == {backend: True for backend in BACKENDS}, f"rank {rank}: {selection}"


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "name"), RUNS)
def test_round_trip_equals_non_parallel_moe(results: tuple[Path, int], backend: str, name: str) -> None:
    out_dir, seed = results
    case = CASES[name]
    for rank in range(WORLD):
        got = torch.load(out_dir / f"{backend}-{name}-rank{rank}.pt", weights_only=False)
        if backend == "mori_low_latency":
            mode = Mode.LOW_LATENCY
        else:
            mode = Mode.SPLIT if "SGLANG_MORI_SPLIT_DISPATCH_COMBINE" in case.env else Mode.INTRANODE
        assert (got["dispatch"], got["combine"], got["mode"]) == (case.dispatch, case.combine, mode)
        assert got["async"] == (mode is not Mode.INTRANODE)
        assert got["cached"], "vLLM's handle cache must hand one op to every layer of one shape"
        out, exact, plain = got["out"], got["exact"], got["plain"]
        assert out.dtype == torch.bfloat16 and out.shape == (case.tokens[rank], HIDDEN)
        bad = (out.float() != exact.float()).any(dim=1).nonzero().view(-1).tolist()
        assert not bad, f"rank {rank} (seed {seed}): tokens {bad} differ from the non-parallel MoE"
        if plain.numel():
            err = (out.double() - plain).norm() / plain.norm()
            assert err < case.tolerance, f"rank {rank}: relative error {float(err):.3g} vs the unquantized MoE"
