"""``python -m eval.layer_accuracy``: combine error per wire format on heavy-tailed expert outputs.

Modes: bf16, fp8_blockwise (ours: every block scaled to the fp8 range), fp8_blockwise_native (native
MoRI's scales: a block is scaled only when it would overflow) and fp8_direct_cast (no scale). For each
it prints the relative error of the combined tokens against the exact f32 sum (norm-wise, and the
median over elements), the fraction of nonzero results flushed to zero, and the fraction of expert
outputs the format clamps (saturates).
"""

from __future__ import annotations

import argparse
import sys

import torch

from eval.layer_accuracy.activations import ActivationSpec
from eval.layer_accuracy.run import MODES, LayerSetup, ModeResult, run
from mori_sglang import Provider
from mori_sglang.config import FP8_TYPES


def _fraction(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def markdown_table(results: list[ModeResult]) -> str:
    lines = [
        "| combine mode | relative error | median element error | flushed to zero | saturated |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.mode.value} | {r.relative_error:.3e} | {r.median_element_error:.3e} | "
            f"{_fraction(r.flushed)} | {_fraction(r.saturated)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    default = LayerSetup()
    spec = ActivationSpec()
    parser = argparse.ArgumentParser(prog="python -m eval.layer_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=default.world_size)
    parser.add_argument("--tokens-per-rank", type=int, default=default.tokens_per_rank)
    parser.add_argument("--hidden", type=int, default=default.hidden)
    parser.add_argument("--experts", type=int, default=default.num_experts)
    parser.add_argument("--topk", type=int, default=default.topk)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--provider", choices=[p.value for p in Provider], default=default.provider.value)
    parser.add_argument("--fp8-type", choices=["auto", *FP8_TYPES], default="auto", help="auto: the device's")
    parser.add_argument("--modes", default=",".join(m.value for m in MODES), help="comma list of combine modes")
    group = parser.add_argument_group("expert outputs")
    group.add_argument("--median", type=float, default=spec.median, help="median per-channel RMS")
    group.add_argument("--channel-sigma", type=float, default=spec.channel_sigma, help="lognormal spread of channels")
    group.add_argument("--token-sigma", type=float, default=spec.token_sigma, help="lognormal spread of tokens")
    group.add_argument("--outlier-rate", type=float, default=spec.outlier_rate, help="fraction of outlier elements")
    group.add_argument("--outlier-min", type=float, default=spec.outlier_min)
    group.add_argument("--outlier-max", type=float, default=spec.outlier_max)
    args = parser.parse_args(argv)

    by_name = {m.value: m for m in MODES}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in by_name]
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: use a comma list of {', '.join(by_name)}")
    try:
        activations = ActivationSpec(
            args.median, args.channel_sigma, args.token_sigma, args.outlier_rate, args.outlier_min, args.outlier_max
        )
        setup = LayerSetup(
            world_size=args.world_size,
            tokens_per_rank=args.tokens_per_rank,
            hidden=args.hidden,
            num_experts=args.experts,
            topk=args.topk,
            seed=args.seed,
            device=args.device,
            provider=Provider(args.provider),
            fp8_dtype=FP8_TYPES.get(args.fp8_type),
            activations=activations,
        )
        results = run(setup, tuple(by_name[m] for m in modes))
    except ValueError as e:  # ConfigError, InputError and bad activation settings name the knob
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"combine of {args.world_size} ranks x {args.tokens_per_rank} tokens, hidden {args.hidden}, "
        f"top-{args.topk} of {args.experts} experts, seed {args.seed}, on {args.device}\n"
    )
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
