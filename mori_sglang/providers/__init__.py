"""Transports behind the op API: native MoRI, our Triton kernels, and torch.distributed."""

from __future__ import annotations

import importlib.util

import torch

from mori_sglang.config import ConfigError, Provider


def mori_available() -> bool:
    return importlib.util.find_spec("mori") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_provider(requested: Provider, device: torch.device, *, real_ranks: bool = True) -> Provider:
    """auto: native MoRI on a GPU where it imports (AMD) and the ranks are real processes, else our
    Triton kernels on a GPU, else torch.distributed. ROCm builds of torch name their GPUs "cuda" too."""
    if requested is Provider.AUTO:
        if device.type == "cuda" and real_ranks and mori_available():
            return Provider.MORI
        if triton_available() and device.type == "cuda":
            return Provider.TRITON
        return Provider.TORCH
    if requested is Provider.MORI and not mori_available():
        raise ConfigError(
            "SGLANG_MORI_BACKEND=mori but the native MoRI package does not import; use auto, triton or torch"
        )
    if requested is Provider.TRITON and not triton_available():
        raise ConfigError("SGLANG_MORI_BACKEND=triton but triton is not installed; use auto or torch")
    return requested
