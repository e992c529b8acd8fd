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
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mori_sglang import cli
from mori_sglang.kernels.launch import BoundLaunch, direct_launch
from mori_sglang.kernels.probes import launch_probe_kernel, launch_probe_wide_kernel
from mori_sglang.tools.measure import host_us_per_call, write_rows

WIDE_ARGUMENTS = 20  # beside the output pointer
REPEATS = 5


@dataclass
class LaunchCost:
    path: str
    runtime_arguments: int
    host_us: float  # median over the repeats of the mean per launch
    ratio_to_torch: float
    device_kept_busy: bool


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


def markdown(rows: list[LaunchCost]) -> str:
    lines = [
        "| path | runtime arguments | host µs per launch | vs torch's launch | device kept busy |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        busy = "yes" if r.device_kept_busy else "no"
        lines.append(f"| {r.path} | {r.runtime_arguments} | {r.host_us:.2f} | {r.ratio_to_torch:.2f} | {busy} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[LaunchCost]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=cli.positive_int, default=200, help="launches per timed repeat")
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device = cli.resolve_device(args.device)
    cli.check_triton_runs(device, "python -m mori_sglang.tools.launch_cost")
    rows = measure(device, args.iters)
    print(f"host cost of one launch on {device} (median of {REPEATS} repeats of {args.iters} launches)\n")
    print(markdown(rows))
    write_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.launch_cost")
