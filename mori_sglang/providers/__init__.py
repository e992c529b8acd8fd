"""Transports behind the op API: native MoRI, our Triton kernels, and torch.distributed."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from mori_sglang.config import ConfigError, Provider


def mori_available() -> bool:
    return importlib.util.find_spec("mori") is not None


def rocm_build() -> bool:
    """Whether this torch is a ROCm build: native MoRI's kernels are built for AMD GPUs only, and an
    ``amd-mori`` package importable beside a CUDA build of torch cannot run them."""
    return torch.version.hip is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def host_name() -> str:
    """The name that tells this process's host from the others' (tests stand in hosts through it)."""
    return socket.gethostname()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made the current GPU, for work that uses the current one: native MoRI allocates its
    buffers there, and an NCCL group gathers Python objects through it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _host_names(group: dist.ProcessGroup | None, device: torch.device) -> list[str]:
    """Every rank's host name, in the ranks' order; a collective over ``group`` (None: the world), made
    with ``device``, the op's, current."""
    names: list[str | None] = [None] * dist.get_world_size(group)
    with on_device(device):
        dist.all_gather_object(names, host_name(), group=group)
    return [str(name) for name in names]


def group_hosts(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """How many hosts the ranks of ``group`` (None: the world) run on; a collective over the group."""
    if dist.get_world_size(group) == 1:
        return 1
    return len(set(_host_names(group, device)))


def ranks_per_host(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """How many ranks of ``group`` (None: the world) each host runs (``host_blocks``); a collective
    over the group."""
    if dist.get_world_size(group) == 1:
        return 1
    return host_blocks(_host_names(group, device))


def host_blocks(names: list[str]) -> int:
    """How many ranks each host runs, from every rank's host name in the ranks' order.

    Native MoRI numbers a rank's host ``rank // gpu_per_node``: its inter-node kernels reach the ranks
    of the same quotient over the host's GPU links and the others over the network. So the ranks must
    fill the hosts in order, the same number on each, as torchrun, SGLang and vLLM lay them out; any
    other layout is refused here rather than sent to the wrong peers."""
    per_host = names.count(names[0])
    blocks = [names[start : start + per_host] for start in range(0, len(names), per_host)]
    if len(names) % per_host or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ConfigError(
            "native MoRI (which SGLANG_MORI_BACKEND picked) needs every host to run the same number of "
            f"consecutive ranks (its kernels take rank // ranks per host for a rank's host); these ranks run on "
            f"{names}: launch them host by host, or use SGLANG_MORI_BACKEND=torch"
        )
    return per_host


def resolve_provider(
    requested: Provider,
    device: torch.device,
    *,
    real_ranks: bool = True,
    hosts: Callable[[], int] = lambda: 1,
) -> Provider:
    """auto: native MoRI on an AMD GPU (a ROCm torch) where it imports and the ranks are real processes, else our
    Triton kernels on a GPU within one host, else torch.distributed. ROCm builds of torch name their
    GPUs "cuda" too. ``hosts``: how many hosts the real ranks span, asked only where the Triton kernels
    would run across them (their arenas are one host's symmetric memory)."""
    triton_on_gpu = device.type == "cuda" and triton_available()
    if requested is Provider.AUTO:
        if device.type == "cuda" and rocm_build() and real_ranks and mori_available():
            return Provider.MORI
        if triton_on_gpu and (not real_ranks or hosts() == 1):
            return Provider.TRITON
        return Provider.TORCH
    if requested is Provider.TRITON and device.type != "cuda" and real_ranks:
        raise ConfigError(
            f"SGLANG_MORI_BACKEND=triton on ranks of a process group needs GPUs: its buffers are torch symmetric "
            f"memory, which has no {device.type} backend (on a CPU the kernels run only in a one-process "
            "LoopbackWorld under TRITON_INTERPRET=1); use auto or torch"
        )
    if requested is Provider.TRITON and device.type == "cuda" and real_ranks and (count := hosts()) > 1:
        raise ConfigError(
            f"SGLANG_MORI_BACKEND=triton runs within one host (the arenas are one host's symmetric memory), "
            f"and these ranks span {count} hosts; use auto or torch (torch.distributed) across hosts"
        )
    if requested is Provider.MORI and device.type == "cuda" and not rocm_build():
        raise ConfigError(
            "SGLANG_MORI_BACKEND=mori needs an AMD GPU: native MoRI's kernels are built for ROCm, and this torch "
            f"is a CUDA build ({torch.version.cuda}); use auto, triton or torch"
        )
    if requested is Provider.MORI and not mori_available():
        raise ConfigError(
            "SGLANG_MORI_BACKEND=mori but the native MoRI package does not import; use auto, triton or torch"
        )
    if requested is Provider.TRITON and not triton_available():
        raise ConfigError("SGLANG_MORI_BACKEND=triton but triton is not installed; use auto or torch")
    return requested
