"""MoRI's v1 API (``mori.ops.EpDispatchCombineOp``) behind our op API, configured as SGLang does.

- Kernel per mode: IntraNode within a host, InterNodeV1 across hosts, AsyncLL for the low-latency and
  split modes and with ``MORI_ENABLE_SDMA``. Not InterNodeV1LL, which SGLang picks for buffers of at
  most ``SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD`` tokens: its receiver divides a dropped id
  (-1) by the experts per rank towards zero and delivers the slot to rank 0, whose output the combine
  then adds (and with one expert per rank it asserts), while InterNodeV1 skips negative ids.
- SGLang's blocks and warps for each kernel, its wider grid for fp4 dispatch within a host, clamped to
  the GPU's compute units, configured as SGLang configures them (MoRI 1.2.4's IntraNode dispatch then
  runs its own default grid whatever is configured; its combine takes these).
- Scale rows travel as opaque bytes already padded to their 128 B stride (v1 lays the rows it
  receives down packed), so the receiver reads them at the stride our other providers use.
- The quantized combines are MoRI's own: ``quant_type`` per combine dtype, with MoRI's block scales
  (``MORI_FP8_COMBINE_SCALE_DIM`` per token, 56 unless set) whichever blockwise name is configured.
- The receive capacity is capped by ``SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS`` where set, except that
  IntraNode, which does not check the cap, refuses one below what the ranks may send.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mori_sglang import env, formats, wire_formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, combine_block_from_scale_dim
from mori_sglang.providers import mori_ids, on_device
from mori_sglang.providers.base import ProviderSetup
from mori_sglang.providers.mori_provider import (
    INTRANODE_MAX_RANKS,
    MoriProvider,
    capped_recv_tokens,
    init_shmem,
    intranode_kernels_serve,
    receive_cap,
)
from mori_sglang.types import CombineHandle, DispatchOutput

# MoRI v1 numbers every token of every source in int32: ``pe * world * M + token``, with ``world * world *
# M`` the "no token" index (``FlatTokenIndex`` / ``NullFlatTokenIndex`` in its dispatch_combine/common.hpp).
INT32_MAX = 2**31 - 1
QUANT_TYPE = {dtype: wire_formats.COMBINE_BY_NAME[dtype.value].mori_quant_type for dtype in CombineDtype}

# (warps per block, blocks, RDMA blocks) per kernel type, as SGLang launches them.
LAUNCH = {
    "IntraNode": (16, 80, 0),
    "InterNodeV1": (8, 64, 32),
    "InterNodeV1LL": (8, 64, 32),
    "AsyncLL": (8, 64, 32),
}
# SGLang's IntraNode grid for fp4 dispatch: (warps, blocks) below and from 128 tokens per rank.
FP4_INTRANODE_LAUNCH = {"small": (5, 225), "large": (16, 256)}
FP4_SMALL_BATCH = 128

# InterNodeV1 hands out send-buffer slots in whole chunks of this many tokens, in arrival order.
INTERNODE_CHUNK = 64

# Combine quantization each kernel runs (MoRI raises at the first combine otherwise).
BLOCKWISE_KERNELS = {"fp8_blockwise": ("IntraNode", "AsyncLL"), "fp4_blockwise": ("IntraNode",)}


def kernel_type_name(config: EpConfig, ranks_per_host: int) -> str:
    """AsyncLL for the split kinds (the only kernel with separate send and receive calls) and with
    SDMA copies; IntraNode within a host (``mori_provider.intranode_kernels_serve``); InterNodeV1 across hosts at
    every buffer size (not InterNodeV1LL: see the module's docstring)."""
    if config.mode is not Mode.INTRANODE or env.get_bool("MORI_ENABLE_SDMA"):
        return "AsyncLL"
    if intranode_kernels_serve(config, ranks_per_host):
        return "IntraNode"
    return "InterNodeV1"


def gpus_per_node(config: EpConfig, ranks_per_host: int) -> int:
    """MoRI's ``gpu_per_node``, the ranks it reaches over a host's GPU links (``rank // gpu_per_node``
    is a rank's node). A world the intranode kernels serve keeps its size, as SGLang passes it.
    Otherwise MoRI asserts a power of two that divides the world: the largest one of at most
    ``INTRANODE_MAX_RANKS`` that divides a host's ranks (8 for a host of 16, as SGLang's; 2 for hosts
    of 6, whose other ranks MoRI then reaches as it reaches other hosts')."""
    if intranode_kernels_serve(config, ranks_per_host):
        return config.world_size
    return math.gcd(min(ranks_per_host, config.world_size), INTRANODE_MAX_RANKS)


def mori_tokens_per_rank(config: EpConfig, kernel: str) -> int:
    """MoRI's ``max_num_inp_token_per_rank``: InterNodeV1 lays a node's chunks at ``node * M + slot``
    with slots taken in whole chunks of 64 in arrival order, so a full chunk can land at
    ``ceil(M / 64) * 64 - 1``, in the next node's region unless M is a multiple of 64 (EP v2 rounds it
    up for the same reason): there it is rounded up, elsewhere it is the op's."""
    tokens = config.max_tokens_per_rank
    if kernel == "InterNodeV1":
        return -(-tokens // INTERNODE_CHUNK) * INTERNODE_CHUNK
    return tokens


def launch_geometry(config: EpConfig, kernel: str, compute_units: int | None) -> tuple[int, int, int]:
    """(warps per block, blocks, RDMA blocks); IntraNode's blocks at most the compute units (its
    combine ends in a grid-wide barrier every block spins on)."""
    warps, blocks, rdma_blocks = LAUNCH[kernel]
    if kernel == "IntraNode" and config.dispatch_dtype is DispatchDtype.MXFP4:
        size = "small" if config.max_tokens_per_rank < FP4_SMALL_BATCH else "large"
        warps, blocks = FP4_INTRANODE_LAUNCH[size]
    if kernel == "IntraNode" and compute_units is not None:
        blocks = min(blocks, compute_units)
    return warps, blocks, rdma_blocks


def mori_config_kwargs(
    config: EpConfig,
    layout: formats.DispatchRowLayout,
    token_dtype: torch.dtype,
    payload_dtype: torch.dtype,
    ranks_per_host: int,
    compute_units: int | None = None,
) -> dict[str, Any]:
    """The ``EpDispatchCombineConfig`` fields for ``config`` (kernel type by name)."""
    kernel = kernel_type_name(config, ranks_per_host)
    warps, blocks, rdma_blocks = launch_geometry(config, kernel, compute_units)
    return {
        "data_type": token_dtype,
        "rank": config.rank,
        "world_size": config.world_size,
        "hidden_dim": config.hidden,
        # Opaque scale rows: bytes, already padded to the stride the receiver reads them with.
        "scale_dim": layout.scale_stride if layout.scale_bytes else 0,
        "scale_type_size": 1 if layout.scale_bytes else 0,
        "max_token_type_size": max(torch.bfloat16.itemsize, payload_dtype.itemsize),
        "max_num_inp_token_per_rank": mori_tokens_per_rank(config, kernel),
        "num_experts_per_rank": config.num_local_experts,
        "num_experts_per_token": config.topk,
        "warp_num_per_block": warps,
        "block_num": blocks,
        "max_total_recv_tokens": receive_cap(),
        "use_external_inp_buf": True,
        "kernel_type": kernel,
        "gpu_per_node": gpus_per_node(config, ranks_per_host),
        "rdma_block_num": rdma_blocks,
        "num_qp_per_pe": 2,
        "quant_type": QUANT_TYPE[config.combine_dtype],
    }


def check_combine_quantization(config: EpConfig, kernel: str) -> None:
    """MoRI quantizes the combine only in some kernels: fp8 blockwise in IntraNode and AsyncLL, fp4 in
    IntraNode (on gfx950, which MoRI checks itself), and fp4 only in blocks of an even length."""
    quant = QUANT_TYPE[config.combine_dtype]
    if quant in BLOCKWISE_KERNELS and kernel not in BLOCKWISE_KERNELS[quant]:
        raise ConfigError(
            f"SGLANG_MORI_COMBINE_DTYPE={config.combine_dtype.value} is not offered by MoRI's {kernel} kernel "
            f"(mode {config.mode.value}, {config.world_size} ranks); use bf16 or fp8_direct_cast there"
        )
    if config.combine_dtype is not CombineDtype.FP4_BLOCKWISE:
        return
    block = mori_combine_block(config)
    if block % 2:
        # MoRI packs element pairs from each block's start: a block of odd length starts every other
        # block mid-byte, and those pairs are quantized with the next block's scale.
        raise ConfigError(
            f"SGLANG_MORI_COMBINE_DTYPE={wire_formats.COMBINE_BY_NAME[config.combine_dtype.value].user_name} "
            f"(fp4_blockwise) at hidden {config.hidden} gives blocks of {block} elements (ceil(hidden / "
            f"MORI_FP8_COMBINE_SCALE_DIM), {wire_formats.NATIVE_COMBINE_SCALES} scales unless set); MoRI's fp4 "
            "combine needs blocks of an even length: set MORI_FP8_COMBINE_SCALE_DIM so that ceil(hidden / it) is even"
        )


def mori_combine_block(config: EpConfig) -> int:
    """The block MoRI's blockwise combines (fp8 and fp4) quantize in: it reads MORI_FP8_COMBINE_SCALE_DIM
    (scales per token) from the process environment itself, whatever the op's config says."""
    scales = env.get_int("MORI_FP8_COMBINE_SCALE_DIM") or wire_formats.NATIVE_COMBINE_SCALES
    return combine_block_from_scale_dim(config.hidden, scales)


def check_receive_cap(config: EpConfig, kernel: str) -> None:
    """IntraNode lays received rows down without checking them against MoRI's receive cap (the other v1
    kernels assert on it): there a cap below what every rank may send is refused, as a batch past it
    would write past MoRI's buffer."""
    if kernel == "IntraNode" and capped_recv_tokens(config) < config.max_recv_tokens:
        raise ConfigError(
            f"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS={receive_cap()} caps MoRI's IntraNode receive buffer below the "
            f"{config.max_recv_tokens} rows {config.world_size} ranks of {config.max_tokens_per_rank} tokens may "
            "send, and that kernel does not check the cap: unset it (0) or raise it to that"
        )


def check_token_index_range(config: EpConfig, kernel: str) -> None:
    """A buffer whose flat token indices pass int32 would wrap them inside MoRI's kernels (tokens sent
    to the wrong rows): refused when the op is built, naming the knob and the largest value that fits
    (on InterNodeV1, after MoRI's buffer is rounded up to whole chunks)."""
    world = config.world_size
    largest = INT32_MAX // (world * world)
    if kernel == "InterNodeV1":
        largest = largest // INTERNODE_CHUNK * INTERNODE_CHUNK
    if config.max_tokens_per_rank > largest:
        raise ConfigError(
            f"SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK={config.max_tokens_per_rank} is too large for native "
            f"MoRI v1's {kernel} kernel on {world} ranks: it indexes tokens in int32 ({world} x {world} x tokens per "
            f"rank must stay below 2^31); at most {largest} here"
        )


def _compute_units(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class MoriV1Handle(CombineHandle):
    """MoRI v1's combine takes the top-k ids this rank dispatched (as MoRI saw them): they are the routing."""

    sent_ids: torch.Tensor


class MoriV1Provider(MoriProvider):
    """Our op API over one ``mori.ops.EpDispatchCombineOp``."""

    def __init__(self, setup: ProviderSetup) -> None:
        import mori

        super().__init__(setup)
        config, device, layout, group = setup.config, setup.device, setup.layout, setup.group
        self.kernel = kernel_type_name(config, setup.host_ranks())
        check_combine_quantization(config, self.kernel)
        check_receive_cap(config, self.kernel)
        check_token_index_range(config, self.kernel)
        self._max_recv_tokens = capped_recv_tokens(config, mori_tokens_per_rank(config, self.kernel))
        with on_device(device):
            init_shmem(setup.cpu_group or group or dist.group.WORLD)
        kwargs = mori_config_kwargs(
            config, layout, self.token_dtype, setup.payload_dtype, setup.host_ranks(), _compute_units(device)
        )
        kwargs["kernel_type"] = getattr(mori.ops.EpDispatchCombineKernelType, self.kernel)
        # Older MoRI releases lack some fields (quant_type, rdma_block_num...): pass what this one has.
        fields = {f.name for f in dataclasses.fields(mori.ops.EpDispatchCombineConfig)}
        if kwargs["quant_type"] != "none" and "quant_type" not in fields:
            raise ConfigError(
                f"SGLANG_MORI_COMBINE_DTYPE={config.combine_dtype.value}: this MoRI has no quantized combine; "
                "use bf16 or upgrade MoRI"
            )
        with on_device(device):
            self.op = mori.ops.EpDispatchCombineOp(
                mori.ops.EpDispatchCombineConfig(**{k: v for k, v in kwargs.items() if k in fields})
            )
        self._split = self.kernel == "AsyncLL"
        self._sent_ids: torch.Tensor | None = None
        self._dispatched: tuple | None = None
        self._combined: torch.Tensor | None = None
        self._num_tokens = 0
        self._awaiting_combine = False

    # -- dispatch -----------------------------------------------------------------------------

    def _routing(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights) as this kernel must see them (see ``mori_ids``)."""
        dropped = mori_ids.flag_past_last(ids, self.config.num_experts, self._status)
        if self._split:
            return mori_ids.asyncll_routing(ids, weights, dropped, self.config.num_experts)
        return mori_ids.negative_for_dropped(ids, dropped), weights.to(torch.float32).contiguous()

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
        if self._awaiting_combine and not self._split:
            raise RuntimeError(
                f"dispatch_send before the previous dispatch was combined: MoRI's {self.kernel} kernel adds each "
                "dispatch's rows to a receive count only its combine clears, so the new dispatch would count (and "
                "its combine read) the old rows too; combine each dispatch before the next dispatch_send"
            )
        self._num_tokens = payload.shape[0]
        self._sent_ids, sent_weights = self._routing(ids, weights)
        padded = None
        if layout.scale_bytes:
            padded = torch.zeros(payload.shape[0], layout.scale_stride, dtype=torch.uint8, device=payload.device)
            padded[:, : layout.scale_bytes] = scales
        tokens = payload.contiguous().view(self.token_dtype)
        args = (tokens, sent_weights, padded, self._sent_ids)
        # AsyncLL hands its output buffers back from the send; dispatch_recv fills them.
        self._dispatched = self.op.dispatch_send(*args) if self._split else self.op.dispatch(*args)
        self._awaiting_combine = True

    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        if self._dispatched is None:
            raise RuntimeError("dispatch_recv called without a dispatch_send before it")
        if self._split:
            self.op.dispatch_recv()
        self._status.after_step(self.check_status)
        tokens, weights, scales, ids, num_recv = self._dispatched[:5]
        self._dispatched = None
        if self._split:
            ids = mori_ids.asyncll_received(ids)
        scale_view = None
        if layout.scale_bytes:
            if scales is None:  # some MoRI releases return none for an empty batch
                scales = torch.zeros(tokens.shape[0], layout.scale_stride, dtype=torch.uint8, device=tokens.device)
            scale_view = scales.view(torch.uint8)[:, : layout.scale_bytes]
        handle = MoriV1Handle(num_tokens=self._num_tokens, num_recv=num_recv, sent_ids=self._sent_ids)
        return DispatchOutput(
            tokens=tokens.view(torch.uint8).view(token_dtype),
            topk_weights=weights,
            topk_ids=ids,
            scales=scale_view,
            scale_stride=layout.scale_stride,
            num_recv=num_recv,
            handle=handle,
        )

    # -- combine ------------------------------------------------------------------------------

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        """MoRI sums the returned rows unweighted: the expert side applied the weights already."""
        assert isinstance(handle, MoriV1Handle)  # the op passes back only this provider's handles
        ids = handle.sent_ids
        y = y.to(torch.bfloat16).contiguous()
        self._flag_short_outputs(y, handle.num_recv)
        self._num_tokens = handle.num_tokens
        send = self.op.combine_send if self._split else self.op.combine
        self._combined = send(y, None, ids)[0]
        self._awaiting_combine = False

    def combine_recv(self) -> torch.Tensor:
        if self._combined is None:
            raise RuntimeError("combine_recv called without a combine_send before it")
        if self._split:
            self.op.combine_recv()
        self._status.after_step(self.check_status)
        out, self._combined = self._combined, None
        return out[: self._num_tokens]
