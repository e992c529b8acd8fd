"""Where a step's host time goes: the op's own Python (every kernel launch replaced by a no-op) and,
on a GPU, its launches, direct and through Triton's launcher, all in one run.

    python -m mori_sglang.tools.op_overhead --tokens 128 --hidden 7168 --world 8

``bench --eager`` times launches and Python together, and a host's launch cost moves by up to 2x
from one process to the next, more than most changes to the host path. Here each call runs over every
rank of a loopback world and is timed per rank: with launches as no-ops (what the op itself costs:
checks, bookkeeping, views; the least mean over the repeats, as ``timeit`` reports it) and, on a GPU,
with its launches (the device kept busy as ``bench --eager`` keeps it), in rounds that alternate the
direct launches with launches through Triton's launcher (the baseline), each round's paths timed
back to back, and one torch launch per round. The difference to the Python per launch is what a
launch costs inside a step. The Python part runs on any machine (on a CPU the first step, which binds
the launches, runs in Triton's interpreter) and is steady enough to compare trees on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch

from mori_sglang import cli
from mori_sglang.config import EpConfig, Mode
from mori_sglang.kernels.launch import BoundLaunch, through_tritons_launcher
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.tools.measure import PHASES, host_us_per_call, kept_busy_text, time_eager
from mori_sglang.tools.step import LoopbackStep

# The torch launch each round is measured against: launches per timed repeat, and repeats.
TORCH_LAUNCHES, REPEATS = 200, 5


@dataclass
class OpOverhead:
    """One call, per rank. The launch columns are medians over the rounds (GPU only, else None)."""

    phase: str
    python_us: float  # launches as no-ops: the least mean over the repeats
    launches: float  # launches per rank and call
    host_us: float | None = None  # with direct launches
    wrapper_host_us: float | None = None  # with every launch through Triton's launcher, the baseline

    @property
    def launch_us(self) -> float | None:
        """Host µs of one direct launch inside the call: what the launches add to the call's Python."""
        if self.host_us is None or not self.launches:
            return None
        return (self.host_us - self.python_us) / self.launches


@dataclass
class Rounds:
    """Per round of the GPU timing: each path's step (the four calls' host µs per rank) and one torch
    launch's host µs, all measured back to back."""

    direct_us: list[float]
    wrapper_us: list[float]
    torch_launch_us: list[float]
    device_kept_busy: bool = True  # whether every timed call ended before the device reached its work

    def differences(self) -> list[float]:
        """Direct minus Triton's launcher, round by round."""
        return [d - w for d, w in zip(self.direct_us, self.wrapper_us, strict=True)]


@dataclass
class Report:
    rows: list[OpOverhead]
    rounds: Rounds | None  # None on a CPU


@contextmanager
def launches_stubbed() -> Iterator[None]:
    """Every ``BoundLaunch`` counts its launches but launches nothing (the buffers keep the last real
    step's contents, so each call's host path runs as in that step)."""

    def count_only(self: BoundLaunch, *values: object) -> None:
        self.launches += 1

    with mock.patch.object(BoundLaunch, "__call__", count_only):
        yield


def python_us(phases: list[Callable[[], None]], steps: int, repeats: int) -> list[float]:
    """Per phase, the least mean over ``repeats`` of ``steps`` steps, in µs (launches stubbed by the caller)."""
    best = [float("inf")] * len(phases)
    for _ in range(repeats):
        totals = [0.0] * len(phases)
        for _ in range(steps):
            for index, phase in enumerate(phases):
                start = time.perf_counter()
                phase()
                totals[index] += time.perf_counter() - start
        best = [min(b, t * 1e6 / steps) for b, t in zip(best, totals, strict=True)]
    return best


def measure(
    cfg: EpConfig, tokens: int, device: torch.device, steps: int, repeats: int, iters: int, rounds: int
) -> Report:
    """Per rank and call: the Python with launches as no-ops, the launches, and on a GPU the host time
    with direct launches and through Triton's launcher over ``rounds`` rounds of ``iters`` steps each."""
    step = LoopbackStep(cfg, tokens, device)
    world, phases = step.world, step.phases
    ranks = cfg.world_size
    with launches_stubbed():
        launches = []
        for phase in phases:
            before = _launch_count(world)
            phase()
            launches.append((_launch_count(world) - before) / ranks)
        python = [us / ranks for us in python_us(phases, steps, repeats)]
    rows = [OpOverhead(p, us, n) for p, us, n in zip(PHASES, python, launches, strict=True)]
    if device.type != "cuda":
        return Report(rows, None)
    with through_tritons_launcher():
        for phase in phases:  # warm-up of the other path
            phase()
    direct: list[list[float]] = []
    wrapper: list[list[float]] = []
    torch_launch = []
    kept_busy = True
    one = torch.zeros(1, device=device)
    for index in range(rounds):
        for use_direct in (True, False) if index % 2 == 0 else (False, True):  # either path first, in turn
            with contextlib.nullcontext() if use_direct else through_tritons_launcher():
                host, _device, busy = time_eager(phases, device, iters)
            (direct if use_direct else wrapper).append([statistics.median(t) * 1e6 / ranks for t in host])
            kept_busy = kept_busy and busy
        torch_us, busy = host_us_per_call(lambda: one.add_(1), device, TORCH_LAUNCHES, REPEATS)
        torch_launch.append(torch_us)
        kept_busy = kept_busy and busy
    for index, row in enumerate(rows):
        row.host_us = statistics.median(r[index] for r in direct)
        row.wrapper_host_us = statistics.median(r[index] for r in wrapper)
    return Report(rows, Rounds([sum(r) for r in direct], [sum(r) for r in wrapper], torch_launch, kept_busy))


def _launch_count(world: LoopbackWorld) -> int:
    """The world's launches so far, over its providers (0 for providers without bound launches)."""
    counts = (getattr(op.provider, "launch_count", None) for op in world.ops)
    return sum(count() for count in counts if count is not None)


def markdown(report: Report) -> str:
    """One row per call and the step ('-' where launches were not timed: on a CPU), then the rounds."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def ratio(value: float | None, baseline: float | None) -> str:
        return "-" if value is None or not baseline else f"{value / baseline:.2f}"

    rows, rounds = report.rows, report.rounds
    torch_launch = statistics.median(rounds.torch_launch_us) if rounds else None
    lines = [
        "| call | Python µs (launches as no-ops) | launches | host µs, direct launches | host µs, Triton's launcher "
        "| direct / Triton's launcher | µs per direct launch in the call | host µs in torch launches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.python_us:.2f} | {r.launches:g} | {cell(r.host_us)} | {cell(r.wrapper_host_us)} | "
            f"{ratio(r.host_us, r.wrapper_host_us)} | {cell(r.launch_us)} | {ratio(r.host_us, torch_launch)} |"
        )
    python = sum(r.python_us for r in rows)
    launches = sum(r.launches for r in rows)
    if rounds is None:
        lines.append(f"| step | {python:.2f} | {launches:g} | - | - | - | - | - |")
        return "\n".join(lines)
    direct, wrapper = statistics.median(rounds.direct_us), statistics.median(rounds.wrapper_us)
    per_launch = (direct - python) / launches if launches else None
    lines.append(
        f"| step | {python:.2f} | {launches:g} | {direct:.2f} | {wrapper:.2f} | {ratio(direct, wrapper)} | "
        f"{cell(per_launch)} | {ratio(direct, torch_launch)} |"
    )
    differences = rounds.differences()
    lower = sum(d < 0 for d in differences)
    busy = kept_busy_text(rounds.device_kept_busy)
    lines += [
        "",
        f"one torch launch (in-place add): {torch_launch:.2f} µs, median of {len(rounds.torch_launch_us)} rounds "
        f"({min(rounds.torch_launch_us):.2f}-{max(rounds.torch_launch_us):.2f})",
        f"step, direct launches: {direct:.2f} µs median of the rounds ({min(rounds.direct_us):.2f}-"
        f"{max(rounds.direct_us):.2f}); through Triton's launcher: {wrapper:.2f} µs ({min(rounds.wrapper_us):.2f}-"
        f"{max(rounds.wrapper_us):.2f})",
        f"direct minus Triton's launcher, round by round: median {statistics.median(differences):+.2f} µs, "
        f"lower in {lower} of {len(differences)} rounds; device kept busy: {busy}",
        "rounds, step µs direct / Triton's launcher / torch launch: "
        + ", ".join(
            f"{d:.1f} / {w:.1f} / {t:.1f}"
            for d, w, t in zip(rounds.direct_us, rounds.wrapper_us, rounds.torch_launch_us, strict=True)
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(
        prog="python -m mori_sglang.tools.op_overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--world", "--world-size", type=cli.positive_int, default=8, help="ranks")
    parser.add_argument("--tokens", type=cli.positive_int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=cli.positive_int, default=7168)
    parser.add_argument("--topk", type=cli.positive_int, default=8)
    parser.add_argument("--experts", type=cli.positive_int, default=256)
    parser.add_argument("--dispatch-dtype", type=cli.dispatch_dtype, default="fp8", help="bf16, fp8, mxfp8 or fp4")
    parser.add_argument("--combine-dtype", type=cli.combine_dtype, default="bf16", help=cli.combine_names())
    parser.add_argument("--mode", default="low_latency", choices=[m.value for m in Mode])
    parser.add_argument("--steps", type=cli.positive_int, default=500, help="steps per timed repeat, no-op launches")
    parser.add_argument("--repeats", type=cli.positive_int, default=7)
    parser.add_argument("--iters", type=cli.positive_int, default=30, help="steps per path and round (GPU)")
    parser.add_argument("--rounds", type=cli.positive_int, default=12, help="rounds of both launch paths (GPU)")
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    args = parser.parse_args(argv)
    device = cli.resolve_device(args.device)
    cli.check_triton_runs(device, "python -m mori_sglang.tools.op_overhead")

    def config() -> EpConfig:
        cfg = EpConfig(
            world_size=args.world,
            rank=0,
            hidden=args.hidden,
            num_experts=args.experts,
            topk=args.topk,
            max_tokens_per_rank=args.tokens,
            dispatch_dtype=args.dispatch_dtype,
            combine_dtype=args.combine_dtype,
            mode=args.mode,
            provider="triton",
        )
        cli.check_wire(cfg)
        return cfg

    cfg = cli.checked(parser, config)
    report = measure(cfg, args.tokens, device, args.steps, args.repeats, args.iters, args.rounds)
    print(
        f"host cost per rank and call on {device}, loopback world of {args.world}, {args.tokens} tokens, hidden "
        f"{args.hidden}, {args.dispatch_dtype.value} dispatch, {cli.combine_name(args.combine_dtype)} combine, "
        f"{args.mode}; Python: least of {args.repeats} repeats of {args.steps} steps with launches as no-ops"
        + (
            f"; with launches: median over {args.rounds} rounds of each path's median of {args.iters} steps, "
            "device kept busy\n"
            if device.type == "cuda"
            else "\n"
        )
    )
    print(markdown(report))
    write_report(args.json, report)
    return report


def write_report(path: str | None, report: Report) -> None:
    """``--json``: the rows and the rounds; nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=1)


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.op_overhead")
