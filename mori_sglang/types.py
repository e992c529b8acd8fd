"""What dispatch returns and what combine needs back: shared by every provider."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class InputError(ValueError):
    """A dispatch/combine input does not fit the op's configuration."""


PEER_TIMEOUT_VAR = "SGLANG_MORI_PEER_TIMEOUT_S"


class PeerTimeoutError(TimeoutError):
    """A receive waited past SGLANG_MORI_PEER_TIMEOUT_S for a peer that never sent."""


def peer_timeout_error(rank: int, peer: int | None, timeout_s: float) -> PeerTimeoutError:
    """The error of a receive that gave up: this rank, the peer it waited for, and the knob."""
    who = f"rank {peer}" if peer is not None else "a peer"
    return PeerTimeoutError(
        f"rank {rank} waited {timeout_s:g} s ({PEER_TIMEOUT_VAR}) for {who}, which never sent; it is stalled, "
        "crashed or ran a different number of dispatch/combine calls"
    )


def collective_timeout_error(rank: int, peers: list[int], timeout_s: float, what: str) -> PeerTimeoutError:
    """The error of a collective receive that gave up: it cannot tell which of the peers never sent."""
    return PeerTimeoutError(
        f"rank {rank} waited {timeout_s:g} s ({PEER_TIMEOUT_VAR}) for the {what} of one all_to_all with ranks "
        f"{peers}, which did not complete: one of them never sent (a collective cannot tell which); it is "
        "stalled, crashed or ran a different number of dispatch/combine calls"
    )


def device_wait_timeout_error(rank: int, timeout_s: float) -> PeerTimeoutError:
    """The error of a host wait for the device that gave up: a kernel that waits without a bound of its
    own (native MoRI; an all_to_all in a CUDA graph) still waits for a peer, and cannot say which."""
    return PeerTimeoutError(
        f"rank {rank} waited {timeout_s:g} s ({PEER_TIMEOUT_VAR}) for its device work, which did not finish: "
        "a receive still waits for a peer that never sent (native MoRI's kernels and an all_to_all "
        "in a CUDA graph wait without a bound of their own and cannot tell which peer); the kernel keeps the "
        "device busy, so end this process"
    )


def short_expert_outputs_error(received: int, rows: int | None = None) -> InputError:
    """Expert outputs with fewer rows than the dispatch received: never a silent drop."""
    got = f"{rows} rows" if rows is not None else "fewer rows"
    return InputError(
        f"expert outputs had {got}, the dispatch received {received}: pass one row per received row "
        "(DispatchOutput.num_recv; the receive capacity, max_recv_tokens, always covers it)"
    )


def expert_id_error(expert: int, num_experts: int, *, dropped: bool) -> InputError:
    """An expert id past the last expert; ``dropped``: the kernels already sent those copies as dropped."""
    verb, tail = ("held", " (those copies were dropped)") if dropped else ("holds", "")
    return InputError(f"topk_ids {verb} expert {expert}; valid ids are [0, {num_experts}) or < 0 to drop{tail}")


@dataclass
class CombineHandle:
    """What combine needs back from a dispatch. Callers pass it through untouched: each provider
    subclasses it with its own routing record, and only that provider reads the record.

    ``num_tokens``: the tokens this rank dispatched (the rows combine returns); ``num_recv``: the rows
    received (on the device). ``issuer`` and ``dispatch_number`` let the op refuse a handle of another
    op, or one whose dispatch buffers a later dispatch has reused.
    """

    num_tokens: int
    num_recv: torch.Tensor
    issuer: int = field(default=0, kw_only=True)  # the op whose dispatch made this handle (EpDispatchCombineOp.ident)
    dispatch_number: int = field(default=0, kw_only=True)  # which of that op's dispatches

    def received_rows_on_host(self) -> int | None:
        """The received row count where the host knows it without a synchronisation, else None."""
        return None


@dataclass
class DispatchOutput:
    """Received tokens, compact and ordered by source rank, sized to the receive capacity.

    Rows at and after ``num_recv`` are unspecified. ``scales`` is a uint8 view of the meaningful bytes
    of each opaque scale row; its row stride is ``scale_stride`` (128 B aligned, pad bytes zero).
    """

    tokens: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    scales: torch.Tensor | None
    scale_stride: int
    num_recv: torch.Tensor
    handle: CombineHandle
    # The op's host wait for the device, bounded by SGLANG_MORI_PEER_TIMEOUT_S (EpDispatchCombineOp
    # sets it); num_recv_host waits with it.
    wait_for_device: Callable[[], None] = field(default=lambda: None, kw_only=True, repr=False)

    def recv_scales(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
        """The scale rows viewed as ``dtype`` (e.g. f32 for fp8 dispatch), keeping the padded stride."""
        if self.scales is None:
            return None
        size = torch.empty((), dtype=dtype).element_size()
        rows, width = self.scales.shape
        if width % size:
            raise InputError(
                f"recv_scales({dtype}): the scale row holds {width} B, not a whole number of {size}-byte elements"
            )
        base = self.scales.as_strided((rows, self.scale_stride), (self.scale_stride, 1))
        return base.view(dtype)[:, : width // size]

    def num_recv_host(self) -> int:
        """Received row count as a Python int (synchronises with the device, at most
        SGLANG_MORI_PEER_TIMEOUT_S: a receive waiting on a stalled peer raises PeerTimeoutError)."""
        self.wait_for_device()
        return int(self.num_recv.item())
