"""One-factor sweep of the Triton kernels' tuning: each variant changes one or more KernelTuning fields
from the defaults and is timed phase by phase in a loopback world, beside the defaults.

    python -m mori_sglang.tools.tune --tokens 128 4096 --mode low_latency --combine-dtype bf16 fp8_blockwise \\
        --vary send_warps=2,4 combine_send_programs_per_sm=16,64 combine_recv_tile=1024,4096

A variant ``a=1,2`` sweeps one field; ``a=1+b=2`` changes two fields together. Use it to retune for
another GPU (AMD's CUs differ from an H200's SMs) and put what wins into ``KernelTuning``'s defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator

from mori_sglang.cli import resolve_device
from mori_sglang.config import Provider
from mori_sglang.providers.triton_provider import KernelTuning
from mori_sglang.tools.bench import Row, bench_one
from mori_sglang.tools.measure import PHASES, copy_bandwidth
from mori_sglang.tools.workload import add_workload_args, workload_configs


def parse_variants(specs: list[str]) -> Iterator[tuple[str, dict[str, int]]]:
    """``field=v1,v2`` -> one variant per value; ``f=1+g=2`` -> one variant changing both."""
    fields = {f.name for f in dataclasses.fields(KernelTuning)}
    for spec in specs:
        parts = [p.split("=", 1) for p in spec.split("+")]
        for name, _ in parts:
            if name not in fields:
                raise SystemExit(f"--vary {spec}: {name} is not a KernelTuning field ({', '.join(sorted(fields))})")
        if len(parts) == 1:
            name, values = parts[0]
            for value in values.split(","):
                yield f"{name}={value}", {name: int(value)}
        else:
            yield spec, {name: int(value) for name, value in parts}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--vary", nargs="+", default=[], help="field=v1,v2 or field=v+field=v (see above)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    variants = [("defaults", {}), *parse_variants(args.vary)]
    device = resolve_device(args.device)
    bw = copy_bandwidth(device)
    results = []
    for name, changes in variants:
        tuning = dataclasses.replace(KernelTuning(), **changes)
        for cfg, tokens in workload_configs(args, args.world, 0, Provider.TRITON):
            row, _ = bench_one(cfg, tokens, device, args.iters, device.type == "cuda", bw, tuning)
            results.append((name, row))
    print(f"copy roofline (read+write): {bw:.0f} GB/s\n")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            rows = [{"variant": name, **dataclasses.asdict(row)} for name, row in results]
            json.dump({"copy_gbs": bw, "device": str(device), "rows": rows}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
