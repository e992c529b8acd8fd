"""One loopback round trip per wire format, printed as a table: ``python -m mori_sglang.roundtrip``.

Every rank of a W-rank world lives in this process on one device (a ``LoopbackWorld``), so the command
runs anywhere, a laptop CPU included. For each dispatch format (with bf16 combine) and each combine
format (with bf16 dispatch) it times dispatch and combine, reports the bytes one token costs per
destination rank on the wire, and measures accuracy with an identity expert: the combined output must
be x * (number of distinct destination ranks), which is exact in f32, so the error of each format is
measured against that exact value and against what the all-bf16 path returns.

Times are medians over ``--iters`` steps of the whole world (every rank's send, then every rank's
receive, on one device), not of one rank. Defaults: on a GPU, 8 ranks x 128 tokens; on a CPU, 4 ranks x
32 tokens, so that the full table takes well under a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mori_sglang import formats
from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.tools.measure import identity_expert, resolve_device, sync

# (dispatch, combine): the bf16 baseline, each dispatch format with bf16 combine, each combine format
# with bf16 dispatch, so every row isolates one format's cost.
FORMATS: tuple[tuple[DispatchDtype, CombineDtype], ...] = (
    (DispatchDtype.BF16, CombineDtype.BF16),
    (DispatchDtype.FP8, CombineDtype.BF16),
    (DispatchDtype.MXFP8, CombineDtype.BF16),
    (DispatchDtype.MXFP4, CombineDtype.BF16),
    (DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE),
    (DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE_NATIVE),
    (DispatchDtype.BF16, CombineDtype.FP8_DIRECT_CAST),
)
COLUMNS = (
    "dispatch",
    "combine",
    "dispatch ms",
    "combine ms",
    "dispatch B/token/dest",
    "combine B/token/dest",
    "rel err vs f32",
    "rel err vs bf16",
)
GPU_DEFAULTS = {"world": 8, "tokens": 128, "iters": 20, "warmup": 3}
CPU_DEFAULTS = {"world": 4, "tokens": 32, "iters": 3, "warmup": 1}


@dataclass
class Row:
    dispatch: str
    combine: str
    dispatch_ms: float
    combine_ms: float
    dispatch_bytes: int
    combine_bytes: int
    rel_err_f32: float
    rel_err_bf16: float

    def cells(self) -> list[str]:
        return [
            self.dispatch,
            self.combine,
            f"{self.dispatch_ms:.3f}",
            f"{self.combine_ms:.3f}",
            str(self.dispatch_bytes),
            str(self.combine_bytes),
            f"{self.rel_err_f32:.2e}",
            f"{self.rel_err_bf16:.2e}",
        ]


@dataclass
class Batch:
    """Every rank's inputs, and the exact f32 result an identity expert must combine to."""

    xs: list[torch.Tensor]
    weights: list[torch.Tensor]
    ids: list[torch.Tensor]
    exact: list[torch.Tensor]


def make_batch(args: argparse.Namespace, device: torch.device) -> Batch:
    """Random bf16 tokens and top-k routings (distinct experts per token), seeded for repeatable tables."""
    gen = torch.Generator().manual_seed(args.seed)
    local = args.experts // args.world
    xs, weights, ids, exact = [], [], [], []
    for _ in range(args.world):
        x = torch.randn(args.tokens, args.hidden, generator=gen)
        if args.input == "lognormal":
            x = x.sign() * torch.exp(torch.randn(x.shape, generator=gen) * 2 - 1)
        x = x.to(torch.bfloat16)
        topk = torch.rand(args.tokens, args.experts, generator=gen).argsort(dim=1)[:, : args.topk]
        ranks = topk // local
        distinct = torch.stack([ranks.eq(r).any(dim=1) for r in range(args.world)], dim=1).sum(dim=1)
        xs.append(x.to(device))
        weights.append(torch.rand(args.tokens, args.topk, generator=gen).to(device))
        ids.append(topk.to(device))
        exact.append((x.float() * distinct[:, None].float()).to(device))
    return Batch(xs, weights, ids, exact)


def run_format(
    args: argparse.Namespace, batch: Batch, dispatch: DispatchDtype, combine: CombineDtype, device: torch.device
) -> tuple[Row, list[torch.Tensor]]:
    """Time ``warmup + iters`` round trips of one format pair; return its row and the combined outputs."""
    cfg = EpConfig(
        world_size=args.world,
        rank=0,
        hidden=args.hidden,
        num_experts=args.experts,
        topk=args.topk,
        max_tokens_per_rank=args.tokens,
        dispatch_dtype=dispatch,
        combine_dtype=combine,
        mode=Mode(args.mode),
        provider=args.provider,
    )
    world = LoopbackWorld(cfg, device)
    dispatch_times, combine_times = [], []
    combined: list[torch.Tensor] = []
    for step in range(args.warmup + args.iters):
        sync(device)
        t0 = time.perf_counter()
        outs = world.dispatch(batch.xs, batch.weights, None, batch.ids)
        sync(device)
        t1 = time.perf_counter()
        ys = [identity_expert(out, dispatch, args.hidden, out.num_recv_host()) for out in outs]
        sync(device)
        t2 = time.perf_counter()
        combined = world.combine(ys, [out.handle for out in outs])
        sync(device)
        t3 = time.perf_counter()
        if step >= args.warmup:
            dispatch_times.append(t1 - t0)
            combine_times.append(t3 - t2)
    op = world.ops[0]
    combine_bytes = formats.combine_row_bytes(combine, args.hidden, cfg.combine_block)
    row = Row(
        dispatch=dispatch.value,
        combine=combine.value,
        dispatch_ms=1e3 * statistics.median(dispatch_times),
        combine_ms=1e3 * statistics.median(combine_times),
        dispatch_bytes=op.token_bytes + op.scale_stride_bytes(),
        combine_bytes=combine_bytes,
        rel_err_f32=relative_error(combined, batch.exact),
        rel_err_bf16=float("nan"),
    )
    return row, combined


def relative_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over every rank's tokens (0 where want is all zeros)."""
    num = sum(float((g.float() - w.float()).square().sum()) for g, w in zip(got, want, strict=True))
    den = sum(float(w.float().square().sum()) for w in want)
    return (num / den) ** 0.5 if den else 0.0


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mori_sglang.roundtrip",
        description="Loopback dispatch + combine round trip for every wire format: time, bytes, accuracy.",
    )
    parser.add_argument("--world", type=int, help="ranks (default: 8 on GPU, 4 on CPU)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default: 128 on GPU, 32 on CPU)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--provider", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--mode", default=Mode.INTRANODE.value, choices=[m.value for m in Mode])
    parser.add_argument("--iters", type=int, help="timed steps per format (default: 20 on GPU, 3 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps per format (default: 3 on GPU, 1 on CPU)")
    parser.add_argument("--input", default="normal", choices=["normal", "lognormal"], help="token distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the table and its settings as JSON here")
    args = parser.parse_args(argv)
    args.device = str(resolve_device(args.device))
    defaults = GPU_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device)
    batch = make_batch(args, device)
    rows: list[Row] = []
    baseline: list[torch.Tensor] = []
    for dispatch, combine in FORMATS:
        row, combined = run_format(args, batch, dispatch, combine, device)
        if not baseline:
            baseline = combined
        row.rel_err_bf16 = relative_error(combined, baseline)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print(
        f"loopback world of {args.world} ranks on {args.device}: {args.tokens} tokens/rank, hidden {args.hidden}, "
        f"{args.experts} experts, top-{args.topk}, mode {args.mode}, provider {args.provider}; "
        f"median of {args.iters} steps of the whole world"
    )
    print()
    print(markdown(rows))
    if args.json is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
