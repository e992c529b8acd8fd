"""A loopback world: W ranks in one process on one device, for tests and benchmarks.

Every rank's buffers live on the same device; one thread drives every rank's send, then every
rank's receive, which is the order in which a real group's ranks meet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mori_sglang.config import EpConfig
from mori_sglang.exchange import LoopbackHub
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import CombineHandle, DispatchOutput


class LoopbackWorld:
    """``ops[r]`` is rank r's op; ``dispatch`` / ``combine`` drive all ranks of one step."""

    def __init__(self, config: EpConfig, device: torch.device | str = "cpu") -> None:
        self.world_size = config.world_size
        self.hub = LoopbackHub(config.world_size)
        self.ops = [
            EpDispatchCombineOp(config.with_rank(r), device=device, loopback=self.hub) for r in range(config.world_size)
        ]
        self.device = self.ops[0].device

    def set_kernel_tuning(self, tuning: KernelTuning) -> None:
        """Every rank's ``EpDispatchCombineOp.set_kernel_tuning``."""
        for op in self.ops:
            op.set_kernel_tuning(tuning)

    def dispatch(
        self,
        xs: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor | None] | None,
        ids: Sequence[torch.Tensor],
    ) -> list[DispatchOutput]:
        scales = scales if scales is not None else [None] * self.world_size
        for op, x, w, s, i in zip(self.ops, xs, weights, scales, ids, strict=True):
            op.dispatch_send(x, w, s, i)
        return [op.dispatch_recv() for op in self.ops]

    def combine(self, ys: Sequence[torch.Tensor], handles: Sequence[CombineHandle]) -> list[torch.Tensor]:
        for op, y, h in zip(self.ops, ys, handles, strict=True):
            op.combine_send(y, h)
        return [op.combine_recv() for op in self.ops]
