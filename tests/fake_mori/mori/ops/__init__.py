"""``mori.ops``: the v1 op at the top, the v2 op in ``dispatch_combine_v2``."""

from mori.ops import dispatch_combine_v2
from mori.ops.dispatch_combine import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineKernelType", "EpDispatchCombineOp", "dispatch_combine_v2"]
