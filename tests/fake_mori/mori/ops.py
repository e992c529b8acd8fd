"""``mori.ops``: EpDispatchCombineConfig / KernelType / Op with MoRI's signatures and checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from mori import shmem


class EpDispatchCombineKernelType(enum.IntEnum):
    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5


@dataclass
class EpDispatchCombineConfig:
    data_type: torch.dtype
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"


QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")
POISON = 7.0  # rows past the received count hold this, never zeros


class EpDispatchCombineOp:
    instances: ClassVar[list[EpDispatchCombineOp]] = []  # every op built in this process, for tests to inspect

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        if shmem.group is None:
            raise RuntimeError("mori.shmem is not initialised: call shmem_torch_process_group_init first")
        if config.quant_type not in QUANT_TYPES:
            raise ValueError(f"quant_type {config.quant_type}")
        if dist.get_world_size(shmem.group) != config.world_size or dist.get_rank(shmem.group) != config.rank:
            raise ValueError("config rank/world_size disagree with the shmem group")
        self.config = config  # the group is looked up per call: shmem_finalize releases it
        self.calls: list[str] = []
        self._sent_ids: torch.Tensor | None = None
        self._pending: tuple | None = None
        self._handed: tuple = ()
        self._sources: list[tuple[int, int]] = []
        EpDispatchCombineOp.instances.append(self)

    # -- dispatch -------------------------------------------------------------------------------

    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                 call_local_expert_count=False):  # fmt: skip
        self.calls.append("dispatch")
        cfg = self.config
        n = input.shape[0]
        if input.dtype != cfg.data_type or input.dim() != 2:
            raise TypeError(f"input {input.dtype} {tuple(input.shape)}, config data_type {cfg.data_type}")
        if n > cfg.max_num_inp_token_per_rank:
            raise ValueError(f"{n} tokens > max_num_inp_token_per_rank")
        if indices.dtype != torch.int32 or tuple(indices.shape) != (n, cfg.num_experts_per_token):
            raise TypeError(f"indices must be int32 [n, topk], got {indices.dtype} {tuple(indices.shape)}")
        if weights is not None and (weights.dtype != torch.float32 or weights.shape != indices.shape):
            raise TypeError("weights must be float32 [n, topk]")
        if cfg.scale_dim:
            if scales is None or tuple(scales.shape) != (n, cfg.scale_dim):
                raise TypeError(f"scales must be [n, scale_dim={cfg.scale_dim}]")
            if scales.element_size() != cfg.scale_type_size:
                raise TypeError(f"scale elements of {scales.element_size()} B, config says {cfg.scale_type_size}")
        self._sent_ids = indices.clone()
        mine = (input, weights, scales if cfg.scale_dim else None, indices)
        everyone = _all_gather(mine, shmem.group, cfg.world_size)
        rows, self._sources = [], []
        for src, (x, w, s, ids) in enumerate(everyone):
            for t in range(x.shape[0]):
                ranks = {int(e) // cfg.num_experts_per_rank for e in ids[t] if int(e) >= 0}
                if cfg.rank in ranks:
                    rows.append((x[t], None if w is None else w[t], None if s is None else s[t], ids[t]))
                    self._sources.append((src, t))
        cap = cfg.world_size * cfg.max_num_inp_token_per_rank
        width = input.shape[1] * input.element_size()
        out = torch.full((cap, width), 0x77, dtype=torch.uint8).view(input.dtype)
        out_w = torch.full((cap, cfg.num_experts_per_token), POISON)
        out_s = torch.full((cap, cfg.scale_dim), 0x77, dtype=torch.uint8).view(scales.dtype) if cfg.scale_dim else None
        out_i = torch.full((cap, cfg.num_experts_per_token), -7, dtype=torch.int32)
        for j, (x, w, s, ids) in enumerate(rows):
            out[j].view(torch.uint8)[:] = x.view(torch.uint8)
            out_i[j] = ids
            if w is not None:
                out_w[j] = w
            if out_s is not None:
                out_s[j] = s
        total = torch.tensor([len(rows)], dtype=torch.int32)
        return out, out_w, out_s, out_i, total

    def dispatch_send(self, input, weights, scales, indices, block_num=-1, warp_per_block=-1,
                      call_local_expert_count=False):  # fmt: skip
        """AsyncLL: returns the output buffers, still poisoned; dispatch_recv fills them in place."""
        self._require_async("dispatch_send")
        done = self.dispatch(input, weights, scales, indices)
        self.calls[-1] = "dispatch_send"
        self._pending = done
        self._handed = tuple(_poisoned_like(t) for t in done)
        return self._handed

    def dispatch_recv(self, block_num=-1, warp_per_block=-1, call_local_expert_count=False) -> None:
        self._require_async("dispatch_recv")
        self._complete("dispatch_recv")

    # -- combine --------------------------------------------------------------------------------

    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False):  # fmt: skip
        self.calls.append("combine")
        cfg = self.config
        if self._sent_ids is None or not torch.equal(indices, self._sent_ids):
            raise ValueError("combine takes this rank's own dispatch indices")
        if input.dtype != torch.bfloat16 or input.shape[1] != cfg.hidden_dim or input.shape[0] < len(self._sources):
            raise TypeError(f"combine input {input.dtype} {tuple(input.shape)}")
        rows = _wire(input[: len(self._sources)].float(), cfg.quant_type)
        everyone = _gather_raw((rows, self._sources), shmem.group, cfg.world_size)  # f32 rows pickle as they are
        out = torch.full((cfg.max_num_inp_token_per_rank, cfg.hidden_dim), POISON)
        acc = torch.zeros(indices.shape[0], cfg.hidden_dim)
        for ys, sources in everyone:
            for y, (src, t) in zip(ys, sources, strict=True):
                if src == cfg.rank:
                    acc[t] += y
        out[: indices.shape[0]] = acc
        return out.to(torch.bfloat16), None

    def combine_send(self, input, weights, indices, block_num=-1, warp_per_block=-1):
        """AsyncLL: returns ``(out, None)`` with ``out`` poisoned until combine_recv."""
        self._require_async("combine_send")
        done = self.combine(input, weights, indices)
        self.calls[-1] = "combine_send"
        self._pending = done
        self._handed = tuple(_poisoned_like(t) for t in done)
        return self._handed

    def combine_recv(self, block_num=-1, warp_per_block=-1) -> None:
        self._require_async("combine_recv")
        self._complete("combine_recv")

    def _complete(self, name: str) -> None:
        """Fill the buffers the matching send handed out, as the receive kernel does."""
        if self._pending is None:
            raise RuntimeError(f"{name} without its send")
        for handed, done in zip(self._handed, self._pending, strict=True):
            if handed is not None:
                handed.copy_(done)
        self._pending = None
        self.calls.append(name)

    def _require_async(self, name: str) -> None:
        if self.config.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            raise RuntimeError(f"{name} needs kernel_type AsyncLL")


def _poisoned_like(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.element_size() == 1:
        return torch.full(t.shape, 0x77, dtype=torch.uint8).view(t.dtype)
    return torch.full_like(t, 7)


def _pack(t: torch.Tensor | None):
    """Tensors travel as bytes plus their dtype (pickling some low-precision dtypes is not supported)."""
    return None if t is None else (t.contiguous().view(torch.uint8).clone(), t.dtype, tuple(t.shape))


def _unpack(packed) -> torch.Tensor | None:
    if packed is None:
        return None
    data, dtype, shape = packed
    return data.view(dtype).view(shape)


def _gather_raw(obj, group: dist.ProcessGroup, world: int) -> list:
    everyone: list = [None] * world
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def _all_gather(tensors: tuple, group: dist.ProcessGroup, world: int) -> list[tuple]:
    packed = _gather_raw(tuple(_pack(t) for t in tensors), group, world)
    return [tuple(_unpack(p) for p in item) for item in packed]


def _wire(y: torch.Tensor, quant_type: str) -> torch.Tensor:
    """What a row looks like after MoRI's combine wire: exact, or cast to e4m3 (with per-128 scales)."""
    if quant_type == "none":
        return y.to(torch.bfloat16).float()
    if quant_type == "fp8_direct_cast":
        return y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    blocks = y.view(y.shape[0], -1, 128)
    scale = (blocks.abs().amax(dim=2, keepdim=True) / 448).clamp(min=1.0)
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view_as(y)
