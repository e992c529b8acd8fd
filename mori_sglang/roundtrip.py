"""One loopback round trip per wire format, printed as a table: ``python -m mori_sglang.roundtrip``.

Every rank of a W-rank world lives in this process on one device (a ``LoopbackWorld``), so the command
runs anywhere, a laptop CPU included. For each dispatch format (with bf16 combine) and each combine
format (with bf16 dispatch) it times dispatch and combine, reports the bytes one token costs per
destination rank on the wire, and measures accuracy with an identity expert: the combined output must
be x * (number of distinct destination ranks), which is exact in f32, so the error of each format is
measured against that exact value and against what the all-bf16 path returns.

The provider is our Triton kernels wherever triton is installed: compiled on a GPU, in Triton's
interpreter (with exact float casts) on a CPU, where the times measure the interpreter, not the
kernels. Without triton it is the torch provider. The default tokens are heavy-tailed (lognormal
magnitudes), as real activations with outliers are: that is where a per-block scale matters.

Times are medians over ``--iters`` steps of the whole world (every rank's send, then every rank's
receive, on one device), not of one rank. Defaults: on a GPU, 8 ranks x 128 tokens at hidden 7168; on
a CPU, 4 ranks x 16 tokens at hidden 1024, so that the table takes well under a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mori_sglang import cli, formats
from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.kernels.interpreter import interpret_on_cpu
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers import triton_available
from mori_sglang.tools.measure import identity_expert, sync
from mori_sglang.wire_formats import COMBINE_FORMATS, DISPATCH_FORMATS

# (dispatch, combine): the bf16 baseline, each dispatch format with bf16 combine, each combine format
# with a reference with bf16 dispatch (in the table's order), so every row isolates one format's cost.
FORMATS: tuple[tuple[DispatchDtype, CombineDtype], ...] = (
    (DispatchDtype.BF16, CombineDtype.BF16),
    *((DispatchDtype(f.name), CombineDtype.BF16) for f in DISPATCH_FORMATS if f.name != DispatchDtype.BF16.value),
    *(
        (DispatchDtype.BF16, CombineDtype(f.name))
        for f in COMBINE_FORMATS
        if f.has_reference and f.name != CombineDtype.BF16.value
    ),
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
LEGEND = """\
dispatch, combine: the wire format of each direction, by its SGLANG_MORI_DISPATCH_DTYPE /
  SGLANG_MORI_COMBINE_DTYPE name (fp8 combine: blockwise, one f32 scale per 128 elements;
  fp8_blockwise_native: native MoRI's, blocks of ceil(hidden / 56), each scale 1.0 unless its block
  would overflow);
  each row changes one direction, the other stays bf16.
dispatch ms, combine ms: median milliseconds of one step of the whole world (every rank's send, then
  every rank's receive, all in this process); the dispatch includes quantizing on the sender.
B/token/dest: bytes one token costs on the wire per destination rank (payload and scale row, padded).
rel err vs f32: ||out - exact|| / ||exact|| over every rank's tokens, where exact = x * (number of
  distinct destination ranks) in f32: what an identity expert's outputs combine to without rounding.
rel err vs bf16: the same norm of the difference from the all-bf16 row's output."""
GPU_DEFAULTS = {"world": 8, "tokens": 128, "hidden": 7168, "iters": 20, "warmup": 3}
CPU_DEFAULTS = {"world": 4, "tokens": 16, "hidden": 1024, "iters": 3, "warmup": 1}
# The interpreter runs a step in seconds: one untimed-free step per format keeps the table near 30 s.
INTERPRETER_DEFAULTS = {**CPU_DEFAULTS, "iters": 1, "warmup": 0}
INPUTS = ("lognormal", "normal")


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
    """Random bf16 tokens and top-k routings (distinct experts per token), seeded for repeatable tables.

    lognormal: magnitudes exp(2 N(0, 1) - 1) with random signs, spanning e4m3's whole range with a few
    values past its 448; normal: N(0, 1)."""
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


def configs(args: argparse.Namespace) -> list[EpConfig]:
    """One op config per row of FORMATS; a size no format accepts raises ConfigError or FormatError."""
    out = []
    for dispatch, combine in FORMATS:
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
        cli.check_wire(cfg)
        out.append(cfg)
    return out


def run_format(
    args: argparse.Namespace, batch: Batch, cfg: EpConfig, device: torch.device
) -> tuple[Row, list[torch.Tensor]]:
    """Time ``warmup + iters`` round trips of one format pair; return its row and the combined outputs."""
    dispatch, combine = cfg.dispatch_dtype, cfg.combine_dtype
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
        combine=cli.combine_name(combine),
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


def choose_provider(requested: str, device: torch.device) -> tuple[Provider, str]:
    """The provider the table runs, and where: auto takes our Triton kernels wherever triton is installed
    (compiled on a GPU, in Triton's interpreter on a CPU), else the torch provider."""
    if requested == "auto":
        provider = Provider.TRITON if triton_available() else Provider.TORCH
    else:
        provider = Provider(requested)
    if provider is Provider.TORCH:
        return provider, "torch.distributed semantics" + ("" if triton_available() else ", triton is not installed")
    if not triton_available():
        raise cli.SetupError("--provider triton: triton is not installed (pip install the [triton] extra)")
    if device.type == "cpu":
        interpret_on_cpu()
        return (
            provider,
            "our Triton kernels in Triton's CPU interpreter, with exact float casts; the times are the interpreter's",
        )
    return provider, "our Triton kernels"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mori_sglang.roundtrip",
        description="Loopback dispatch + combine round trip for every wire format: time, bytes, accuracy.",
        epilog="Columns:\n" + LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world", "--world-size", type=cli.positive_int, help="ranks (default: 8 on GPU, 4 on CPU)")
    parser.add_argument("--tokens", type=cli.positive_int, help="tokens per rank (default: 128 on GPU, 16 on CPU)")
    parser.add_argument("--hidden", type=cli.positive_int, help="hidden size (default: 7168 on GPU, 1024 on CPU)")
    parser.add_argument("--experts", type=cli.positive_int, default=256)
    parser.add_argument("--topk", type=cli.positive_int, default=8)
    parser.add_argument(
        "--device", type=cli.device_name, default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N"
    )
    parser.add_argument(
        "--provider",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: triton where it is installed (on a CPU in Triton's interpreter), else torch",
    )
    parser.add_argument("--mode", default=Mode.INTRANODE.value, choices=[m.value for m in Mode])
    parser.add_argument(
        "--iters", type=cli.positive_int, help="timed steps per format (default: 20 GPU, 3 CPU, 1 interpreter)"
    )
    parser.add_argument(
        "--warmup", type=cli.non_negative_int, help="untimed steps per format (default: 3 GPU, 1 CPU, 0 interpreter)"
    )
    parser.add_argument(
        "--input", default=INPUTS[0], choices=INPUTS, help="token distribution (default: lognormal, heavy-tailed)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=cli.output_file, help="also write the table and its settings as JSON here")
    args = parser.parse_args(argv)
    device = cli.resolve_device(args.device)
    args.device = str(device)
    provider, args.runs_on = choose_provider(args.provider, device)
    args.provider = provider.value
    if device.type == "cuda":
        defaults = GPU_DEFAULTS
    else:
        defaults = INTERPRETER_DEFAULTS if provider is Provider.TRITON else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = cli.checked(parser, lambda: configs(args))
    return args


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device)
    batch = make_batch(args, device)
    rows: list[Row] = []
    baseline: list[torch.Tensor] = []
    for number, cfg in enumerate(args.configs, 1):
        start = time.perf_counter()
        row, combined = run_format(args, batch, cfg, device)
        if not baseline:
            baseline = combined
        row.rel_err_bf16 = relative_error(combined, baseline)
        rows.append(row)
        print(
            f"[{number}/{len(args.configs)}] dispatch {row.dispatch}, combine {row.combine}: "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"loopback world of {args.world} ranks on {args.device}: {args.tokens} tokens/rank, hidden {args.hidden}, "
        f"{args.experts} experts, top-{args.topk}, {args.input} input, mode {args.mode}, provider {args.provider} "
        f"({args.runs_on}); median of {args.iters} step{'s' if args.iters > 1 else ''} of the whole world",
        flush=True,
    )
    rows = run(args)
    print()
    print(markdown(rows))
    print()
    print(LEGEND)
    if args.json is not None:
        skip = {"configs"}
        settings = {k: v for k, v in vars(args).items() if k not in skip}
        Path(args.json).write_text(
            json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
        )


if __name__ == "__main__":
    cli.run(main, "python -m mori_sglang.roundtrip")
