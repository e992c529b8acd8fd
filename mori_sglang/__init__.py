"""Expert-parallel MoE dispatch/combine for SGLang and vLLM.

The public names load on first use, so that ``python -m mori_sglang.<command>`` runs the command's
module once, as ``__main__``, rather than after the package imported it (Python warns about that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
    from mori_sglang.env import EnvError
    from mori_sglang.formats import FormatError, scale_stride_bytes
    from mori_sglang.loopback import LoopbackWorld
    from mori_sglang.op import EpDispatchCombineOp, InputError
    from mori_sglang.types import CombineHandle, DispatchOutput, PeerTimeoutError

_MODULE_OF = {
    "CombineDtype": "mori_sglang.config",
    "CombineHandle": "mori_sglang.types",
    "ConfigError": "mori_sglang.config",
    "DispatchDtype": "mori_sglang.config",
    "DispatchOutput": "mori_sglang.types",
    "EnvError": "mori_sglang.env",
    "EpConfig": "mori_sglang.config",
    "EpDispatchCombineOp": "mori_sglang.op",
    "FormatError": "mori_sglang.formats",
    "InputError": "mori_sglang.op",
    "LoopbackWorld": "mori_sglang.loopback",
    "Mode": "mori_sglang.config",
    "PeerTimeoutError": "mori_sglang.types",
    "Provider": "mori_sglang.config",
    "scale_stride_bytes": "mori_sglang.formats",
}
__all__ = [
    "CombineDtype",
    "CombineHandle",
    "ConfigError",
    "DispatchDtype",
    "DispatchOutput",
    "EnvError",
    "EpConfig",
    "EpDispatchCombineOp",
    "FormatError",
    "InputError",
    "LoopbackWorld",
    "Mode",
    "PeerTimeoutError",
    "Provider",
    "scale_stride_bytes",
]


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mori_sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
