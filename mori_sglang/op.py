"""The op API: one object per rank, shaped after MoRI's ``EpDispatchCombineOp``.

It checks every input before anything is sent (a bad batch is an error, never a silent wrong result
or a hang), quantizes bf16 tokens to the dispatch dtype once on the sender, and hands the wire work
to a provider.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mori_sglang import formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.exchange import DistExchange, Exchange, LoopbackExchange, LoopbackHub
from mori_sglang.providers import resolve_provider
from mori_sglang.providers.torch_provider import TorchProvider
from mori_sglang.types import CombineHandle, DispatchOutput, InputError, expert_id_error, short_expert_outputs_error

SUPPORTED_COMBINE = (
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
)
_OP_IDENTS = itertools.count(1)


class EpDispatchCombineOp:
    """Dispatch/combine for one rank of an expert-parallel group.

    ``group``: a torch.distributed ProcessGroup (default: the world group). ``loopback``: a
    LoopbackHub shared by the ops of a one-process world (see ``LoopbackWorld``).
    """

    def __init__(
        self,
        config: EpConfig,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        loopback: LoopbackHub | None = None,
    ) -> None:
        self.config = config
        self.ident = next(_OP_IDENTS)  # stamped on every handle this op's dispatches make
        self._dispatches = 0
        self.device = _normalize_device(device)
        self.fp8_dtype = config.fp8_dtype or formats.fp8_dtype_for_device(self.device)
        self.provider_kind = resolve_provider(config.provider, self.device, real_ranks=loopback is None)
        supported = SUPPORTED_COMBINE + ((CombineDtype.FP4_BLOCKWISE,) if self.provider_kind is Provider.MORI else ())
        if config.combine_dtype not in supported:
            accepted = ", ".join(d.value for d in supported)
            raise ConfigError(
                f"SGLANG_MORI_COMBINE_DTYPE: combine dtype {config.combine_dtype.value} is only provided by "
                f"native MoRI on gfx950; the {self.provider_kind.value} provider accepts: {accepted}"
            )
        if config.combine_dtype in SUPPORTED_COMBINE and config.combine_dtype is not CombineDtype.BF16:
            formats.combine_row_bytes(config.combine_dtype, config.hidden, config.combine_block)
        self.token_bytes = formats.dispatch_token_bytes(config.dispatch_dtype, config.hidden)
        self.scale_bytes = (
            config.scale_bytes
            if config.scale_bytes is not None
            else formats.dispatch_scale_bytes(config.dispatch_dtype, config.hidden)
        )
        self.layout = formats.DispatchRowLayout(self.token_bytes, self.scale_bytes, config.topk)
        self.payload_dtype = formats.dispatch_payload_dtype(config.dispatch_dtype, self.fp8_dtype)
        # Checked on every dispatch: made once here (the hot path's host time counts).
        self._token_dtypes = {torch.bfloat16, self.payload_dtype}
        if config.dispatch_dtype is DispatchDtype.MXFP4:
            self._token_dtypes.add(torch.float4_e2m1fn_x2)
        self._natural_scales = self.scale_bytes == formats.dispatch_scale_bytes(config.dispatch_dtype, config.hidden)
        if self.provider_kind is Provider.TRITON:
            from mori_sglang.providers.triton_provider import TritonProvider

            self.provider = TritonProvider(
                config, self.device, self.fp8_dtype, self.layout, group=group, loopback=loopback
            )
            return
        if self.provider_kind is Provider.MORI:
            if loopback is not None:
                raise ConfigError("the native MoRI provider runs on real ranks; a loopback world takes triton or torch")
            from mori_sglang.providers.mori_provider import MoriProvider

            self.provider = MoriProvider(config, self.device, self.layout, self.payload_dtype, group)
            return
        exchange: Exchange
        if loopback is not None:
            if loopback.world_size != config.world_size:
                raise ConfigError(f"loopback world of {loopback.world_size} ranks, config says {config.world_size}")
            exchange = LoopbackExchange(loopback, config.rank)
        else:
            exchange = DistExchange(group, config.peer_timeout_s)
            if exchange.world_size != config.world_size or exchange.rank != config.rank:
                raise ConfigError(
                    f"config says rank {config.rank} of {config.world_size}, the process group says "
                    f"rank {exchange.rank} of {exchange.world_size}"
                )
        self.provider = TorchProvider(config, exchange, self.device, self.fp8_dtype)

    # -- properties callers size their buffers with ---------------------------------------------

    @property
    def max_recv_tokens(self) -> int:
        return self.config.max_recv_tokens

    def scale_stride_bytes(self) -> int:
        return self.layout.scale_stride

    # -- checks ---------------------------------------------------------------------------------

    def _check_dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor
    ) -> None:
        cfg = self.config
        n = x.shape[0]
        if x.dim() != 2:
            raise InputError(f"tokens must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
        if n > cfg.max_tokens_per_rank:
            raise InputError(
                f"{n} tokens exceed SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK={cfg.max_tokens_per_rank} "
                "(the buffer capacity); raise it or send smaller batches (e.g. lower --chunked-prefill-size)"
            )
        if tuple(ids.shape) != (n, cfg.topk) or tuple(weights.shape) != (n, cfg.topk):
            raise InputError(
                f"topk_ids {tuple(ids.shape)} and topk_weights {tuple(weights.shape)} must both be "
                f"[{n}, topk={cfg.topk}]"
            )
        if ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"topk_ids must be int32 or int64, got {ids.dtype}")
        for name, t in (("tokens", x), ("topk_weights", weights), ("topk_ids", ids)):
            if t.device != self.device:
                raise InputError(f"{name} is on {t.device}, the op runs on {self.device}")
        if n and not getattr(self.provider, "checks_ids_on_device", False):
            top = int(ids.max())
            if top >= cfg.num_experts:
                raise expert_id_error(top, cfg.num_experts, dropped=False)
        if x.dtype not in self._token_dtypes:
            names = ", ".join(sorted(str(d) for d in self._token_dtypes))
            raise InputError(f"{cfg.dispatch_dtype.value} dispatch takes tokens of {names}; got {x.dtype}")
        quantized_input = x.dtype != torch.bfloat16 or cfg.dispatch_dtype is DispatchDtype.BF16
        if x.dtype == torch.bfloat16 and x.shape[1] != cfg.hidden:
            raise InputError(f"tokens have hidden {x.shape[1]}, the op was built for hidden={cfg.hidden}")
        if quantized_input and formats.row_bytes(x) != self.token_bytes:
            raise InputError(
                f"a {cfg.dispatch_dtype.value} token is {self.token_bytes} B on the wire; got rows of "
                f"{formats.row_bytes(x)} B ({x.dtype} x {x.shape[1]})"
            )
        if scales is not None and scales.dim() != 2:
            raise InputError(
                f"scales must be 2-D [num_tokens, S], one opaque row of scale_bytes={self.scale_bytes} B per "
                f"token; got shape {tuple(scales.shape)}"
            )
        if scales is not None and formats.row_bytes(scales) != self.scale_bytes:
            raise InputError(
                f"scale rows must be {self.scale_bytes} B (the op's scale_bytes), got {formats.row_bytes(scales)} B"
            )
        if scales is not None and scales.shape[0] != n:
            raise InputError(f"scales have {scales.shape[0]} rows for {n} tokens")
        if x.dtype != torch.bfloat16 and self.scale_bytes and scales is None:
            raise InputError(f"pre-quantized {cfg.dispatch_dtype.value} tokens need their scales")

    # -- dispatch -------------------------------------------------------------------------------

    def dispatch_send(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        scales: torch.Tensor | None,
        topk_ids: torch.Tensor,
    ) -> None:
        """Start sending each token to the distinct ranks among its top-k experts."""
        self._check_dispatch(x, topk_weights, scales, topk_ids)
        self._dispatches += 1
        payload = x
        if x.dtype == torch.bfloat16 and self.config.dispatch_dtype is not DispatchDtype.BF16:
            fused = self.config.dispatch_dtype in self.provider.fused_quantization
            if fused and scales is None and self._natural_scales:
                self.provider.dispatch_send(x, None, topk_weights, topk_ids, self.layout, quantize=True)
                return
            payload, scales = formats.quantize_dispatch(x, self.config.dispatch_dtype, self.fp8_dtype)
        scale_rows = None
        if self.scale_bytes:
            if scales is None:
                raise InputError(f"the op carries {self.scale_bytes} B scale rows; pass scales for every token")
            scale_rows = scales.contiguous().view(torch.uint8).view(x.shape[0], self.scale_bytes)
        self.provider.dispatch_send(payload, scale_rows, topk_weights, topk_ids, self.layout)

    def dispatch_recv(self) -> DispatchOutput:
        """Finish the dispatch started by ``dispatch_send``."""
        out = self.provider.dispatch_recv(self.layout, self.payload_dtype)
        out.handle.issuer, out.handle.dispatch_number = self.ident, self._dispatches
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
        if y.dim() != 2 or y.shape[1] != self.config.hidden:
            raise InputError(f"expert outputs must be [rows, hidden={self.config.hidden}], got {tuple(y.shape)}")
        if y.dtype not in (torch.bfloat16, torch.float32):
            raise InputError(f"expert outputs must be bf16 or f32, got {y.dtype}")
        if handle.issuer != self.ident:
            raise InputError(
                "the combine handle comes from another op's dispatch: pass the handle of this op's dispatch"
            )
        if handle.dispatch_number != self._dispatches and not self.provider.keeps_old_handles:
            raise InputError(
                f"the combine handle is from this op's dispatch #{handle.dispatch_number}, but dispatch "
                f"#{self._dispatches} has since reused its buffers ({self.provider_kind.value} provider): combine "
                "each dispatch before the next dispatch_send, or give overlapping batches an op each"
            )
        if handle.recv_counts_host is not None and y.shape[0] < sum(handle.recv_counts_host):
            raise short_expert_outputs_error(sum(handle.recv_counts_host), y.shape[0])

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        """Start returning expert outputs (weights already applied) to their source ranks."""
        self._check_combine(y, handle)
        self.provider.combine_send(y, handle)

    def combine_recv(self) -> torch.Tensor:
        """Per original token, the f32 sum over its destination ranks, as bf16 ``[num_tokens, hidden]``."""
        return self.provider.combine_recv()

    def synchronize(self) -> None:
        """Wait for this rank's device work; raise if a receive gave up on a stalled peer."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        check = getattr(self.provider, "check_status", None)
        if check is not None:
            check()

    def combine(self, y: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        if self.config.combine_mode is Mode.LOW_LATENCY:
            raise InputError("low-latency combine is split: call combine_send, then combine_recv")
        self.combine_send(y, handle)
        return self.combine_recv()


def _normalize_device(device: torch.device | str | None) -> torch.device:
    """An explicit device with its index, so that tensors' devices compare equal to it."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
