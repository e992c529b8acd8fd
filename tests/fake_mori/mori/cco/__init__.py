"""``mori.cco``: the communicator EP v2 is built on, over the default torch.distributed group.

As in the real package, rank 0 makes a unique id, the caller broadcasts it, and every rank calls
``Communicator.init`` with it (a collective). The stand-in checks that every rank got the same id and
that the ranks agree with the process group. Like the real one, a communicator does not own the torch
group: it looks the default group up when it needs it, so that group dies with ``destroy_process_group``
even while an op still holds the communicator.
"""

from __future__ import annotations

import secrets

import torch.distributed as dist

__all__ = ["Communicator", "UniqueId", "get_unique_id"]


class UniqueId:
    def __init__(self, token: bytes) -> None:
        self.token = token

    def __bytes__(self) -> bytes:
        return self.token


def get_unique_id() -> UniqueId:
    return UniqueId(secrets.token_bytes(16))


class Communicator:
    DEFAULT_PER_RANK_VMM: int = 4 * 1024 * 1024 * 1024

    def __init__(self) -> None:
        self._valid = False
        self._rank: int | None = None
        self._nranks: int | None = None
        self.per_rank_vmm = 0

    @staticmethod
    def get_unique_id() -> UniqueId:
        return get_unique_id()

    @classmethod
    def init(
        cls, nranks: int, rank: int, unique_id: UniqueId, per_rank_vmm: int = DEFAULT_PER_RANK_VMM
    ) -> Communicator:
        if not isinstance(unique_id, UniqueId):
            raise TypeError(f"unique_id must be a mori.cco.UniqueId, got {type(unique_id).__name__}")
        group = dist.group.WORLD
        if dist.get_world_size(group) != nranks or dist.get_rank(group) != rank:
            raise ValueError(f"rank {rank} of {nranks} disagrees with the process group")
        ids: list = [None] * nranks
        dist.all_gather_object(ids, bytes(unique_id), group=group)
        if len(set(ids)) != 1:
            raise RuntimeError("ranks called Communicator.init with different unique ids")
        comm = cls()
        comm._valid, comm._rank, comm._nranks, comm.per_rank_vmm = True, rank, nranks, per_rank_vmm
        return comm

    @property
    def is_valid(self) -> bool:
        return self._valid

    @property
    def group(self) -> dist.ProcessGroup:
        """The group the stand-in's transfers run over (the default one)."""
        return self._check_valid("communicate")

    def _check_valid(self, op: str) -> dist.ProcessGroup:
        if not self._valid:
            raise RuntimeError(f"Cannot {op}: Communicator has been destroyed")
        return dist.group.WORLD

    @property
    def rank(self) -> int:
        self._check_valid("get rank")
        return self._rank  # type: ignore[return-value]

    @property
    def nranks(self) -> int:
        self._check_valid("get nranks")
        return self._nranks  # type: ignore[return-value]

    def barrier(self) -> None:
        dist.barrier(self._check_valid("barrier"))

    def destroy(self) -> None:
        self._valid = False
