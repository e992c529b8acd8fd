"""The host's wait for the device, given up after SGLANG_MORI_PEER_TIMEOUT_S.

Native MoRI's kernels spin on a peer's signal without a bound of their own (MoRI 1.2.4 has no timeout
knob, docs/api.md), and an all_to_all replayed in a CUDA graph is watched by nothing on the host. Where
the op's API waits for the device anyway (``EpDispatchCombineOp.synchronize``,
``DispatchOutput.num_recv_host``) it polls an event with a deadline instead of blocking, so a stalled
peer ends in PeerTimeoutError, not a hang. The kernel keeps spinning: the device is lost to that process.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from mori_sglang.types import device_wait_timeout_error

FIRST_PAUSE_S = 1e-5  # the poll's first sleep, doubled up to LAST_PAUSE_S: a quick step pays ~10 us
LAST_PAUSE_S = 1e-3


class Completion(Protocol):
    def query(self) -> bool: ...


def wait_for(done: Completion, timeout_s: float, rank: int) -> None:
    """Return once ``done.query()`` is true; raise PeerTimeoutError ``timeout_s`` after the call."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_PAUSE_S
    while not done.query():
        if time.monotonic() >= deadline:
            raise device_wait_timeout_error(rank, timeout_s)
        time.sleep(pause)
        pause = min(2 * pause, LAST_PAUSE_S)


def wait_for_device(device: torch.device, timeout_s: float, rank: int) -> None:
    """Wait for the work queued on ``device``'s current stream (every peer wait of the providers runs
    there or is joined to it), bounded by ``timeout_s``; then for the device's other streams."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_for(done, timeout_s, rank)
    torch.cuda.synchronize(device)
