"""The torch.distributed provider: packed wire rows through all_to_all_single.

It is the reference the kernels must match byte for byte and the multi-node path. Intranode mode
exchanges exactly the copies (one host sync for the counts); low-latency mode exchanges fixed
per-source slots (``max_tokens_per_rank`` rows per source, no counts on the host, graph-capturable on
NCCL). Every receive waits at most SGLANG_MORI_PEER_TIMEOUT_S (see ``exchange``): over NCCL an eager
receive is therefore a host wait; a captured one is the stream's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mori_sglang import checks, formats
from mori_sglang.config import ConfigError, Mode
from mori_sglang.exchange import DistExchange, Exchange, LoopbackExchange, Pending
from mori_sglang.providers.base import (
    ALL_DISPATCH,
    ALL_MODES,
    OUR_COMBINE_FORMATS,
    Capabilities,
    EpProvider,
    ProviderSetup,
)
from mori_sglang.providers.device_status import DeviceStatus
from mori_sglang.routing import SendPlan, plan_dispatch, source_of_rows
from mori_sglang.types import CombineHandle, DispatchOutput, short_expert_outputs_error


@dataclass
class ExchangeHandle(CombineHandle):
    """The torch provider's routing record: every tensor is the handle's own, so any earlier dispatch's
    handle stays valid.

    Source side: ``copy_of_pair`` / ``slot_of_pair`` address the copy of token n sent for top-k slot k
    (-1 where none), in the exact exchange and in the fixed per-source slots. Expert side: ``recv_src`` /
    ``recv_pos`` are each received row's source rank and position within that source; ``recv_counts``
    are rows per source. The host lists are present only where the intranode dispatch synchronised.
    """

    copy_of_pair: torch.Tensor
    slot_of_pair: torch.Tensor
    recv_src: torch.Tensor
    recv_pos: torch.Tensor
    recv_counts: torch.Tensor
    send_counts_host: list[int] | None = None
    recv_counts_host: list[int] | None = None

    def received_rows_on_host(self) -> int | None:
        return None if self.recv_counts_host is None else sum(self.recv_counts_host)


@dataclass
class _PendingDispatch:
    plan: SendPlan
    num_tokens: int
    rows: Pending
    counts: Pending | None  # low-latency only: per-source copy counts


@dataclass
class _PendingCombine:
    handle: ExchangeHandle
    rows: Pending
    fixed_slots: bool


class TorchProvider(EpProvider):
    """Dispatch/combine for one rank over an Exchange (a ProcessGroup or a loopback world)."""

    name = "torch"
    display_name = "torch"
    capabilities = Capabilities(
        dispatch_formats=ALL_DISPATCH,
        combine_formats=OUR_COMBINE_FORMATS,
        fused_quantization=frozenset(),
        id_checks_on_device=frozenset(),
        modes=ALL_MODES,
        loopback=True,
        keeps_old_handles=True,
    )

    def __init__(self, setup: ProviderSetup) -> None:
        config = setup.config
        self.config = config
        self.exchange = _exchange(setup)
        self.device = setup.device
        self.fp8_dtype = setup.fp8_dtype
        self._dispatch: _PendingDispatch | None = None
        self._combine: _PendingCombine | None = None
        # 1 + the rows a low-latency combine needed where the expert outputs held fewer (compared on the
        # device: that mode never synchronises with the host).
        self._status = DeviceStatus(1, setup.device)

    def check_status(self) -> None:
        """Raise if a combine got fewer expert output rows than its dispatch received."""
        (rows_needed,) = self._status.read()
        if rows_needed:
            raise short_expert_outputs_error(rows_needed - 1)

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
        cfg = self.config
        plan = plan_dispatch(ids, cfg.num_local_experts, cfg.world_size, cfg.max_tokens_per_rank)
        n = payload.shape[0]
        if cfg.dispatch_mode is Mode.LOW_LATENCY:
            slots = cfg.world_size * cfg.max_tokens_per_rank
            copies = torch.arange(n * cfg.topk, device=self.device)
            # Copies past the real count land in a spare row that is never sent.
            target = torch.where(copies < plan.num_copies, plan.slot_of_copy, torch.full_like(copies, slots))
            token = plan.token_of_copy
            rows = layout.pack(payload[token], None if scales is None else scales[token], weights[token], ids[token])
            send = torch.zeros(slots + 1, layout.row_bytes, dtype=torch.uint8, device=self.device)
            send.index_copy_(0, target, rows)
            chunks = send[:slots].view(cfg.world_size, cfg.max_tokens_per_rank, layout.row_bytes)
            counts = plan.send_counts.view(cfg.world_size, 1)
            self._dispatch = _PendingDispatch(plan, n, self.exchange.fixed(chunks), self.exchange.fixed(counts))
            return
        if checks.capturing(ids):
            raise RuntimeError(
                "the torch.distributed provider's intranode mode exchanges row counts through the host, which "
                "CUDA-graph capture forbids: use the Triton provider (SGLANG_MORI_BACKEND=auto or triton), the "
                "low-latency mode, or run without CUDA graphs (SGLang --cuda-graph-backend-decode=disabled "
                "--cuda-graph-backend-prefill=disabled, vLLM --enforce-eager)"
            )
        send_counts = plan.send_counts.tolist()
        token = plan.token_of_copy[: sum(send_counts)]
        rows = layout.pack(payload[token], None if scales is None else scales[token], weights[token], ids[token])
        self._dispatch = _PendingDispatch(plan, n, self.exchange.variable(rows, send_counts), None)

    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        if self._dispatch is None:
            raise RuntimeError("dispatch_recv called without a dispatch_send before it")
        pending, self._dispatch = self._dispatch, None
        cfg = self.config
        capacity = cfg.max_recv_tokens
        recv, recv_counts_host = pending.rows.wait()
        fixed_slots = pending.counts is not None
        if fixed_slots:
            counts, _ = pending.counts.wait()
            recv_counts = counts.view(-1).to(self.device)
        else:
            assert recv_counts_host is not None
            recv_counts = torch.tensor(recv_counts_host, dtype=torch.int64, device=self.device)
        src, pos = source_of_rows(recv_counts, capacity)
        if fixed_slots:
            slot = (src * cfg.max_tokens_per_rank + pos.clamp(max=cfg.max_tokens_per_rank - 1)).clamp(min=0)
            rows = recv.view(capacity, layout.row_bytes)[slot]
            num_recv = recv_counts.sum().view(1).int()
            send_counts_host = None
        else:
            rows = torch.zeros(capacity, layout.row_bytes, dtype=torch.uint8, device=self.device)
            rows[: recv.shape[0]] = recv
            num_recv = torch.tensor([recv.shape[0]], dtype=torch.int32, device=self.device)
            send_counts_host = pending.plan.send_counts.tolist()
        handle = ExchangeHandle(
            num_tokens=pending.num_tokens,
            copy_of_pair=pending.plan.copy_of_pair,
            slot_of_pair=pending.plan.slot_of_pair,
            recv_src=src,
            recv_pos=pos,
            recv_counts=recv_counts,
            num_recv=num_recv,
            send_counts_host=send_counts_host,
            recv_counts_host=None if fixed_slots else recv_counts_host,
        )
        scales = None
        if layout.scale_bytes:
            scale_rows = layout.scale_region(rows).contiguous()
            scales = scale_rows[:, : layout.scale_bytes]
        return DispatchOutput(
            tokens=layout.tokens(rows).contiguous().view(token_dtype),
            topk_weights=layout.weights(rows),
            topk_ids=layout.ids(rows),
            scales=scales,
            scale_stride=layout.scale_stride,
            num_recv=num_recv,
            handle=handle,
        )

    # -- combine ------------------------------------------------------------------------------

    def _wire_rows(self, y: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return formats.quantize_combine(y, cfg.combine_dtype, self.fp8_dtype, cfg.combine_block)

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        assert isinstance(handle, ExchangeHandle)  # the op passes back only this provider's handles
        cfg = self.config
        if cfg.combine_mode is Mode.LOW_LATENCY:
            slots = cfg.world_size * cfg.max_tokens_per_rank
            capacity = min(y.shape[0], cfg.max_recv_tokens)
            received = handle.num_recv.long().view(())
            flag = self._status.flags[0]
            torch.maximum(flag, torch.where(received > y.shape[0], received + 1, 0), out=flag)
            wire = self._wire_rows(y[:capacity])
            rows = torch.arange(capacity, device=self.device)
            target = handle.recv_src[:capacity] * cfg.max_tokens_per_rank + handle.recv_pos[:capacity]
            target = torch.where(rows < handle.num_recv.long(), target, torch.full_like(target, slots))
            send = torch.zeros(slots + 1, wire.shape[1], dtype=torch.uint8, device=self.device)
            send.index_copy_(0, target, wire)
            chunks = send[:slots].view(cfg.world_size, cfg.max_tokens_per_rank, wire.shape[1])
            self._combine = _PendingCombine(handle, self.exchange.fixed(chunks), fixed_slots=True)
            return
        if handle.recv_counts_host is None or handle.send_counts_host is None:
            raise RuntimeError("intranode combine needs the handle of an intranode dispatch")
        total = sum(handle.recv_counts_host)
        wire = self._wire_rows(y[:total])
        self._combine = _PendingCombine(
            handle, self.exchange.variable(wire, handle.recv_counts_host), fixed_slots=False
        )

    def combine_recv(self) -> torch.Tensor:
        if self._combine is None:
            raise RuntimeError("combine_recv called without a combine_send before it")
        pending, self._combine = self._combine, None
        cfg = self.config
        handle = pending.handle
        back, _ = pending.rows.wait()
        back = back.reshape(-1, back.shape[-1])
        values = formats.dequantize_combine(back, cfg.combine_dtype, cfg.hidden, self.fp8_dtype, cfg.combine_block)
        address = handle.slot_of_pair if pending.fixed_slots else handle.copy_of_pair
        self._status.after_step(self.check_status)  # short expert outputs raise (on a GPU one call later)
        return accumulate_copies(values, address)


def _exchange(setup: ProviderSetup) -> Exchange:
    """The loopback world's mailbox, or the process group's all_to_all, checked against the config."""
    config = setup.config
    if setup.loopback is not None:
        return LoopbackExchange(setup.loopback, config.rank)
    exchange = DistExchange(setup.group, config.peer_timeout_s)
    if exchange.world_size != config.world_size or exchange.rank != config.rank:
        raise ConfigError(
            f"config says rank {config.rank} of {config.world_size}, the process group says "
            f"rank {exchange.rank} of {exchange.world_size}"
        )
    return exchange


def accumulate_copies(values: torch.Tensor, address: torch.Tensor) -> torch.Tensor:
    """Per token, the f32 sum of its returned rows in ascending owning-k order, cast once to bf16.

    ``address[n, k]`` indexes ``values`` (-1: nothing for that slot). Starting from +0.0 and adding the
    rows in k order fixes the rounding, so every provider produces the same bits.
    """
    n, k = address.shape
    padded = torch.cat([values, values.new_zeros(1, values.shape[1])])
    spare = values.shape[0]
    acc = values.new_zeros(n, values.shape[1])
    for slot in range(k):
        index = address[:, slot]
        acc = acc + padded[torch.where(index >= 0, index, torch.full_like(index, spare))]
    return acc.to(torch.bfloat16)
