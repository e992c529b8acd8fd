"""How the stand-in moves data between its ranks: every rank sees every rank's tensors.

Real MoRI writes into its peers' symmetric buffers; the stand-in gathers over a torch.distributed group
instead (tiny test sizes only). Tensors travel as bytes plus their dtype, since pickling some
low-precision dtypes is not supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

POISON_BYTE = 0x77  # fills buffers before the kernels write them: a read of an unwritten row fails


def poisoned(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), POISON_BYTE, dtype=torch.uint8)


def _pack(t: torch.Tensor | None):
    return None if t is None else (t.contiguous().view(torch.uint8).clone(), t.dtype, tuple(t.shape))


def _unpack(packed) -> torch.Tensor | None:
    if packed is None:
        return None
    data, dtype, shape = packed
    return data.view(dtype).view(shape)


def gather(items: tuple, group: dist.ProcessGroup) -> list[tuple]:
    """Every rank's ``items`` (tensors, None or plain objects), in rank order."""
    packed = tuple(_pack(t) if isinstance(t, torch.Tensor) else ("obj", t) for t in items)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, packed, group=group)
    return [
        tuple(p[1] if isinstance(p, tuple) and len(p) == 2 and p[0] == "obj" else _unpack(p) for p in item)
        for item in everyone
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as uint8 ``[rows, row bytes]`` (also for zero rows)."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def trunc_div(ids: torch.Tensor, divisor: int) -> torch.Tensor:
    """C++ integer division (towards zero): -1 / 32 is 0, the destination AsyncLL computes."""
    return torch.div(ids, divisor, rounding_mode="trunc")
