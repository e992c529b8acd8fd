"""The op over a real process group: gloo with 2 and 4 processes must match the loopback world bit for bit.

One spawn per world size runs every scenario; each process rebuilds the same inputs from the same seeds,
runs its rank, and saves what it observed. The parent runs the same scenarios in a loopback world, checks
them through the reverse map, and demands identical bytes from every process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode
from mori_sglang.op import EpDispatchCombineOp, InputError
from tests.helpers import (
    RankResult,
    Scenario,
    assert_results_identical,
    check_step,
    run_gloo,
    run_loopback,
    run_step,
    world_inputs,
)

UNEVEN = (5, 0, 7, 3)


def gloo_scenarios(world: int, seed: int) -> list[Scenario]:
    """Every mode with four format/routing pairs, plus model hidden sizes, the other fp8 flavour, a
    rank-scaled bf16 expert over two steps; rank 1 sends nothing."""
    tokens = UNEVEN[:world]
    pairs = [
        dict(routing="random"),
        dict(routing="dropped", dispatch=DispatchDtype.FP8, combine=CombineDtype.FP8_BLOCKWISE, inputs="lognormal"),
        dict(
            routing="all_to_one", dispatch=DispatchDtype.MXFP8, combine=CombineDtype.FP8_BLOCKWISE_NATIVE, tagged=False
        ),
        dict(routing="spread", dispatch=DispatchDtype.MXFP4, combine=CombineDtype.FP8_DIRECT_CAST, topk=9),
    ]
    out = [Scenario(world=world, tokens=tokens, mode=mode, **kw) for mode in Mode for kw in pairs]  # type: ignore[arg-type]
    fp8 = {"dispatch": DispatchDtype.FP8, "combine": CombineDtype.FP8_BLOCKWISE}
    out += [
        Scenario(world=world, tokens=(3,) * world, hidden=7168, mode=Mode.LOW_LATENCY, **fp8),  # type: ignore[arg-type]
        Scenario(world=world, tokens=(2, 4, 1, 3)[:world], hidden=4096, routing="round_robin", topk=9),
        Scenario(world=world, tokens=tokens, fp8="e4m3fnuz", inputs="outliers", mode=Mode.SPLIT, **fp8),  # type: ignore[arg-type]
        Scenario(
            world=world,
            tokens=tokens,
            expert="rank_scaled",
            expert_dtype=torch.bfloat16,
            combine=CombineDtype.FP8_BLOCKWISE,
            steps=2,
            max_tokens=9,
        ),
    ]
    return [dataclasses.replace(s, seed=seed + i) for i, s in enumerate(out)]


def _worker(rank: int, world: int, scenarios: list[Scenario], out_dir: str) -> None:
    """One process: rejected calls first (they must send nothing, or the group would desynchronise),
    then every scenario's steps on this rank's op."""
    errors = []
    first = scenarios[0]
    try:
        EpDispatchCombineOp(first.config((rank + 1) % world), device="cpu")
    except ConfigError as err:
        errors.append(str(err))
    op = EpDispatchCombineOp(first.config(rank), device="cpu")
    if rank == 0:
        inp = world_inputs(first)[0]
        bad_ids = torch.full_like(inp.ids, first.num_experts)
        try:
            op.dispatch(inp.payload, inp.weights, inp.scales, bad_ids)
        except InputError as err:
            errors.append(str(err))
    results = []
    for scn in scenarios:
        op = EpDispatchCombineOp(scn.config(rank), device="cpu")
        steps = [dataclasses.asdict(run_step(scn, [op], world_inputs(scn, step))[0]) for step in range(scn.steps)]
        results.append(steps)
    torch.save({"errors": errors, "results": results}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_matches_loopback(world: int, seed: int, tmp_path: Path) -> None:
    scenarios = gloo_scenarios(world, seed)
    run_gloo(world, _worker, (scenarios, str(tmp_path)), tmp_path)
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, s in enumerate(saved):
        assert any("process group says" in e for e in s["errors"]), f"rank {rank}: rank mismatch not refused"
        assert (rank == 0) == any("valid ids are" in e for e in s["errors"])
    for i, scn in enumerate(scenarios):
        for step, loop in enumerate(run_loopback(scn)):
            check_step(scn, world_inputs(scn, step), loop)
            gloo = [RankResult(**saved[r]["results"][i][step]) for r in range(world)]
            assert_results_identical(loop, gloo, f"scenario {i} ({scn.mode.value}) step {step}")


def _count_hosts(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from mori_sglang.providers import group_hosts

    cpu = torch.device("cpu")
    Path(out_dir, f"hosts{rank}").write_text(f"{group_hosts(None, cpu)} {group_hosts(dist.new_group([0, 1]), cpu)}")


def test_group_hosts_counts_the_hosts_of_a_group(tmp_path: Path) -> None:
    run_gloo(2, _count_hosts, (str(tmp_path),), tmp_path)
    assert [Path(tmp_path, f"hosts{rank}").read_text() for rank in range(2)] == ["1 1"] * 2


def test_the_triton_kernels_run_within_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their arenas are one host's symmetric memory: across hosts auto takes torch.distributed and an
    explicit triton is refused by name; the hosts are asked only where it decides."""
    from mori_sglang import providers
    from mori_sglang.config import Provider

    monkeypatch.setattr(providers, "mori_available", lambda: False)
    monkeypatch.setattr(providers, "triton_available", lambda: True)
    gpu, asked = torch.device("cuda", 0), []

    def hosts(count: int):
        return lambda: asked.append(count) or count

    assert providers.resolve_provider(Provider.AUTO, gpu, hosts=hosts(1)) is Provider.TRITON
    assert providers.resolve_provider(Provider.AUTO, gpu, hosts=hosts(2)) is Provider.TORCH
    assert providers.resolve_provider(Provider.TRITON, gpu, hosts=hosts(1)) is Provider.TRITON
    with pytest.raises(ConfigError, match=r"SGLANG_MORI_BACKEND=triton runs within one host .* span 2 hosts"):
        providers.resolve_provider(Provider.TRITON, gpu, hosts=hosts(2))
    assert asked == [1, 2, 1, 2]
    for requested in (Provider.AUTO, Provider.TRITON, Provider.TORCH):  # loopback, CPU, torch: not asked
        providers.resolve_provider(requested, gpu, real_ranks=False, hosts=hosts(3))
        providers.resolve_provider(requested, torch.device("cpu"), real_ranks=False, hosts=hosts(3))
    providers.resolve_provider(Provider.AUTO, torch.device("cpu"), hosts=hosts(3))
    providers.resolve_provider(Provider.TORCH, gpu, hosts=hosts(3))
    assert asked == [1, 2, 1, 2]


def test_the_triton_kernels_on_cpu_ranks_of_a_group_are_refused_by_name() -> None:
    """Torch symmetric memory has no CPU backend: on a CPU the kernels run only in a loopback world
    (the interpreter), and a process group's ranks are refused before the group or a buffer is touched."""
    cfg = EpConfig(2, 1, 64, 4, 2, max_tokens_per_rank=4, provider="triton")
    with pytest.raises(ConfigError, match="SGLANG_MORI_BACKEND=triton on ranks of a process group needs GPUs"):
        EpDispatchCombineOp(cfg, device="cpu")
