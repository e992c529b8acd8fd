"""The op API: one object per rank, shaped after MoRI's ``EpDispatchCombineOp``.

It checks every input before anything is sent (a bad batch is an error, never a silent wrong result
or a hang), quantizes bf16 tokens to the dispatch dtype once on the sender, and hands the wire work
to a provider.
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.distributed as dist

from mori_sglang import env, formats
from mori_sglang.checks import (
    check_capacity,
    check_devices,
    check_dispatch_dtypes,
    check_dispatch_shapes,
    check_expert_ids_on_host,
    check_expert_outputs,
    check_outputs_cover_received,
    check_tokens_the_op_quantizes,
    input_signature,
)
from mori_sglang.config import ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.device_wait import wait_for_device
from mori_sglang.exchange import LoopbackHub
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.providers import group_hosts, ranks_per_host, resolve_provider
from mori_sglang.providers.base import ProviderSetup
from mori_sglang.providers.registry import build_provider
from mori_sglang.types import CombineHandle, DispatchOutput, InputError

_OP_IDENTS = itertools.count(1)
logger = logging.getLogger(__name__)


class EpDispatchCombineOp:
    """Dispatch/combine for one rank of an expert-parallel group.

    ``group``: a torch.distributed ProcessGroup (default: the world group). ``cpu_group``: a gloo group
    over the same ranks, for host-side bootstraps (SGLang's and vLLM's CPU group; default: one made from
    ``group`` where a provider needs it). ``loopback``: a LoopbackHub shared by the ops of a one-process
    world (see ``LoopbackWorld``).
    """

    def __init__(
        self,
        config: EpConfig,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        loopback: LoopbackHub | None = None,
        cpu_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.ident = next(_OP_IDENTS)  # stamped on every handle this op's dispatches make
        self._dispatches = 0
        self.device = _normalize_device(device)
        self.fp8_dtype = config.fp8_dtype or formats.fp8_dtype_for_device(self.device)
        env.check_all()
        self.provider_kind = resolve_provider(
            config.provider,
            self.device,
            real_ranks=loopback is None,
            hosts=lambda: group_hosts(cpu_group or group, self.device),
        )
        _warn_ignored_env(self.provider_kind.value, tuple(env.ignored_by_provider(self.provider_kind.value)))
        if loopback is not None and loopback.world_size != config.world_size:
            raise ConfigError(f"loopback world of {loopback.world_size} ranks, config says {config.world_size}")
        self.token_bytes = formats.dispatch_token_bytes(config.dispatch_dtype, config.hidden)
        # The scale row the format makes when the op quantizes (checked per dispatch of bf16 tokens).
        self._format_scale_bytes = formats.dispatch_scale_bytes(config.dispatch_dtype, config.hidden)
        self.scale_bytes = config.scale_bytes if config.scale_bytes is not None else self._format_scale_bytes
        self.layout = formats.DispatchRowLayout(self.token_bytes, self.scale_bytes, config.topk)
        self.payload_dtype = formats.dispatch_payload_dtype(config.dispatch_dtype, self.fp8_dtype)
        # Native MoRI picks its kernels by the ranks' hosts (a collective: every rank builds its op).
        host_ranks = None
        if self.provider_kind is Provider.MORI and loopback is None:
            host_ranks = ranks_per_host(cpu_group or group, self.device)
        setup = ProviderSetup(
            config, self.device, self.fp8_dtype, self.layout, self.payload_dtype, group, loopback, cpu_group, host_ranks
        )
        # The op's buffers are normal tensors even when it is built under torch.inference_mode() (a server
        # may build it inside its first forward): tensors made there could not be updated outside it.
        with torch.inference_mode(False):
            self.provider = build_provider(self.provider_kind, setup)
        # A send not yet received, per kind ("dispatch", "combine"): a second send would overwrite it.
        self._in_flight = {"dispatch": False, "combine": False}
        self._closed = False
        # The input signatures (``input_signature``) that last passed the shape, dtype and device checks.
        self._checked_dispatch: tuple | None = None
        self._checked_combine: tuple | None = None
        self._ids_checked_on_host = self.device.type not in self.provider.capabilities.id_checks_on_device
        # Whether bf16 tokens are quantized by the provider's send, decided once: the per-step host path
        # stays short. (The op quantizes bf16 tokens only into the format's own scale row, without scales
        # from the caller: check_tokens_the_op_quantizes.)
        self._quantize_in_send = (
            config.dispatch_dtype is not DispatchDtype.BF16
            and config.dispatch_dtype in self.provider.capabilities.fused_quantization
        )

    # -- properties callers size their buffers with ---------------------------------------------

    @property
    def max_recv_tokens(self) -> int:
        return self.provider.max_recv_tokens

    def scale_stride_bytes(self) -> int:
        return self.layout.scale_stride

    def set_kernel_tuning(self, tuning: KernelTuning) -> None:
        """Launch the provider's Triton kernels with ``tuning`` (tiles, warps, programs) from the next call
        on: for benchmarks and tuning sweeps. A provider without kernels of ours raises ConfigError."""
        self.provider.set_kernel_tuning(tuning)

    # -- checks ---------------------------------------------------------------------------------

    def _check_dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor
    ) -> None:
        signature = input_signature(x, weights, scales, ids)
        if signature != self._checked_dispatch:
            check_dispatch_shapes(self.config, self.layout, x, weights, scales, ids)
            check_capacity(self.config, x.shape[0])
            check_dispatch_dtypes(self.config, self.layout, self.payload_dtype, x, weights, scales, ids)
            check_tokens_the_op_quantizes(self.config, self.layout, self._format_scale_bytes, x, scales)
            check_devices(self.device, tokens=x, topk_weights=weights, topk_ids=ids, scales=scales)
            self._checked_dispatch = signature
        if self._ids_checked_on_host:
            check_expert_ids_on_host(self.config, ids)

    @staticmethod
    def _closed_error(call: str) -> RuntimeError:
        return RuntimeError(f"{call} on a closed op: build a new EpDispatchCombineOp")

    def _start_send(self, kind: str) -> None:
        """Refuse a send while this op's previous send of the same kind is not received: the provider
        keeps one send of each kind, so the new batch would replace the old one unseen (its tokens lost,
        its receive returning the new batch)."""
        if self._closed:
            raise self._closed_error(f"{kind}_send")
        if self._in_flight[kind]:
            raise RuntimeError(
                f"{kind}_send called again before {kind}_recv received the previous {kind}_send: receive each "
                "send once, in order (give overlapping batches an op each)"
            )

    # -- dispatch -------------------------------------------------------------------------------

    def dispatch_send(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        scales: torch.Tensor | None,
        topk_ids: torch.Tensor,
    ) -> None:
        """Start sending each token to the distinct ranks among its top-k experts."""
        self._start_send("dispatch")
        if self._in_flight["combine"] and not self.provider.capabilities.keeps_old_handles:
            raise RuntimeError(
                "dispatch_send called while a combine_send is not yet received: call combine_recv first (the "
                f"{self.provider_kind.value} provider's dispatch reuses the routing that combine reads), or give "
                "overlapping batches an op each"
            )
        self._check_dispatch(x, topk_weights, scales, topk_ids)
        self._send_dispatch(x, topk_weights, scales, topk_ids)
        self._dispatches += 1  # after the send: a dispatch the provider refused leaves the last handle valid
        self._in_flight["dispatch"] = True

    def _send_dispatch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, scales: torch.Tensor | None, topk_ids: torch.Tensor
    ) -> None:
        """Hand checked inputs to the provider, quantizing bf16 tokens where its send does not. Packed fp4
        tokens may come as torch's float4_e2m1fn_x2: the providers take their bytes (uint8, the same
        layout), as torch's own indexing and Triton know no float4 type."""
        dtype = x.dtype
        if dtype == torch.bfloat16 and self.config.dispatch_dtype is not DispatchDtype.BF16:
            if self._quantize_in_send:
                self.provider.dispatch_send(x, None, topk_weights, topk_ids, self.layout, quantize=True)
                return
            payload, scales = formats.quantize_dispatch(x, self.config.dispatch_dtype, self.fp8_dtype)
        else:
            payload = x.view(torch.uint8) if dtype == torch.float4_e2m1fn_x2 else x
        scale_rows = None
        if scales is not None and self.scale_bytes:  # the checks ensured scales wherever scale_bytes
            scale_rows = formats.dense(scales).view(torch.uint8).view(x.shape[0], self.scale_bytes)
        self.provider.dispatch_send(payload, scale_rows, topk_weights, topk_ids, self.layout)

    def dispatch_recv(self) -> DispatchOutput:
        """Finish the dispatch started by ``dispatch_send``."""
        if self._closed:
            raise self._closed_error("dispatch_recv")
        self._in_flight["dispatch"] = False  # received (or given up on) by the provider's receive
        out = self.provider.dispatch_recv(self.layout, self.payload_dtype)
        out.handle.issuer, out.handle.dispatch_number = self.ident, self._dispatches
        out.wait_for_device = self._wait_for_device
        return out

    def dispatch(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        scales: torch.Tensor | None,
        topk_ids: torch.Tensor,
    ) -> DispatchOutput:
        if self.config.dispatch_mode is Mode.LOW_LATENCY:
            raise InputError("low-latency mode splits dispatch: call dispatch_send, then dispatch_recv")
        self.dispatch_send(x, topk_weights, scales, topk_ids)
        return self.dispatch_recv()

    # -- combine --------------------------------------------------------------------------------

    def _check_combine(self, y: torch.Tensor, handle: CombineHandle) -> None:
        signature = input_signature(y)
        if signature != self._checked_combine:
            check_expert_outputs(self.config, y)
            check_devices(self.device, expert_outputs=y)
            self._checked_combine = signature
        if not isinstance(handle, CombineHandle):
            raise InputError(
                f"combine takes the handle of a dispatch (DispatchOutput.handle), got {type(handle).__name__}"
            )
        if handle.issuer != self.ident:
            raise InputError(
                "the combine handle comes from another op's dispatch: pass the handle of this op's dispatch"
            )
        if handle.dispatch_number != self._dispatches and not self.provider.capabilities.keeps_old_handles:
            raise InputError(
                f"the combine handle is from this op's dispatch #{handle.dispatch_number}, but dispatch "
                f"#{self._dispatches} has since reused its buffers ({self.provider_kind.value} provider): combine "
                "each dispatch before the next dispatch_send, or give overlapping batches an op each"
            )
        check_outputs_cover_received(y, handle)

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        """Start returning expert outputs (weights already applied) to their source ranks."""
        self._start_send("combine")
        self._check_combine(y, handle)
        self.provider.combine_send(y, handle)
        self._in_flight["combine"] = True

    def combine_recv(self) -> torch.Tensor:
        """Per original token, the f32 sum over its destination ranks, as bf16 ``[num_tokens, hidden]``."""
        if self._closed:
            raise self._closed_error("combine_recv")
        self._in_flight["combine"] = False
        return self.provider.combine_recv()

    def _wait_for_device(self) -> None:
        """The host's wait for this rank's device work, at most SGLANG_MORI_PEER_TIMEOUT_S (the bound
        native MoRI's kernels lack)."""
        if self.device.type == "cuda":
            wait_for_device(self.device, self.config.peer_timeout_s, self.config.rank)

    def synchronize(self) -> None:
        """Wait for this rank's device work (bounded, see ``_wait_for_device``); raise if a receive gave
        up on a stalled peer."""
        self._wait_for_device()
        self.provider.check_status()

    def close(self) -> None:
        """Release what the provider holds beyond Python's memory (native MoRI EP v2: its symmetric
        window and communicator; collective over the group, as building was). Later calls are refused
        (a send not yet received is dropped with the provider); closing twice does nothing."""
        if not self._closed:
            self._closed = True
            self.provider.close()

    def combine(self, y: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        if self.config.combine_mode is Mode.LOW_LATENCY:
            raise InputError("low-latency combine is split: call combine_send, then combine_recv")
        self.combine_send(y, handle)
        return self.combine_recv()


def _normalize_device(device: torch.device | str | None) -> torch.device:
    """An explicit device with its index, so that tensors' devices compare equal to it. The op runs on
    the CPU or a GPU this torch sees (ROCm's too, as "cuda"): anything else is refused by name here,
    before torch fails inside a provider or, for a device without memory (meta), at the first step."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={str(device)!r}: the op runs on 'cpu' or a GPU ('cuda', 'cuda:N')")
    if device.type == "cpu":
        return torch.device("cpu")  # CPU tensors carry no index: "cpu:0" would refuse every input
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={str(device)!r}: this torch sees no GPU; use device='cpu'")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


@functools.cache
def _warn_ignored_env(provider: str, names: tuple[str, ...]) -> None:
    """Once per process and set: a variable of another provider is set, and this one does not read it
    (SGLang's MoRI knobs would otherwise look as if they applied)."""
    if names:
        logger.warning(
            "%s set, but the %s provider does not read %s (see `python -m mori_sglang.env`)",
            ", ".join(names),
            provider,
            "it" if len(names) == 1 else "them",
        )
