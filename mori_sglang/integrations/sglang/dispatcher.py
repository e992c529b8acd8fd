"""``MoriSglangDispatcher``: SGLang's MoRI dispatcher contract on top of ``EpDispatchCombineOp``.

SGLang builds one dispatcher per MoE layer (two under two-batch overlap, told apart by
``instance_id``) with the keywords of its ``create_moe_dispatcher`` factory, and calls it by keyword:
``dispatch`` is ``dispatch_a``, the registered dispatch hooks, then ``dispatch_b``; ``combine`` is
``combine_a`` then ``combine_b``. The outputs are SGLang's own ``MoriEPNormalDispatchOutput`` /
``MoriEPLLDispatchOutput``, so its MoE runners read them unchanged: received rows compact from row 0,
global top-k ids (``expert_mask_gpu`` marks this rank's experts), the received-row count in
``num_recv_tokens_per_expert``, router weights applied by the expert side, and combine summing the
returned rows without weighting.

Dtypes, buffer capacity, split combine and the provider come from the ``SGLANG_MORI_*`` variables
through ``EpConfig.from_env``; ``set_quant_config`` lets the MoE weight dtype pick the dispatch and
combine dtypes as upstream does.

Unless ``SGLANG_MORI_RECV_BOUND=0`` (and never under two-batch overlap, as upstream), the output's
``recv_cap`` is upstream's host bound on the received rows, from the batch sizes SGLang already knows,
so the expert side sorts and multiplies no more rows than can have arrived; and while SGLang records
the expert distribution (``--enable-eplb``, ``--expert-distribution-recorder-mode``) each dispatch
reports this rank's per-expert counts, computed on the device, to its recorder.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
from sglang.srt.layers.dp_attention import get_dp_global_num_tokens, get_is_extend_in_batch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher, CombineInput
from sglang.srt.layers.moe.token_dispatcher.moriep import (
    MoriEPLLDispatchOutput,
    MoriEPNormalDispatchOutput,
    MoriEPPDispatchHooks,
    mori_recv_bound,
    round_logical_recv_rows,
)
from sglang.srt.layers.moe.utils import DeepEPMode, is_tbo_enabled
from sglang.srt.runtime_context import get_exec

from mori_sglang import env
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig
from mori_sglang.integrations import current_device
from mori_sglang.integrations.sglang.expert_input import expert_rows, local_expert_counts, local_expert_ids
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import CombineHandle, DispatchOutput

logger = logging.getLogger(__name__)

# How SGLang's runners expect the received scale rows: f32 per 128 elements for fp8, one e8m0 byte
# per 32 elements for the MX formats.
_SCALE_DTYPES = {
    DispatchDtype.FP8: torch.float32,
    DispatchDtype.MXFP8: torch.float8_e8m0fnu,
    DispatchDtype.MXFP4: torch.float8_e8m0fnu,
}
_CONCRETE_MODES = (DeepEPMode.NORMAL, DeepEPMode.LOW_LATENCY)


class _Stage(enum.Enum):
    INITIAL = enum.auto()
    AFTER_DISPATCH_A = enum.auto()
    AFTER_DISPATCH_B = enum.auto()
    AFTER_COMBINE_A = enum.auto()


_NEXT_CALL = {
    _Stage.INITIAL: "dispatch_a",
    _Stage.AFTER_DISPATCH_A: "dispatch_b",
    _Stage.AFTER_DISPATCH_B: "combine_a",
    _Stage.AFTER_COMBINE_A: "combine_b",
}


@dataclass
class _InFlight:
    """One batch between ``dispatch_a`` and ``combine_b``."""

    mode: DeepEPMode
    op: EpDispatchCombineOp
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    out_dtype: torch.dtype
    sender_rows: tuple[int, ...] | None = None
    handle: CombineHandle | None = None


@functools.cache
def _shared_op(
    config: EpConfig,
    group: dist.ProcessGroup,
    cpu_group: dist.ProcessGroup | None,
    device: torch.device,
    instance_id: int,
) -> EpDispatchCombineOp:
    """One op per distinct config, group and two-batch-overlap instance, shared by every layer.

    Layers run one after another and each dispatcher keeps its own combine handle; an op holds state
    only between a send and its receive, which never straddles another layer's call on the same
    instance. Sharing keeps the buffers at one set per instance instead of one per layer.
    """
    op = EpDispatchCombineOp(config, group, device=device, cpu_group=cpu_group)
    logger.info(
        "mori-sglang op: rank %d/%d mode=%s dispatch=%s combine=%s provider=%s max_tokens=%d instance=%d",
        config.rank,
        config.world_size,
        config.mode.value,
        config.dispatch_dtype.value,
        config.combine_dtype.value,
        op.provider_kind.value,
        config.max_tokens_per_rank,
        instance_id,
    )
    return op


def release_shared_ops() -> None:
    """Forget the ops the dispatchers share. Each holds its process group and buffers for as long as it
    is shared; a process that tears its groups down (``destroy_process_group``) calls this first, so
    that no group outlives its destruction with its worker threads (gloo's would still run into the
    interpreter's exit) and the buffers go with the groups. Dispatchers built afterwards build anew."""
    _shared_op.cache_clear()


def _process_group(group: Any) -> dist.ProcessGroup:
    """SGLang hands the MoRI dispatcher its tp GroupCoordinator; the op wants the device group."""
    if isinstance(group, dist.ProcessGroup):
        return group
    device_group = getattr(group, "device_group", None)
    if isinstance(device_group, dist.ProcessGroup):
        return device_group
    raise TypeError(f"group must be a ProcessGroup or have a device_group ProcessGroup, got {type(group).__name__}")


def _cpu_group(group: Any) -> dist.ProcessGroup | None:
    """The GroupCoordinator's gloo group, for native MoRI's shmem bootstrap (as SGLang's own MoRI
    dispatcher registers it); None for a bare ProcessGroup."""
    cpu_group = getattr(group, "cpu_group", None)
    return cpu_group if isinstance(cpu_group, dist.ProcessGroup) else None


class MoriSglangDispatcher(BaseDispatcher):
    """Drop-in for SGLang's ``MoriEPDispatcher`` (same keywords, calls, stages and outputs).

    Every mode sends in ``*_a`` and receives in ``*_b``, so compute SGLang places between the two (the
    other micro-batch under two-batch overlap) overlaps the transfer. ``deepep_mode`` normal exchanges
    exactly the copies (intranode mode), or, under ``SGLANG_MORI_SPLIT_DISPATCH_COMBINE=1``, dispatches
    that way and combines through fixed slots (split mode); low_latency uses fixed per-source slots both
    ways; auto picks normal for batches with prefill and low_latency otherwise. Keywords other than
    upstream's are accepted and ignored: SGLang passes its factory's keywords to every backend.
    """

    def __init__(
        self,
        group: Any,
        router_topk: int,
        permute_fusion: bool = False,
        num_experts: int | None = None,
        num_local_experts: int | None = None,
        hidden_size: int | None = None,
        params_dtype: torch.dtype | None = None,
        deepep_mode: DeepEPMode = DeepEPMode.AUTO,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        instance_id: int = 0,
        **ignored: Any,
    ) -> None:
        super().__init__()
        if num_experts is None or num_local_experts is None or hidden_size is None:
            raise TypeError("MoriSglangDispatcher needs num_experts, num_local_experts and hidden_size")
        if ignored:
            logger.debug("MoriSglangDispatcher ignores keywords %s", sorted(ignored))
        self.group = group
        self.router_topk = router_topk
        self.permute_fusion = permute_fusion
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.deepep_mode = deepep_mode
        self.async_finish = async_finish
        self.return_recv_hook = return_recv_hook
        self.instance_id = instance_id

        self.process_group = _process_group(group)
        self.cpu_group = _cpu_group(group)
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.device = current_device()
        self._weight_dtype: torch.dtype | None = None
        # Built now so a bad SGLANG_MORI_* value fails when the model is built, naming the variable.
        self._configs = self._build_configs()
        local = next(iter(self._configs.values())).num_local_experts
        if local != num_local_experts:
            raise ConfigError(
                f"num_local_experts={num_local_experts} but {num_experts} experts over {self.world_size} "
                f"ranks give {local} per rank"
            )
        self.expert_mask_gpu = torch.zeros(num_experts, dtype=torch.int32, device=self.device)
        self.expert_mask_gpu[self.rank * local : (self.rank + 1) * local] = 1

        self._stage = _Stage.INITIAL
        self._flight: _InFlight | None = None
        self._deepep_dispatch_hooks = MoriEPPDispatchHooks()
        # Never under two-batch overlap, as upstream: the bound comes from per-batch sizes that it splits.
        self._bound_recv = env.get_bool("SGLANG_MORI_RECV_BOUND") and not is_tbo_enabled()
        if env.get_int("SGLANG_MORI_MOE_MAX_INPUT_TOKENS"):
            _warn_manual_recv_cap()

    # -- configuration --------------------------------------------------------------------------

    def _build_configs(self) -> dict[DeepEPMode, EpConfig]:
        modes = [m for m in _CONCRETE_MODES if self.deepep_mode in (m, DeepEPMode.AUTO)]
        return {
            mode: EpConfig.from_env(
                world_size=self.world_size,
                rank=self.rank,
                hidden=self.hidden_size,
                num_experts=self.num_experts,
                topk=self.router_topk,
                weight_dtype=self._weight_dtype,
                low_latency=mode is DeepEPMode.LOW_LATENCY,
            )
            for mode in modes
        }

    @property
    def dispatch_dtype(self) -> DispatchDtype:
        return next(iter(self._configs.values())).dispatch_dtype

    @property
    def combine_dtype(self) -> CombineDtype:
        return next(iter(self._configs.values())).combine_dtype

    def config(self, mode: DeepEPMode) -> EpConfig:
        """The op configuration used for batches resolved to ``mode`` (normal or low_latency)."""
        return self._configs[mode]

    def set_quant_config(self, quant_config: dict) -> None:
        """The MoE weight dtype picks the dtypes (``config.dtypes_from_env``: fp8 weights, fp8 dispatch;
        fp4 weights, fp4 dispatch), the env overrides them. The ops are built here, while the model loads,
        rather than on the first batch, which may already run under CUDA graph capture."""
        super().set_quant_config(quant_config)
        self._weight_dtype = quant_config.get("weight_dtype")
        self._configs = self._build_configs()
        for mode in self._configs:
            self._op(mode)

    def _op(self, mode: DeepEPMode) -> EpDispatchCombineOp:
        return _shared_op(self._configs[mode], self.process_group, self.cpu_group, self.device, self.instance_id)

    def _resolve_mode(self) -> DeepEPMode:
        return self.deepep_mode.resolve(get_is_extend_in_batch())

    def _expect(self, stage: _Stage, call: str) -> None:
        if self._stage is not stage:
            raise RuntimeError(
                f"{call} called when {_NEXT_CALL[self._stage]} was due; the order is "
                "dispatch_a, dispatch_b, combine_a, combine_b"
            )

    # -- dispatch -------------------------------------------------------------------------------

    def dispatch(
        self, hidden_states: torch.Tensor, topk_output: Any
    ) -> MoriEPNormalDispatchOutput | MoriEPLLDispatchOutput:
        self.dispatch_a(hidden_states=hidden_states, topk_output=topk_output)
        self._deepep_dispatch_hooks(self)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: Any) -> None:
        """Checks the batch and starts sending it; compute placed before ``dispatch_b`` overlaps the
        transfer. A batch over ``SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` is refused here, before
        anything is sent, and leaves the dispatcher ready for the next batch."""
        self._expect(_Stage.INITIAL, "dispatch_a")
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(
                f"mori-sglang dispatches bf16 activations, got {hidden_states.dtype}; "
                "serve the model with --dtype bfloat16"
            )
        mode = self._resolve_mode()
        op = self._op(mode)
        # The router's tensors as they are (the op reads f32 or 16-bit weights and int32 or int64 ids
        # without a conversion): no copy per step, and origin_topk_* are the router's, as upstream's.
        weights, ids = topk_output.topk_weights, topk_output.topk_ids
        op.dispatch_send(hidden_states, weights, None, ids)
        self._num_tokens = hidden_states.shape[0]
        sender_rows = _sender_rows() if self._bound_recv else None
        self._flight = _InFlight(mode, op, weights, ids, hidden_states.dtype, sender_rows)
        self._stage = _Stage.AFTER_DISPATCH_A

    def dispatch_b(self) -> MoriEPNormalDispatchOutput | MoriEPLLDispatchOutput:
        self._expect(_Stage.AFTER_DISPATCH_A, "dispatch_b")
        flight = self._flight
        assert flight is not None
        out = flight.op.dispatch_recv()
        flight.handle = out.handle
        self._stage = _Stage.AFTER_DISPATCH_B
        recv_cap = self._recv_cap(flight, out.tokens.shape[0])
        if _recording_expert_distribution():
            self._record_expert_counts(out, expert_rows(out.tokens.shape[0], recv_cap))
        return _sglang_output(out, flight, recv_cap)

    def _recv_cap(self, flight: _InFlight, capacity: int) -> int:
        """Upstream's logical receive cap: a bound on the received rows (0: offer the whole buffer).

        Every received row is one source token (a token sends one row to each destination rank), so
        the tokens of all senders bound it; SGLang's ``mori_recv_bound`` proves that sum from its batch
        metadata, or returns 0 where it cannot."""
        if not self._bound_recv:
            return 0
        bound = mori_recv_bound(flight.topk_ids.shape[0], flight.sender_rows)
        if bound <= 0:
            return 0
        cap = round_logical_recv_rows(bound, pow2_buckets=False)
        return cap if cap < capacity else 0

    def _record_expert_counts(self, out: DispatchOutput, rows: int) -> None:
        """This rank's received (token, expert) pairs per local expert, to SGLang's recorder; ``rows``:
        the rows the experts get, which hold every received one (a decode batch's bound, not the whole
        buffer, so that counting costs what the experts' own sort does)."""
        first = self.rank * self.num_local_experts
        ids = local_expert_ids(out.topk_ids[:rows], out.num_recv, first, self.num_local_experts)
        counts = local_expert_counts(ids, self.num_local_experts)
        # The recorder counts routed experts only: drop a fused shared expert's slot after them.
        routed = get_global_expert_location_metadata().num_local_physical_experts
        get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(counts[:routed])

    # -- combine --------------------------------------------------------------------------------

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        self.combine_a(combine_input=combine_input)
        hidden_states = self.combine_b()
        return hidden_states[: self._num_tokens]

    def combine_a(self, combine_input: CombineInput) -> None:
        """Starts returning ``combine_input.hidden_states``: the expert outputs, one row per received row
        (rows past the received count are ignored), router weights already applied."""
        self._expect(_Stage.AFTER_DISPATCH_B, "combine_a")
        flight = self._flight
        assert flight is not None and flight.handle is not None
        flight.op.combine_send(combine_input.hidden_states, flight.handle)
        self._stage = _Stage.AFTER_COMBINE_A

    def combine_b(self) -> torch.Tensor:
        self._expect(_Stage.AFTER_COMBINE_A, "combine_b")
        flight = self._flight
        assert flight is not None
        combined = flight.op.combine_recv()
        self._flight = None
        self._stage = _Stage.INITIAL
        return combined

    def register_deepep_dispatch_hook(self, hook: Any) -> Any:
        """``hook(dispatcher)`` runs inside ``dispatch`` between ``dispatch_a`` and ``dispatch_b``."""
        return self._deepep_dispatch_hooks.register_hook(hook)


@functools.cache
def _warn_manual_recv_cap() -> None:
    logger.warning(
        "SGLANG_MORI_MOE_MAX_INPUT_TOKENS is not applied by mori-sglang: a manual cap below the received rows "
        "would drop tokens unseen; the experts get SGLang's proven bound (SGLANG_MORI_RECV_BOUND) or the "
        "whole receive buffer"
    )


def _recording_expert_distribution() -> bool:
    """Upstream's rule: count while the recorder records; under CUDA graph capture, count wherever a
    recorder is configured, so that a replay counts once recording starts."""
    if get_global_expert_distribution_recorder().recording:
        return True
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return capturing and get_exec().moe.expert_distribution_recorder_mode is not None


def _sender_rows() -> tuple[int, ...] | None:
    """Tokens per attention-DP rank of this batch, where SGLang holds them as host ints (upstream's
    snapshot: anything else would need a device sync)."""
    rows = get_dp_global_num_tokens()
    if not isinstance(rows, list | tuple) or not all(isinstance(r, int) for r in rows):
        return None
    return tuple(rows)


def _sglang_output(
    out: DispatchOutput, flight: _InFlight, recv_cap: int
) -> MoriEPNormalDispatchOutput | MoriEPLLDispatchOutput:
    """The op's receive buffers in the dtypes and shapes SGLang's runners read."""
    dispatch_dtype = flight.op.config.dispatch_dtype
    tokens = out.tokens
    if dispatch_dtype is DispatchDtype.MXFP4:
        tokens = tokens.view(torch.float4_e2m1fn_x2)
    scale_dtype = _SCALE_DTYPES.get(dispatch_dtype)
    scales = None if scale_dtype is None else out.recv_scales(scale_dtype)
    output_class = MoriEPLLDispatchOutput if flight.mode is DeepEPMode.LOW_LATENCY else MoriEPNormalDispatchOutput
    return output_class(
        hidden_states=tokens,
        hidden_states_scale=scales,
        topk_ids=out.topk_ids,
        topk_weights=out.topk_weights,
        num_recv_tokens_per_expert=out.num_recv,
        origin_topk_ids=flight.topk_ids,
        origin_topk_weights=flight.topk_weights,
        out_dtype=flight.out_dtype,
        recv_cap=recv_cap,
    )
