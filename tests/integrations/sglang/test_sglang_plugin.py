"""The SGLang plugin against the real SGLang package, on CPU.

SGLang's own loader must discover the entry point and swap its ``MoriEPDispatcher`` for ours; SGLang's
own factory (``create_moe_dispatcher`` with ``--moe-a2a-backend mori``) must then build ours with the
upstream keywords; its launch-time resolution must keep the chunked-prefill check and reject bad
``SGLANG_MORI_*`` values by name. The layer tests run a MoE step on 2 and 4 gloo ranks through that
factory (router top-k -> our dispatch -> per-expert MLPs on the received rows -> our combine) and compare
it with the same layer computed on all tokens in one process, for every dispatch and combine dtype in
normal, low-latency and split modes, with two-batch-overlap instances interleaved.

Run with the environment ``.ci/install-sglang.sh VENV`` builds; elsewhere the module is skipped.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.integrations.sglang.cpu_import import prepare_sglang_cpu_import

prepare_sglang_cpu_import()
pytest.importorskip(
    "sglang", reason="needs the sglang package: .ci/install-sglang.sh VENV installs SGLang 0.5.23 for CPU tests"
)

import torch.distributed as dist  # noqa: E402
from sglang.srt.arg_groups.resolution_hooks import _HOOKS  # noqa: E402
from sglang.srt.batch_overlap import two_batch_overlap  # noqa: E402
from sglang.srt.batch_overlap.two_batch_overlap import MaybeTboDeepEPDispatcher  # noqa: E402
from sglang.srt.distributed.parallel_state import GroupCoordinator  # noqa: E402
from sglang.srt.layers.moe import token_dispatcher  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher import moriep  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputFormat  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend  # noqa: E402
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group  # noqa: E402
from sglang.srt.runtime_context import get_flags, get_forward, get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from mori_sglang import env, formats  # noqa: E402
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode  # noqa: E402
from mori_sglang.env import EnvError  # noqa: E402
from mori_sglang.integrations.sglang import plugin  # noqa: E402
from mori_sglang.integrations.sglang.dispatcher import MoriSglangDispatcher, release_shared_ops  # noqa: E402
from mori_sglang.op import EpDispatchCombineOp, InputError  # noqa: E402
from mori_sglang.providers.mori_provider import finalize_shmem  # noqa: E402
from tests.helpers import SEED_ENV, generator, run_gloo  # noqa: E402

# Captured before any test loads the plugins, inside a tuple: the registry rebinds every module-level
# name that holds the replaced class.
UPSTREAM = (moriep.MoriEPDispatcher,)
HIDDEN = 256
TOPK = 3
CAP_VAR = "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
# These tests publish no parallel placement (SGLang's received-row bound reads it) and give ranks batch
# sizes no single placement produces, so the dispatch output offers the whole buffer; the bound is
# tested with SGLang's placement in test_sglang_experts.py.
WHOLE_BUFFER = ("SGLANG_MORI_RECV_BOUND", "0")


# ---------------------------------------------------------------------------------------------
# SGLang context: a tp group coordinator and the MoE flags its factory reads
# ---------------------------------------------------------------------------------------------


def tp_coordinator(world_size: int, rank: int) -> GroupCoordinator:
    """SGLang's own tp group over the default (gloo) process group, as its launcher builds it."""
    return GroupCoordinator([list(range(world_size))], rank, "gloo", *[False] * 6, group_name="tp")


@contextlib.contextmanager
def sglang_moe(tp: GroupCoordinator, deepep_mode: DeepEPMode, tbo: bool = False) -> Iterator[None]:
    """What ``--moe-a2a-backend mori --deepep-mode ...`` sets up before the model is built."""
    with (
        get_parallel().override(tp_group=tp),
        get_flags().moe.override(a2a_backend=MoeA2ABackend.MORI, deepep_mode=deepep_mode, tbo_enabled=tbo),
    ):
        yield


def runner_config(num_experts: int, world_size: int) -> MoeRunnerConfig:
    return MoeRunnerConfig(
        num_experts=num_experts,
        num_local_experts=num_experts // world_size,
        hidden_size=HIDDEN,
        top_k=TOPK,
        params_dtype=torch.bfloat16,
    )


def build_with_factory(tp: GroupCoordinator, num_experts: int, deepep_mode: DeepEPMode, tbo: bool):
    with sglang_moe(tp, deepep_mode, tbo):
        return create_moe_dispatcher(runner_config(num_experts, tp.world_size), None)


@pytest.fixture(scope="module")
def tp() -> Iterator[GroupCoordinator]:
    """A one-rank gloo world in this process (the multi-rank tests spawn their own)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield tp_coordinator(dist.get_world_size(), dist.get_rank())
    release_shared_ops()
    if owned:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plugins_loaded() -> None:
    load_plugins()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Every SGLANG_MORI_* variable unset (restored afterwards), so the defaults apply."""
    for name in list(os.environ):
        if name.startswith(("SGLANG_MORI_", "MORI_")) and name != SEED_ENV:
            monkeypatch.delenv(name)
    monkeypatch.setenv(*WHOLE_BUFFER)
    return monkeypatch


def make_dispatcher(tp: GroupCoordinator, deepep_mode: DeepEPMode = DeepEPMode.NORMAL, **overrides):
    keywords = dict(
        group=tp,
        router_topk=TOPK,
        permute_fusion=True,
        num_experts=8,
        num_local_experts=8 // tp.world_size,
        hidden_size=HIDDEN,
        params_dtype=torch.bfloat16,
        deepep_mode=deepep_mode,
        async_finish=True,
        return_recv_hook=True,
    )
    keywords.update(overrides)
    return MoriSglangDispatcher(**keywords)


def topk_output(num_tokens: int, num_experts: int, seed: int, *salt: int) -> StandardTopKOutput:
    """Distinct random experts per token, ~10% of the slots dropped (-1), positive router weights."""
    gen = generator(seed, *salt)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :TOPK]
    ids = torch.where(torch.rand(num_tokens, TOPK, generator=gen) < 0.1, -1, ids).to(torch.int32)
    weights = torch.rand(num_tokens, TOPK, generator=gen) + 0.1
    return StandardTopKOutput(weights, ids, torch.zeros(num_tokens, num_experts))


def tokens(num_tokens: int, seed: int, *salt: int) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=generator(seed, *salt)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# discovery and replacement through SGLang's loader
# ---------------------------------------------------------------------------------------------


def test_sglang_loader_discovers_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    func, dist_name = load_plugins_by_group(GENERAL_PLUGINS_GROUP)["mori_sglang"]
    assert func is plugin.register
    assert dist_name == "mori-sglang"


@pytest.mark.parametrize(("allowed", "loaded"), [("mori_sglang", True), ("some_other_plugin", False)])
def test_sglang_plugins_whitelist_is_honoured(monkeypatch: pytest.MonkeyPatch, allowed: str, loaded: bool) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", allowed)
    assert ("mori_sglang" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)) is loaded


def test_load_plugins_replaces_every_binding(plugins_loaded: None) -> None:
    """The defining module and the modules that imported the class by name all see ours."""
    assert UPSTREAM[0] is not MoriSglangDispatcher
    for module in (moriep, token_dispatcher, two_batch_overlap):
        assert module.MoriEPDispatcher is MoriSglangDispatcher, module.__name__
    assert plugin.check_env_at_launch in _HOOKS[plugin.A2A_RESOLUTION_STEP]


def test_constructor_keeps_upstream_keywords_and_defaults() -> None:
    ours = inspect.signature(MoriSglangDispatcher).parameters
    for name, param in inspect.signature(UPSTREAM[0]).parameters.items():
        assert name in ours, f"upstream keyword {name} missing"
        assert ours[name].default == param.default, f"default of {name}"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())


@pytest.mark.parametrize("tbo", [False, True], ids=["single", "two_batch_overlap"])
@pytest.mark.parametrize("deepep_mode", [DeepEPMode.NORMAL, DeepEPMode.LOW_LATENCY], ids=lambda m: m.value)
def test_sglang_factory_builds_ours(
    plugins_loaded: None, tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, deepep_mode: DeepEPMode, tbo: bool
) -> None:
    built = build_with_factory(tp, 8, deepep_mode, tbo)
    assert isinstance(built, MaybeTboDeepEPDispatcher)
    inners = built._inners
    assert [type(d) for d in inners] == [MoriSglangDispatcher] * (2 if tbo else 1)
    assert [d.instance_id for d in inners] == list(range(len(inners)))
    for d in inners:
        assert d.group is tp and d.process_group is tp.device_group and d.cpu_group is tp.cpu_group
        assert (d.router_topk, d.num_experts, d.num_local_experts, d.hidden_size) == (TOPK, 8, 8, HIDDEN)
        assert d.params_dtype == torch.bfloat16 and d.deepep_mode is deepep_mode
        assert d.permute_fusion and d.async_finish and d.return_recv_hook
    assert torch.equal(built.expert_mask_gpu, torch.ones(8, dtype=torch.int32))


def test_unknown_keywords_are_tolerated(tp: GroupCoordinator, clean_env: pytest.MonkeyPatch) -> None:
    d = make_dispatcher(tp, instance_id=1, runner_backend=None, a_keyword_from_a_later_sglang=3)
    assert d.instance_id == 1


def test_expert_count_that_does_not_split_is_refused(tp: GroupCoordinator, clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="num_local_experts=3"):
        make_dispatcher(tp, num_local_experts=3)


# ---------------------------------------------------------------------------------------------
# dtypes and modes from the weight dtype and SGLANG_MORI_*
# ---------------------------------------------------------------------------------------------

B, F8, MX8, F4 = DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4
CB, CF8, CCAST = CombineDtype.BF16, CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_DIRECT_CAST


@pytest.mark.parametrize(
    ("weight_dtype", "env", "dispatch", "combine"),
    [
        (torch.bfloat16, {}, B, CB),
        (torch.float8_e4m3fn, {}, F8, CB),
        (torch.float8_e4m3fnuz, {}, F8, CB),
        (torch.float4_e2m1fn_x2, {}, F4, CB),  # as SGLang's EP v2 dispatcher, the default
        (torch.float4_e2m1fn_x2, {"SGLANG_MORI_EP_V2": "0"}, F4, CF8),  # as its v1 dispatcher
        (torch.float8_e4m3fn, {"SGLANG_MORI_DISPATCH_DTYPE": "bf16"}, B, CB),
        (torch.float4_e2m1fn_x2, {"SGLANG_MORI_COMBINE_DTYPE": "bf16"}, F4, CB),
        (
            torch.bfloat16,
            {"SGLANG_MORI_DISPATCH_DTYPE": "mxfp8", "SGLANG_MORI_COMBINE_DTYPE": "fp8_direct_cast"},
            MX8,
            CCAST,
        ),
        (torch.bfloat16, {"SGLANG_MORI_FP8_DISP": "1", "SGLANG_MORI_FP8_COMB": "1"}, F8, CF8),
        (torch.bfloat16, {"SGLANG_MORI_DISPATCH_DTYPE": "auto", "SGLANG_MORI_FP4_DISP": "1"}, B, CB),
    ],
)
def test_set_quant_config_picks_dtypes_from_weights_then_env(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, weight_dtype, env, dispatch, combine
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    d = make_dispatcher(tp, DeepEPMode.AUTO)
    d.set_quant_config({"weight_dtype": weight_dtype})
    assert (d.dispatch_dtype, d.combine_dtype) == (dispatch, combine)
    for mode in (DeepEPMode.NORMAL, DeepEPMode.LOW_LATENCY):
        assert (d.config(mode).dispatch_dtype, d.config(mode).combine_dtype) == (dispatch, combine)


@pytest.mark.parametrize(
    ("deepep_mode", "split", "modes"),
    [
        (DeepEPMode.NORMAL, "0", {DeepEPMode.NORMAL: Mode.INTRANODE}),
        (DeepEPMode.NORMAL, "1", {DeepEPMode.NORMAL: Mode.SPLIT}),
        (DeepEPMode.LOW_LATENCY, "1", {DeepEPMode.LOW_LATENCY: Mode.LOW_LATENCY}),
        (DeepEPMode.AUTO, "0", {DeepEPMode.NORMAL: Mode.INTRANODE, DeepEPMode.LOW_LATENCY: Mode.LOW_LATENCY}),
    ],
)
def test_deepep_mode_and_split_variable_pick_the_op_mode(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, deepep_mode: DeepEPMode, split: str, modes: dict
) -> None:
    clean_env.setenv("SGLANG_MORI_SPLIT_DISPATCH_COMBINE", split)
    clean_env.setenv(CAP_VAR, "64")
    d = make_dispatcher(tp, deepep_mode)
    assert {m: d.config(m).mode for m in modes} == modes
    assert all(d.config(m).max_tokens_per_rank == 64 for m in modes)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SGLANG_MORI_DISPATCH_DTYPE", "fp16"),
        ("SGLANG_MORI_COMBINE_DTYPE", "int8"),
        (CAP_VAR, "4k"),
        (CAP_VAR, "0"),
        ("SGLANG_MORI_SPLIT_DISPATCH_COMBINE", "maybe"),
        ("SGLANG_MORI_BACKEND", "cuda"),
        ("SGLANG_MORI_FP8_TYPE", "e5m2"),
    ],
)
def test_bad_env_value_fails_at_construction_naming_the_variable(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(EnvError, match=name):
        make_dispatcher(tp)
    with pytest.raises(EnvError, match=name):
        env.check_all()


BAD_VALUE_OF_KIND = {"bool": "maybe", "int": "4k", "choice": "nonsense", "seconds": "soon", "size": "lots"}


@pytest.mark.parametrize("var", env.ENV_VARS, ids=lambda v: v.name)
def test_launch_check_parses_every_variable(clean_env: pytest.MonkeyPatch, var) -> None:
    """Every variable mori-sglang reads, of every kind, is parsed at launch."""
    clean_env.setenv(var.name, BAD_VALUE_OF_KIND[var.kind])
    with pytest.raises(EnvError, match=var.name):
        env.check_all()


def test_combine_dtype_no_provider_here_offers_is_refused_when_the_op_is_built(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("SGLANG_MORI_COMBINE_DTYPE", "fp4")
    clean_env.setenv("SGLANG_MORI_BACKEND", "torch")
    d = make_dispatcher(tp)
    with pytest.raises(ConfigError, match="SGLANG_MORI_COMBINE_DTYPE"):
        d.set_quant_config({"weight_dtype": torch.bfloat16})


def test_release_shared_ops_lets_the_ops_and_their_group_go(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch
) -> None:
    """Dispatchers share their ops (and the group each holds) until release_shared_ops(); after it, the
    ops die with the dispatchers, and a dispatcher built afterwards builds anew."""
    import gc

    clean_env.setenv("SGLANG_MORI_BACKEND", "torch")

    def live_ops() -> list[EpDispatchCombineOp]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, EpDispatchCombineOp)]

    release_shared_ops()
    before = {id(o) for o in live_ops()}
    first, second = make_dispatcher(tp), make_dispatcher(tp)
    for d in (first, second):
        d.set_quant_config({"weight_dtype": torch.bfloat16})
    built = [o for o in live_ops() if id(o) not in before]
    assert built, "set_quant_config built no op"
    del first, second
    assert {id(o) for o in live_ops()} >= {id(o) for o in built}, "the shared ops went with their dispatchers"
    ids = {id(o) for o in built}
    del built
    release_shared_ops()
    assert not ids & {id(o) for o in live_ops()}, "release_shared_ops() left an op alive"


# ---------------------------------------------------------------------------------------------
# launch-time resolution (SGLang's ServerArgs pipeline with our hook)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_moe_model(tmp_path: Path) -> str:
    """A local config of a small Mixtral: resolution reads it, nothing is downloaded or loaded."""
    (tmp_path / "config.json").write_text(
        '{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,'
        ' "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,'
        ' "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 512,'
        ' "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0}'
    )
    return str(tmp_path)


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """Resolution writes variables (e.g. SGLANG_MORI_EP_V2); put the environment back afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def resolved(args: ServerArgs) -> object:
    """The values launch resolution settled on (what the servers read)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(args)


def resolve(model: str, backend: str, chunked_prefill_size: int = 2048, runner: str = "auto") -> ServerArgs:
    args = ServerArgs(
        model_path=model,
        skip_tokenizer_init=True,
        device="cpu",
        tp_size=2,
        moe_a2a_backend=backend,
        moe_runner_backend=runner,
        chunked_prefill_size=chunked_prefill_size,
    )
    args.resolve_once()
    return args


@pytest.mark.parametrize(("cap", "ok"), [("1024", False), ("2048", True)])
def test_launch_keeps_sglangs_chunked_prefill_check(
    plugins_loaded: None, tiny_moe_model: str, restored_environ: None, clean_env: pytest.MonkeyPatch, cap: str, ok: bool
) -> None:
    clean_env.setenv(CAP_VAR, cap)
    if ok:
        assert resolved(resolve(tiny_moe_model, "mori", chunked_prefill_size=2048)).chunked_prefill_size == 2048
    else:
        with pytest.raises(AssertionError, match=CAP_VAR):
            resolve(tiny_moe_model, "mori", chunked_prefill_size=2048)


@pytest.mark.parametrize(("backend", "rejected"), [("mori", True), ("none", False)])
def test_launch_rejects_a_bad_variable_only_for_the_mori_backend(
    plugins_loaded: None,
    tiny_moe_model: str,
    restored_environ: None,
    clean_env: pytest.MonkeyPatch,
    backend: str,
    rejected: bool,
) -> None:
    clean_env.setenv("SGLANG_MORI_BACKEND", "nvshmem")
    if rejected:
        with pytest.raises(EnvError, match="SGLANG_MORI_BACKEND"):
            resolve(tiny_moe_model, backend)
    else:
        resolve(tiny_moe_model, backend)


@pytest.mark.parametrize(
    ("runner", "ok"), [("auto", True), ("triton", True), ("deep_gemm", False), ("flashinfer_cutlass", False)]
)
def test_launch_accepts_only_runners_that_consume_mori_outputs(
    plugins_loaded: None, tiny_moe_model: str, restored_environ: None, clean_env: pytest.MonkeyPatch, runner, ok
) -> None:
    """Where AITER does not run the experts (NVIDIA, and this CPU), only the Triton runner reads our
    outputs: any other --moe-runner-backend stops the launch with one sentence naming the flag."""
    if ok:
        assert resolved(resolve(tiny_moe_model, "mori", runner=runner)).moe_runner_backend == runner
        return
    with pytest.raises(
        ValueError, match=rf"^--moe-runner-backend {runner} cannot .* use --moe-runner-backend auto or triton \("
    ):
        resolve(tiny_moe_model, "mori", runner=runner)


def test_other_a2a_backends_keep_their_runner_choice(
    plugins_loaded: None, tiny_moe_model: str, restored_environ: None, clean_env: pytest.MonkeyPatch
) -> None:
    assert resolved(resolve(tiny_moe_model, "none", runner="deep_gemm")).moe_runner_backend == "deep_gemm"


def test_aiter_platforms_keep_their_runner_choice(
    plugins_loaded: None, tiny_moe_model: str, restored_environ: None, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setattr(plugin, "aiter_runs_experts", lambda: True)
    assert resolved(resolve(tiny_moe_model, "mori", runner="deep_gemm")).moe_runner_backend == "deep_gemm"


@pytest.mark.parametrize(
    ("a2a", "aiter", "expected"),
    [
        (MoeA2ABackend.MORI, False, "FusedMoE"),
        (MoeA2ABackend.MORI, True, "DeepEPMoE"),
        (MoeA2ABackend.DEEPEP, False, "DeepEPMoE"),
        (MoeA2ABackend.NONE, False, "FusedMoE"),
    ],
)
def test_mori_layers_are_built_as_fused_moe_unless_aiter_runs_them(
    plugins_loaded: None, monkeypatch: pytest.MonkeyPatch, a2a: MoeA2ABackend, aiter: bool, expected: str
) -> None:
    """SGLang's own ``get_moe_impl_class``, as a model module imported after the plugins sees it.
    Launch resolution turns MoRI EPv2 off for every model but DeepSeek-V4 (EPv2 layers are always
    ``FusedMoE``)."""
    from sglang.srt.layers.moe.ep_moe import layer as ep_moe_layer
    from sglang.srt.models import qwen2_moe

    monkeypatch.setenv("SGLANG_MORI_EP_V2", "false")
    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: aiter)
    with get_flags().moe.override(a2a_backend=a2a):
        assert ep_moe_layer.get_moe_impl_class(None).__name__ == expected
        assert qwen2_moe.get_moe_impl_class(None).__name__ == expected


def test_mori_layers_of_quantizations_the_triton_path_cannot_take_are_refused_at_build(
    plugins_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quant methods that read SGLang's standard dispatch output (``topk_output``, which MoRI's outputs
    lack) or run kernels of their own would fail at the first forward: the layer's class lookup refuses
    them by name while the model is built; the ones whose methods hand MoRI's outputs to the Triton
    runner pass. Other a2a backends keep SGLang's choice."""
    from sglang.srt.layers.quantization.blockwise_int8 import BlockInt8Config
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config
    from sglang.srt.layers.quantization.w8a8_fp8 import W8A8Fp8Config
    from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8Config

    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)
    original = []
    accepted = (None, Fp8Config(True, weight_block_size=[128, 128]), W8A8Fp8Config(), BlockInt8Config())
    refused = {"w8a8_int8": W8A8Int8Config(), "modelopt_fp8": ModelOptFp8Config(), "mxfp8": Fp8Config(use_mxfp8=True)}
    with get_flags().moe.override(a2a_backend=MoeA2ABackend.MORI):
        for quant_config in accepted:
            assert plugin.moe_impl_class(original.append, quant_config).__name__ == "FusedMoE"
        for name, quant_config in refused.items():
            with pytest.raises(ValueError, match=f"cannot run the MoE layers of a {name} checkpoint"):
                plugin.moe_impl_class(original.append, quant_config)
    assert original == []
    with get_flags().moe.override(a2a_backend=MoeA2ABackend.NONE):
        plugin.moe_impl_class(original.append, refused["w8a8_int8"])
    assert original == [refused["w8a8_int8"]]


def test_fused_function_is_registered_for_mori_and_triton(plugins_loaded: None) -> None:
    from sglang.srt.layers.moe.moe_runner.base import FusedOpPool

    from mori_sglang.integrations.sglang import triton_experts

    assert FusedOpPool.get_fused_func("mori", "triton") is triton_experts.mori_to_triton
    triton_experts.register()  # a second registration in the same process is harmless
    assert FusedOpPool.get_fused_func("mori", "triton") is triton_experts.mori_to_triton


# ---------------------------------------------------------------------------------------------
# one rank: the call contract, the outputs SGLang reads, hooks, errors
# ---------------------------------------------------------------------------------------------


def combine_input_of(out, y: torch.Tensor):
    if out.format is DispatchOutputFormat.DEEPEP_NORMAL:
        return moriep.MoriEPNormalCombineInput(hidden_states=y, topk_ids=out.topk_ids, topk_weights=out.topk_weights)
    return moriep.MoriEPLLCombineInput(hidden_states=y, topk_ids=out.topk_ids, topk_weights=out.topk_weights)


@pytest.mark.parametrize(
    ("deepep_mode", "extend", "output_class"),
    [
        (DeepEPMode.NORMAL, False, moriep.MoriEPNormalDispatchOutput),
        (DeepEPMode.LOW_LATENCY, True, moriep.MoriEPLLDispatchOutput),
        (DeepEPMode.AUTO, True, moriep.MoriEPNormalDispatchOutput),
        (DeepEPMode.AUTO, False, moriep.MoriEPLLDispatchOutput),
    ],
)
def test_one_rank_step_returns_what_sglang_reads(
    tp: GroupCoordinator,
    clean_env: pytest.MonkeyPatch,
    seed: int,
    deepep_mode: DeepEPMode,
    extend: bool,
    output_class: type,
) -> None:
    """One rank owns every expert: each token with a kept slot comes back to itself once. With an
    expert side that returns x * (sum of its kept weights), combine must give exactly that in bf16."""
    clean_env.setenv(CAP_VAR, "32")
    clean_env.setenv("SGLANG_MORI_DISPATCH_DTYPE", "fp8")
    d = make_dispatcher(tp, deepep_mode)
    calls: list[str] = []
    d.register_deepep_dispatch_hook(lambda dispatcher: calls.append("deepep") if dispatcher is d else None)
    d.register_pre_dispatch_hook(lambda dispatcher, x, topk: calls.append("pre") or None)
    d.register_post_combine_hook(lambda dispatcher, y: calls.append("post_combine") or None)
    x = tokens(20, seed)
    topk = topk_output(20, 8, seed)
    with get_forward().scoped(is_extend_in_batch=extend):
        out = d.dispatch(hidden_states=x, topk_output=topk)
    assert calls == ["pre", "deepep"]
    assert type(out) is output_class
    kept = (topk.topk_ids >= 0).any(dim=1)
    n = int(kept.sum())
    capacity = 32
    assert out.hidden_states.shape == (capacity, HIDDEN) and out.hidden_states.dtype == torch.float8_e4m3fn
    assert out.hidden_states_scale.shape == (capacity, HIDDEN // 128)
    assert out.hidden_states_scale.dtype == torch.float32
    assert out.topk_ids.shape == (capacity, TOPK) and out.topk_ids.dtype == torch.int32
    assert out.topk_weights.shape == (capacity, TOPK) and out.topk_weights.dtype == torch.float32
    assert out.num_recv_tokens_per_expert.tolist() == [n]
    assert torch.equal(out.origin_topk_ids, topk.topk_ids) and torch.equal(out.origin_topk_weights, topk.topk_weights)
    assert out.out_dtype == torch.bfloat16
    assert torch.equal(out.topk_ids[:n], topk.topk_ids[kept])
    payload, scales = formats.quantize_dispatch(x[kept], DispatchDtype.FP8, torch.float8_e4m3fn)
    assert torch.equal(out.hidden_states[:n].view(torch.uint8), payload.view(torch.uint8))
    assert torch.equal(out.hidden_states_scale[:n], scales)

    y = torch.full((capacity, HIDDEN), float("nan"), dtype=torch.bfloat16)
    kept_weight = torch.where(out.topk_ids[:n] >= 0, out.topk_weights[:n], 0).sum(dim=1, keepdim=True)
    y[:n] = (x[kept].float() * kept_weight).to(torch.bfloat16)
    combined = d.combine(combine_input=combine_input_of(out, y))
    assert calls[-1] == "post_combine"
    want = torch.zeros(20, HIDDEN, dtype=torch.bfloat16)
    want[kept] = y[:n]
    assert combined.shape == (20, HIDDEN) and torch.equal(combined, want)


@pytest.mark.parametrize(("weights_dtype", "ids_dtype"), [(torch.bfloat16, torch.int64), (torch.float16, torch.int32)])
def test_router_tensors_of_other_dtypes_travel_as_they_are(
    tp: GroupCoordinator,
    clean_env: pytest.MonkeyPatch,
    seed: int,
    weights_dtype: torch.dtype,
    ids_dtype: torch.dtype,
) -> None:
    """A router's 16-bit weights or int64 ids are sent without a conversion: origin_topk_* are the
    router's own tensors (as upstream's dispatcher hands them back), and every received field equals
    that of the same router output in f32 weights and int32 ids."""
    clean_env.setenv(CAP_VAR, "32")
    clean_env.setenv("SGLANG_MORI_DISPATCH_DTYPE", "fp8")
    x = tokens(20, seed)
    f32 = topk_output(20, 8, seed)
    topk = StandardTopKOutput(f32.topk_weights.to(weights_dtype), f32.topk_ids.to(ids_dtype), f32.router_logits)
    reference = StandardTopKOutput(topk.topk_weights.float(), f32.topk_ids, f32.router_logits)
    outs = [make_dispatcher(tp).dispatch(hidden_states=x, topk_output=t) for t in (topk, reference)]
    assert outs[0].origin_topk_weights is topk.topk_weights and outs[0].origin_topk_ids is topk.topk_ids
    n = int((f32.topk_ids >= 0).any(dim=1).sum())
    for field in ("hidden_states", "hidden_states_scale", "topk_ids", "topk_weights"):
        got, want = (getattr(out, field)[:n] for out in outs)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), field


def test_calls_out_of_order_are_refused(tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, seed: int) -> None:
    clean_env.setenv(CAP_VAR, "16")
    d = make_dispatcher(tp)
    x, topk = tokens(4, seed), topk_output(4, 8, seed)
    with pytest.raises(RuntimeError, match="dispatch_a was due"):
        d.dispatch_b()
    d.dispatch_a(hidden_states=x, topk_output=topk)
    with pytest.raises(RuntimeError, match="dispatch_b was due"):
        d.dispatch_a(hidden_states=x, topk_output=topk)
    out = d.dispatch_b()
    with pytest.raises(RuntimeError, match="combine_a was due"):
        d.combine_b()
    d.combine_a(combine_input=combine_input_of(out, torch.zeros(16, HIDDEN, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match="combine_b was due"):
        d.dispatch_a(hidden_states=x, topk_output=topk)
    assert d.combine_b().shape == (4, HIDDEN)


@pytest.mark.parametrize("deepep_mode", [DeepEPMode.NORMAL, DeepEPMode.LOW_LATENCY], ids=lambda m: m.value)
def test_batch_over_the_cap_is_an_error_not_a_silent_zero(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, seed: int, deepep_mode: DeepEPMode
) -> None:
    """sglang#27194: a batch past the buffer capacity must fail loudly, before anything is sent, and
    leave the dispatcher able to run the next batch."""
    clean_env.setenv(CAP_VAR, "16")
    d = make_dispatcher(tp, deepep_mode)
    with pytest.raises(InputError, match=f"17 tokens exceed {CAP_VAR}=16"):
        d.dispatch(hidden_states=tokens(17, seed), topk_output=topk_output(17, 8, seed))
    x, topk = tokens(16, seed, 1), topk_output(16, 8, seed, 1)
    out = d.dispatch(hidden_states=x, topk_output=topk)
    # One rank owns every expert: each kept token comes back once; rows past them are poisoned.
    kept = (topk.topk_ids >= 0).any(dim=1)
    n = int(kept.sum())
    assert out.num_recv_tokens_per_expert.tolist() == [n]
    y = torch.full((16, HIDDEN), float("nan"), dtype=torch.bfloat16)
    y[:n] = torch.randn(n, HIDDEN, generator=generator(seed, 2)).to(torch.bfloat16)
    combined = d.combine(combine_input=combine_input_of(out, y))
    want = torch.zeros(16, HIDDEN, dtype=torch.bfloat16)
    want[kept] = y[:n]
    assert combined.shape == (16, HIDDEN) and torch.equal(combined, want)


def test_non_bf16_activations_are_refused(tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, seed: int) -> None:
    d = make_dispatcher(tp)
    with pytest.raises(ValueError, match=r"bf16 activations, got torch\.float16"):
        d.dispatch(hidden_states=tokens(4, seed).half(), topk_output=topk_output(4, 8, seed))


# ---------------------------------------------------------------------------------------------
# a MoE layer on 2 and 4 gloo ranks against the same layer without expert parallelism
# ---------------------------------------------------------------------------------------------

LAYER_TOKENS = {2: (9, 16), 4: (13, 0, 7, 20)}  # a rank with no tokens takes part too
LAYER_EXPERTS = 8
LAYER_CAP = 24
INTERMEDIATE = 32
DISPATCH_VALUES = {B: "bf16", F8: "fp8", MX8: "mxfp8", F4: "fp4"}
COMBINE_VALUES = {CB: "bf16", CF8: "fp8", CCAST: "fp8_direct_cast"}
LAYER_MODES = {
    "normal": (DeepEPMode.NORMAL, "0"),
    "low_latency": (DeepEPMode.LOW_LATENCY, "0"),
    "split": (DeepEPMode.NORMAL, "1"),
}


class Layer:
    """Router and per-expert SiLU MLPs, in f64 so the only rounding is the one under test."""

    def __init__(self, seed: int) -> None:
        gen = generator(seed, "layer")
        self.gate = torch.randn(HIDDEN, LAYER_EXPERTS, generator=gen)
        self.up = torch.randn(LAYER_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen, dtype=torch.float64) / HIDDEN**0.5
        self.down = torch.randn(LAYER_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen, dtype=torch.float64)
        self.down /= INTERMEDIATE**0.5

    def route(self, x: torch.Tensor, gen: torch.Generator) -> StandardTopKOutput:
        """Softmax top-k of the router logits; ~10% of the slots then dropped (-1), as SGLang masks them."""
        logits = x.float() @ self.gate
        weights, ids = torch.topk(logits.softmax(dim=1), TOPK, dim=1)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.1, -1, ids).to(torch.int32)
        return StandardTopKOutput(weights, ids, logits)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor):
        """Sum over the kept slots of weight * expert(x), and the sum of the terms' magnitudes."""
        out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
        magnitude = torch.zeros_like(out)
        for e in ids[keep].unique().tolist():
            rows, slots = (keep & (ids == e)).nonzero(as_tuple=True)
            h = torch.nn.functional.silu(x[rows].double() @ self.up[e]) @ self.down[e]
            term = weights[rows, slots, None].double() * h
            out.index_add_(0, rows, term)
            magnitude.index_add_(0, rows, term.abs())
        return out, magnitude


def layer_batch(layer: Layer, world_size: int, seed: int, rank: int, step: int, sub: int):
    """Rank ``rank``'s tokens and routing for one (step, micro-batch): every process can rebuild them."""
    gen = generator(seed, world_size, rank, step, sub)
    n = LAYER_TOKENS[world_size][rank] + sub  # the two micro-batches differ in size
    x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
    return x, layer.route(x, gen)


def reference(layer: Layer, x: torch.Tensor, topk: StandardTopKOutput, dispatch: DispatchDtype):
    """The layer on all of a rank's tokens in one process. Activations go through the dispatch format
    first, as a non-EP layer with quantized activations does: the format is per token, so this is the
    same input the experts see in the EP run (``test_formats`` bounds the format's own error)."""
    payload, scales = formats.quantize_dispatch(x, dispatch, torch.float8_e4m3fn)
    activations = formats.dequantize_dispatch(payload, scales, dispatch, HIDDEN)
    ids, weights = topk.topk_ids.long(), topk.topk_weights
    return layer.experts(activations, ids, weights, ids >= 0)


def received_activations(out, dispatch: DispatchDtype, n: int) -> torch.Tensor:
    """Decode the received rows from the fields and dtypes SGLang's MoE runners read."""
    hs, scale = out.hidden_states, out.hidden_states_scale
    if dispatch is DispatchDtype.BF16:
        assert hs.dtype == torch.bfloat16 and hs.shape[1] == HIDDEN and scale is None
        return hs[:n].float()
    if dispatch is DispatchDtype.MXFP4:
        assert hs.dtype == torch.float4_e2m1fn_x2 and hs.shape[1] == HIDDEN // 2
        hs = hs.view(torch.uint8)
    else:
        assert hs.dtype == torch.float8_e4m3fn and hs.shape[1] == HIDDEN
    if dispatch is DispatchDtype.FP8:
        assert scale.dtype == torch.float32 and scale.shape[1] == HIDDEN // 128
    else:
        assert scale.dtype == torch.float8_e8m0fnu and scale.shape[1] == HIDDEN // 32
    return formats.dequantize_dispatch(hs[:n], scale[:n], dispatch, HIDDEN)


def expert_side(layer: Layer, out, mask: torch.Tensor, dispatch: DispatchDtype) -> torch.Tensor:
    """What a runner does with a MoRI dispatch output: this rank's experts (by ``expert_mask_gpu``) on
    the received rows, router weights applied, bf16 out. Rows past the received count are NaN: combine
    must never read them."""
    n = int(out.num_recv_tokens_per_expert.item())
    ids = out.topk_ids[:n].long()
    keep = (ids >= 0) & (mask[ids.clamp(min=0)] == 1)
    y, _ = layer.experts(received_activations(out, dispatch, n), ids, out.topk_weights[:n], keep)
    full = torch.full((out.hidden_states.shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16)
    full[:n] = y.to(torch.bfloat16)
    return full


def error_bound(magnitude: torch.Tensor, combine: CombineDtype, world_size: int) -> torch.Tensor:
    """Largest |EP - reference| per element; ``magnitude`` is the sum of |weight * expert(x)| (S).

    bf16 keeps 8 significant bits, so a rounding moves a value by at most 2^-8 of it. The expert side
    rounds each rank's partial sum to bf16 and combine rounds the total once more: 2^-7 S. An e4m3
    combine (4 significant bits) moves each partial by 2^-4 of it for normals, plus half the subnormal
    step (2^-10) times the block scale (amax / 448, amax <= the block's largest S, grown by the bf16
    rounding) for blockwise, or unscaled for the direct cast; (2^-4 + 2^-6) S covers the relative terms
    of the three roundings. 2^-20 S covers the f32 arithmetic.
    """
    if combine is CombineDtype.BF16:
        return (2.0**-7 + 2.0**-20) * magnitude
    relative = (2.0**-4 + 2.0**-6) * magnitude
    if combine is CombineDtype.FP8_DIRECT_CAST:
        return relative + world_size * 2.0**-10
    blocks = magnitude.view(magnitude.shape[0], HIDDEN // 128, 128).amax(dim=2, keepdim=True)
    block_scale = (1 + 2.0**-7) / 448 * blocks.expand(-1, -1, 128).reshape(magnitude.shape)
    return relative + world_size * 2.0**-10 * block_scale


def check_layer(
    world_size: int,
    mode_name: str,
    seed: int,
    dispatch: DispatchDtype,
    combine: CombineDtype,
    tp,
    bound: CombineDtype | None = None,
) -> None:
    """``bound``: the combine format whose error bound applies (default: ``combine``)."""
    rank = tp.rank_in_group
    deepep_mode = LAYER_MODES[mode_name][0]
    layer = Layer(seed)
    ep = build_with_factory(tp, LAYER_EXPERTS, deepep_mode, tbo=True)
    ep.set_quant_config({"weight_dtype": torch.bfloat16})
    assert [d.dispatch_dtype for d in ep._inners] == [dispatch] * 2
    assert [d.combine_dtype for d in ep._inners] == [combine] * 2
    local = LAYER_EXPERTS // world_size
    mask = ep.expert_mask_gpu
    assert mask.tolist() == [int(e // local == rank) for e in range(LAYER_EXPERTS)]
    output_format = DispatchOutputFormat.DEEPEP_LL if mode_name == "low_latency" else DispatchOutputFormat.DEEPEP_NORMAL
    what = f"{mode_name} dispatch={dispatch.value} combine={combine.value} rank {rank}/{world_size}"

    # step 0: one micro-batch through dispatch() / combine(); step 1: two micro-batches interleaved
    # through the *_a / *_b halves of the two-batch-overlap instances.
    for step, subs in ((0, [0]), (1, [0, 1])):
        batches = [layer_batch(layer, world_size, seed, rank, step, sub) for sub in subs]
        if len(subs) == 1:
            outs = [ep.dispatch(hidden_states=batches[0][0], topk_output=batches[0][1])]
        else:
            for sub, (x, topk) in zip(subs, batches, strict=True):
                ep.dispatch_a(hidden_states=x, topk_output=topk, tbo_subbatch_index=sub)
            outs = [ep.dispatch_b(tbo_subbatch_index=sub) for sub in subs]
        ys = [expert_side(layer, out, mask, dispatch) for out in outs]
        # Read as the experts read them, before the combine: native MoRI v1's combine clears its count.
        counts = [out.num_recv_tokens_per_expert.tolist() for out in outs]
        if len(subs) == 1:
            results = [ep.combine(combine_input=combine_input_of(outs[0], ys[0]))]
        else:
            for sub, out, y in zip(subs, outs, ys, strict=True):
                ep.combine_a(combine_input=combine_input_of(out, y), tbo_subbatch_index=sub)
            results = [ep.combine_b(tbo_subbatch_index=sub) for sub in subs]

        for sub, (x, topk), out, got, count in zip(subs, batches, outs, results, counts, strict=True):
            where = f"{what} step {step} micro-batch {sub}"
            assert out.format is output_format, where
            senders = [layer_batch(layer, world_size, seed, r, step, sub)[1].topk_ids for r in range(world_size)]
            arrivals = sum(int(((ids >= 0) & (ids // local == rank)).any(dim=1).sum()) for ids in senders)
            assert count == [arrivals], where
            want, magnitude = reference(layer, x, topk, dispatch)
            assert got.shape == (x.shape[0], HIDDEN) and got.dtype == torch.bfloat16, where
            excess = (got.double() - want).abs() - error_bound(magnitude, bound or combine, world_size)
            worst = float(excess.max()) if excess.numel() else 0.0
            assert worst <= 0, f"{where}: error exceeds its bound by {worst}"


def _layer_worker(rank: int, world_size: int, seed: int) -> None:
    for name in list(os.environ):
        if name.startswith(("SGLANG_MORI_", "MORI_")) and name != SEED_ENV:
            del os.environ[name]
    os.environ.update([WHOLE_BUFFER])
    os.environ[CAP_VAR] = str(LAYER_CAP)
    load_plugins()
    tp = tp_coordinator(world_size, rank)
    try:
        for mode_name, (_, split) in LAYER_MODES.items():
            os.environ["SGLANG_MORI_SPLIT_DISPATCH_COMBINE"] = split
            for dispatch, combine in [(d, c) for d in DISPATCH_VALUES for c in COMBINE_VALUES]:
                os.environ["SGLANG_MORI_DISPATCH_DTYPE"] = DISPATCH_VALUES[dispatch]
                os.environ["SGLANG_MORI_COMBINE_DTYPE"] = COMBINE_VALUES[combine]
                check_layer(world_size, mode_name, seed, dispatch, combine, tp)
    finally:
        release_shared_ops()


def _mori_layer_worker(rank: int, world_size: int, seed: int) -> None:
    """The same layer through SGLANG_MORI_BACKEND=mori, over the MoRI stand-in (tests/fake_mori)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "fake_mori"))
    for name in list(os.environ):
        if name.startswith(("SGLANG_MORI_", "MORI_")) and name != SEED_ENV:
            del os.environ[name]
    os.environ.update([WHOLE_BUFFER])
    os.environ[CAP_VAR] = str(LAYER_CAP)
    os.environ["SGLANG_MORI_BACKEND"] = "mori"
    load_plugins()
    try:
        _mori_layer_checks(rank, world_size, seed)
    finally:
        release_shared_ops()
        finalize_shmem()


def _mori_layer_checks(rank: int, world_size: int, seed: int) -> None:
    tp = tp_coordinator(world_size, rank)
    for mode_name, (_, split) in LAYER_MODES.items():
        os.environ["SGLANG_MORI_SPLIT_DISPATCH_COMBINE"] = split
        for dispatch, combine in [(B, CB), (F8, CF8), (F4, CCAST)]:
            os.environ["SGLANG_MORI_DISPATCH_DTYPE"] = DISPATCH_VALUES[dispatch]
            os.environ["SGLANG_MORI_COMBINE_DTYPE"] = COMBINE_VALUES[combine]
            # MoRI's blockwise scales only blocks above the fp8 range: below it, the direct cast's bound.
            check_layer(world_size, mode_name, seed, dispatch, combine, tp, bound=combine if combine is CB else CCAST)
    import mori

    ops = mori.ops.EpDispatchCombineOp.instances
    v2_ops = mori.ops.dispatch_combine_v2.EpDispatchCombineOp.instances
    assert ops and v2_ops and all(op.calls for op in ops + v2_ops), "the layer did not run through MoRI"
    kinds = {op.config.kernel_type.name for op in ops}
    assert kinds == {"IntraNode", "AsyncLL"}, kinds  # bf16 intranode took EP v2


def test_moe_layer_through_native_mori_equals_the_layer_without(seed: int, tmp_path: Path) -> None:
    """SGLANG_MORI_BACKEND=mori: SGLang's factory builds our dispatcher over the MoRI provider, and the
    layer matches the one without expert parallelism in every mode."""
    run_gloo(2, _mori_layer_worker, (seed,), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_with_expert_parallelism_equals_the_layer_without(world_size: int, seed: int, tmp_path: Path) -> None:
    """Normal, low-latency and split modes x every dispatch and combine dtype, through SGLang's factory,
    on ``world_size`` gloo ranks (one spawn per world: importing SGLang dominates the cost)."""
    run_gloo(world_size, _layer_worker, (seed,), tmp_path)


def test_the_op_gets_the_coordinators_cpu_group(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op runs over the device group and bootstraps native MoRI's shmem over SGLang's gloo CPU group
    (as SGLang's own MoRI dispatcher registers it), so no group is made from the device group."""
    from mori_sglang.integrations.sglang import dispatcher

    handed: list[tuple] = []
    real = dispatcher.EpDispatchCombineOp

    def make_op(config: EpConfig, group: dist.ProcessGroup, **kwargs: object) -> object:
        handed.append((group, kwargs.get("cpu_group")))
        return real(config, group, **kwargs)

    monkeypatch.setattr(dispatcher, "EpDispatchCombineOp", make_op)
    release_shared_ops()
    d = make_dispatcher(tp, DeepEPMode.AUTO)
    for mode in d._configs:
        d._op(mode)
    assert len(handed) == len(d._configs) >= 1
    assert all(group is tp.device_group and cpu_group is tp.cpu_group for group, cpu_group in handed)


def test_upstreams_manual_recv_cap_is_checked_and_said_not_to_apply(
    tp: GroupCoordinator, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLANG_MORI_MOE_MAX_INPUT_TOKENS drops received rows past it upstream: here a bad value stops the
    launch by name, and a set one is said (once) not to apply; the experts keep the proven bound."""
    from mori_sglang.integrations.sglang import dispatcher

    clean_env.setenv("SGLANG_MORI_MOE_MAX_INPUT_TOKENS", "-1")
    with pytest.raises(EnvError, match="SGLANG_MORI_MOE_MAX_INPUT_TOKENS=-1"):
        env.check_all()
    clean_env.setenv("SGLANG_MORI_MOE_MAX_INPUT_TOKENS", "512")
    env.check_all()
    dispatcher._warn_manual_recv_cap.cache_clear()
    with caplog.at_level("WARNING", logger=dispatcher.__name__):
        make_dispatcher(tp)
        make_dispatcher(tp, instance_id=1)
    warnings = [r for r in caplog.records if "SGLANG_MORI_MOE_MAX_INPUT_TOKENS is not applied" in r.getMessage()]
    assert len(warnings) == 1


SHARED_BOOLEANS = [var.name for var in env.ENV_VARS if var.sglang_default is not None]


@pytest.mark.parametrize("user_value", [None, "0", "1", "on", "OFF", " 1", "y", "N", "True", ""])
@pytest.mark.parametrize("name", SHARED_BOOLEANS)
def test_the_launch_shares_its_booleans_with_sglang(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch, name: str, user_value: str | None
) -> None:
    """SGLang reads SGLANG_MORI_RECV_BOUND (to share attention-DP token counts, which the bound needs
    under CUDA graphs) and SGLANG_MORI_EP_V2 with a parser of its own, which falls back to its default
    on values it does not take (" 1", "on") and, for the bound, with another default (off): after the
    launch both sides read each one alike. An unset SGLANG_MORI_EP_V2 stays unset (SGLang's launcher
    tells an explicit value from none)."""
    from types import SimpleNamespace

    from sglang.srt import environ as sglang_environ
    from sglang.srt.arg_groups import overrides

    assert set(SHARED_BOOLEANS) == {"SGLANG_MORI_RECV_BOUND", "SGLANG_MORI_EP_V2"}
    if user_value is None:
        clean_env.delenv(name, raising=False)
    else:
        clean_env.setenv(name, user_value)
    ours = env.get_bool(name)
    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)
    view = SimpleNamespace(
        moe_a2a_backend="mori", moe_runner_backend="auto", speculative_algorithm=None, deepep_mode="normal"
    )
    monkeypatch.setattr(overrides, "resolved_view", lambda server_args: view)
    seen_by_sglangs_step = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SGLang warns where it cannot read a value
        plugin.check_env_at_launch(
            SimpleNamespace(moe_a2a_backend="mori"),
            lambda server_args: seen_by_sglangs_step.append(getattr(sglang_environ.envs, name).get()),
        )
        assert seen_by_sglangs_step == [ours]  # SGLang's own step (the EP v2 choice) reads ours already
        assert getattr(sglang_environ.envs, name).get() is ours
    assert env.get_bool(name) is ours
    assert (name in os.environ) is (user_value is not None or name == "SGLANG_MORI_RECV_BOUND")


@pytest.mark.parametrize(
    ("backend", "nnodes", "deepep_mode", "graphs_off"),
    [
        ("auto", 2, "normal", True),  # across hosts auto runs torch.distributed
        ("torch", 1, "normal", True),
        ("auto", 2, "low_latency", False),  # the torch provider captures a low-latency dispatch
        ("auto", 1, "normal", False),  # the Triton kernels capture both modes
        ("triton", 1, "normal", False),
    ],
)
def test_the_launch_turns_graphs_off_where_the_dispatch_syncs_with_the_host(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch, backend: str, nnodes: int, deepep_mode: str,
    graphs_off: bool,
) -> None:  # fmt: skip
    """SGLang keeps CUDA graphs on for mori's normal mode; the torch provider (chosen, or auto across
    hosts) reads a normal-mode dispatch's counts on the host, which a graph cannot capture, so the
    launch turns graphs off as SGLang does for DeepEP's normal mode."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import overrides
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, default_cuda_graph_config

    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)
    clean_env.setenv("SGLANG_MORI_BACKEND", backend)
    config = default_cuda_graph_config()
    assert config[Phase.DECODE].backend != Backend.DISABLED
    view = SimpleNamespace(moe_a2a_backend="mori", moe_runner_backend="auto", speculative_algorithm=None,
                           deepep_mode=deepep_mode, nnodes=nnodes, cuda_graph_config=config)  # fmt: skip
    monkeypatch.setattr(overrides, "resolved_view", lambda server_args: view)
    server_args = SimpleNamespace()
    plugin.check_env_at_launch(server_args, lambda server_args: None)
    declared = [fields for _, fields in getattr(server_args, "_resolved_overrides", [])]
    if graphs_off:
        (fields,) = declared
        assert all(fields["cuda_graph_config"][phase].backend == Backend.DISABLED for phase in Phase.ALL)
    else:
        assert declared == []


@pytest.mark.parametrize("raw", ["auto", "triton_kernel"])
def test_a_runner_sglang_picked_for_auto_becomes_triton_and_a_chosen_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch, raw: str
) -> None:
    """SGLang's gpt-oss override turns an auto runner into triton_kernel (before the EP size is set):
    left on auto, mori's launch declares the triton runner its experts run on; asked for by name, the
    runner is refused by name."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import overrides

    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)
    view = SimpleNamespace(moe_a2a_backend="mori", moe_runner_backend="triton_kernel", speculative_algorithm=None,
                           deepep_mode="normal", nnodes=1)  # fmt: skip
    monkeypatch.setattr(overrides, "resolved_view", lambda server_args: view)
    server_args = SimpleNamespace(moe_runner_backend=raw)
    if raw == "auto":
        plugin.check_env_at_launch(server_args, lambda server_args: None)
        assert server_args._resolved_overrides == [("mori_sglang", {"moe_runner_backend": "triton"})]
    else:
        with pytest.raises(ValueError, match=r"^--moe-runner-backend triton_kernel cannot run the experts"):
            plugin.check_env_at_launch(server_args, lambda server_args: None)


def test_the_launch_refuses_a_provider_that_cannot_run_on_the_servers_hosts(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch
) -> None:
    """Triton's arenas are one host's symmetric memory: asked for across hosts, the launch stops with
    the variable's name instead of every worker failing after the weights have loaded."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import overrides

    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)
    clean_env.setenv("SGLANG_MORI_BACKEND", "triton")
    view = SimpleNamespace(moe_a2a_backend="mori", moe_runner_backend="auto", speculative_algorithm=None,
                           deepep_mode="low_latency", nnodes=2)  # fmt: skip
    monkeypatch.setattr(overrides, "resolved_view", lambda server_args: view)
    with pytest.raises(ConfigError, match="SGLANG_MORI_BACKEND=triton runs within one host"):
        plugin.check_env_at_launch(SimpleNamespace(), lambda server_args: None)


def test_launch_checks_cover_drafts_lora_and_the_fused_function_switch(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch
) -> None:
    """A speculative draft's MoE layers run on mori where its a2a flag (or the target's, its default)
    says so, so its runner is checked under its own flag; LoRA and SGLANG_CI_DISABLE_MOE_FUSED_FUNC=1
    turn off the fused function mori's experts run through, so they stop the launch by name."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import overrides

    monkeypatch.setattr(plugin, "aiter_runs_experts", lambda: False)

    def launch(**fields: object) -> None:
        view = SimpleNamespace(
            moe_a2a_backend="mori", moe_runner_backend="auto", speculative_algorithm=None, deepep_mode="normal"
        )
        view.__dict__.update(fields)
        monkeypatch.setattr(overrides, "resolved_view", lambda server_args: view)
        plugin.check_env_at_launch(object(), lambda server_args: None)

    launch()
    launch(moe_a2a_backend="none", moe_runner_backend="deep_gemm", enable_lora=True)  # mori runs nothing
    launch(speculative_algorithm="EAGLE", speculative_moe_runner_backend="triton")
    with pytest.raises(ValueError, match=r"^--speculative-moe-runner-backend deep_gemm cannot run the experts"):
        launch(speculative_algorithm="EAGLE", speculative_moe_runner_backend="deep_gemm")
    with pytest.raises(ValueError, match=r"^--speculative-moe-runner-backend deep_gemm cannot run the experts"):
        launch(
            moe_a2a_backend="none",
            moe_runner_backend="deep_gemm",
            speculative_algorithm="EAGLE",
            speculative_moe_a2a_backend="mori",
        )
    launch(moe_runner_backend="triton", speculative_algorithm="EAGLE", speculative_moe_a2a_backend="none",
           speculative_moe_runner_backend="deep_gemm")  # fmt: skip
    for lora in ({"enable_lora": True}, {"lora_paths": ["adapter"]}):
        with pytest.raises(ValueError, match="which LoRA turns off"):
            launch(**lora)
    clean_env.setenv("SGLANG_CI_DISABLE_MOE_FUSED_FUNC", "1")
    with pytest.raises(ValueError, match=r"^SGLANG_CI_DISABLE_MOE_FUSED_FUNC=1 turns off the fused MoE function"):
        launch()
