"""Expert-parallel MoE dispatch/combine for SGLang and vLLM."""

from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.formats import scale_stride_bytes
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp, InputError
from mori_sglang.types import CombineHandle, DispatchOutput

__all__ = [
    "CombineDtype",
    "CombineHandle",
    "DispatchDtype",
    "DispatchOutput",
    "EpConfig",
    "EpDispatchCombineOp",
    "InputError",
    "LoopbackWorld",
    "Mode",
    "Provider",
    "scale_stride_bytes",
]
