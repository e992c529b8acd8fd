"""Push the same expert outputs through combine once per wire format, on a loopback world.

Routing and expert outputs are drawn once and shared by every mode, so the modes differ only in the
combine format. Dispatch is bf16 (exact), and the expert outputs are synthetic rather than computed
from the dispatched tokens: what is measured is the combine alone. The reference is the exact f32 sum,
per source token, of the rows its destination ranks return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eval.layer_accuracy.activations import ActivationSpec, channel_scales, expert_outputs
from eval.layer_accuracy.metrics import flushed_fraction, median_element_error, relative_error, saturated_fraction
from mori_sglang import CombineDtype, DispatchDtype, EpConfig, LoopbackWorld, Provider
from mori_sglang.wire_formats import COMBINE_FORMATS

# Every combine format whose bytes we define, in the table's order.
MODES = tuple(CombineDtype(f.name) for f in COMBINE_FORMATS if f.has_reference)


@dataclass(frozen=True)
class LayerSetup:
    world_size: int = 8
    tokens_per_rank: int = 64
    hidden: int = 7168
    num_experts: int = 256
    topk: int = 8
    seed: int = 1
    device: str = "cpu"
    provider: Provider = Provider.AUTO
    fp8_dtype: torch.dtype | None = None  # None: the device's flavour (e4m3fnuz on MI300)
    activations: ActivationSpec = field(default_factory=ActivationSpec)


@dataclass(frozen=True)
class ModeResult:
    mode: CombineDtype
    relative_error: float
    median_element_error: float
    flushed: float
    saturated: float


@dataclass(frozen=True)
class Workload:
    """Routing, expert outputs per destination rank, and the exact combine result per source rank."""

    tokens: list[torch.Tensor]
    topk_ids: list[torch.Tensor]
    expert_outputs: list[torch.Tensor]
    reference: list[torch.Tensor]


def make_workload(setup: LayerSetup) -> Workload:
    """Random top-k routing, then for each destination rank the rows it receives (ordered by source
    rank, then source token, as dispatch delivers them) filled with synthetic expert outputs."""
    w, n, h = setup.world_size, setup.tokens_per_rank, setup.hidden
    gen = torch.Generator().manual_seed(setup.seed)
    tokens = [torch.randn(n, h, generator=gen).to(torch.bfloat16) for _ in range(w)]
    ids = [torch.rand(n, setup.num_experts, generator=gen).topk(setup.topk).indices.int() for _ in range(w)]
    experts_per_rank = setup.num_experts // w
    # goes_to[s][t, r]: token t of source s has an expert on rank r
    goes_to = [torch.zeros(n, w, dtype=torch.bool).scatter_(1, i.long() // experts_per_rank, True) for i in ids]
    channels = channel_scales(h, setup.activations, gen)
    reference = [torch.zeros(n, h) for _ in range(w)]
    outputs = []
    for r in range(w):
        y = expert_outputs(sum(int(g[:, r].sum()) for g in goes_to), channels, setup.activations, gen)
        start = 0
        for s in range(w):
            mask = goes_to[s][:, r]
            count = int(mask.sum())
            reference[s][mask] += y[start : start + count].float()
            start += count
        outputs.append(y)
    return Workload(tokens, ids, outputs, reference)


def mode_config(setup: LayerSetup, mode: CombineDtype) -> EpConfig:
    """The op config of one mode (ConfigError for sizes no op takes)."""
    return EpConfig(
        world_size=setup.world_size,
        rank=0,
        hidden=setup.hidden,
        num_experts=setup.num_experts,
        topk=setup.topk,
        max_tokens_per_rank=setup.tokens_per_rank,
        dispatch_dtype=DispatchDtype.BF16,
        combine_dtype=mode,
        provider=setup.provider,
        fp8_dtype=setup.fp8_dtype,
    )


def run_mode(setup: LayerSetup, work: Workload, mode: CombineDtype) -> ModeResult:
    config = mode_config(setup, mode)
    world = LoopbackWorld(config, setup.device)
    device = world.device
    n, k = setup.tokens_per_rank, setup.topk
    weights = [torch.ones(n, k, device=device) for _ in range(setup.world_size)]
    received = world.dispatch([x.to(device) for x in work.tokens], weights, None, [i.to(device) for i in work.topk_ids])
    for r, (out, y) in enumerate(zip(received, work.expert_outputs, strict=True)):
        if out.num_recv_host() != y.shape[0]:
            raise RuntimeError(f"rank {r} received {out.num_recv_host()} rows, the routing sends it {y.shape[0]}")
    ys = [y.to(device) for y in work.expert_outputs]
    combined = world.combine(ys, [out.handle for out in received])
    out = torch.cat([c.float().cpu() for c in combined])
    ref = torch.cat(work.reference)
    saturated = saturated_fraction(torch.cat(ys), mode, world.ops[0].fp8_dtype, config.combine_block)
    return ModeResult(
        mode, relative_error(out, ref), median_element_error(out, ref), flushed_fraction(out, ref), saturated
    )


def run(setup: LayerSetup, modes: tuple[CombineDtype, ...] = MODES) -> list[ModeResult]:
    work = make_workload(setup)
    return [run_mode(setup, work, mode) for mode in modes]
