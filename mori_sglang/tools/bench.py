"""Benchmark of dispatch and combine in a loopback world: time, algorithm GB/s, % of the copy roofline.

    python -m mori_sglang.tools.bench --world 8 --tokens 128 4096 --hidden 7168 --topk 8 --experts 256 \
        --dispatch-dtype fp8 --combine-dtype bf16 fp8 fp8_direct_cast --mode low_latency

Every rank's buffers sit on one device, so the numbers measure the kernels' memory traffic against
the device's own copy bandwidth (measured in the same run), and the torch provider runs the same
steps beside them as the baseline. Bandwidth follows MoRI's accounting: received rows x row bytes.
On a GPU each phase is captured in a CUDA graph and replayed (which is also a capture test), and so is
the whole step in one graph ("step µs, one graph"), as a server's decode graph holds it, and beside it
the floor of such a step: the phases' least traffic moved by one plain copy kernel per rank and phase
("copy floor µs, one graph"), launches and ramp-up included.

``--eager`` also launches every phase from Python, as a server without CUDA graphs does, and reports per
rank and phase the host time of the calls, the device time of what they queued and the launches they
made (``EagerRow``), next to the graph numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from mori_sglang import cli, formats
from mori_sglang.config import EpConfig, Provider
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.routing import owning_destinations
from mori_sglang.tools.measure import (
    COPY_FLOOR_BLOCKS,
    PHASES,
    CopyFloorStep,
    copy_bandwidth,
    count_launches,
    graph_replay,
    kept_busy_text,
    time_eager,
    time_phases,
)
from mori_sglang.tools.step import LoopbackStep
from mori_sglang.tools.workload import add_workload_args, report_progress, speedup_cells, workload_configs

# The torch launches each eager row is measured against, timed beside each iteration of its step as
# one more phase of it.
STEP_TORCH_LAUNCHES = 8


@dataclass
class Row:
    provider: str
    mode: str
    tokens: int
    max_tokens_per_rank: int  # the buffers' capacity; decode batches run far below it in serving
    dispatch_dtype: str
    combine_dtype: str
    dispatch_us: float
    combine_us: float
    dispatch_send_us: float
    dispatch_recv_us: float
    combine_send_us: float
    combine_recv_us: float
    dispatch_gbs: float
    combine_gbs: float
    # Bytes each phase must read and write at least once, per second, as % of the copy bandwidth.
    dispatch_send_pct: float
    dispatch_recv_pct: float
    combine_send_pct: float
    combine_recv_pct: float
    round_trip_pct: float
    # The whole step (four phases, every rank) replayed from one CUDA graph, summed over the ranks like the
    # phases: what the phases' separate graphs and timings leave out or add (None where nothing is graphed).
    step_graph_us: float | None = None
    # The same phases' least traffic moved by one plain copy kernel per rank and phase, in one CUDA graph
    # (``measure.CopyFloorStep``, its faster program size): the floor the step's graph time compares with.
    copy_floor_us: float | None = None
    eager: EagerRow | None = None  # with --eager


@dataclass
class EagerRow:
    """One step launched from Python, per rank (the loopback world's phase over its ranks), median of the
    iterations. ``host_us``: the calls' own time, with the device kept busy so that nothing waits for it;
    ``device_us``: from the first to the last device operation the calls queued (None on CPU);
    ``launches``: device operations (kernels, copies, fills) per call, from the profiler (None on CPU, and
    until ``count_eager_launches`` fills them in); ``d2h_copies``: device-to-host copies per step
    (likewise); ``graph_us``: the same phases replayed from a graph;
    ``torch_launch_us``: one torch launch's host µs (an in-place add, timed the same way as one more
    phase of every iteration), the unit that makes host times of different hosts comparable (a
    VM's launches cost twice a bare-metal host's); ``host_in_torch_launches``: the median over the
    iterations of each one's step (the four calls, per rank) in its own torch launches, so that a host
    that changes speed within a run changes both sides of the ratio."""

    host_us: list[float]
    device_us: list[float] | None
    launches: list[float] | None
    d2h_copies: float | None
    graph_us: list[float] | None
    # Every host measurement ended before the device reached the calls' work (None on a CPU: no device).
    device_kept_busy: bool | None
    torch_launch_us: float
    host_in_torch_launches: float


def bench_one(
    cfg: EpConfig,
    tokens: int,
    device: torch.device,
    iters: int,
    graph: bool,
    copy_gbs: float,
    tuning: KernelTuning | None = None,
    eager: bool = False,
) -> tuple[Row, int]:
    """``tuning``: the Triton provider's kernel tuning to measure (default: its defaults); ``eager``: also
    time the phases launched from Python (``Row.eager``)."""
    step = LoopbackStep(cfg, tokens, device, tuning)
    eager_phases = step.phases
    graphed = graph and device.type == "cuda"
    phases = [graph_replay(p) for p in eager_phases] if graphed else eager_phases
    for phase in phases:  # warm-up
        phase()
    times = [statistics.median(t) * 1e6 for t in time_phases(phases, device, iters)]
    pairs = sum(int((owning_destinations(i, cfg.num_local_experts) >= 0).sum()) for i in step.ids)
    recv_rows = _received_rows(step, pairs)  # after the phases' replays
    op = step.world.ops[0]
    row = _row(cfg, tokens, times, recv_rows, op, copy_gbs)
    if graphed:
        whole = graph_replay(step.whole_step)
        whole()
        row.step_graph_us = statistics.median(time_phases([whole], device, iters)[0]) * 1e6
        _received_rows(step, pairs)  # after the whole step's replays
        row.copy_floor_us = _copy_floor_us(least_traffic(cfg, tokens, recv_rows, op), cfg.world_size, device, iters)
    if eager:
        row.eager = _eager_row(eager_phases, device, iters, cfg.world_size, times if graphed else None)
        _received_rows(step, pairs)
    return row, recv_rows


def _copy_floor_us(phase_bytes: list[int], world: int, device: torch.device, iters: int) -> float | None:
    """The step's copy floor (``CopyFloorStep``) replayed from a graph: the median µs of its fastest
    variant. Each variant's buffers go before the next one's are made. None, said on stderr, where
    they do not fit in the device's memory beside the step's (half the phases' traffic, twice)."""
    fastest = float("inf")
    for block in COPY_FLOOR_BLOCKS:
        try:
            copies = CopyFloorStep(phase_bytes, world, device, block)
        except torch.OutOfMemoryError:
            gib = sum(phase_bytes) / 2**30
            print(f"copy floor not measured: its {gib:.1f} GiB of buffers do not fit beside the step", file=sys.stderr)
            return None
        copies()  # compiles outside the capture
        replay = graph_replay(copies)
        replay()
        fastest = min(fastest, statistics.median(time_phases([replay], device, iters)[0]) * 1e6)
        del copies, replay
    return fastest


def _received_rows(step: LoopbackStep, pairs: int) -> int:
    """Rows the last run of ``step`` received over every rank, checked against the (token, destination
    rank) pairs its ids make: a replay that lost or repeated a row fails the benchmark."""
    recv_rows = sum(int(o.num_recv.item()) for o in step.outs)
    assert recv_rows == pairs, (recv_rows, pairs)
    return recv_rows


def _eager_row(
    phases: list[Callable[[], None]], device: torch.device, iters: int, world: int, graph_us: list[float] | None
) -> EagerRow:
    """Eager timings of the four phases, per rank; the launch counts come later (``count_eager_launches``)."""
    one = torch.zeros(1, device=device)

    def torch_launches() -> None:
        for _ in range(STEP_TORCH_LAUNCHES):
            one.add_(1)

    timed = [*phases, torch_launches]
    for phase in timed:  # warm-up, also of whatever the calls cache
        phase()
    host, dev, busy = time_eager(timed, device, iters)
    steps, launch = [sum(calls) / world for calls in zip(*host[:-1], strict=True)], host[-1]
    return EagerRow(
        host_us=[statistics.median(t) * 1e6 / world for t in host[:-1]],
        device_us=[statistics.median(t) * 1e6 / world for t in dev[:-1]] if dev is not None else None,
        launches=None,
        d2h_copies=None,
        graph_us=[t / world for t in graph_us] if graph_us is not None else None,
        device_kept_busy=busy,
        torch_launch_us=statistics.median(launch) * 1e6 / STEP_TORCH_LAUNCHES,
        host_in_torch_launches=statistics.median(
            step * STEP_TORCH_LAUNCHES / t for step, t in zip(steps, launch, strict=True)
        ),
    )


def count_eager_launches(measured: list[tuple[Row, EpConfig]], device: torch.device) -> None:
    """Fill in each eager row's launches and device-to-host copies, from torch's profiler on a step built
    anew. Run after every row is timed: once the profiler has run in a process, every launch there costs
    the host more, so counting beside the timing would slow the rows timed after it. Nothing launches on
    a CPU: the counts stay None there."""
    for row, cfg in measured:
        assert row.eager is not None
        counts = [count_launches(p, device) for p in LoopbackStep(cfg, row.tokens, device).phases]
        if counts[0] is not None:
            row.eager.launches = [c[0] / cfg.world_size for c in counts]
            row.eager.d2h_copies = sum(c[1] for c in counts) / cfg.world_size


def least_traffic(cfg: EpConfig, tokens: int, recv_rows: int, op) -> list[int]:
    """Bytes each phase must read plus write at least, summed over the ranks (the triton provider's
    model): the dispatch send reads every bf16 token once and writes one packed row per destination;
    the receive copies the rows out compact; the combine send reads each expert output and writes its
    wire row; the combine receive reads the wire rows and writes one bf16 row per token."""
    combine_row = formats.combine_row_bytes(cfg.combine_dtype, cfg.hidden, cfg.combine_block)
    sent_tokens = cfg.world_size * tokens
    row_bytes = op.layout.row_bytes
    bf16_row = 2 * cfg.hidden
    return [
        sent_tokens * bf16_row + recv_rows * row_bytes,
        2 * recv_rows * row_bytes,
        recv_rows * (bf16_row + combine_row),
        recv_rows * combine_row + sent_tokens * bf16_row,
    ]


def _row(cfg: EpConfig, tokens: int, times: list[float], recv_rows: int, op, bw: float) -> Row:
    ds, dr, cs, cr = times
    dispatch_bytes = recv_rows * (op.layout.token_bytes + op.layout.scale_bytes)
    combine_bytes = recv_rows * formats.combine_row_bytes(cfg.combine_dtype, cfg.hidden, cfg.combine_block)
    traffic = least_traffic(cfg, tokens, recv_rows, op)
    pct = [100 * t / (us * 1e-6) / 1e9 / bw for t, us in zip(traffic, times, strict=True)]
    return Row(
        provider=op.provider_kind.value,
        mode=cfg.mode.value,
        tokens=tokens,
        max_tokens_per_rank=cfg.max_tokens_per_rank,
        dispatch_dtype=cfg.dispatch_dtype.value,
        combine_dtype=cli.combine_name(cfg.combine_dtype),
        dispatch_us=ds + dr,
        combine_us=cs + cr,
        dispatch_send_us=ds,
        dispatch_recv_us=dr,
        combine_send_us=cs,
        combine_recv_us=cr,
        dispatch_gbs=dispatch_bytes / ((ds + dr) * 1e-6) / 1e9,
        combine_gbs=combine_bytes / ((cs + cr) * 1e-6) / 1e9,
        dispatch_send_pct=pct[0],
        dispatch_recv_pct=pct[1],
        combine_send_pct=pct[2],
        combine_recv_pct=pct[3],
        round_trip_pct=100 * sum(traffic) / (sum(times) * 1e-6) / 1e9 / bw,
    )


def markdown(rows: list[Row], baseline: dict[tuple, Row], copy_bw: float) -> str:
    lines = [
        f"copy roofline (read+write): {copy_bw:.0f} GB/s",
        "",
        "| provider | mode | tokens/rank | dispatch | combine | dispatch µs | combine µs | dispatch GB/s | "
        "combine GB/s | % roof: dispatch send | dispatch recv | combine send | combine recv | round trip | "
        "dispatch x torch | combine x torch | step µs, one graph | copy floor µs, one graph | step / copy floor |",
        "| --- | --- | ---: | --- | --- |" + " ---: |" * 14,
    ]
    for r in rows:
        ratio_d, ratio_c = speedup_cells(r, baseline.get((r.mode, r.tokens, r.dispatch_dtype, r.combine_dtype)))
        lines.append(
            f"| {r.provider} | {r.mode} | {r.tokens} | {r.dispatch_dtype} | {r.combine_dtype} | "
            f"{r.dispatch_us:.1f} | {r.combine_us:.1f} | {r.dispatch_gbs:.0f} | {r.combine_gbs:.0f} | "
            f"{r.dispatch_send_pct:.0f} | {r.dispatch_recv_pct:.0f} | {r.combine_send_pct:.0f} | "
            f"{r.combine_recv_pct:.0f} | {r.round_trip_pct:.0f} | "
            f"{ratio_d} | {ratio_c} | {_us_cell(r.step_graph_us)} | {_us_cell(r.copy_floor_us)} | "
            f"{_floor_ratio_cell(r)} |"
        )
    return "\n".join(lines)


def _us_cell(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f}"


def _floor_ratio_cell(row: Row) -> str:
    """The step's graph time over its copy floor's: how far the step is from moving its bytes alone."""
    if row.step_graph_us is None or row.copy_floor_us is None:
        return "-"
    return f"{row.step_graph_us / row.copy_floor_us:.2f}"


def eager_markdown(rows: list[Row]) -> str:
    """The eager table: per rank, host µs, device µs and launches per call, by phase, and the graph's µs."""

    def cells(values: list[float] | None, fmt: str) -> str:
        if values is None:
            return " | ".join("-" for _ in range(len(PHASES) + 1))
        return " | ".join(format(v, fmt) for v in [*values, sum(values)])

    short = "ds | dr | cs | cr | sum"
    lines = [
        "eager steps, per rank (ds/dr/cs/cr: dispatch send/recv, combine send/recv; median of the iterations)",
        "",
        f"| provider | mode | tokens/rank | dispatch | combine | host µs: {short} | device µs: {short} | "
        f"graph µs: {short} | launches: {short} | D2H copies | torch launch µs | host sum in torch launches | "
        "device kept busy |",
        "| --- | --- | ---: | --- | --- |" + " ---: |" * 23 + " --- |",
    ]
    for r in rows:
        e = r.eager
        if e is None:
            continue
        d2h = "-" if e.d2h_copies is None else f"{e.d2h_copies:g}"
        lines.append(
            f"| {r.provider} | {r.mode} | {r.tokens} | {r.dispatch_dtype} | {r.combine_dtype} | "
            f"{cells(e.host_us, '.1f')} | {cells(e.device_us, '.1f')} | {cells(e.graph_us, '.1f')} | "
            f"{cells(e.launches, 'g')} | {d2h} | {e.torch_launch_us:.2f} | {e.host_in_torch_launches:.1f} | "
            f"{kept_busy_text(e.device_kept_busy)} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.provider}\n{r.mode}\n{r.tokens}\n{r.combine_dtype}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.dispatch_gbs for r in rows], width=0.4, label="dispatch")
    ax.bar([x + 0.2 for x in xs], [r.combine_gbs for r in rows], width=0.4, label="combine")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("algorithm GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m mori_sglang.tools.bench", description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--world", "--world-size", type=cli.positive_int, default=8, help="ranks")
    parser.add_argument("--provider", default="triton", choices=["triton", "torch"])
    parser.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA graphs")
    parser.add_argument(
        "--eager", action="store_true", help="also report host µs, device µs and launches of eager steps per rank"
    )
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    parser.add_argument("--plot", type=cli.output_file, help="write a bar chart (PNG) here")
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")

    device = cli.resolve_device(args.device)
    provider = Provider(args.provider)
    if provider is Provider.TRITON:
        cli.check_triton_runs(device, "python -m mori_sglang.tools.bench --provider triton")
    points = cli.checked(parser, lambda: workload_configs(args, args.world, 0, provider))
    bw = copy_bandwidth(device)
    rows: list[Row] = []
    measured: list[tuple[Row, EpConfig]] = []
    baseline: dict[tuple, Row] = {}
    for done, (cfg, tokens) in enumerate(points, 1):
        start = time.perf_counter()
        row, _ = bench_one(cfg, tokens, device, args.iters, not args.no_graph, bw, eager=args.eager)
        rows.append(row)
        measured.append((row, cfg))
        if not args.no_baseline and provider is not Provider.TORCH:
            base_cfg = replace(cfg, provider=Provider.TORCH)
            base, _ = bench_one(base_cfg, tokens, device, max(3, args.iters // 4), False, bw, eager=args.eager)
            baseline[(row.mode, tokens, row.dispatch_dtype, row.combine_dtype)] = base
            rows.append(base)
            measured.append((base, base_cfg))
        report_progress(done, len(points), cfg, tokens, time.perf_counter() - start)
    if args.eager:
        count_eager_launches(measured, device)
    if args.max_tokens_per_rank:
        print(f"buffers sized for {args.max_tokens_per_rank} tokens per rank")
    print(markdown(rows, baseline, bw))
    if args.eager:
        print()
        print(eager_markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": bw, "device": str(device), "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.bench")
