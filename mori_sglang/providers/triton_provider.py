"""The Triton provider: our kernels over symmetric memory (or a loopback world's arenas).

Both modes use fixed per-source slots, so a send never waits for a count exchange: intranode mode
is the send and the receive back to back, low-latency mode returns after the send. Outputs live in
buffers owned by the op and are overwritten by the next call, as with native MoRI; nothing allocates,
converts or synchronises with the host on the hot path, so the calls can be captured in a CUDA graph.
Each kernel launch is bound once per batch size (``BoundLaunch``): a step re-launches with the least
Python, and runs no torch operation at all for inputs in the documented layout.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from mori_sglang import env, formats, wire_formats
from mori_sglang.config import FP8_TYPES, CombineDtype, ConfigError, DispatchDtype, EpConfig
from mori_sglang.kernels import interpreter, transport
from mori_sglang.kernels.geometry import (
    MIN_ROUTE_TASK,
    SELF_ROUTING_MAX_WORLD,
    KernelTuning,
    multiprocessors,
    program_count,
)
from mori_sglang.kernels.launch import BoundLaunch
from mori_sglang.providers.arena import Arena, ArenaLayout
from mori_sglang.providers.base import (
    ALL_DISPATCH,
    ALL_MODES,
    OUR_COMBINE_FORMATS,
    Capabilities,
    EpProvider,
    ProviderSetup,
)
from mori_sglang.providers.device_status import MappedStatus
from mori_sglang.types import (
    CombineHandle,
    DispatchOutput,
    PeerTimeoutError,
    expert_id_error,
    peer_timeout_error,
    short_expert_outputs_error,
)
from mori_sglang.wire_formats import QUANT_NONE

TRITON_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8}


# The kernels that count their finished work (one word of ``_tickets`` each, in this order).
TICKETS = ("dispatch_send", "combine_send")

# Polls of an earlier routing task's count before the task counts those tokens itself (on a GPU; the
# interpreter runs programs one after another, so there it never waits).
COUNT_SPINS = 64
# Warps of a dispatch send program: latency-bound, many small programs keep the most rows in flight, and
# the routing's waits read each poll as one value only within a single warp.
SEND_WARPS = 1
# Earlier routing blocks' counts a routing task in the send reads at once (more are read in turns).
COUNT_LANES = 256
# The formats whose wire rows carry no scales: their kernels tile a row in blocks of this many elements,
# whatever MORI_FP8_COMBINE_SCALE_DIM says.
UNSCALED_COMBINE_BLOCK = 128

__all__ = ["PeerTimeoutError", "TritonProvider"]


def _words(nbytes: int) -> int:
    assert nbytes % 4 == 0, nbytes
    return nbytes // 4


def check_word_rows(config: EpConfig, layout: formats.DispatchRowLayout) -> None:
    """The kernels move dispatch tokens in 4-byte words: refuse, naming hidden, a token that is not."""
    if layout.token_bytes % 4:
        multiple = 32 // wire_formats.DISPATCH_BY_NAME[config.dispatch_dtype.value].element_bits  # per word
        rule = "even" if multiple == 2 else f"a multiple of {multiple}"
        raise ConfigError(
            f"hidden={config.hidden}: the triton provider moves {config.dispatch_dtype.value} tokens in 4-byte "
            f"words and a token is {layout.token_bytes} B; use a hidden that is {rule}, or "
            "SGLANG_MORI_BACKEND=torch"
        )


# The dispatch formats whose send quantizes to the op's fp8 flavour; every combine format but bf16 is fp8.
FP8_DISPATCH = (DispatchDtype.FP8, DispatchDtype.MXFP8)


def compiled_fp8_types(device: torch.device) -> tuple[str, ...] | None:
    """The fp8 types Triton compiles for ``device``'s GPU, from its backend's own options (NVIDIA: e4m3fn
    from sm_89 on, never e4m3fnuz; AMD: both); None on a CPU, whose interpreter takes every type."""
    if device.type != "cuda" or interpreter.interpreting():
        return None
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    with torch.cuda.device(device):
        target = driver.active.get_current_target()
    supported = getattr(make_backend(target).parse_options({}), "supported_fp8_dtypes", None)
    return None if supported is None else tuple(supported)  # None: a Triton without the table checks at compile


def check_fp8_compiles(config: EpConfig, fp8_dtype: torch.dtype, supported: Collection[str] | None) -> None:
    """Refuse, when the op is built, a configuration whose kernels would use an fp8 type Triton does not
    compile for this GPU (e4m3fnuz on NVIDIA, any e4m3 before sm_89): Triton would raise only at the
    first dispatch or combine, from inside its compiler."""
    if supported is None:
        return
    uses = []
    if config.dispatch_dtype in FP8_DISPATCH:
        uses.append(f"{config.dispatch_dtype.value} dispatch (SGLANG_MORI_DISPATCH_DTYPE)")
    if config.combine_dtype is not CombineDtype.BF16:
        name = wire_formats.COMBINE_BY_NAME[config.combine_dtype.value].user_name
        uses.append(f"{name} combine (SGLANG_MORI_COMBINE_DTYPE)")
    triton_type = TRITON_FP8[fp8_dtype].name
    if not uses or triton_type in supported:
        return
    flavour = next(name for name, dtype in FP8_TYPES.items() if dtype == fp8_dtype)
    others = [name for name, dtype in FP8_TYPES.items() if TRITON_FP8[dtype].name in supported]
    instead = f"SGLANG_MORI_FP8_TYPE={others[0]}, " if others else ""
    raise ConfigError(
        f"the triton provider would run {' and '.join(uses)} in {flavour} (SGLANG_MORI_FP8_TYPE), which Triton "
        f"does not compile for this GPU (its fp8 types: {', '.join(sorted(supported))}); use {instead}bf16 "
        "formats, or SGLANG_MORI_BACKEND=torch"
    )


def clock_kind(device: torch.device) -> int:
    """Which clock the receive kernels' deadline reads (transport.CLOCK_*)."""
    if device.type == "cpu" or interpreter.interpreting():
        return transport.CLOCK_HOST
    return transport.CLOCK_HIP if torch.version.hip else transport.CLOCK_CUDA


@dataclass
class SlotHandle(CombineHandle):
    """The Triton provider's routing record: views of the op's buffers, valid until the next dispatch.

    ``slot_of_pair[n, k]``: the fixed slot the copy of token n for top-k slot k went to (-1: none);
    ``recv_counts``: the rows received from each source.
    """

    slot_of_pair: torch.Tensor
    recv_counts: torch.Tensor


class TritonProvider(EpProvider):
    """Expert ids are range-checked by the routing in the dispatch send, on the device: no host sync per dispatch."""

    name = "triton"
    display_name = "triton"
    capabilities = Capabilities(
        dispatch_formats=ALL_DISPATCH,
        combine_formats=OUR_COMBINE_FORMATS,
        fused_quantization=frozenset({DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4}),
        id_checks_on_device=frozenset({"cuda", "cpu"}),  # the routing in the send, compiled or interpreted
        modes=ALL_MODES,
        loopback=True,
        keeps_old_handles=False,  # handles point at the op's buffers, which the next dispatch reuses
    )

    def __init__(self, setup: ProviderSetup) -> None:
        config, device, fp8_dtype, layout = setup.config, setup.device, setup.fp8_dtype, setup.layout
        group, loopback = setup.group, setup.loopback
        if device.type == "cpu":
            if not interpreter.interpreting():
                raise ConfigError(
                    "the triton provider on a CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1, "
                    "or use the torch provider (SGLANG_MORI_BACKEND=torch)"
                )
            interpreter.install_exact_casts()
        check_word_rows(config, layout)
        check_fp8_compiles(config, fp8_dtype, compiled_fp8_types(device))
        self.config = config
        self.device = device
        self.fp8_dtype = fp8_dtype
        self.peer_timeout_s = config.peer_timeout_s
        self._clock = clock_kind(device)
        self._tuning = KernelTuning()
        self._sms = multiprocessors(device)
        # Every launch takes these: the kernels' PDL switch and the launch option go together (transport docs).
        self._pdl_launch = (
            {"PDL": transport.PDL_WAIT, "launch_pdl": True}
            if programmatic_launch(device)
            else {"PDL": transport.PDL_OFF}
        )
        combine_bytes = formats.combine_row_bytes(config.combine_dtype, config.hidden, config.combine_block)
        self.arena_layout = ArenaLayout(
            config.world_size, config.max_tokens_per_rank, layout.row_bytes, formats.align(combine_bytes)
        )
        self._loopback = loopback
        if loopback is not None:
            self.arena = Arena.loopback(self.arena_layout, loopback, config.rank, device)
            self._peers_ready = False
        else:
            self.arena = Arena.symmetric(self.arena_layout, group or dist.group.WORLD, device)
            self._peers_ready = True
        capacity = config.max_recv_tokens
        # Per round kind (dispatch, combine): [the round its next receive waits for (advanced by the
        # send), the last round whose senders were all seen to arrive, whether a receive gave up on it].
        self.rounds = torch.zeros(2, 3, dtype=torch.int64, device=device)
        # Per send kernel: work done so far in the running launch, back to 0 at its end.
        self._tickets = torch.zeros(len(TICKETS), dtype=torch.int32, device=device)
        # status[0]: 1 + a peer a receive gave up on; status[1]: the largest expert id past the last minus
        # (num_experts - 1); status[2]: 1 + the rows a combine needed where the expert outputs held fewer.
        self._status = MappedStatus(3, device)
        self._no_rows = torch.zeros(1, config.hidden, dtype=torch.bfloat16, device=device)
        self.tokens_out = torch.empty(capacity, _words(layout.token_bytes), dtype=torch.int32, device=device)
        self.scales_out = torch.empty(capacity, _words(layout.scale_stride), dtype=torch.int32, device=device)
        self.weights_out = torch.empty(capacity, config.topk, dtype=torch.float32, device=device)
        self.ids_out = torch.empty(capacity, config.topk, dtype=torch.int32, device=device)
        self.num_recv = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_scales = torch.zeros(1, dtype=torch.int32, device=device)  # the scale words when none travel
        self.recv_counts = torch.zeros(config.world_size, dtype=torch.int64, device=device)
        self.send_counts = torch.zeros(config.world_size, dtype=torch.int64, device=device)
        route_blocks = triton.cdiv(config.max_tokens_per_rank, MIN_ROUTE_TASK)  # the most a batch can span
        # Per routing task (block and destination): its count and the round whose numbering it finished,
        # both tagged with the send's round, so never reset.
        self._block_counts = torch.zeros(config.world_size * route_blocks, dtype=torch.int64, device=device)
        self._routed = torch.zeros_like(self._block_counts)
        # The programs of the running send (routing in tasks) that have started, back to 0 at its end.
        self._start_order = torch.zeros(1, dtype=torch.int32, device=device)
        # Each copy's slot (for the combine) and destination row address (for the send right after the
        # routing), made by the routing; a dispatch's handle views the first rows.
        self._slot_of_pair = torch.empty(config.max_tokens_per_rank, config.topk, dtype=torch.int64, device=device)
        self._row_of_pair = torch.empty(config.max_tokens_per_rank, config.topk, dtype=torch.int64, device=device)
        self.combined_out = torch.empty(config.max_tokens_per_rank, config.hidden, dtype=torch.bfloat16, device=device)
        self._sent: int | None = None  # the batch size of the dispatch sent and not yet received
        self._combine_handle: SlotHandle | None = None
        self.triton_fp8_type = TRITON_FP8[fp8_dtype]
        self._launches: dict[tuple, object] = {}  # bound launches and views, by what they depend on

    # -- bound launches -----------------------------------------------------------------------

    def set_kernel_tuning(self, tuning: KernelTuning) -> None:
        self._tuning = tuning
        self._launches.clear()  # the bound launches hold the old shapes

    def _cached(self, key: tuple, make: Callable[..., object], *args: object):
        """What ``make(*args)`` builds for ``key`` (a launch plan or a view), built on first use. The
        per-step calls look ``_launches`` up themselves first and come here on a miss: one Python call
        less per call."""
        found = self._launches.get(key)
        if found is None:
            found = self._launches[key] = make(*args)
        return found

    def launch_count(self) -> int:
        """Kernel launches so far, over every bound launch (a test's and a benchmark's counter); a launch
        that several plans hold counts once."""
        bound = {
            id(launch): launch
            for plan in self._launches.values()
            for launch in (plan if isinstance(plan, tuple) else (plan,))
            if isinstance(launch, BoundLaunch)
        }
        return sum(launch.launches for launch in bound.values())

    def _bind(self, kernel, grid: tuple[int, ...], args: dict, options: dict, variable=()) -> BoundLaunch:
        pdl = self._pdl_launch
        if pdl["PDL"] and math.prod(grid) <= self._tuning.early_launch_max_programs:
            pdl = {**pdl, "PDL": transport.PDL_EARLY}
        return BoundLaunch(kernel, self.device, grid, args, {**options, **pdl}, variable)

    # -- bookkeeping --------------------------------------------------------------------------

    def _grid(self, per_sm: int, items: int) -> tuple[int]:
        """``per_sm`` programs per multiprocessor, but no more than work items where the host knows them
        (idle programs only cost time; the combine send's grid covers the most rows a rank can receive).
        At least one, which signals (a send) or waits (a receive) when there is nothing to move."""
        return (max(1, min(program_count(per_sm, self._sms), items)),)

    def _ticket(self, kernel: str) -> torch.Tensor:
        index = TICKETS.index(kernel)
        return self._tickets[index : index + 1]

    def _resolve_peers(self) -> None:
        """A loopback world's peers, found at the first send (every rank's arena exists by then)."""
        self.arena.resolve_loopback_peers(self._loopback)
        self._peers_ready = True

    def check_status(self) -> None:
        """Raise if a receive gave up on a peer, a dispatch met an expert id out of range or a combine
        got fewer expert output rows than its dispatch received."""
        stalled, bad_id, rows_needed = self._status.read()
        if bad_id:
            raise expert_id_error(bad_id + self.config.num_experts - 1, self.config.num_experts, dropped=True)
        if rows_needed:
            raise short_expert_outputs_error(rows_needed - 1)
        if stalled:
            raise peer_timeout_error(self.config.rank, stalled - 1, self.peer_timeout_s)

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
        """Send each token's row to its destinations; ``quantize``: ``payload`` is bf16, quantize it
        to the dispatch dtype on the way, once per token whatever the number of destinations. The
        kernels read the tensors as they are (int32 or int64 ids, f32 or 16-bit weights, tokens of any
        dtype as words); only a tensor that is not contiguous, or tokens or scale rows that do not start
        on a 4-byte word, are copied."""
        if not self._peers_ready:
            self._resolve_peers()
        num_tokens = payload.shape[0]
        with_scales = scales is not None
        key = ("dispatch", num_tokens, quantize, with_scales)
        send = self._launches.get(key) or self._cached(
            key, self._dispatch_send, num_tokens, layout, quantize, with_scales
        )
        ids = _contiguous(ids)
        if with_scales:
            send(_word_aligned(payload), _contiguous(weights), ids, _word_aligned(scales))
        else:
            send(_word_aligned(payload), _contiguous(weights), ids)
        self._sent = num_tokens

    def _dispatch_send(
        self, num_tokens: int, layout: formats.DispatchRowLayout, quantize: bool, with_scales: bool
    ) -> BoundLaunch:
        """The send of a batch of ``num_tokens``, which routes it too: item by item, or in tasks of
        ``route_block`` tokens for one destination run by programs of their own."""
        cfg = self.config
        self_routed = num_tokens <= self._tuning.self_routing_max_tokens and cfg.world_size <= SELF_ROUTING_MAX_WORLD
        route_block = min(self._tuning.route_block, max(triton.next_power_of_2(num_tokens), MIN_ROUTE_TASK))
        blocks = max(1, triton.cdiv(num_tokens, route_block))
        if quantize:  # a tile is whole scale groups of the format's row in the table
            fmt = wire_formats.DISPATCH_BY_NAME[cfg.dispatch_dtype.value]
            quant, group = fmt.kernel_code, fmt.scale_group
            tile_groups = max(1, self._tuning.send_tile // group)
            # MX scale rows end in zero pad bytes up to a dword: the tiles cover those "groups" too.
            tiles = triton.cdiv(layout.scale_bytes // fmt.scale_bytes, tile_groups)
        else:  # a tile is words to copy, whatever the format: no groups
            quant, group, tile_groups = QUANT_NONE, 1, 1
            tiles = triton.cdiv(_words(layout.token_bytes), self._tuning.copy_block)
        # A send that routes in tasks has programs that run them, and move no rows.
        (routers,) = (0,) if self_routed else self._grid(self._tuning.route_programs_per_sm, blocks * cfg.world_size)
        (movers,) = self._grid(self._tuning.send_programs_per_sm, num_tokens * tiles)
        fixed = {
            "peer_bases": self.arena.peer_bases,
            "slot_of_pair_ptr": self._slot_of_pair,
            "row_of_pair_ptr": self._row_of_pair,
            "block_counts_ptr": self._block_counts,
            "send_counts_ptr": self.send_counts,
            "status_ptr": self._status.flags,
            "num_tokens": num_tokens,
            "num_experts": cfg.num_experts,
            "num_local_experts": cfg.num_local_experts,
            "rank": cfg.rank,
            "max_tokens": cfg.max_tokens_per_rank,
            "routed_ptr": self._routed,
            "start_order_ptr": self._start_order,
            "tickets_ptr": self._ticket("dispatch_send"),
            "round_ptr": self.rounds[0],
            "counts_offset": self.arena_layout.counts_offset,
            "arrivals_offset": self.arena_layout.dispatch_arrivals_offset,
            "routers": routers,
        }
        if not with_scales:
            fixed["scales_ptr"] = self._no_scales
        send = self._bind(
            transport.dispatch_send_kernel,
            (routers + movers,),
            fixed,
            {
                **self._row_meta(layout),
                "ROW_BYTES": layout.row_bytes,
                "WP": triton.next_power_of_2(cfg.world_size),
                "SCALE_WORDS": _words(layout.scale_bytes),
                "BLOCK": self._tuning.copy_block,
                "PAD_BLOCK": triton.next_power_of_2(_words(layout.scale_stride)) if layout.scale_stride else 1,
                "TILES": tiles,
                "QUANT": quant,
                "HIDDEN": cfg.hidden,
                "GROUP": group,
                "TILE_GROUPS": tile_groups,
                "FP8_MAX": formats.fp8_max(self.fp8_dtype),
                "FP8": self.triton_fp8_type,
                "EMAX": formats.mx_emax(cfg.dispatch_dtype, self.fp8_dtype),
                "SELF_ROUTING": self_routed,
                "ROUTE_CHUNK": min(self._tuning.self_route_chunk, triton.next_power_of_2(max(num_tokens, 1))),
                "BLOCK_N": route_block,
                "LANES": min(triton.next_power_of_2(blocks), COUNT_LANES),
                "COUNT_SPINS": COUNT_SPINS if self._sms else 0,
                "enable_fp_fusion": False,
                "num_warps": SEND_WARPS,
            },
            ("x_ptr", "weights_ptr", "ids_ptr", "scales_ptr") if with_scales else ("x_ptr", "weights_ptr", "ids_ptr"),
        )
        return send

    def _row_meta(self, layout: formats.DispatchRowLayout) -> dict[str, int]:
        """Where each section of a packed dispatch row starts, in words, for the send and receive kernels."""
        return {
            "TOKEN_WORDS": _words(layout.token_bytes),
            "STRIDE_WORDS": _words(layout.scale_stride),
            "SCALE_AT": _words(layout.scale_offset),
            "WEIGHTS_AT": _words(layout.weights_offset),
            "IDS_AT": _words(layout.ids_offset),
            "K": self.config.topk,
            "KP": triton.next_power_of_2(self.config.topk),
            "W": self.config.world_size,
        }

    def _refuse_receive(self, kind: str) -> NoReturn:
        """A receive needs a send of its own: it waits for the round that send opened, and a second
        receive of one round would find its senders' counters already past. A receive that gave up on
        that round is reported first, as the timeout it is."""
        self.check_status()
        raise RuntimeError(f"{kind}_recv called without a {kind}_send before it (each send is received once)")

    def _wait_args(self, round_index: int) -> dict[str, object]:
        """The receive kernels' round, status and deadline arguments."""
        return {
            "round_ptr": self.rounds[round_index],
            "status_ptr": self._status.flags,
            "timeout_ns": int(self.peer_timeout_s * 1e9),
        }

    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        if self._sent is None:
            self._refuse_receive("dispatch")
        num_tokens, self._sent = self._sent, None  # each send is received once
        key = ("dispatch_recv", num_tokens, token_dtype)
        recv, slots, tokens, scales = self._launches.get(key) or self._cached(
            key, self._dispatch_recv_plan, num_tokens, layout, token_dtype
        )
        recv()
        self._status.after_step(self.check_status)  # a stalled peer or a bad id raises at a later call
        handle = SlotHandle(
            num_tokens=num_tokens,
            num_recv=self.num_recv,
            slot_of_pair=slots,
            recv_counts=self.recv_counts,
        )
        return DispatchOutput(
            tokens=tokens,
            topk_weights=self.weights_out,
            topk_ids=self.ids_out,
            scales=scales,
            scale_stride=layout.scale_stride,
            num_recv=self.num_recv,
            handle=handle,
        )

    def _dispatch_recv_plan(
        self, num_tokens: int, layout: formats.DispatchRowLayout, token_dtype: torch.dtype
    ) -> tuple[BoundLaunch, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The receive's launch (one for every batch size), and the views a receive of a batch of
        ``num_tokens`` returns: each pair's slot, the received tokens as ``token_dtype`` and the
        meaningful bytes of their scale rows."""
        recv = self._cached(("dispatch_recv",), self._dispatch_recv_launch, layout)
        slots = self._slot_of_pair.narrow(0, 0, num_tokens)
        scales = self.scales_out.view(torch.uint8)[:, : layout.scale_bytes] if layout.scale_bytes else None
        return recv, slots, self.tokens_out.view(torch.uint8).view(token_dtype), scales

    def _dispatch_recv_launch(self, layout: formats.DispatchRowLayout) -> BoundLaunch:
        cfg = self.config
        programs_per_sm = self._tuning.dispatch_recv_programs_per_sm(layout.row_bytes)
        return self._bind(
            transport.dispatch_recv_kernel,
            self._grid(programs_per_sm, self.arena_layout.slots),
            {
                "arena_ptr": self.arena.base,
                "tokens_out": self.tokens_out,
                "scales_out": self.scales_out,
                "weights_out": self.weights_out.view(torch.int32),
                "ids_out": self.ids_out,
                "num_recv_out": self.num_recv,
                "recv_counts_out": self.recv_counts,
                **self._wait_args(0),
                "max_tokens": cfg.max_tokens_per_rank,
                "counts_offset": self.arena_layout.counts_offset,
                "arrivals_offset": self.arena_layout.dispatch_arrivals_offset,
            },
            {
                **self._row_meta(layout),
                "ROW_WORDS": _words(layout.row_bytes),
                "WP": triton.next_power_of_2(cfg.world_size),
                "BLOCK": self._tuning.copy_block,
                "SCALE_BLOCK": triton.next_power_of_2(max(1, _words(layout.scale_stride))),
                "CLOCK": self._clock,
                "num_warps": self._tuning.recv_warps,
            },
        )

    # -- combine ------------------------------------------------------------------------------

    @property
    def _combine_block(self) -> int:
        """Elements per block: the scale block of blockwise formats, a fixed tile for the others. A block
        longer than the row is the row (the same one block and scale), so that the kernels' block
        vector stays within the row however large ``combine_block`` is."""
        if not wire_formats.COMBINE_BY_NAME[self.config.combine_dtype.value].block_scaled:
            return UNSCALED_COMBINE_BLOCK
        return min(self.config.combine_block, self.config.hidden)

    def _combine_meta(self, tile: int) -> dict[str, object]:
        cfg = self.config
        block_p2 = triton.next_power_of_2(self._combine_block)
        return {
            "HIDDEN": cfg.hidden,
            "SCALE_AT": formats.combine_scale_offset(cfg.hidden),
            "ROW_STRIDE": self.arena_layout.combine_row_stride,
            "FORMAT": wire_formats.COMBINE_BY_NAME[cfg.combine_dtype.value].kernel_code,
            "BLOCK": self._combine_block,
            "BLOCK_P2": block_p2,
            "TILE_BLOCKS": max(1, tile // block_p2),
        }

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        assert isinstance(handle, SlotHandle)  # the op passes back only this provider's handles
        if not self._peers_ready:
            self._resolve_peers()
        send = self._launches.get(("combine_send",)) or self._cached(("combine_send",), self._combine_send_launch)
        rows = y.shape[0]
        send(_contiguous(y) if rows else self._no_rows, rows)
        self._combine_handle = handle

    def _combine_send_launch(self) -> BoundLaunch:
        cfg = self.config
        meta = self._combine_meta(self._tuning.combine_send_tile)
        num_blocks = formats.num_blocks(cfg.hidden, self._combine_block)
        # The native format's sign flag covers the whole row: one item per row.
        whole_row = cfg.combine_dtype is CombineDtype.FP8_BLOCKWISE_NATIVE
        tile_blocks = meta["TILE_BLOCKS"]
        item_blocks = triton.cdiv(num_blocks, tile_blocks) * tile_blocks if whole_row else tile_blocks
        items = triton.cdiv(num_blocks, item_blocks)
        return self._bind(
            transport.combine_send_kernel,
            self._grid(self._tuning.combine_send_programs_per_sm, self.arena_layout.slots * items),
            {
                "peer_bases": self.arena.peer_bases,
                "recv_counts_ptr": self.recv_counts,
                "tickets_ptr": self._ticket("combine_send"),
                "round_ptr": self.rounds[1],
                "status_ptr": self._status.flags,
                "rank": cfg.rank,
                "max_tokens": cfg.max_tokens_per_rank,
                "combine_offset": self.arena_layout.combine_offset,
                "arrivals_offset": self.arena_layout.combine_arrivals_offset,
            },
            {
                **meta,
                "ITEM_BLOCKS": item_blocks,
                "ITEMS": items,
                "FP8_MAX": formats.fp8_max(self.fp8_dtype),
                "MIN_AMAX": formats.min_block_amax(self.fp8_dtype),
                "FP8": self.triton_fp8_type,
                "W": cfg.world_size,
                "WP": triton.next_power_of_2(cfg.world_size),
                "enable_fp_fusion": False,
                "num_warps": self._tuning.combine_send_warps,
            },
            ("y_ptr", "y_rows"),
        )

    def combine_recv(self) -> torch.Tensor:
        if self._combine_handle is None:
            self._refuse_receive("combine")
        handle, self._combine_handle = self._combine_handle, None
        num_tokens = handle.num_tokens
        key = ("combine_recv", num_tokens)
        recv, out = self._launches.get(key) or self._cached(key, self._combine_recv_launch, num_tokens)
        recv()
        self._status.after_step(self.check_status)  # a stalled peer or a bad id raises at a later call
        return out

    def _combine_recv_launch(self, num_tokens: int) -> tuple[BoundLaunch, torch.Tensor]:
        """The combine receive of a batch of ``num_tokens`` and the view of the output it writes."""
        cfg = self.config
        tuning = self._tuning
        if cfg.combine_dtype is CombineDtype.BF16:
            tile, warps = tuning.combine_recv_tile, tuning.combine_recv_warps
        else:
            tile, warps = tuning.combine_recv_tile_fp8, tuning.combine_recv_warps_fp8
        meta = self._combine_meta(tile)
        tiles = triton.cdiv(formats.num_blocks(cfg.hidden, self._combine_block), meta["TILE_BLOCKS"])
        launch = self._bind(
            transport.combine_recv_kernel,
            self._grid(tuning.combine_recv_programs_per_sm, num_tokens * tiles),
            {
                "arena_ptr": self.arena.base,
                "slot_of_pair_ptr": self._slot_of_pair,
                "out_ptr": self.combined_out,
                **self._wait_args(1),
                "num_tokens": num_tokens,
                "combine_offset": self.arena_layout.combine_offset,
                "arrivals_offset": self.arena_layout.combine_arrivals_offset,
            },
            {
                **meta,
                "FP8": self.triton_fp8_type,
                "K": cfg.topk,
                "W": cfg.world_size,
                "WP": triton.next_power_of_2(cfg.world_size),
                "CLOCK": self._clock,
                "enable_fp_fusion": False,  # q * scale then + acc, rounded twice, as the torch reference does
                "num_warps": warps,
            },
        )
        return launch, self.combined_out[:num_tokens]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied only where it is not contiguous (``Tensor.contiguous`` costs a dispatch even then)."""
    return t if t.is_contiguous() else t.contiguous()


def _word_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 4-byte word, as the send kernel reads tokens and scale rows (as
    words, whatever their dtype). A contiguous view that starts at an odd element (``flat[1:].view(n,
    h)``) is copied: a GPU faults on a word load from an address that is not a multiple of 4, and
    ``Tensor.contiguous`` returns such a view as it is."""
    if t.is_contiguous() and t.data_ptr() % 4 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# The first CUDA whose graphs keep programmatic launch edges (the ops are captured in CUDA graphs).
PROGRAMMATIC_LAUNCH_CUDA = (12, 3)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels may launch before the one they follow ends (programmatic dependent launch):
    NVIDIA GPUs from Hopper (sm_90) on, outside the interpreter, where both torch's CUDA and the
    driver (which makes the launches and the graphs) are 12.3 or later, unless TRTLLM_ENABLE_PDL=0."""
    if device.type != "cuda" or torch.version.cuda is None or interpreter.interpreting():
        return False
    if not env.get_bool("TRTLLM_ENABLE_PDL"):
        return False
    toolkit = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    if min(toolkit, cuda_driver_version()) < PROGRAMMATIC_LAUNCH_CUDA:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def cuda_driver_version() -> tuple[int, int]:
    """(major, minor) CUDA version of the installed driver; (0, 0) where no CUDA driver loads."""
    version = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    except OSError:
        return (0, 0)
    return divmod(version.value // 10, 100)
