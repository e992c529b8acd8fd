"""SGLang general plugin: stock ``--moe-a2a-backend mori`` runs through mori-sglang.

SGLang's ``load_plugins()`` runs every entry point of the group ``sglang.srt.plugins`` (restricted by
``SGLANG_PLUGINS`` where set) early in the launcher and in every worker, then applies the hooks
registered with its ``HookRegistry``. ``register`` adds:

- a class replacement of ``moriep.MoriEPDispatcher`` by ``MoriSglangDispatcher``; the registry also
  rebinds the modules that imported the class by name (the dispatcher package, two-batch overlap), so
  SGLang's own factory builds ours;
- a wrapper around ``ep_moe.layer.get_moe_impl_class``: where SGLang's AITER runner does not run the
  experts (NVIDIA), mori layers are built as ``FusedMoE``, whose quant methods run the Triton runner,
  instead of ``DeepEPMoE``, which reads DeepEP's layouts (upstream does the same for MoRI EPv2);
- the fused function of (mori, triton) in SGLang's ``FusedOpPool`` (``triton_experts``);
- a wrapper around the ``handle_a2a_moe`` resolution step: where mori is asked for, every variable we
  read is parsed first, so a bad value stops the launch with its name instead of failing later in a
  worker, and the booleans SGLang reads too are written as 1 or 0, our reading, before SGLang's step
  reads them (``share_booleans_with_sglang``); then SGLang's checks run (the chunked prefill size
  against ``SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` among them), then ours: the MoE runner
  backend is checked, and the provider is resolved for the servers' hosts (a choice that cannot run
  there stops the launch, and the torch provider's host-synchronised normal mode turns CUDA graphs
  off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mori_sglang import env
from mori_sglang.config import Provider

logger = logging.getLogger(__name__)

DISPATCHER_TARGET = "sglang.srt.layers.moe.token_dispatcher.moriep.MoriEPDispatcher"
MOE_CLASS_TARGET = "sglang.srt.layers.moe.ep_moe.layer.get_moe_impl_class"
A2A_RESOLUTION_STEP = "handle_a2a_moe"
# The --moe-runner-backend values whose experts consume our dispatch outputs where AITER does not run
# them: auto resolves to triton for mori layers (deep_gemm only for the DeepEP-family backends).
TRITON_RUNNER_BACKENDS = ("auto", "triton")
# Quantizations whose FusedMoE quant method hands MoRI's dispatch output to the Triton runner as it is
# (None: unquantized). The others read ``dispatch_output.topk_output``, a field of SGLang's standard
# dispatch output that MoRI's outputs lack, or run their own kernels (w8a8_int8, modelopt_*, mxfp4,
# compressed_tensors' MoE schemes, gguf, bitsandbytes, w4afp8, quark...).
TRITON_QUANTIZATIONS = ("fp8", "w8a8_fp8", "blockwise_int8", "moe_wna16")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from mori_sglang.integrations.sglang import triton_experts
    from mori_sglang.integrations.sglang.dispatcher import MoriSglangDispatcher

    HookRegistry.register(DISPATCHER_TARGET, MoriSglangDispatcher, HookType.REPLACE)
    HookRegistry.register(MOE_CLASS_TARGET, moe_impl_class, HookType.AROUND)
    triton_experts.register()
    register_resolution_hook(A2A_RESOLUTION_STEP)(check_env_at_launch)


def aiter_runs_experts() -> bool:
    """Whether SGLang runs MoE experts with AITER (ROCm with ``SGLANG_USE_AITER``): its runner reads
    MoRI's outputs in ``DeepEPMoE``; everywhere else our Triton fused function does, in ``FusedMoE``."""
    from sglang.srt.utils import get_bool_env_var, is_hip

    return is_hip() and get_bool_env_var("SGLANG_USE_AITER")


def moe_impl_class(original: Callable[[Any], type], quant_config: Any) -> type:
    """``get_moe_impl_class`` wrapper: ``FusedMoE`` for mori layers unless AITER runs the experts; a
    quantization whose MoE method cannot take MoRI's outputs is refused here, when the model is built,
    rather than at its first forward."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    if get_moe_a2a_backend().is_mori() and not aiter_runs_experts():
        check_quantization(quant_config)
        return FusedMoE
    return original(quant_config)


def check_quantization(quant_config: Any) -> None:
    """Only the quant methods of ``TRITON_QUANTIZATIONS`` (and unquantized experts) run MoRI's outputs."""
    if quant_config is None:
        return
    name = quant_config.get_name()
    if name not in TRITON_QUANTIZATIONS:
        raise ValueError(
            f"--moe-a2a-backend mori cannot run the MoE layers of a {name} checkpoint on this platform: its "
            f"quant method reads SGLang's standard dispatch output or runs kernels of its own; mori runs "
            f"unquantized and {', '.join(TRITON_QUANTIZATIONS)} MoE layers (use another --moe-a2a-backend)"
        )


def check_env_at_launch(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution step wrapper: SGLang's own a2a checks, then ours where mori runs the target's MoE
    layers or a speculative draft's (``--speculative-moe-*`` default to the target's)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    asked = (getattr(server_args, "moe_a2a_backend", None), getattr(server_args, "speculative_moe_a2a_backend", None))
    shared = "mori" in asked
    if shared:  # before SGLang's step reads SGLANG_MORI_EP_V2 (and later steps the bound)
        env.check_all()  # every variable, before any model loads
        share_booleans_with_sglang()
    previous(server_args)
    view = resolved_view(server_args)
    runners = {}
    if view.moe_a2a_backend == "mori":
        runners["--moe-runner-backend"] = view.moe_runner_backend
    if getattr(view, "speculative_algorithm", None):
        draft_a2a = getattr(view, "speculative_moe_a2a_backend", None) or view.moe_a2a_backend
        if draft_a2a == "mori":
            draft_runner = getattr(view, "speculative_moe_runner_backend", None) or view.moe_runner_backend
            runners["--speculative-moe-runner-backend"] = draft_runner
    if not runners:
        return
    if not shared:  # resolution, not the flags, chose mori (a draft's default)
        env.check_all()
        share_booleans_with_sglang()
    if view.moe_a2a_backend == "mori" and launch_provider(view) is Provider.TORCH:
        keep_graphs_off_a_host_synced_dispatch(server_args, view)
    if aiter_runs_experts():
        return
    if "--moe-runner-backend" in runners and take_triton_runner_for_auto(server_args, view):
        runners["--moe-runner-backend"] = "triton"
    for flag, runner_backend in runners.items():
        check_runner_backend(runner_backend, flag)
    check_fused_function_runs(view)


def launch_provider(view: Any) -> Provider:
    """The provider the servers' ops will resolve to (``SGLANG_MORI_BACKEND`` on the servers' GPUs over
    ``--nnodes`` hosts): a choice that cannot run there stops the launch, naming the variable."""
    from mori_sglang.providers import resolve_provider

    requested = Provider(env.get_choice("SGLANG_MORI_BACKEND"))
    return resolve_provider(requested, torch.device("cuda"), hosts=lambda: getattr(view, "nnodes", 1) or 1)


def keep_graphs_off_a_host_synced_dispatch(server_args: Any, view: Any) -> None:
    """Where the torch provider runs (across hosts, or chosen), it reads each normal-mode dispatch's
    counts on the host, which no CUDA graph can capture: SGLang keeps graphs on for mori's normal mode,
    so they are turned off here, as SGLang does itself for DeepEP's normal mode
    (``--deepep-mode low_latency`` captures)."""
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    if view.deepep_mode != "normal":
        return
    config = view.cuda_graph_config
    if all(config[phase].backend == Backend.DISABLED for phase in Phase.ALL):
        return
    logger.warning(
        "CUDA graphs are disabled: --moe-a2a-backend mori runs torch.distributed here (%s), whose normal-mode "
        "dispatch synchronises with the host; --deepep-mode low_latency keeps decode graphs",
        "SGLANG_MORI_BACKEND=torch" if env.get_choice("SGLANG_MORI_BACKEND") == "torch" else "ranks on several hosts",
    )
    for phase in Phase.ALL:
        config = with_phase(config, phase, backend=Backend.DISABLED)
    declare_resolution(server_args, "mori_sglang", cuda_graph_config=config)


def take_triton_runner_for_auto(server_args: Any, view: Any) -> bool:
    """Where the user left ``--moe-runner-backend`` on auto and SGLang's model overrides picked a runner
    that cannot take mori's outputs (gpt-oss: ``triton_kernel``, chosen before the EP size is set),
    declare the Triton runner instead, as auto means for mori layers. True where it did."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    if getattr(server_args, "moe_runner_backend", None) != "auto" or view.moe_runner_backend in TRITON_RUNNER_BACKENDS:
        return False
    logger.warning(
        "--moe-runner-backend: SGLang picked %s for this model; --moe-a2a-backend mori runs its experts on the "
        "triton runner",
        view.moe_runner_backend,
    )
    declare_resolution(server_args, "mori_sglang", moe_runner_backend="triton")
    return True


def share_booleans_with_sglang() -> None:
    """Write each boolean SGLang reads too (``EnvVar.sglang_default``) as 1 or 0, our reading of it,
    for the servers' processes, so that both sides read one value. SGLang's parser falls back to its
    default, with a warning, on a value it does not take (" 1", "on"), and for
    ``SGLANG_MORI_RECV_BOUND`` its default (off) is not ours (on): it decides there whether
    attention-DP ranks share their token counts and capture graphs for one bucket, and without those
    counts the dispatcher's bound is unproven. An unset variable whose default SGLang shares stays
    unset: SGLang tells an explicit ``SGLANG_MORI_EP_V2`` from none (its launcher writes it)."""
    for var in env.ENV_VARS:
        if var.sglang_default is None:
            continue
        if env.is_set(var.name) or var.default != var.sglang_default:
            os.environ[var.name] = "1" if env.get_bool(var.name) else "0"


def check_fused_function_runs(view: Any, environ: Mapping[str, str] | None = None) -> None:
    """SGLang's MoE runner skips the fused function that runs mori's experts under LoRA and with
    ``SGLANG_CI_DISABLE_MOE_FUSED_FUNC=1``, and has no other path for MoRI's outputs."""
    environ = os.environ if environ is None else environ
    if getattr(view, "enable_lora", None) or getattr(view, "lora_paths", None):
        raise ValueError(
            "--moe-a2a-backend mori runs its experts through SGLang's fused MoE function, which LoRA turns off "
            "(--enable-lora / --lora-paths): serve LoRA adapters with another --moe-a2a-backend"
        )
    if environ.get("SGLANG_CI_DISABLE_MOE_FUSED_FUNC", "0") == "1":
        raise ValueError(
            "SGLANG_CI_DISABLE_MOE_FUSED_FUNC=1 turns off the fused MoE function that runs the experts of "
            "--moe-a2a-backend mori; unset it"
        )


def check_runner_backend(runner_backend: str, flag: str = "--moe-runner-backend") -> None:
    """Only the Triton runner consumes our dispatch outputs where AITER does not run the experts."""
    if runner_backend not in TRITON_RUNNER_BACKENDS:
        accepted = " or ".join(TRITON_RUNNER_BACKENDS)
        raise ValueError(
            f"{flag} {runner_backend} cannot run the experts of --moe-a2a-backend mori "
            f"on this platform; use {flag} {accepted} (left on auto, the triton runner is taken; MXFP4 "
            "checkpoints such as gpt-oss's run kernels of their own, which mori cannot feed here: serve those "
            "with another --moe-a2a-backend)"
        )
