"""Ceilings of the transport's access patterns: copy (the roofline the benches divide by), write-only
fill, and the dispatch send's fan-out (read a token once, write a byte per element to D destinations),
each as GB/s and % of the copy roofline.

    python -m mori_sglang.tools.bandwidth --tokens 4096 --hidden 7168 --fan-out 1 4 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.testing

from mori_sglang import cli
from mori_sglang.kernels.geometry import multiprocessors, program_count
from mori_sglang.kernels.probes import fan_out_kernel
from mori_sglang.tools.measure import copy_bandwidth, roofline_bytes, time_phases, write_rows

# (warps, programs per SM): the dispatch send's shape and two wider ones.
FAN_OUT_SHAPES = ((1, 32), (2, 16), (4, 8))
FAN_OUT_TILE = 1024


@dataclass
class Pattern:
    name: str
    us: float
    gbs: float  # bytes read + written per second
    pct_of_copy: float


def fan_out_tile(hidden: int) -> int:
    """The probe's tile for a hidden size; ValueError where no power-of-two tile divides it."""
    tile = min(FAN_OUT_TILE, hidden)
    if hidden % tile or tile & (tile - 1):
        raise ValueError(f"--hidden {hidden}: the fan-out probe needs a multiple of a power-of-two tile ({tile})")
    return tile


def fan_out(x: torch.Tensor, out: torch.Tensor, warps: int, programs: int) -> None:
    """Launch the fan-out probe: x [tokens, hidden] 16-bit -> out [D, tokens, hidden] bytes."""
    tokens, hidden = x.shape
    tile = fan_out_tile(hidden)
    meta = {"D": out.shape[0], "HIDDEN": hidden, "TILE": tile, "num_warps": warps}
    fan_out_kernel[(programs,)](x, out, out.stride(0), tokens, **meta)


def measure(device: torch.device, tokens: int, hidden: int, fan_outs: list[int], iters: int) -> list[Pattern]:
    copy_gbs = copy_bandwidth(device, iters=iters)
    patterns = [Pattern("copy (roofline)", 0.0, copy_gbs, 100.0)]
    fill = torch.empty(roofline_bytes(device), dtype=torch.uint8, device=device)
    seconds = _seconds(lambda: fill.fill_(1), device, iters)
    patterns.append(_pattern("fill (write only)", seconds, fill.numel(), copy_gbs))
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16).view(torch.int16)
    sms = multiprocessors(device)
    for d in fan_outs:
        out = torch.empty(d, tokens, hidden, dtype=torch.uint8, device=device)
        for warps, per_sm in FAN_OUT_SHAPES if sms else FAN_OUT_SHAPES[:1]:
            launch = functools.partial(fan_out, x, out, warps, program_count(per_sm, sms))
            launch()  # compile outside the timing
            seconds = _seconds(launch, device, iters)
            name = f"fan-out to {d} ({warps} warps, {per_sm} programs/SM)"
            patterns.append(_pattern(name, seconds, x.numel() * 2 + out.numel(), copy_gbs))
    return patterns


def _seconds(launch: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds of one launch. On a GPU from Triton's benchmarker (device events around the kernels
    alone, caches flushed between runs): these kernels last less than a host launch takes."""
    if device.type == "cuda":
        return triton.testing.do_bench(launch, rep=max(25, iters), return_mode="median") * 1e-3
    return statistics.median(time_phases([launch], device, iters)[0])


def _pattern(name: str, seconds: float, nbytes: int, copy_gbs: float) -> Pattern:
    gbs = nbytes / seconds / 1e9
    return Pattern(name, seconds * 1e6, gbs, 100 * gbs / copy_gbs)


def markdown(patterns: list[Pattern]) -> str:
    lines = ["| pattern | µs | GB/s | % of copy |", "| --- | ---: | ---: | ---: |"]
    for p in patterns:
        us = f"{p.us:.1f}" if p.us else "-"
        lines.append(f"| {p.name} | {us} | {p.gbs:.0f} | {p.pct_of_copy:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Pattern]:
    parser = argparse.ArgumentParser(prog="python -m mori_sglang.tools.bandwidth", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=cli.positive_int, default=4096)
    parser.add_argument("--hidden", type=cli.positive_int, default=7168)
    parser.add_argument(
        "--fan-out", type=cli.positive_int, nargs="+", default=[1, 4, 8], help="destinations (powers of two)"
    )
    parser.add_argument("--iters", type=cli.positive_int, default=20)
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    args = parser.parse_args(argv)
    bad = [d for d in args.fan_out if d & (d - 1)]
    if bad:
        parser.error(f"--fan-out {bad}: destinations must be powers of two")
    try:
        fan_out_tile(args.hidden)
    except ValueError as e:
        parser.error(str(e))
    device = cli.resolve_device(args.device)
    cli.check_triton_runs(device, "python -m mori_sglang.tools.bandwidth")
    patterns = measure(device, args.tokens, args.hidden, args.fan_out, args.iters)
    print(markdown(patterns))
    write_rows(args.json, patterns)
    return patterns


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.bandwidth")
