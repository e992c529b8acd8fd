"""Host cost of one kernel launch by each path a step's calls can take: the floor under an eager step's
host time (``bench --eager``), with the device kept busy so that no row waits for it.

    python -m mori_sglang.tools.launch_cost --iters 200

Rows: torch's own launch (an in-place add on one element); a Triton kernel through its JIT
(``kernel[grid](...)``: binding, specialization key, cache lookup); through a ``BoundLaunch`` (the
provider's path), without and with a per-launch tensor; through the compiled kernel's launcher called
with prepared arguments (what Triton costs below the JIT) and through the C launcher beneath it (what
a ``BoundLaunch`` calls); each for a kernel of one runtime argument and
one of 21 (the dispatch send's count). On CPU the kernels run in Triton's interpreter and the times say
nothing about a GPU.

On a GPU a second table gives the floor under a phase's graph-replayed device time: the device µs per
kernel of an idle kernel (``idle_probe_kernel``: no program moves anything) launched back to back in
a CUDA graph, as the loopback benchmark replays a phase's kernels, for grids of one program to the
most programs per SM the provider's kernels launch, with and without programmatic dependent launch;
and the same for a dispatch send without rows (``send_end_probe_kernel``: every program's ticket, the
last one's counts and arrival signal to eight ranks), whose difference from the idle kernel is what a
send's synchronization costs.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mori_sglang import cli
from mori_sglang.kernels.geometry import multiprocessors
from mori_sglang.kernels.launch import BoundLaunch, direct_launch
from mori_sglang.kernels.probes import (
    idle_probe_kernel,
    launch_probe_kernel,
    launch_probe_wide_kernel,
    send_end_probe_kernel,
)
from mori_sglang.providers.triton_provider import programmatic_launch
from mori_sglang.tools.measure import graph_replay, host_us_per_call, kept_busy_text, time_phases, write_rows

WIDE_ARGUMENTS = 20  # beside the output pointer
REPEATS = 5
KERNELS_PER_GRAPH = 8  # a loopback phase's kernels: one per rank of EP8
PROGRAMS_PER_SM = (8, 48)  # beside grids of one program and one per SM; 48: the dispatch send's default


@dataclass
class LaunchCost:
    path: str
    runtime_arguments: int
    host_us: float  # median over the repeats of the mean per launch
    ratio_to_torch: float
    device_kept_busy: bool | None  # None on a CPU: no device to keep busy


def _paths(device: torch.device, wide: bool) -> dict[str, Callable[[], object]]:
    out = torch.zeros(1, dtype=torch.int64, device=device)
    kernel = launch_probe_wide_kernel if wide else launch_probe_kernel
    values = {f"a{i}": i + 1 for i in range(WIDE_ARGUMENTS)} if wide else {}
    bound = BoundLaunch(kernel, device, (1,), {"out_ptr": out, **values}, {"num_warps": 1})
    per_call = BoundLaunch(kernel, device, (1,), values, {"num_warps": 1}, variable=("out_ptr",))
    paths: dict[str, Callable[[], object]] = {
        "Triton JIT (kernel[grid](...))": lambda: kernel[(1,)](out, **values, num_warps=1),
        "BoundLaunch, fixed arguments": bound,
        "BoundLaunch, one tensor per launch": lambda: per_call(out),
    }
    if device.type == "cuda":
        compiled = kernel[(1,)](out, **values, num_warps=1)
        from triton.runtime import driver

        stream = driver.active.get_current_stream(device.index)
        arguments = (out.data_ptr(), *values.values())
        function, metadata = compiled.function, compiled.packed_metadata
        paths["compiled kernel's launcher, prepared arguments"] = lambda: compiled.run(
            1, 1, 1, stream, function, metadata, None, None, None, *arguments
        )
        direct = direct_launch(compiled.run, (1, 1, 1), function, metadata)
        if direct is not None:  # what a BoundLaunch calls: the C launcher, without the Python wrapper
            c_launch, head, middle = direct.c_launch, direct.head, direct.middle
            if direct.packs_arguments:
                paths["C launcher, prepared arguments"] = lambda: c_launch(*head, stream, *middle, arguments)
            else:
                paths["C launcher, prepared arguments"] = lambda: c_launch(*head, stream, *middle, *arguments)
    return paths


def measure(device: torch.device, iters: int) -> list[LaunchCost]:
    one = torch.zeros(1, device=device)
    torch_us, torch_busy = host_us_per_call(lambda: one.add_(1), device, iters, REPEATS)
    rows = [LaunchCost("torch (in-place add)", 1, torch_us, 1.0, torch_busy)]
    for wide in (False, True):
        for path, call in _paths(device, wide).items():
            us, busy = host_us_per_call(call, device, iters, REPEATS)
            rows.append(LaunchCost(path, 1 + WIDE_ARGUMENTS * wide, us, us / torch_us, busy))
    return rows


# The probes of the device floor: an idle kernel, and a dispatch send's end to this many ranks.
FLOOR_KERNELS = ("idle", "dispatch send's end")
SIGNALLED_RANKS = 8


@dataclass
class DeviceFloor:
    kernel: str  # one of FLOOR_KERNELS
    programs: int
    programmatic_launch: bool
    device_us: float  # per kernel: the median over the replays of the graph's time / KERNELS_PER_GRAPH


def _floor_probe(kernel: str, device: torch.device) -> tuple[object, dict[str, object], list[torch.Tensor]]:
    """A floor probe, its fixed arguments, and the buffers its arguments address (a launch holds
    addresses, not tensors: the caller keeps these alive while it launches). The send's end signals
    SIGNALLED_RANKS arenas of its own (int64 words: the counts, then the arrivals), as a loopback rank
    signals its peers."""
    if kernel == "idle":
        out = torch.zeros(1, dtype=torch.int64, device=device)
        return idle_probe_kernel, {"out_ptr": out, "store_in": -1}, [out]
    words = torch.zeros(SIGNALLED_RANKS, 2 * SIGNALLED_RANKS, dtype=torch.int64, device=device)
    args = {
        "tickets_ptr": torch.zeros(1, dtype=torch.int32, device=device),
        "round_ptr": torch.zeros(3, dtype=torch.int64, device=device),
        "peer_bases": torch.tensor([row.data_ptr() for row in words], dtype=torch.int64, device=device),
        "send_counts_ptr": torch.arange(SIGNALLED_RANKS, dtype=torch.int64, device=device),
        "counts_offset": 0,
        "arrivals_offset": 8 * SIGNALLED_RANKS,
        "rank": 0,
        "W": SIGNALLED_RANKS,
        "WP": SIGNALLED_RANKS,
    }
    return send_end_probe_kernel, args, [words, *(v for v in args.values() if isinstance(v, torch.Tensor))]


def measure_device_floor(device: torch.device, replays: int) -> list[DeviceFloor]:
    """Device µs per probe kernel in graph replay, per probe, launch mode and grid (GPU only)."""
    sms = multiprocessors(device)
    grids = [1, sms, *(per_sm * sms for per_sm in PROGRAMS_PER_SM)]
    rows = []
    for name, pdl in [
        (k, p) for k in FLOOR_KERNELS for p in ((False, True) if programmatic_launch(device) else (False,))
    ]:
        kernel, args, _buffers = _floor_probe(name, device)
        options = {"num_warps": 1, "PDL": pdl, **({"launch_pdl": True} if pdl else {})}
        for programs in grids:
            launch = BoundLaunch(kernel, device, (programs,), args, options)
            launch()  # compiles

            def back_to_back(launch: BoundLaunch = launch) -> None:
                for _ in range(KERNELS_PER_GRAPH):
                    launch()

            replay = graph_replay(back_to_back)
            replay()
            times = [seconds * 1e6 / KERNELS_PER_GRAPH for seconds in time_phases([replay], device, replays)[0]]
            rows.append(DeviceFloor(name, programs, pdl, statistics.median(times)))
    return rows


def floor_markdown(rows: list[DeviceFloor]) -> str:
    lines = ["| kernel | programs | programmatic launch | device µs per kernel |", "| --- | ---: | --- | ---: |"]
    lines += [
        f"| {r.kernel} | {r.programs} | {'yes' if r.programmatic_launch else 'no'} | {r.device_us:.2f} |" for r in rows
    ]
    return "\n".join(lines)


def markdown(rows: list[LaunchCost]) -> str:
    lines = [
        "| path | runtime arguments | host µs per launch | vs torch's launch | device kept busy |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        busy = kept_busy_text(r.device_kept_busy)
        lines.append(f"| {r.path} | {r.runtime_arguments} | {r.host_us:.2f} | {r.ratio_to_torch:.2f} | {busy} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[LaunchCost]:
    parser = argparse.ArgumentParser(
        prog="python -m mori_sglang.tools.launch_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--iters", type=cli.positive_int, default=200, help="launches per timed repeat")
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    args = parser.parse_args(argv)
    device = cli.resolve_device(args.device)
    cli.check_triton_runs(device, "python -m mori_sglang.tools.launch_cost")
    rows = measure(device, args.iters)
    print(f"host cost of one launch on {device} (median of {REPEATS} repeats of {args.iters} launches)\n")
    print(markdown(rows))
    if device.type == "cuda":
        print(
            f"\ndevice cost of an idle kernel on {device}: {KERNELS_PER_GRAPH} launches back to back in a CUDA graph, "
            f"median of {args.iters} replays\n"
        )
        print(floor_markdown(measure_device_floor(device, args.iters)))
    write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.launch_cost")
