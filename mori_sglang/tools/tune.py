"""One-factor sweep of the Triton kernels' tuning: each variant changes one or more KernelTuning fields
from the defaults and is timed phase by phase in a loopback world, beside the defaults.

    python -m mori_sglang.tools.tune --tokens 128 4096 --mode low_latency --combine-dtype bf16 fp8 \\
        --vary send_programs_per_sm=8,16 combine_send_programs_per_sm=16,64 combine_recv_tile=1024,4096

A variant ``a=1,2`` sweeps one field; ``a=1+b=2`` changes two fields together. Use it to retune for
another GPU (AMD's CUs differ from an H200's SMs) and put what wins into ``KernelTuning``'s defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from mori_sglang import cli
from mori_sglang.config import Provider
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.tools.bench import Row, bench_one
from mori_sglang.tools.measure import PHASES, copy_bandwidth
from mori_sglang.tools.workload import add_workload_args, report_progress, workload_configs


def parse_variants(specs: list[str]) -> list[tuple[str, dict[str, int]]]:
    """``field=v1,v2`` -> one variant per value; ``f=1+g=2`` -> one variant changing both. A spec that
    names no KernelTuning field, gives no integer or makes a tuning KernelTuning refuses raises
    ValueError naming it, before anything runs."""
    fields = {f.name for f in dataclasses.fields(KernelTuning)}
    variants = []
    for spec in specs:
        parts = [p.split("=", 1) for p in spec.split("+")]
        for part in parts:
            if len(part) != 2:
                raise ValueError(f"--vary {spec}: write field=value (see --help)")
            if part[0] not in fields:
                raise ValueError(f"--vary {spec}: {part[0]} is not a KernelTuning field ({', '.join(sorted(fields))})")
        try:
            if len(parts) == 1:
                name, values = parts[0]
                made = [(f"{name}={value}", {name: int(value)}) for value in values.split(",")]
            else:
                made = [(spec, {name: int(value) for name, value in parts})]
        except ValueError:
            raise ValueError(f"--vary {spec}: the values must be integers") from None
        for name, changes in made:
            try:
                dataclasses.replace(KernelTuning(), **changes)
            except ValueError as e:
                raise ValueError(f"--vary {name}: {e}") from None
        variants += made
    return variants


def markdown(results: list[tuple[str, Row]]) -> str:
    lines = [
        "| variant | mode | tokens/rank | combine | " + " | ".join(f"{p} µs" for p in PHASES) + " | round trip % |",
        "| --- | --- | ---: | --- | " + " | ".join("---:" for _ in PHASES) + " | ---: |",
    ]
    for name, r in results:
        times = " | ".join(f"{getattr(r, p + '_us'):.1f} ({getattr(r, p + '_pct'):.0f}%)" for p in PHASES)
        lines.append(f"| {name} | {r.mode} | {r.tokens} | {r.combine_dtype} | {times} | {r.round_trip_pct:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[tuple[str, Row]]:
    parser = argparse.ArgumentParser(prog="python -m mori_sglang.tools.tune", description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--world", "--world-size", type=cli.positive_int, default=8, help="ranks")
    parser.add_argument("--vary", nargs="+", default=[], help="field=v1,v2 or field=v+field=v (see above)")
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        variants = [("defaults", {}), *parse_variants(args.vary)]
    except ValueError as e:
        parser.error(str(e))
    device = cli.resolve_device(args.device)
    cli.check_triton_runs(device, "python -m mori_sglang.tools.tune")
    points = cli.checked(parser, lambda: workload_configs(args, args.world, 0, Provider.TRITON))
    bw = copy_bandwidth(device)
    results = []
    for name, changes in variants:
        tuning = dataclasses.replace(KernelTuning(), **changes)
        for cfg, tokens in points:
            start = time.perf_counter()
            row, _ = bench_one(cfg, tokens, device, args.iters, device.type == "cuda", bw, tuning)
            results.append((name, row))
            elapsed = time.perf_counter() - start
            report_progress(len(results), len(variants) * len(points), cfg, tokens, elapsed, f"{name}: ")
    print(f"copy roofline (read+write): {bw:.0f} GB/s\n")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            rows = [{"variant": name, **dataclasses.asdict(row)} for name, row in results]
            json.dump({"copy_gbs": bw, "device": str(device), "rows": rows}, f, indent=1)
    return results


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.tune")
