"""The native MoRI provider: AMD's compiled HIP kernels (``mori.ops.EpDispatchCombineOp``) behind our op API.

It configures MoRI as SGLang's own ``moriep.py`` does (kernel type per mode; its blocks and warps for
the IntraNode, InterNodeV1 and AsyncLL kernels; ``quant_type`` per combine dtype) and adapts the
results to ``DispatchOutput``:

- scale rows travel as opaque bytes already padded to their 128 B stride with zero pads, so the receiver
  gets the same strided view as from our other providers;
- the combine returns the per-token sum of the (weighted) expert outputs, sliced to the batch;
- with the native kernels the fp8 blockwise combine is MoRI's own format (its scales, see
  ``formats.FP8_BLOCKWISE_NATIVE``) whichever of our two blockwise names is configured, since MoRI's
  kernels write the wire rows.

Received rows come in MoRI's order. MoRI allocates symmetric memory for the op, so building one is a
collective over the group, as is the shmem bootstrap done once per process. MoRI's split kernel
(AsyncLL) returns its outputs from the ``*_send`` calls; they hold the data once ``*_recv`` returned.
Expert ids past the last expert are sent as dropped (-1) and raised one call later, without a host
synchronisation (as the Triton provider does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from mori_sglang import formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode
from mori_sglang.providers.device_status import DeviceStatus
from mori_sglang.types import CombineHandle, DispatchOutput, expert_id_error

# The name MoRI's shmem bootstrap looks the process group up by (the one SGLang and vLLM register).
SHMEM_GROUP_NAME = "mori"

QUANT_TYPE = {
    CombineDtype.BF16: "none",
    CombineDtype.FP8_DIRECT_CAST: "fp8_direct_cast",
    CombineDtype.FP8_BLOCKWISE: "fp8_blockwise",
    CombineDtype.FP8_BLOCKWISE_NATIVE: "fp8_blockwise",
    CombineDtype.FP4_BLOCKWISE: "fp4_blockwise",
}

# (warps per block, blocks, RDMA blocks) per kernel type, as SGLang launches them.
LAUNCH = {
    "IntraNode": (16, 80, 0),
    "InterNodeV1": (8, 64, 32),
    "AsyncLL": (8, 64, 32),
}

_shmem_ready = False


def kernel_type_name(config: EpConfig) -> str:
    """IntraNode within a node, InterNodeV1 across nodes; the split kinds (low latency, and split
    mode's async combine) need AsyncLL, the only kernel with separate send and receive calls."""
    if config.mode is not Mode.INTRANODE:
        return "AsyncLL"
    return "IntraNode" if config.world_size <= 8 else "InterNodeV1"


def _bootstrap_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """MoRI's bootstrap exchanges host buffers: a gloo group over the same ranks (SGLang and vLLM
    hand it their CPU group). Building one is a collective over the default group."""
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def _init_shmem(group: dist.ProcessGroup) -> None:
    """Register a CPU group under MoRI's name and bootstrap MoRI's shmem over it, once per process. A
    name registered already means the serving framework bootstrapped MoRI itself."""
    global _shmem_ready
    if _shmem_ready:
        return
    import mori

    try:
        torch._C._distributed_c10d._register_process_group(SHMEM_GROUP_NAME, _bootstrap_group(group))
    except RuntimeError as err:
        if "already" not in str(err):
            raise
        _shmem_ready = True
        return
    mori.shmem.shmem_torch_process_group_init(SHMEM_GROUP_NAME)
    _shmem_ready = True


def finalize_shmem() -> None:
    """Tear MoRI's shmem down and drop the group registration (before the process group is destroyed)."""
    global _shmem_ready
    if not _shmem_ready:
        return
    import mori

    mori.shmem.shmem_finalize()
    torch._C._distributed_c10d._unregister_process_group(SHMEM_GROUP_NAME)
    _shmem_ready = False


def mori_token_dtype(config: EpConfig, payload_dtype: torch.dtype) -> torch.dtype:
    """The element type MoRI is told its tokens have: packed e2m1 pairs for fp4 (as SGLang passes them)."""
    return torch.float4_e2m1fn_x2 if config.dispatch_dtype is DispatchDtype.MXFP4 else payload_dtype


def mori_config_kwargs(
    config: EpConfig, layout: formats.DispatchRowLayout, payload_dtype: torch.dtype
) -> dict[str, Any]:
    """The ``EpDispatchCombineConfig`` fields for ``config`` (kernel type by name)."""
    warps, blocks, rdma_blocks = LAUNCH[kernel_type_name(config)]
    return {
        "data_type": mori_token_dtype(config, payload_dtype),
        "rank": config.rank,
        "world_size": config.world_size,
        "hidden_dim": config.hidden,
        # Opaque scale rows: bytes, already padded to the stride the receiver reads them with.
        "scale_dim": layout.scale_stride if layout.scale_bytes else 0,
        "scale_type_size": 1 if layout.scale_bytes else 0,
        "max_token_type_size": max(torch.bfloat16.itemsize, payload_dtype.itemsize),
        "max_num_inp_token_per_rank": config.max_tokens_per_rank,
        "num_experts_per_rank": config.num_local_experts,
        "num_experts_per_token": config.topk,
        "warp_num_per_block": warps,
        "block_num": blocks,
        "use_external_inp_buf": True,
        "gpu_per_node": min(8, config.world_size),
        "rdma_block_num": rdma_blocks,
        "num_qp_per_pe": 2,
        "quant_type": QUANT_TYPE[config.combine_dtype],
    }


class MoriProvider:
    """Our op API over one ``mori.ops.EpDispatchCombineOp``."""

    name = "mori"
    fused_quantization: frozenset[DispatchDtype] = frozenset()
    keeps_old_handles = False  # MoRI's combine reads the state of the op's last dispatch

    def __init__(
        self,
        config: EpConfig,
        device: torch.device,
        layout: formats.DispatchRowLayout,
        payload_dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        import mori

        kernel = kernel_type_name(config)
        # MoRI quantizes the combine only in some kernels: fp4 in IntraNode, fp8 blockwise not across nodes.
        if (config.combine_dtype is CombineDtype.FP4_BLOCKWISE and kernel != "IntraNode") or (
            QUANT_TYPE[config.combine_dtype] == "fp8_blockwise" and kernel == "InterNodeV1"
        ):
            raise ConfigError(
                f"SGLANG_MORI_COMBINE_DTYPE={config.combine_dtype.value} is not offered by MoRI's {kernel} kernel "
                f"(mode {config.mode.value}, {config.world_size} ranks); use bf16 or fp8_direct_cast there"
            )
        _init_shmem(group or dist.group.WORLD)
        self.config = config
        kwargs = mori_config_kwargs(config, layout, payload_dtype)
        self.token_dtype = kwargs["data_type"]
        kwargs["kernel_type"] = getattr(mori.ops.EpDispatchCombineKernelType, kernel)
        # Older MoRI releases lack some fields (quant_type, rdma_block_num...): pass what this one has.
        fields = {f.name for f in dataclasses.fields(mori.ops.EpDispatchCombineConfig)}
        if kwargs["quant_type"] != "none" and "quant_type" not in fields:
            raise ConfigError(
                f"SGLANG_MORI_COMBINE_DTYPE={config.combine_dtype.value}: this MoRI has no quantized combine; "
                "use bf16 or upgrade MoRI"
            )
        self.op = mori.ops.EpDispatchCombineOp(
            mori.ops.EpDispatchCombineConfig(**{k: v for k, v in kwargs.items() if k in fields})
        )
        self._split = kernel == "AsyncLL"
        # On a GPU the ids are checked on the device and a bad one raises at the next receive; on CPU
        # the op checks them before sending (a synchronisation costs nothing there).
        self.checks_ids_on_device = device.type == "cuda"
        self._status = DeviceStatus(1, device)  # the largest expert id past the last expert, minus (num_experts - 1)
        self._ids: torch.Tensor | None = None
        self._dispatched: tuple | None = None
        self._combined: torch.Tensor | None = None
        self._num_tokens = 0

    def check_status(self) -> None:
        """Raise if a dispatch met an expert id past the last expert (those copies were dropped)."""
        (bad_id,) = self._status.read()
        if bad_id:
            raise expert_id_error(bad_id + self.config.num_experts - 1, self.config.num_experts, dropped=True)

    def _checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """int32 ids with those past the last expert dropped (-1) and flagged, all on the device; every
        negative id (int64 ones included) is -1. Compared before the cast, so that no id is truncated."""
        over = ids >= self.config.num_experts
        past = ids.long() - (self.config.num_experts - 1)  # >= 1 for an id past the last expert, never overflows
        flag = torch.where(over, past, 0).amax() if ids.numel() else self._status.flags[0]
        torch.maximum(self._status.flags[0], flag, out=self._status.flags[0])
        return torch.where(over | (ids < 0), -1, ids).to(torch.int32).contiguous()

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
        if quantize:
            raise RuntimeError("the MoRI provider carries pre-quantized tokens (it fuses no quantization)")
        self._num_tokens = payload.shape[0]
        self._ids = self._checked_ids(ids)
        padded = None
        if layout.scale_bytes:
            padded = torch.zeros(payload.shape[0], layout.scale_stride, dtype=torch.uint8, device=payload.device)
            padded[:, : layout.scale_bytes] = scales
        tokens = payload.contiguous().view(self.token_dtype)
        args = (tokens, weights.to(torch.float32).contiguous(), padded, self._ids)
        # AsyncLL hands its output buffers back from the send; dispatch_recv fills them.
        self._dispatched = self.op.dispatch_send(*args) if self._split else self.op.dispatch(*args)

    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        if self._dispatched is None:
            raise RuntimeError("dispatch_recv called without a dispatch_send before it")
        if self._split:
            self.op.dispatch_recv()
        self._status.after_step(self.check_status)
        tokens, weights, scales, ids, num_recv = self._dispatched[:5]
        self._dispatched = None
        scale_view = None
        if layout.scale_bytes:
            if scales is None:  # some MoRI releases return none for an empty batch
                scales = torch.zeros(tokens.shape[0], layout.scale_stride, dtype=torch.uint8, device=tokens.device)
            scale_view = scales.view(torch.uint8)[:, : layout.scale_bytes]
        handle = CombineHandle(  # MoRI's combine takes this rank's own ids: they stand in for the slots
            num_tokens=self._num_tokens,
            copy_of_pair=self._ids,
            slot_of_pair=self._ids,
            recv_src=None,
            recv_pos=None,
            recv_counts=num_recv,
            num_recv=num_recv,
        )
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
        ids = handle.copy_of_pair  # this rank's own routing, which MoRI's combine takes
        y = y.to(torch.bfloat16).contiguous()
        self._num_tokens = handle.num_tokens
        send = self.op.combine_send if self._split else self.op.combine
        self._combined = send(y, None, ids)[0]

    def combine_recv(self) -> torch.Tensor:
        if self._combined is None:
            raise RuntimeError("combine_recv called without a combine_send before it")
        if self._split:
            self.op.combine_recv()
        out, self._combined = self._combined, None
        return out[: self._num_tokens]
