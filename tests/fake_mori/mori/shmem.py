"""``mori.shmem``: the bootstrap looks the process group up by the name it was registered under."""

from __future__ import annotations

import torch
import torch.distributed as dist

group: dist.ProcessGroup | None = None


def shmem_torch_process_group_init(group_name: str) -> None:
    global group
    group = torch._C._distributed_c10d._resolve_process_group(group_name)


def shmem_finalize() -> None:
    global group
    group = None
