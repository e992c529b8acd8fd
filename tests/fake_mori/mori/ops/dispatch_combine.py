"""``mori.ops.dispatch_combine``: MoRI's v1 op as ``amd-mori`` 1.2.4 behaves, on CPU ranks.

What the real op does and the stand-in reproduces:

- outputs are views of buffers the op owns, handed out again (the same tensor objects) by every call
  and overwritten by the next one; rows past the received count keep what they held;
- ``combine`` sends rows back along the routing the op kept from its last dispatch; its ``indices``
  only have to have that dispatch's row count (ROCm/mori#475);
- the destination of a copy is ``expert / num_experts_per_rank`` in C++ integer division. AsyncLL
  drops destinations outside ``[0, world_size)`` (so -1 goes to rank 0) and its receiver asserts that
  every id of a received row names a rank; the other kernels drop negative ids;
- a token goes once to each rank among its experts (later top-k slots to the same rank are dropped);
- AsyncLL's ``*_send`` returns the output views, which its ``*_recv`` fills;
- the combine's numerics follow the GPU architecture (``mori._numerics``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from mori import _numerics, _wire, shmem
from mori.jit.config import detect_gpu_arch

TOPK_IDX_DTYPE = torch.int32
_TOKEN_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2)


class EpDispatchCombineKernelType(enum.IntEnum):
    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5


class EpDispatchCombineQuantType(enum.IntEnum):
    None_ = 0
    Fp8DirectCast = 1
    Fp8BlockwiseQuant = 2
    Fp4BlockwiseQuant = 3


_QUANT_TYPE_MAP = {
    "none": EpDispatchCombineQuantType.None_,
    "fp8_direct_cast": EpDispatchCombineQuantType.Fp8DirectCast,
    "fp8_blockwise": EpDispatchCombineQuantType.Fp8BlockwiseQuant,
    "fp4_blockwise": EpDispatchCombineQuantType.Fp4BlockwiseQuant,
}

_KT = EpDispatchCombineKernelType
_QT = EpDispatchCombineQuantType
# Which kernels run a blockwise combine (the real op raises ValueError at the combine otherwise).
_BLOCKWISE_KERNELS = {
    _QT.Fp8BlockwiseQuant: (_KT.IntraNode, _KT.IntraNodeLL, _KT.AsyncLL),
    _QT.Fp4BlockwiseQuant: (_KT.IntraNode, _KT.IntraNodeLL),
}


def _normalize_quant_type(quant_type) -> EpDispatchCombineQuantType:
    if isinstance(quant_type, EpDispatchCombineQuantType):
        return quant_type
    if isinstance(quant_type, str) and quant_type.strip().lower() in _QUANT_TYPE_MAP:
        return _QUANT_TYPE_MAP[quant_type.strip().lower()]
    raise ValueError(f"invalid quant_type '{quant_type}', expected one of {list(_QUANT_TYPE_MAP)}")


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


@dataclass
class _Received:
    """One rank's dispatch result, before it lands in the output buffers."""

    tokens: torch.Tensor  # [R, row bytes] uint8
    weights: torch.Tensor | None
    scales: torch.Tensor | None  # [R, scale bytes] uint8
    indices: torch.Tensor
    sources: list[tuple[int, int]]  # (source rank, source token) per row


class EpDispatchCombineOp:
    instances: ClassVar[list[EpDispatchCombineOp]] = []  # every op built in this process, for tests

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        if shmem.group is None:
            raise RuntimeError("mori.shmem is not initialised: call shmem_torch_process_group_init first")
        self.config = config
        quant = _normalize_quant_type(config.quant_type)
        if quant is _QT.Fp4BlockwiseQuant and "gfx950" not in str(detect_gpu_arch()):
            raise ValueError(f"quant_type='fp4_blockwise' combine requires a gfx950 GPU; got {detect_gpu_arch()}")
        if dist.get_world_size(shmem.group) != config.world_size or dist.get_rank(shmem.group) != config.rank:
            raise ValueError("config rank/world_size disagree with the shmem group")
        self._quant = quant
        self._fp8_blockwise_combine_scale_dim = _numerics.scale_dim_from_env() if quant in _BLOCKWISE_KERNELS else 0
        row_bytes = config.hidden_dim * config.max_token_type_size
        recv = self.max_num_tokens_to_recv()
        self._buffers = {
            "disp_out": _wire.poisoned(recv * row_bytes),
            "disp_w": _wire.poisoned(recv * config.num_experts_per_token * 4),
            "disp_s": _wire.poisoned(recv * max(config.scale_dim * config.scale_type_size, 1)),
            "disp_i": _wire.poisoned(recv * config.num_experts_per_token * 4),
            "disp_total": torch.zeros(4, dtype=torch.uint8),  # the count the kernels add to: zeroed at creation
            "comb_out": _wire.poisoned(config.max_num_inp_token_per_rank * row_bytes),
        }
        self._views: dict[tuple, torch.Tensor] = {}
        self.calls: list[str] = []
        self._lane_dest: torch.Tensor | None = None  # [n, K] destination rank per top-k slot, -1: not sent
        self._num_tokens = 0
        self._sources: list[tuple[int, int]] = []
        self._pending_dispatch: tuple[_Received, tuple] | None = None
        self._pending_combine: torch.Tensor | None = None
        self._dispatch_dtype: torch.dtype | None = None
        EpDispatchCombineOp.instances.append(self)
        dist.barrier()  # the real constructor meets every rank of the job, twice: a collective over all
        dist.barrier()

    # -- sizes --------------------------------------------------------------------------------

    def max_num_tokens_to_recv_per_rank(self) -> int:
        cfg = self.config
        if cfg.max_total_recv_tokens > 0:
            return min(-(-cfg.max_total_recv_tokens // cfg.world_size), cfg.max_num_inp_token_per_rank)
        return cfg.max_num_inp_token_per_rank

    def max_num_tokens_to_recv(self) -> int:
        return self.config.world_size * self.max_num_tokens_to_recv_per_rank()

    def _view(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The same tensor object for the same (buffer, shape, dtype), as the real op's view cache."""
        cache_key = (key, shape, dtype)
        if cache_key not in self._views:
            size = torch.empty((), dtype=dtype).element_size()
            count = math.prod(shape)
            self._views[cache_key] = self._buffers[key][: count * size].view(dtype).view(shape)
        return self._views[cache_key]

    # -- dispatch -------------------------------------------------------------------------------

    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                 call_local_expert_count=False, *, routing=None, return_routing=False):  # fmt: skip
        if routing is not None or return_routing:
            raise NotImplementedError("the stand-in does not model v1 routing handles")
        cfg = self.config
        self._check_dispatch(input, weights, scales, indices)
        self.calls.append("dispatch")
        n = input.shape[0]
        self._dispatch_dtype = input.dtype
        self._num_tokens = n
        self._lane_dest = self._destinations(indices)
        has_scales = scales is not None and cfg.scale_dim > 0
        mine = (
            _wire.as_bytes(input),
            None if weights is None else weights.float(),
            _wire.as_bytes(scales) if has_scales else None,
            indices.clone(),
            self._lane_dest,
        )
        received = self._receive(_wire.gather(mine, shmem.group))
        if received.tokens.shape[0] > self.max_num_tokens_to_recv():
            raise RuntimeError(
                f"device assert: {received.tokens.shape[0]} tokens received, the buffers hold "
                f"{self.max_num_tokens_to_recv()} (max_total_recv_tokens={cfg.max_total_recv_tokens})"
            )
        self._sources = received.sources
        views = self._dispatch_views(input, scales if has_scales else None)
        if cfg.kernel_type != _KT.AsyncLL and int(views[4][0]):
            raise AssertionError(
                "stand-in: a dispatch before the previous dispatch's combine; the real kernels add its rows to "
                "the uncleared receive count (intranode.hpp atomicAdd on totalRecvTokenNum), which is not modelled"
            )
        if cfg.kernel_type == _KT.AsyncLL:
            views[4][0] = 0  # the slot-assign kernel clears the count; the receive kernels fill the rest
            self._pending_dispatch = (received, views)
        else:
            self._land(received, views)
        return views

    def _check_dispatch(self, input, weights, scales, indices) -> None:
        cfg = self.config
        if input.dim() != 2 or input.dtype not in _TOKEN_DTYPES:
            raise TypeError(f"input must be a 2-D tensor of {_TOKEN_DTYPES}, got {input.dtype} {tuple(input.shape)}")
        if input.shape[1] * input.element_size() > cfg.hidden_dim * cfg.max_token_type_size:
            raise ValueError("input rows are wider than hidden_dim * max_token_type_size")
        n = input.shape[0]
        if n > cfg.max_num_inp_token_per_rank:
            raise ValueError(f"{n} tokens > max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}")
        if indices.dtype != TOPK_IDX_DTYPE or tuple(indices.shape) != (n, cfg.num_experts_per_token):
            raise TypeError(f"indices must be int32 [n, topk], got {indices.dtype} {tuple(indices.shape)}")
        if weights is not None and (weights.dtype != torch.float32 or weights.shape != indices.shape):
            raise TypeError("weights must be float32 [n, topk]")
        if scales is not None and cfg.scale_dim > 0:
            row = scales.shape[1] * scales.element_size() if scales.dim() == 2 else -1
            if scales.shape[0] != n or row != cfg.scale_dim * cfg.scale_type_size:
                raise TypeError(
                    f"scale rows of {row} B for {scales.shape[0]} tokens; the kernel reads "
                    f"scale_dim * scale_type_size = {cfg.scale_dim * cfg.scale_type_size} B for each of {n}"
                )

    def _destinations(self, indices: torch.Tensor) -> torch.Tensor:
        """Destination rank of each top-k slot as the kernel computes it, -1 where nothing is sent."""
        cfg = self.config
        pe = _wire.trunc_div(indices.long(), cfg.num_experts_per_rank)
        in_range = (pe >= 0) & (pe < cfg.world_size)
        # AsyncLL and InterNodeV1LL's receiver take -1 / experts-per-rank (0, towards zero) as rank 0.
        if cfg.kernel_type not in (_KT.AsyncLL, _KT.InterNodeV1LL):
            in_range &= indices >= 0
        k = indices.shape[1]
        earlier = torch.ones(k, k, dtype=torch.bool).tril(diagonal=-1)
        same = (pe[:, :, None] == pe[:, None, :]) & in_range[:, None, :]
        repeated = (same & earlier).any(dim=2)
        return torch.where(in_range & ~repeated, pe, -1)

    def _receive(self, everyone: list[tuple]) -> _Received:
        cfg = self.config
        tokens, weights, scales, indices, sources = [], [], [], [], []
        for src, (x, w, s, ids, dest) in enumerate(everyone):
            for t in range(x.shape[0]):
                if not bool((dest[t] == cfg.rank).any()):
                    continue
                if cfg.kernel_type == _KT.AsyncLL:
                    pe = _wire.trunc_div(ids[t].long(), cfg.num_experts_per_rank)
                    if bool(((pe < 0) | (pe >= cfg.world_size)).any()):
                        raise RuntimeError(
                            f"device assert on rank {cfg.rank}: AsyncLL received a token whose ids "
                            f"{ids[t].tolist()} name no rank"
                        )
                tokens.append(x[t])
                weights.append(None if w is None else w[t])
                scales.append(None if s is None else s[t])
                indices.append(ids[t])
                sources.append((src, t))

        def stack(rows: list, empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.stack(rows) if rows else torch.empty(empty_shape, dtype=dtype)

        k = cfg.num_experts_per_token
        have_w = bool(weights) and weights[0] is not None
        have_s = bool(scales) and scales[0] is not None
        return _Received(
            tokens=stack(tokens, (0, 0), torch.uint8),
            weights=stack(weights, (0, k), torch.float32) if have_w else None,
            scales=stack(scales, (0, 0), torch.uint8) if have_s else None,
            indices=stack(indices, (0, k), TOPK_IDX_DTYPE),
            sources=sources,
        )

    def _dispatch_views(self, input: torch.Tensor, scales: torch.Tensor | None) -> tuple:
        cfg = self.config
        recv, k = self.max_num_tokens_to_recv(), cfg.num_experts_per_token
        out_scales = None
        if scales is not None:
            out_scales = self._view("disp_s", (recv, cfg.scale_dim), scales.dtype)
        return (
            self._view("disp_out", (recv, input.shape[1]), input.dtype),
            self._view("disp_w", (recv, k), torch.float32),
            out_scales,
            self._view("disp_i", (recv, k), TOPK_IDX_DTYPE),
            self._view("disp_total", (1,), TOPK_IDX_DTYPE),
        )

    def _land(self, received: _Received, views: tuple) -> None:
        out, out_w, out_s, out_i, total = views
        rows = received.tokens.shape[0]
        if rows:
            out[:rows].view(torch.uint8).view(rows, -1)[:] = received.tokens
            out_i[:rows] = received.indices
            if received.weights is not None:
                out_w[:rows] = received.weights
            if out_s is not None and received.scales is not None:
                out_s[:rows].view(torch.uint8).view(rows, -1)[:] = received.scales
        total[0] = rows

    def dispatch_send(self, input, weights, scales, indices, block_num=-1, warp_per_block=-1,
                      call_local_expert_count=False):  # fmt: skip
        views = self.dispatch(input, weights, scales, indices, block_num=block_num, warp_per_block=warp_per_block)
        self.calls[-1] = "dispatch_send"
        return views

    def dispatch_recv(self, block_num=-1, warp_per_block=-1, call_local_expert_count=False):
        if self._dispatch_dtype is None:
            raise AssertionError("dispatch_recv requires a prior dispatch/dispatch_send call")
        if self.config.kernel_type != _KT.AsyncLL:
            raise ValueError(f"dispatch_recv only supports AsyncLL, got kernel_type={self.config.kernel_type.value}")
        self.calls.append("dispatch_recv")
        if self._pending_dispatch is not None:
            received, views = self._pending_dispatch
            self._pending_dispatch = None
            self._land(received, views)

    # -- combine --------------------------------------------------------------------------------

    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False, *, routing=None):  # fmt: skip
        if routing is not None:
            raise NotImplementedError("the stand-in does not model v1 routing handles")
        cfg = self.config
        self.calls.append("combine")
        if self._lane_dest is None:
            raise AssertionError("combine before any dispatch")
        if int(indices.size(0)) != self._num_tokens:
            raise ValueError(
                f"combine() indices has {int(indices.size(0))} rows but this rank dispatched {self._num_tokens} "
                "tokens. Pass this rank's own [num_tokens, topk] routing (ROCm/mori#475)."
            )
        if weights is not None:
            raise NotImplementedError("the stand-in does not model the weighted combine")
        self._check_combine(input, use_external_inp_buf)
        rows = len(self._sources)
        if input.shape[1] != cfg.hidden_dim:
            raise ValueError(f"combine input {tuple(input.shape)}: rows of hidden {cfg.hidden_dim}")
        if input.shape[0] < rows:  # the kernels take no row count: they read the missing rows past the end
            past_end = _wire.poisoned((rows - input.shape[0]) * cfg.hidden_dim * input.element_size())
            input = torch.cat([input, past_end.view(input.dtype).view(-1, cfg.hidden_dim)])
        wire = self._wire(input[:rows])
        everyone = _wire.gather((*wire, self._sources), shmem.group)
        result = self._accumulate(everyone, input.dtype)
        out = self._view("comb_out", (cfg.max_num_inp_token_per_rank, cfg.hidden_dim), input.dtype)
        if cfg.kernel_type == _KT.AsyncLL:
            self._pending_combine = result
        else:
            out[: self._num_tokens] = result
            self._view("disp_total", (1,), TOPK_IDX_DTYPE)[0] = 0  # only the combine clears the count
        return out, None

    def _check_combine(self, input: torch.Tensor, use_external_inp_buf: int) -> None:
        cfg = self.config
        if input.dtype not in (torch.float32, torch.bfloat16):
            raise KeyError(f"no combine kernel for {input.dtype}")
        if self._quant in _BLOCKWISE_KERNELS:
            label = "fp4_blockwise" if self._quant is _QT.Fp4BlockwiseQuant else "fp8_blockwise"
            if cfg.kernel_type not in _BLOCKWISE_KERNELS[self._quant]:
                raise ValueError(f"{label} combine does not run on kernel_type {cfg.kernel_type.name}")
            if input.dtype != torch.bfloat16:
                raise ValueError(f"{label} combine only supports bf16, got {input.dtype}")
            external = use_external_inp_buf if use_external_inp_buf >= 0 else int(cfg.use_external_inp_buf)
            if not external:
                raise ValueError(f"{label} combine currently requires useExternalInpBuffer=True")

    def _wire(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a received row becomes on its way back: (values, blockwise scales or None)."""
        fp8 = _numerics.combine_fp8()
        if self._quant is _QT.Fp8DirectCast and y.dtype == torch.bfloat16:
            return _numerics.direct_cast(y, fp8), None
        if self._quant is _QT.Fp8BlockwiseQuant:
            return _numerics.quantize_blockwise(y, fp8, self._fp8_blockwise_combine_scale_dim)
        if self._quant is _QT.Fp4BlockwiseQuant:
            return _numerics.quantize_fp4_blockwise(y, self._fp8_blockwise_combine_scale_dim)
        return y.clone(), None

    def _accumulate(self, everyone: list[tuple], dtype: torch.dtype) -> torch.Tensor:
        """Per own token, the returned copies added in top-k order (the op-held routing says where)."""
        cfg = self.config
        n, hidden = self._num_tokens, cfg.hidden_dim
        returned: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for dest, (values, scales, sources) in enumerate(everyone):
            for row, (src, t) in enumerate(sources):
                if src == cfg.rank:
                    returned[(t, dest)] = (values[row], None if scales is None else scales[row])
        acc = torch.zeros(n, hidden)
        for lane in range(cfg.num_experts_per_token):
            for t in range(n):
                dest = int(self._lane_dest[t, lane])
                if dest < 0:
                    continue
                values, scales = returned[(t, dest)]
                acc[t] = _numerics.accumulate(
                    acc[t : t + 1], values[None], None if scales is None else scales[None], hidden
                )[0]
        return acc.to(dtype)

    def combine_send(self, input, weights, indices, block_num=-1, warp_per_block=-1):
        views = self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)
        self.calls[-1] = "combine_send"
        return views

    def combine_recv(self, block_num=-1, warp_per_block=-1):
        cfg = self.config
        if cfg.kernel_type != _KT.AsyncLL:
            raise ValueError(f"combine_recv only supports AsyncLL, got kernel_type={cfg.kernel_type.value}")
        if self._pending_combine is None:
            raise AssertionError("combine_recv requires a prior combine/combine_send call")
        self.calls.append("combine_recv")
        result, self._pending_combine = self._pending_combine, None
        out = self._view("comb_out", (cfg.max_num_inp_token_per_rank, cfg.hidden_dim), result.dtype)
        out[: self._num_tokens] = result
