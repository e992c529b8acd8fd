"""``mori.shmem``: the two bootstraps, the torch one and the unique-id one, as the real package has them.

The real torch bootstrap broadcasts its unique id from global rank 0 (``src=0``), so it raises for a
group without that rank, as here. The stand-in has no sockets: the ranks of a unique-id bootstrap are
those of the group registered under MoRI's name ("mori", as SGLang, vLLM and the provider register it),
and the unique id is checked to be one for the whole group.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

MORI_SHMEM_INIT_WITH_UNIQUEID = 1
REGISTERED_NAME = "mori"

group: dist.ProcessGroup | None = None


def shmem_torch_process_group_init(group_name: str):
    resolved = torch._C._distributed_c10d._resolve_process_group(group_name)
    rank, world_size = dist.get_rank(resolved), dist.get_world_size(resolved)
    uid = [shmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0, group=resolved)
    return shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world_size, uid[0])


def shmem_get_unique_id() -> bytes:
    return os.urandom(16)


def shmem_init_attr(flags: int, rank: int, nranks: int, unique_id: bytes):
    global group
    if flags != MORI_SHMEM_INIT_WITH_UNIQUEID or not isinstance(unique_id, bytes):
        raise ValueError("shmem_init_attr takes MORI_SHMEM_INIT_WITH_UNIQUEID and the bytes of a unique id")
    resolved = torch._C._distributed_c10d._resolve_process_group(REGISTERED_NAME)
    if (dist.get_rank(resolved), dist.get_world_size(resolved)) != (rank, nranks):
        raise ValueError(f"rank {rank} of {nranks} is not this process's place in the shmem group")
    ids: list[bytes | None] = [None] * nranks
    dist.all_gather_object(ids, unique_id, group=resolved)
    if len(set(ids)) != 1:
        raise RuntimeError("the ranks of one shmem bootstrap hold different unique ids")
    group = resolved
    return 0


def shmem_finalize() -> None:
    global group
    group = None
