"""Per-rank arenas the Triton kernels write into, and the table of every rank's arena address.

On GPUs of one node the arena is PyTorch symmetric memory, so a kernel on rank r can store straight
into rank d's arena through its peer pointer. In a loopback world every rank's arena is a plain buffer
on the one device and the table simply lists their addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mori_sglang.exchange import LoopbackHub
from mori_sglang.kernels.transport import ROW_ALIGN

SYNC_ALIGN = 128


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of the regions of one arena (identical on every rank)."""

    world_size: int
    max_tokens: int
    dispatch_row_bytes: int
    combine_row_stride: int

    def __post_init__(self) -> None:
        # The kernels tell the compiler that every row starts on ROW_ALIGN bytes.
        for name in ("dispatch_row_bytes", "combine_row_stride"):
            if getattr(self, name) % ROW_ALIGN.value:
                raise ValueError(f"{name}={getattr(self, name)} is not a multiple of {ROW_ALIGN.value} bytes")

    @property
    def slots(self) -> int:
        return self.world_size * self.max_tokens

    @property
    def combine_offset(self) -> int:
        return _align(self.slots * self.dispatch_row_bytes, SYNC_ALIGN)

    @property
    def dispatch_arrivals_offset(self) -> int:
        return _align(self.combine_offset + self.slots * self.combine_row_stride, SYNC_ALIGN)

    @property
    def combine_arrivals_offset(self) -> int:
        return self.dispatch_arrivals_offset + 8 * self.world_size

    @property
    def counts_offset(self) -> int:
        return self.combine_arrivals_offset + 8 * self.world_size

    @property
    def nbytes(self) -> int:
        return _align(self.counts_offset + 8 * self.world_size, SYNC_ALIGN)


class Arena:
    """This rank's arena and the address of every rank's arena."""

    def __init__(self, layout: ArenaLayout, buffer: torch.Tensor, peer_bases: torch.Tensor) -> None:
        _check_aligned([buffer.data_ptr()])
        self.layout = layout
        self.buffer = buffer
        self.peer_bases = peer_bases

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    @classmethod
    def loopback(cls, layout: ArenaLayout, hub: LoopbackHub, rank: int, device: torch.device) -> Arena:
        buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        hub.arenas[rank] = buffer
        return cls(layout, buffer, torch.zeros(layout.world_size, dtype=torch.int64, device=device))

    def resolve_loopback_peers(self, hub: LoopbackHub) -> None:
        """Fill the address table once every rank of the loopback world has its arena."""
        if len(hub.arenas) != self.layout.world_size:
            missing = sorted(set(range(self.layout.world_size)) - set(hub.arenas))
            raise RuntimeError(f"loopback world: ranks {missing} have no arena yet; build every rank's op first")
        addresses = [hub.arenas[r].data_ptr() for r in range(self.layout.world_size)]
        _check_aligned(addresses)
        self.peer_bases.copy_(torch.tensor(addresses, dtype=torch.int64))

    @classmethod
    def symmetric(cls, layout: ArenaLayout, group: dist.ProcessGroup, device: torch.device) -> Arena:
        """Allocate symmetric memory and exchange peer pointers (a collective over ``group``)."""
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = symm_mem.rendezvous(buffer, group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        _check_aligned(list(handle.buffer_ptrs))
        bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        arena = cls(layout, buffer, bases)
        arena.handle = handle  # keeps the mapping alive as long as the arena
        return arena


def _check_aligned(addresses: list[int]) -> None:
    bad = [hex(a) for a in addresses if a % ROW_ALIGN.value]
    if bad:
        raise RuntimeError(f"arena buffers at {bad} are not {ROW_ALIGN.value}-byte aligned")
