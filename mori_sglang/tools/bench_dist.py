"""Benchmark across real ranks (one process per GPU): dispatch and combine beside NCCL all_to_all.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    torchrun --nproc-per-node 8 -m mori_sglang.tools.bench_dist --tokens 128 4096 --hidden 7168 --topk 8 \
        --experts 256 --dispatch-dtype fp8 --combine-dtype bf16 fp8 fp8_direct_cast

Each timed step is one dispatch (send + receive) and one combine on every rank, started together after
a barrier; a step's time is the slowest rank's. The torch provider (all_to_all_single over NCCL, or
gloo on CPUs) runs the same steps as the baseline. GB/s follows MoRI's accounting: rows received by all
ranks x row bytes, over the step time. Rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from mori_sglang import cli, formats
from mori_sglang.config import EpConfig, Provider
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.providers import group_hosts, resolve_provider
from mori_sglang.tools.measure import Stopwatch, identity_expert
from mori_sglang.tools.workload import add_workload_args, speedup_cells, workload_configs


@dataclass
class DistRow:
    provider: str
    mode: str
    world: int
    tokens: int
    dispatch_dtype: str
    combine_dtype: str
    dispatch_us: float
    combine_us: float
    dispatch_gbs: float
    combine_gbs: float


def _step(op: EpDispatchCombineOp, x, weights, ids, device: torch.device) -> tuple[float, float, int]:
    """One dispatch and one identity-expert combine; returns (dispatch s, combine s, rows received)."""
    with Stopwatch(device) as t_dispatch:
        op.dispatch_send(x, weights, None, ids)
        out = op.dispatch_recv()
    y = identity_expert(out, op.config.dispatch_dtype, op.config.hidden)
    dist.barrier()
    with Stopwatch(device) as t_combine:
        op.combine_send(y, out.handle)
        op.combine_recv()
    return t_dispatch.seconds, t_combine.seconds, out.num_recv_host()


def bench(cfg: EpConfig, tokens: int, device: torch.device, iters: int, seed: int) -> DistRow:
    op = EpDispatchCombineOp(cfg, device=device)
    gen = torch.Generator().manual_seed(seed * 1000 + cfg.rank)
    x = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.rand(tokens, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.int().to(device)
    weights = torch.rand(tokens, cfg.topk, generator=gen).to(device)
    times = []
    rows = 0
    for i in range(iters + 2):
        dist.barrier()
        d, c, rows = _step(op, x, weights, ids, device)
        if i >= 2:  # the first steps compile kernels and warm the allocator
            times.append((d, c))
    op.synchronize()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total_rows = torch.tensor([rows], dtype=torch.int64)
    dist.all_reduce(total_rows)
    dispatch_s = statistics.median(slowest[:, 0].tolist())
    combine_s = statistics.median(slowest[:, 1].tolist())
    dispatch_row = op.layout.token_bytes + op.layout.scale_bytes
    combine_row = formats.combine_row_bytes(cfg.combine_dtype, cfg.hidden, cfg.combine_block)
    received = int(total_rows)
    return DistRow(
        provider=op.provider_kind.value,
        mode=cfg.mode.value,
        world=cfg.world_size,
        tokens=tokens,
        dispatch_dtype=cfg.dispatch_dtype.value,
        combine_dtype=cli.combine_name(cfg.combine_dtype),
        dispatch_us=dispatch_s * 1e6,
        combine_us=combine_s * 1e6,
        dispatch_gbs=received * dispatch_row / dispatch_s / 1e9,
        combine_gbs=received * combine_row / combine_s / 1e9,
    )


def markdown(rows: list[DistRow]) -> str:
    baseline = {(r.mode, r.tokens, r.combine_dtype): r for r in rows if r.provider == "torch"}
    lines = [
        "| provider | mode | world | tokens/rank | dispatch | combine | dispatch µs | combine µs | dispatch GB/s | "
        "combine GB/s | dispatch x torch | combine x torch |",
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio_d, ratio_c = speedup_cells(r, baseline.get((r.mode, r.tokens, r.combine_dtype)))
        lines.append(
            f"| {r.provider} | {r.mode} | {r.world} | {r.tokens} | {r.dispatch_dtype} | {r.combine_dtype} | "
            f"{r.dispatch_us:.1f} | {r.combine_us:.1f} | {r.dispatch_gbs:.1f} | {r.combine_gbs:.1f} | "
            f"{ratio_d} | {ratio_c} |"
        )
    return "\n".join(lines)


# What torchrun (torch.distributed.run) sets in every process it starts.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main(argv: list[str] | None = None) -> None:
    prog = "python -m mori_sglang.tools.bench_dist"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--provider", default="auto", choices=[p.value for p in Provider])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=cli.output_file, help="rank 0 writes the rows here")
    args = parser.parse_args(argv)
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise cli.SetupError(
            f"{prog} runs one process per rank and needs {', '.join(missing)} from torchrun: start it as "
            "torchrun --nproc-per-node N -m mori_sglang.tools.bench_dist ..."
        )

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world = int(os.environ["WORLD_SIZE"])
    providers = [Provider(args.provider)]
    if not args.no_baseline and providers[0] is not Provider.TORCH:
        providers.append(Provider.TORCH)
    points = cli.checked(parser, lambda: workload_configs(args, world, int(os.environ["RANK"]), providers[0]))
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank = dist.get_rank()
    if resolve_provider(providers[0], device, hosts=lambda: group_hosts(None, device)) is Provider.TORCH:
        providers = [Provider.TORCH]  # auto took torch: it is its own baseline, one row per point
    rows = [
        bench(replace(cfg, provider=provider), tokens, device, args.iters, args.seed)
        for cfg, tokens in points
        for provider in providers
    ]
    if rank == 0:
        print(markdown(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "rows": [asdict(r) for r in rows]}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.tools.bench_dist")
