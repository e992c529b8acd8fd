"""``mori.ops.dispatch_combine_v2``: MoRI's v2 op (bootstrapped through ``mori.cco.Communicator``)."""

from mori.ops.dispatch_combine_v2.dispatch_combine_op import (
    EpDispatchCombineConfig,
    EpDispatchCombineOp,
    EpDispatchRoutingHandle,
)

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDispatchRoutingHandle"]
