"""Error flags a kernel raises on the device, read by the host without a synchronisation on the hot path."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch


class DeviceStatus:
    """A small int64 vector kernels set (0 = fine; int64 holds what any int64 expert id flags). On CPU
    the host reads it at once; on a GPU each ``publish`` copies it to pinned memory behind an event,
    and the next ``pending`` reads that copy once the event has passed, so a bad step raises one call
    later instead of stalling every call.
    Inside CUDA graph capture nothing is published (the flags stay on the device for ``read``)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.flags = torch.zeros(size, dtype=torch.int64, device=device)
        self._on_gpu = device.type == "cuda"
        if self._on_gpu:
            self._host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            self._event = torch.cuda.Event()

    def read(self) -> list[int]:
        """The flags now (a synchronisation), cleared for the next step."""
        values = [int(v) for v in self.flags.tolist()]
        if any(values):
            self.flags.zero_()
        return values

    def pending(self) -> bool:
        """Whether a published copy already shows a raised flag (never waits)."""
        if not self._on_gpu:
            return bool(self.flags.any())
        if torch.cuda.is_current_stream_capturing():
            return False
        return self._event.query() and bool(self._host.any())

    def after_step(self, raise_flags: Callable[[], None]) -> None:
        """End of a receive: ``raise_flags`` (the provider's check, which reads the flags and raises)
        if an earlier step's published copy shows one, then publish this step's flags."""
        if self.pending():
            raise_flags()
        self.publish()

    def publish(self) -> None:
        if self._on_gpu and not torch.cuda.is_current_stream_capturing():
            self._host.copy_(self.flags, non_blocking=True)
            self._event.record()


class MappedStatus:
    """A small int64 vector kernels set (0 = fine), in host memory that kernels write through: pinned
    memory on a GPU, which the device addresses directly (unified addressing), a plain tensor on CPU.
    The host reads it at any time without a copy, an event or a synchronisation, so a step moves
    nothing from the device to the host; a flag set by a step shows at a later call (or at once after
    a synchronisation). Kernels write it only when something went wrong."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.flags = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._words = (ctypes.c_int64 * size).from_address(self.flags.data_ptr())
        # The flags' bytes, compared whole against zeros: one C call where ``any`` walks them in Python.
        self._bytes = memoryview(self._words).cast("B")
        self._clear = bytes(self._bytes.nbytes)

    def read(self) -> list[int]:
        """The flags now, cleared for the next step."""
        values = list(self._words)
        for i, value in enumerate(values):
            if value:
                self._words[i] = 0
        return values

    def pending(self) -> bool:
        """Whether a flag is raised (never waits)."""
        return self._bytes.tobytes() != self._clear

    def after_step(self, raise_flags: Callable[[], None]) -> None:
        """End of a receive: ``raise_flags`` (the provider's check, which reads the flags and raises)
        if a step before this one raised a flag."""
        if self.pending():
            raise_flags()
