"""The op's input checks: one named function per rule, each raising ``InputError`` that names the
argument (or the knob) and what it accepts. They run before anything is sent, so a bad batch is an
error, never a silent wrong result or a hang."""

from __future__ import annotations

import torch

from mori_sglang import formats
from mori_sglang.config import DispatchDtype, EpConfig
from mori_sglang.types import CombineHandle, InputError, expert_id_error, short_expert_outputs_error


def input_signature(*tensors: torch.Tensor | None) -> tuple:
    """What the shape, dtype and device checks read of each input (None: an input not passed). Inputs of
    a signature that passed them pass again: a step whose inputs keep the last step's signature skips
    them (a serving loop's usually do), and a check of values, such as ``check_expert_ids_on_host``,
    runs every time."""
    return tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors])


# The router's weights as servers hand them over; each travels as f32.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dispatch_shapes(
    config: EpConfig,
    layout: formats.DispatchRowLayout,
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    ids: torch.Tensor,
) -> None:
    """Tokens 2-D; top-k ids and weights ``[num_tokens, topk]``; scales 2-D with one row per token."""
    if x.dim() != 2:
        raise InputError(f"tokens must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if tuple(ids.shape) != (n, config.topk) or tuple(weights.shape) != (n, config.topk):
        raise InputError(
            f"topk_ids {tuple(ids.shape)} and topk_weights {tuple(weights.shape)} must both be "
            f"[{n}, topk={config.topk}]"
        )
    if scales is None:
        return
    if scales.dim() != 2:
        raise InputError(
            f"scales must be 2-D [num_tokens, S], one opaque row of scale_bytes={layout.scale_bytes} B per "
            f"token; got shape {tuple(scales.shape)}"
        )
    if scales.shape[0] != n:
        raise InputError(f"scales have {scales.shape[0]} rows for {n} tokens")


def check_capacity(config: EpConfig, num_tokens: int) -> None:
    """A batch fits the buffers the op was sized for."""
    if num_tokens > config.max_tokens_per_rank:
        raise InputError(
            f"{num_tokens} tokens exceed SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK={config.max_tokens_per_rank} "
            "(the buffer capacity); raise it or send smaller batches (e.g. lower --chunked-prefill-size)"
        )


def check_devices(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Every input on the op's device (None: an input not passed). A kernel handed a tensor of another
    device reads an address that is not its memory."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise InputError(f"{name} is on {t.device}, the op runs on {device}")


def check_dispatch_dtypes(
    config: EpConfig,
    layout: formats.DispatchRowLayout,
    payload_dtype: torch.dtype,
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    ids: torch.Tensor,
) -> None:
    """Integer ids; floating weights (f32, or 16-bit and f64 ones that travel converted to f32); bf16
    tokens of the op's hidden, or pre-quantized wire tokens of the format's row size with their scale
    rows of the op's scale bytes."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"topk_ids must be int32 or int64, got {ids.dtype}")
    if weights.dtype not in WEIGHT_DTYPES:
        names = ", ".join(str(d) for d in WEIGHT_DTYPES)
        raise InputError(f"topk_weights must be one of {names} (they travel as f32), got {weights.dtype}")
    accepted = {torch.bfloat16, payload_dtype}
    if config.dispatch_dtype is DispatchDtype.MXFP4:
        accepted.add(torch.float4_e2m1fn_x2)
    if x.dtype not in accepted:
        names = ", ".join(sorted(str(d) for d in accepted))
        raise InputError(f"{config.dispatch_dtype.value} dispatch takes tokens of {names}; got {x.dtype}")
    wire_tokens = x.dtype != torch.bfloat16 or config.dispatch_dtype is DispatchDtype.BF16
    if x.dtype == torch.bfloat16 and x.shape[1] != config.hidden:
        raise InputError(f"tokens have hidden {x.shape[1]}, the op was built for hidden={config.hidden}")
    if wire_tokens and formats.row_bytes(x) != layout.token_bytes:
        raise InputError(
            f"a {config.dispatch_dtype.value} token is {layout.token_bytes} B on the wire; got rows of "
            f"{formats.row_bytes(x)} B ({x.dtype} x {x.shape[1]})"
        )
    if scales is not None and formats.row_bytes(scales) != layout.scale_bytes:
        raise InputError(
            f"scale rows must be {layout.scale_bytes} B (the op's scale_bytes), got {formats.row_bytes(scales)} B"
        )
    if wire_tokens and layout.scale_bytes and scales is None:
        if x.dtype == torch.bfloat16:
            raise InputError(f"the op carries {layout.scale_bytes} B scale rows; pass scales for every token")
        raise InputError(f"pre-quantized {config.dispatch_dtype.value} tokens need their scales")


def check_tokens_the_op_quantizes(
    config: EpConfig,
    layout: formats.DispatchRowLayout,
    format_scale_bytes: int,
    x: torch.Tensor,
    scales: torch.Tensor | None,
) -> None:
    """bf16 tokens of a quantized dispatch format are quantized by the op, which makes their scale rows
    (the format's own, ``format_scale_bytes``: ``formats.dispatch_scale_bytes``, computed once by the op):
    scales passed with them would be dropped unseen, and an op that carries scale rows of another size
    has nothing to fill them with. Both are refused; pre-quantized tokens carry any scale row of the op's
    scale_bytes."""
    if x.dtype != torch.bfloat16 or config.dispatch_dtype is DispatchDtype.BF16:
        return
    fmt = config.dispatch_dtype.value
    if scales is not None:
        raise InputError(
            f"bf16 tokens are quantized to {fmt} by the op, which makes their scale rows: pass scales=None, "
            f"or pre-quantized {fmt} tokens with their scales"
        )
    if layout.scale_bytes != format_scale_bytes:
        raise InputError(
            f"bf16 tokens are quantized to {fmt} by the op, which makes {format_scale_bytes} B scale rows, but the op "
            f"carries scale_bytes={layout.scale_bytes}: pass pre-quantized {fmt} tokens with their "
            f"{layout.scale_bytes} B scale rows, or build the op with scale_bytes=None"
        )


def capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s GPU stream is being captured into a CUDA graph (no host read is allowed)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def check_expert_ids_on_host(config: EpConfig, ids: torch.Tensor) -> None:
    """No id past the last expert (negative ids are dropped slots). Reads the ids on the host: only for
    providers that do not check them on the device, and not while a CUDA graph is captured, which
    forbids the read (the graph replays whatever ids its inputs then hold, unchecked)."""
    if ids.numel() and not capturing(ids):
        top = int(ids.max())
        if top >= config.num_experts:
            raise expert_id_error(top, config.num_experts, dropped=False)


def check_expert_outputs(config: EpConfig, y: torch.Tensor) -> None:
    """Expert outputs ``[rows, hidden]`` in bf16 or f32."""
    if y.dim() != 2 or y.shape[1] != config.hidden:
        raise InputError(f"expert outputs must be [rows, hidden={config.hidden}], got {tuple(y.shape)}")
    if y.dtype not in (torch.bfloat16, torch.float32):
        raise InputError(f"expert outputs must be bf16 or f32, got {y.dtype}")


def check_outputs_cover_received(y: torch.Tensor, handle: CombineHandle) -> None:
    """A row of expert output for every received row, where the host knows how many arrived without a
    synchronisation (elsewhere the provider compares on the device and raises one call later)."""
    received = handle.received_rows_on_host()
    if received is not None and y.shape[0] < received:
        raise short_expert_outputs_error(received, y.shape[0])
