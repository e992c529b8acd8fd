"""MoRI's EP v2 API (``mori.ops.dispatch_combine_v2``) behind our op API: the intranode mode within a
host with a bf16 combine (``mori_provider.uses_ep_v2``).

- Bootstrap: a ``mori.cco.Communicator`` (rank 0's unique id broadcast over the group), then the op;
  both are collectives. ``close`` frees the op's symmetric window and the communicator.
- The op is built on v2's hip backend: it skips dropped (negative) ids in the kernel as v1 does (the
  FlyDSL backend computes a peer address from any id), and it lays each received scale row at a 128 B
  stride itself (MoRI PR #593): the caller's row is passed as it is (``scale_dim`` x
  ``scale_type_size``, whole dwords) and read back through MoRI's ``recv_scales()`` at its
  ``scale_stride_bytes()``. It needs no FlyDSL.
- ``dispatch(..., return_routing=True)`` hands back a routing handle; the combine takes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from mori_sglang import formats, wire_formats
from mori_sglang.config import EpConfig
from mori_sglang.providers import mori_ids, on_device
from mori_sglang.providers.base import ProviderSetup
from mori_sglang.providers.mori_provider import MoriProvider, receive_cap
from mori_sglang.types import CombineHandle, DispatchOutput

KERNEL_BACKEND = "hip"
MIN_WINDOW_GIB = 4
WINDOW_SLACK_BYTES = 1 << 20


def scale_row(config: EpConfig, layout: formats.DispatchRowLayout) -> tuple[int, int]:
    """(scale_dim, scale_type_size) of the caller's scale row: its natural elements, or bytes for a
    custom row."""
    if not layout.scale_bytes:
        return 0, 0
    # One scale's bytes (f32 block scales, e8m0 microscales), as SGLang states them; bytes without scales.
    size = wire_formats.DISPATCH_BY_NAME[config.dispatch_dtype.value].scale_bytes or 1
    if layout.scale_bytes % size:
        size = 1
    return layout.scale_bytes // size, size


def window_bytes(config: EpConfig, layout: formats.DispatchRowLayout) -> int:
    """The communicator's symmetric window per rank: the op's receive regions (tokens, combine
    staging, 128 B scale rows, weights, ids, source map) with room to spare, whole GiB, at least 4."""
    capacity = config.max_recv_tokens
    per_row = layout.token_bytes + 2 * config.hidden + layout.scale_stride + 8 * config.topk + 4
    total = capacity * per_row + WINDOW_SLACK_BYTES
    return max(MIN_WINDOW_GIB, math.ceil(total / (1 << 30))) * (1 << 30)


@dataclass
class MoriV2Handle(CombineHandle):
    """EP v2's combine takes the routing handle its dispatch returned (``return_routing=True``)."""

    routing: object


class MoriV2Provider(MoriProvider):
    """Our op API over one ``mori.ops.dispatch_combine_v2.EpDispatchCombineOp`` (hip backend)."""

    def __init__(self, setup: ProviderSetup) -> None:
        from mori.cco import Communicator
        from mori.ops import dispatch_combine_v2 as v2

        super().__init__(setup)
        config, layout, group = setup.config, setup.layout, setup.group
        self.kernel = "v2"
        group = group or dist.group.WORLD
        unique_id = [Communicator.get_unique_id() if config.rank == 0 else None]
        dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
        self.device = setup.device
        with on_device(setup.device):
            self.comm = Communicator.init(
                config.world_size, config.rank, unique_id[0], per_rank_vmm=window_bytes(config, layout)
            )
            try:
                self.op = self._build_op(v2, config, layout)
            except BaseException:
                self.comm.destroy()  # the window was reserved; nothing else will release it
                raise
        self.comm.barrier()
        self._dispatched: tuple | None = None
        self._combined: torch.Tensor | None = None

    def _build_op(self, v2: ModuleType, config: EpConfig, layout: formats.DispatchRowLayout) -> object:
        """The EP v2 op on the hip backend, over this provider's communicator."""
        scale_dim, scale_type_size = scale_row(config, layout)
        asymmetric = self.token_dtype != torch.bfloat16
        return v2.EpDispatchCombineOp(
            v2.EpDispatchCombineConfig(
                rank=config.rank,
                world_size=config.world_size,
                hidden_dim=config.hidden,
                max_num_inp_token_per_rank=config.max_tokens_per_rank,
                num_experts_per_rank=config.num_local_experts,
                num_experts_per_token=config.topk,
                data_type=torch.bfloat16,
                dispatch_data_type=self.token_dtype if asymmetric else None,
                combine_data_type=torch.bfloat16 if asymmetric else None,
                scale_dim=scale_dim,
                scale_type_size=scale_type_size,
                combine_mode="gather",
                quant_type="none",
                max_total_recv_tokens=receive_cap(),
                kernel_backend=KERNEL_BACKEND,
            ),
            self.comm,
        )

    def close(self) -> None:
        """Free the op's symmetric window, then the communicator (collective, like building them). This
        rank's kernels end and every rank meets first: a peer's combine may still be gathering rows
        from this rank's window."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm.barrier()
        self.op.close()
        self.comm.destroy()

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch_send(
        self,
        payload: torch.Tensor,
        scales: torch.Tensor | None,
        weights: torch.Tensor,
        ids: torch.Tensor,
        layout: formats.DispatchRowLayout,
        quantize: bool = False,
    ) -> None:
        self.refuse_fused_quantization(quantize)
        dropped = mori_ids.flag_past_last(ids, self.config.num_experts, self._status)
        sent_ids = mori_ids.negative_for_dropped(ids, dropped)
        rows = None if scales is None or not layout.scale_bytes else scales.contiguous()
        tokens = payload.contiguous().view(self.token_dtype)
        self._dispatched = self.op.dispatch(
            tokens, weights.to(torch.float32).contiguous(), rows, sent_ids, return_routing=True
        )

    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        if self._dispatched is None:
            raise RuntimeError("dispatch_recv called without a dispatch_send before it")
        self._status.after_step(self.check_status)
        tokens, weights, scales, ids, num_recv, routing = self._dispatched
        self._dispatched = None
        scale_view = None
        if layout.scale_bytes:
            scale_view = scales.view(torch.uint8)[:, : layout.scale_bytes]
        handle = MoriV2Handle(num_tokens=routing.cur_rank_num_token, num_recv=num_recv, routing=routing)
        return DispatchOutput(
            tokens=tokens.view(torch.uint8).view(token_dtype),
            topk_weights=weights,
            topk_ids=ids,
            scales=scale_view,
            scale_stride=self.op.scale_stride_bytes() if layout.scale_bytes else layout.scale_stride,
            num_recv=num_recv,
            handle=handle,
        )

    # -- combine ------------------------------------------------------------------------------

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        """MoRI sums the returned rows unweighted: the expert side applied the weights already."""
        assert isinstance(handle, MoriV2Handle)  # the op passes back only this provider's handles
        y = y.to(torch.bfloat16).contiguous()
        self._flag_short_outputs(y, handle.num_recv)
        self._combined = self.op.combine(y, None, None, routing=handle.routing)[0]

    def combine_recv(self) -> torch.Tensor:
        if self._combined is None:
            raise RuntimeError("combine_recv called without a combine_send before it")
        self._status.after_step(self.check_status)
        out, self._combined = self._combined, None
        return out
