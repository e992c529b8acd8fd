"""``mori.ops.dispatch_combine_v2.dispatch_combine_op``: MoRI's EP v2 op as ``amd-mori`` 1.2.4 behaves.

``EpDispatchCombineOp(cfg, comm)`` builds the backend ``cfg.kernel_backend`` or
``MORI_V2_KERNEL_BACKEND`` names. The stand-in models the hip backend's intranode path: it refuses
what that backend refuses at construction (quantized or scattered combines off gfx125x, a receive cap
below the worst case, scale rows that are not whole dwords); it skips negative ids and ranks outside
the world; it lays received scale rows at a 128 B stride and hands them back as an int32 view; the
combine gathers along the routing handle's map and adds in f32 in top-k order. Outputs are views of
the op's arena, overwritten by the next call. The FlyDSL backend is not modelled (its import fails,
as on a machine without FlyDSL).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from mori import _numerics, _wire
from mori.jit.config import detect_gpu_arch

WAVE = 64
_FP4_QUANT_TYPES = ("fp4_blockwise", "fp4_blockwise_fp32")
_PUSH_QUANT_TYPES = (*_FP4_QUANT_TYPES, "fp8_blockwise")
_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", *_FP4_QUANT_TYPES)
_DT = {torch.bfloat16: 2, torch.float32: 4, torch.float8_e4m3fnuz: 1, torch.float8_e4m3fn: 1}
_FP8_DTYPES = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)
_DISPATCH_DTYPES = (torch.bfloat16, torch.float32, *_FP8_DTYPES, torch.float4_e2m1fn_x2)
_COMBINE_DTYPES = (torch.bfloat16, torch.float32)
_SCALE_ALIGN = 128


@dataclass
class EpDispatchCombineConfig:
    rank: int
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: torch.dtype = torch.bfloat16
    dispatch_data_type: torch.dtype = None
    combine_data_type: torch.dtype = None
    scale_dim: int = 0
    scale_type_size: int = 0
    combine_mode: str = "gather"
    quant_type: str = "none"
    dispatch_block_num: int = None
    combine_block_num: int = None
    warp_num_per_block: int = None
    combine_warp_num_per_block: int = None
    schedule: tuple = None
    enable_std_moe: bool = False
    max_total_recv_tokens: int = 0
    gpu_per_node: int = None
    num_qp_per_pe: int = 2
    max_token_type_size: int = None
    dispatch_rdma_block_num: int = None
    combine_rdma_block_num: int = None
    internode_kernel: str = "auto"
    internode_auto_ll_max_tokens: int = 512
    kernel_backend: str = None

    def __post_init__(self) -> None:
        if self.gpu_per_node is None:
            self.gpu_per_node = self.world_size
        if self.gpu_per_node <= 0 or self.world_size % self.gpu_per_node:
            raise ValueError(f"world_size ({self.world_size}) must be a positive multiple of gpu_per_node")
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ValueError("dispatch_data_type / combine_data_type must be set together (all-or-none)")
        if self.quant_type not in _QUANT_TYPES:
            raise ValueError(f"quant_type must be one of {_QUANT_TYPES}, got {self.quant_type!r}")
        if self.combine_mode not in ("gather", "scatter"):
            raise ValueError(f"combine_mode must be gather|scatter, got {self.combine_mode!r}")
        if self.quant_type != "none":
            if self.is_internode:
                raise ValueError(f"quant_type={self.quant_type!r} is not supported on the internode path")
            self.combine_mode = "scatter"
        if self.token_nbytes % 16:
            raise ValueError(f"per-token transport bytes must be 16 B aligned; token_nbytes={self.token_nbytes}")
        if self.is_asymmetric_dtype and self.combine_dtype == torch.float4_e2m1fn_x2:
            raise ValueError("asymmetric combine dtype does not support fp4")
        widest = max(self.elem_size, self.combine_elem_size)
        if self.max_token_type_size is None:
            self.max_token_type_size = widest
        elif self.max_token_type_size < widest:
            raise ValueError(f"max_token_type_size={self.max_token_type_size} is smaller than {widest}")
        # Geometry: the stand-in keeps the single-shot fallback where the real op reads its tables.
        for name, fallback in (
            ("dispatch_block_num", 64),
            ("combine_block_num", 80),
            ("warp_num_per_block", 16),
            ("combine_warp_num_per_block", 4),
        ):
            if getattr(self, name) is None:
                setattr(self, name, fallback)

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpu_per_node

    @property
    def is_internode(self) -> bool:
        return self.nodes > 1

    @property
    def is_scatter(self) -> bool:
        return self.combine_mode == "scatter"

    @property
    def dispatch_dtype(self) -> torch.dtype:
        return self.dispatch_data_type if self.dispatch_data_type is not None else self.data_type

    @property
    def combine_dtype(self) -> torch.dtype:
        return self.combine_data_type if self.combine_data_type is not None else self.data_type

    @property
    def is_fp4(self) -> bool:
        return self.dispatch_dtype == torch.float4_e2m1fn_x2

    @property
    def elem_size(self) -> int:
        return 1 if self.is_fp4 else _DT[self.dispatch_dtype]

    @property
    def combine_elem_size(self) -> int:
        return 1 if self.combine_dtype == torch.float4_e2m1fn_x2 else _DT[self.combine_dtype]

    @property
    def token_nbytes(self) -> int:
        return self.hidden_dim // 2 if self.is_fp4 else self.hidden_dim * self.elem_size

    @property
    def combine_token_nbytes(self) -> int:
        return self.hidden_dim * self.combine_elem_size

    @property
    def is_asymmetric_dtype(self) -> bool:
        return self.dispatch_dtype != self.combine_dtype

    @property
    def max_recv(self) -> int:
        return self.world_size * self.max_num_inp_token_per_rank

    @property
    def effective_max_recv_per_rank(self) -> int:
        if self.max_total_recv_tokens <= 0:
            return self.max_num_inp_token_per_rank
        per = (self.max_total_recv_tokens + self.world_size - 1) // self.world_size
        return min(per, self.max_num_inp_token_per_rank)

    @property
    def effective_max_recv(self) -> int:
        return self.world_size * self.effective_max_recv_per_rank


class EpDispatchRoutingHandle:
    """Per-call routing: ``disp_dest_tok_id_map[token * topk + k]`` is ``rank * recv_cap + slot`` or the
    null value ``world_size * recv_cap``."""

    def __init__(
        self,
        disp_dest_tok_id_map,
        inter_node_disp_dest_tok_id_map,
        inter_node_disp_send_map,
        total_recv_token_num,
        disp_tok_id_to_src_tok_id_local=None,
        cur_rank_num_token=0,
        *,
        reverse_src_view=None,
    ):
        self.disp_dest_tok_id_map = disp_dest_tok_id_map
        self.inter_node_disp_dest_tok_id_map = inter_node_disp_dest_tok_id_map
        self.inter_node_disp_send_map = inter_node_disp_send_map
        self.total_recv_token_num = total_recv_token_num
        self.cur_rank_num_token = cur_rank_num_token
        self._reverse_cache = disp_tok_id_to_src_tok_id_local
        self._reverse_src_view = reverse_src_view


class EpDispatchCombineOp:
    """Base and backend selector: ``EpDispatchCombineOp(cfg, comm)`` returns the named backend."""

    _BACKENDS: ClassVar[dict[str, type]] = {}
    backend_name: str | None = None
    instances: ClassVar[list[EpDispatchCombineOp]] = []  # every op built in this process, for tests

    def __init_subclass__(cls, backend: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if backend:
            cls.backend_name = backend
            EpDispatchCombineOp._BACKENDS[backend] = cls

    def __new__(cls, cfg=None, comm=None, *a, **kw):
        if cls is EpDispatchCombineOp:
            name = getattr(cfg, "kernel_backend", None) or os.environ.get("MORI_V2_KERNEL_BACKEND") or "flydsl"
            if name not in EpDispatchCombineOp._BACKENDS:
                raise ImportError(
                    f"kernel backend {name!r} is not available. Pick another backend with "
                    "MORI_V2_KERNEL_BACKEND or cfg.kernel_backend."
                )
            cls = EpDispatchCombineOp._BACKENDS[name]
        return super().__new__(cls)

    def close(self):
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def scale_stride_bytes(self) -> int:
        return self._scale_row_bytes()

    def _scale_row_bytes(self) -> int:
        n = self.cfg.scale_dim * self.cfg.scale_type_size
        return ((n + 3) // 4) * 4 if n else 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the op was closed: its symmetric window is freed")

    # -- the ops ----------------------------------------------------------------------------------

    def dispatch(self, input, weights, scales, indices, *, routing=None, return_routing=False):
        self._check_open()
        if routing is not None and return_routing:
            raise ValueError("pass either routing= (replay) or return_routing=True, not both")
        if routing is not None:
            raise NotImplementedError("the hip backend has no routing replay")
        cfg = self.cfg
        n = input.shape[0]
        if n > cfg.max_num_inp_token_per_rank:
            raise ValueError(f"{n} tokens exceeds max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}")
        if input.dtype != cfg.dispatch_dtype or input.shape[1] * input.element_size() != cfg.token_nbytes:
            raise TypeError(f"input {input.dtype} {tuple(input.shape)}; the op transports {cfg.dispatch_dtype}")
        if indices.dtype != torch.int32 or tuple(indices.shape) != (n, cfg.num_experts_per_token):
            raise TypeError(f"indices must be int32 [n, topk], got {indices.dtype} {tuple(indices.shape)}")
        row_bytes = self._scale_row_bytes()
        if row_bytes and scales is not None and scales.shape[1] * scales.element_size() != row_bytes:
            raise TypeError(f"scale rows of {scales.shape[1] * scales.element_size()} B; the op carries {row_bytes}")
        self.calls.append("dispatch")
        dest = self._destinations(indices)
        mine = (
            _wire.as_bytes(input),
            weights.float(),
            _wire.as_bytes(scales) if row_bytes and scales is not None else None,
            indices.clone(),
            dest,
        )
        everyone = _wire.gather(mine, self.comm.group)
        self._land(everyone)
        slot_map = self._slot_map(everyone, dest)
        out = (self.recv_tokens(), self.recv_weights(), self.recv_scales(), self.recv_indices(), self.total_recv)
        if not return_routing:
            return out
        self.routing_dest_map[: slot_map.numel()] = slot_map
        empty = torch.empty(0, dtype=torch.int32)
        return (*out, EpDispatchRoutingHandle(self.routing_dest_map, empty, empty, self.total_recv, None, n))

    def _destinations(self, indices: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        pe = _wire.trunc_div(indices.long(), cfg.num_experts_per_rank)
        kept = (indices >= 0) & (pe < cfg.world_size)
        k = indices.shape[1]
        earlier = torch.ones(k, k, dtype=torch.bool).tril(diagonal=-1)
        same = (pe[:, :, None] == pe[:, None, :]) & kept[:, None, :]
        return torch.where(kept & ~(same & earlier).any(dim=2), pe, -1)

    def _land(self, everyone: list[tuple]) -> None:
        cfg = self.cfg
        self._sources = []
        rows = 0
        stride = self.scale_stride_bytes()
        tokens = self._arena["disp_out"].view(self._recv_cap, cfg.token_nbytes)
        scale_rows = self._arena["out_scales"].view(self._recv_cap, stride) if stride else None
        for src, (x, w, s, ids, dest) in enumerate(everyone):
            for t in range(x.shape[0]):
                if not bool((dest[t] == cfg.rank).any()):
                    continue
                if rows >= self._recv_cap:
                    raise RuntimeError("device: more tokens received than the receive capacity")
                tokens[rows] = x[t]
                self.recv_weights()[rows] = w[t]
                self.recv_indices()[rows] = ids[t]
                if scale_rows is not None and s is not None:
                    scale_rows[rows, : s.shape[1]] = s[t]
                self._sources.append((src, t))
                rows += 1
        self.total_recv[0] = rows

    def _slot_map(self, everyone: list[tuple], dest: torch.Tensor) -> torch.Tensor:
        """Where each of this rank's (token, k) copies landed: ``rank * recv_cap + slot``, or null."""
        cfg = self.cfg
        slots: dict[tuple[int, int], int] = {}
        for pe in range(len(everyone)):
            position = 0
            for src, (*_rows, d) in enumerate(everyone):
                for t in range(d.shape[0]):
                    if bool((d[t] == pe).any()):
                        if src == cfg.rank:
                            slots[(t, pe)] = position
                        position += 1
        null = cfg.world_size * self._recv_cap
        flat = torch.full(dest.shape, null, dtype=torch.int32)
        for t in range(dest.shape[0]):
            for k in range(dest.shape[1]):
                pe = int(dest[t, k])
                if pe >= 0:
                    flat[t, k] = pe * self._recv_cap + slots[(t, pe)]
        return flat.view(-1)

    def combine(self, input, weights=None, indices=None, *, routing):
        self._check_open()
        cfg = self.cfg
        ct = routing.cur_rank_num_token
        staging = self.combine_in_view()
        if input.data_ptr() != staging.data_ptr():
            staging.view(-1)[: input.numel()].copy_(input.reshape(-1))
        self.calls.append("combine")
        total = int(routing.total_recv_token_num[0])
        everyone = _wire.gather((staging[:total].clone(),), self.comm.group)
        dest_map = routing.disp_dest_tok_id_map[: ct * cfg.num_experts_per_token].view(ct, cfg.num_experts_per_token)
        acc = torch.zeros(ct, cfg.hidden_dim)
        for k in range(cfg.num_experts_per_token):
            for t in range(ct):
                flat = int(dest_map[t, k])
                pe, slot = divmod(flat, self._recv_cap)
                if pe < cfg.world_size:
                    acc[t] = _numerics.accumulate(acc[t : t + 1], everyone[pe][0][slot][None], None, cfg.hidden_dim)[0]
        out = self._arena["combine_out"].view(cfg.combine_dtype)[: ct * cfg.hidden_dim].view(ct, cfg.hidden_dim)
        out.copy_(acc)
        routing.total_recv_token_num.zero_()  # the hip combine kernel clears the count, as v1's does
        return out, None


class EpDispatchCombineOpHip(EpDispatchCombineOp, backend="hip"):
    def __init__(self, cfg: EpDispatchCombineConfig, comm) -> None:
        self.cfg, self.comm = cfg, comm
        self._closed = False
        bad = self._unsupported(cfg)
        if bad:
            raise ValueError("hip backend cannot serve this config:\n  " + "\n  ".join(bad))
        if comm.nranks != cfg.world_size or comm.rank != cfg.rank:
            raise ValueError("config rank/world_size disagree with the communicator")
        cap, k = cfg.effective_max_recv, cfg.num_experts_per_token
        self._recv_cap = cap
        self._arena = {
            "disp_out": torch.zeros(cap * cfg.token_nbytes, dtype=torch.uint8),
            "out_tok": torch.zeros(cap * cfg.combine_token_nbytes, dtype=torch.uint8),
            "out_wts": torch.zeros(cap * k, dtype=torch.float32),
            "out_idx": torch.zeros(cap * k, dtype=torch.int32),
            "out_scales": torch.zeros(cap * self.scale_stride_bytes(), dtype=torch.uint8),
            "combine_out": torch.zeros(cfg.max_num_inp_token_per_rank * cfg.combine_token_nbytes, dtype=torch.uint8),
        }
        self.total_recv = torch.zeros(1, dtype=torch.int32)
        self.token_dest_map = torch.full((cfg.max_num_inp_token_per_rank * k,), -1, dtype=torch.int32)
        self.routing_dest_map = torch.full_like(self.token_dest_map, cfg.world_size * cap)
        self._sources: list[tuple[int, int]] = []
        self.calls: list[str] = []
        EpDispatchCombineOp.instances.append(self)
        comm.barrier()

    def _unsupported(self, cfg: EpDispatchCombineConfig) -> tuple[str, ...]:
        if cfg.is_internode:
            return ("the stand-in does not model the internode path",)
        bad = []
        if cfg.dispatch_dtype not in _DISPATCH_DTYPES:
            bad.append(f"dispatch dtype {cfg.dispatch_dtype} (have bf16, fp32, fp8, fp4)")
        if cfg.combine_dtype not in _COMBINE_DTYPES:
            bad.append(f"combine dtype {cfg.combine_dtype} (have bf16, fp32)")
        push = cfg.quant_type in _PUSH_QUANT_TYPES
        if cfg.is_scatter and not push:
            bad.append("combine_mode='scatter' (gather only, except the push quant types)")
        if cfg.quant_type != "none" and not push:
            bad.append(f"quant_type={cfg.quant_type!r}")
        if push and not str(detect_gpu_arch()).startswith("gfx125"):
            bad.append(f"quant_type={cfg.quant_type!r} (the push combine is gfx125x only)")
        if cfg.enable_std_moe:
            bad.append("enable_std_moe")
        if (cfg.scale_dim * cfg.scale_type_size) % 4:
            bad.append(f"per-token scale row of {cfg.scale_dim * cfg.scale_type_size} B is not whole dwords")
        if cfg.effective_max_recv < cfg.world_size * cfg.max_num_inp_token_per_rank:
            bad.append("max_total_recv_tokens below the worst case; token dropping is not implemented")
        return tuple(bad)

    def scale_stride_bytes(self) -> int:
        row = self._scale_row_bytes()
        return (row + _SCALE_ALIGN - 1) // _SCALE_ALIGN * _SCALE_ALIGN if row else 0

    # -- views of the arena (the same objects every call) ----------------------------------------

    def recv_tokens(self) -> torch.Tensor:
        cols = self.cfg.hidden_dim // 2 if self.cfg.is_fp4 else self.cfg.hidden_dim
        return self._arena["disp_out"].view(self.cfg.dispatch_dtype).view(self._recv_cap, cols)

    def recv_weights(self) -> torch.Tensor:
        return self._arena["out_wts"].view(self._recv_cap, self.cfg.num_experts_per_token)

    def recv_indices(self) -> torch.Tensor:
        return self._arena["out_idx"].view(self._recv_cap, self.cfg.num_experts_per_token)

    def recv_scales(self) -> torch.Tensor | None:
        n_i32 = self._scale_row_bytes() // 4
        if not n_i32:
            return None
        rows = self._arena["out_scales"].view(torch.int32).view(self._recv_cap, self.scale_stride_bytes() // 4)
        return rows[:, :n_i32]

    def combine_in_view(self) -> torch.Tensor:
        return self._arena["out_tok"].view(self.cfg.combine_dtype).view(self._recv_cap, self.cfg.hidden_dim)
