"""The sweep the benchmark commands share: their workload flags, the op configs those flags describe,
and the comparison cells against the torch baseline."""

from __future__ import annotations

import argparse
import sys
from typing import Protocol

from mori_sglang import cli
from mori_sglang.config import ConfigError, EpConfig, Mode, Provider


class PhaseTimes(Protocol):
    """A benchmark row: dispatch and combine times in µs."""

    dispatch_us: float
    combine_us: float


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags the benchmarks share (sizes, dtypes, modes, iterations); formats by their
    SGLANG_MORI_* names, the long combine names as aliases."""
    parser.add_argument("--tokens", type=cli.positive_int, nargs="+", default=[128, 4096], help="tokens per rank")
    parser.add_argument(
        "--max-tokens-per-rank",
        type=cli.positive_int,
        help="buffer capacity per rank (default: each batch's own size); a server sizes its buffers for the "
        "largest batch and runs decode batches far below it",
    )
    parser.add_argument("--hidden", type=cli.positive_int, default=7168)
    parser.add_argument("--topk", type=cli.positive_int, default=8)
    parser.add_argument("--experts", type=cli.positive_int, default=256)
    parser.add_argument(
        "--dispatch-dtype", type=cli.dispatch_dtype, default="fp8", help="bf16, fp8, mxfp8 or fp4 (default: fp8)"
    )
    parser.add_argument(
        "--combine-dtype",
        type=cli.combine_dtype,
        nargs="+",
        # Parsed here: argparse runs ``type`` on a string default only, never on a list's items.
        default=[cli.combine_dtype(name) for name in ("bf16", "fp8", "fp8_direct_cast")],
        help=f"one or more of {cli.combine_names()} (default: bf16 fp8 fp8_direct_cast)",
    )
    parser.add_argument("--mode", nargs="+", default=["intranode", "low_latency"], choices=[m.value for m in Mode])
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch provider baseline")
    parser.add_argument("--iters", type=cli.positive_int, default=20)


def workload_configs(
    args: argparse.Namespace, world_size: int, rank: int, provider: Provider
) -> list[tuple[EpConfig, int]]:
    """Every (mode, tokens per rank, combine dtype) point of the sweep the workload flags describe, as
    the op's config and the batch size per rank; ConfigError / FormatError for a point no op takes."""
    capacity = args.max_tokens_per_rank
    if capacity is not None and capacity < max(args.tokens):
        raise ConfigError(f"--max-tokens-per-rank {capacity} is below the largest --tokens value {max(args.tokens)}")
    points = []
    for mode in args.mode:
        for tokens in args.tokens:
            for combine in args.combine_dtype:
                config = EpConfig(
                    world_size=world_size,
                    rank=rank,
                    hidden=args.hidden,
                    num_experts=args.experts,
                    topk=args.topk,
                    max_tokens_per_rank=capacity or tokens,
                    dispatch_dtype=args.dispatch_dtype,
                    combine_dtype=combine,
                    mode=mode,
                    provider=provider,
                )
                cli.check_wire(config)
                points.append((config, tokens))
    return points


def speedup_cells(row: PhaseTimes, base: PhaseTimes | None) -> tuple[str, str]:
    """Dispatch and combine time of the torch baseline over the row's, as table cells ("-" without one)."""
    if base is None:
        return "-", "-"
    return f"{base.dispatch_us / row.dispatch_us:.1f}", f"{base.combine_us / row.combine_us:.1f}"


def report_progress(done: int, total: int, config: EpConfig, tokens: int, seconds: float, label: str = "") -> None:
    """One line on stderr per measured point, so that a long sweep (minutes in the interpreter) shows
    where it is without touching the table on stdout."""
    point = f"{config.mode.value}, {tokens} tokens, combine {cli.combine_name(config.combine_dtype)}"
    print(f"[{done}/{total}] {label}{point}: {seconds:.1f} s", file=sys.stderr, flush=True)
