"""Framework integrations: each subpackage plugs the op into one serving framework.

Each one registers through its framework's own plugin entry point (declared in ``pyproject.toml``), so
users install mori-sglang next to a stock framework and change no code. Importing this package imports
no framework.
"""

from __future__ import annotations

import torch


def current_device() -> torch.device:
    """The device the framework made current for this rank (with its index), or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
