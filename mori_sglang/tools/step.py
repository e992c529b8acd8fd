"""One loopback step as the benchmarks run it: every rank's inputs, and the four calls of a step, each
over every rank in rank order (a receive then finds every rank's send queued before it, as it would
find the other GPUs' sends in a real world)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mori_sglang.config import EpConfig
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.tools.measure import identity_expert
from mori_sglang.types import DispatchOutput


def make_inputs(
    cfg: EpConfig, tokens: int, device: torch.device, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per rank: Gaussian bf16 tokens, top-k of random scores as int32 ids, f32 weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    xs, weights, ids = [], [], []
    for _ in range(cfg.world_size):
        xs.append(torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device))
        ids.append(torch.rand(tokens, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.int().to(device))
        weights.append(torch.rand(tokens, cfg.topk, generator=gen).to(device))
    return xs, weights, ids


class LoopbackStep:
    """A loopback world that has run one whole step; its calls re-run it with the same inputs. The
    expert side returns the received tokens (dequantized) as its outputs."""

    def __init__(
        self, cfg: EpConfig, tokens: int, device: torch.device, tuning: KernelTuning | None = None, seed: int = 1
    ) -> None:
        self.world = LoopbackWorld(cfg, device)
        if tuning is not None:
            self.world.set_kernel_tuning(tuning)
        self.xs, self.weights, self.ids = make_inputs(cfg, tokens, device, seed)
        self.outs: list[DispatchOutput | None] = [None] * cfg.world_size  # filled in place by each call
        self.dispatch_send()
        self.dispatch_recv()
        self.ys = [identity_expert(o, cfg.dispatch_dtype, cfg.hidden) for o in self.outs]
        self.combine_send()
        self.combine_recv()

    @property
    def phases(self) -> list[Callable[[], None]]:
        """The four calls in step order (``measure.PHASES``)."""
        return [self.dispatch_send, self.dispatch_recv, self.combine_send, self.combine_recv]

    def whole_step(self) -> None:
        """The four calls one after another: a step as a server's decode graph holds it."""
        for phase in self.phases:
            phase()

    def dispatch_send(self) -> None:
        for op, x, w, i in zip(self.world.ops, self.xs, self.weights, self.ids, strict=True):
            op.dispatch_send(x, w, None, i)

    def dispatch_recv(self) -> None:
        for rank, op in enumerate(self.world.ops):
            self.outs[rank] = op.dispatch_recv()

    def combine_send(self) -> None:
        for op, y, out in zip(self.world.ops, self.ys, self.outs, strict=True):
            op.combine_send(y, out.handle)

    def combine_recv(self) -> None:
        for op in self.world.ops:
            op.combine_recv()
