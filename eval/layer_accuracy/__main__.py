"""``python -m eval.layer_accuracy``: combine error per wire format on heavy-tailed expert outputs.

Modes, by their SGLANG_MORI_COMBINE_DTYPE names: bf16, fp8 (blockwise, ours: every block scaled to the
fp8 range; alias fp8_blockwise), fp8_blockwise_native (native MoRI's scales: a block is scaled only
when it would overflow) and fp8_direct_cast (no scale). For each it prints the relative error of the
combined tokens against the exact f32 sum (norm-wise, and the median over elements), the fraction of
nonzero results flushed to zero, and the fraction of expert outputs the format clamps (saturates).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from eval.layer_accuracy.activations import ActivationSpec
from eval.layer_accuracy.run import MODES, LayerSetup, ModeResult, mode_config, run
from mori_sglang import cli
from mori_sglang.config import FP8_TYPES, CombineDtype, Provider
from mori_sglang.kernels.interpreter import interpret_on_cpu


def _fraction(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def markdown_table(results: list[ModeResult]) -> str:
    lines = [
        "| combine mode | relative error | median element error | flushed to zero | saturated |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {cli.combine_name(r.mode)} | {r.relative_error:.3e} | {r.median_element_error:.3e} | "
            f"{_fraction(r.flushed)} | {_fraction(r.saturated)} |"
        )
    return "\n".join(lines)


def parse_modes(text: str) -> list[CombineDtype]:
    """A comma list of combine formats by env or long name (``fp8`` and ``fp8_blockwise`` are one mode)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    accepted = ", ".join(cli.combine_name(m) for m in MODES)
    modes = []
    for name in names:
        try:
            mode = cli.combine_dtype(name)
        except argparse.ArgumentTypeError:
            mode = None
        if mode not in MODES:
            raise argparse.ArgumentTypeError(f"{name!r} is not a mode; use a comma list of {accepted}")
        modes.append(mode)
    if not modes:
        raise argparse.ArgumentTypeError(f"use a comma list of {accepted}")
    return modes


def main(argv: Sequence[str] | None = None) -> int:
    default = LayerSetup()
    spec = ActivationSpec()
    parser = argparse.ArgumentParser(prog="python -m eval.layer_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--world", "--world-size", type=cli.positive_int, default=default.world_size, help="ranks")
    parser.add_argument(
        "--tokens", "--tokens-per-rank", type=cli.positive_int, default=default.tokens_per_rank, help="tokens per rank"
    )
    parser.add_argument("--hidden", type=cli.positive_int, default=default.hidden)
    parser.add_argument("--experts", type=cli.positive_int, default=default.num_experts)
    parser.add_argument("--topk", type=cli.positive_int, default=default.topk)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--device", type=cli.device_name, default="auto", help="auto (cuda if available), cpu, cuda:N")
    parser.add_argument(
        "--provider",
        choices=[p.value for p in Provider if p is not Provider.MORI],
        default=default.provider.value,
        help="auto: triton on a GPU, torch on a CPU",
    )
    parser.add_argument("--fp8-type", choices=["auto", *FP8_TYPES], default="auto", help="auto: the device's")
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=list(MODES),
        help="comma list of combine formats (default: " + ",".join(cli.combine_name(m) for m in MODES) + ")",
    )
    group = parser.add_argument_group("expert outputs")
    group.add_argument("--median", type=float, default=spec.median, help="median per-channel RMS")
    group.add_argument("--channel-sigma", type=float, default=spec.channel_sigma, help="lognormal spread of channels")
    group.add_argument("--token-sigma", type=float, default=spec.token_sigma, help="lognormal spread of tokens")
    group.add_argument("--outlier-rate", type=float, default=spec.outlier_rate, help="fraction of outlier elements")
    group.add_argument("--outlier-min", type=float, default=spec.outlier_min)
    group.add_argument("--outlier-max", type=float, default=spec.outlier_max)
    args = parser.parse_args(argv)

    device = cli.resolve_device(args.device)
    provider = Provider(args.provider)
    if provider is Provider.TRITON and device.type == "cpu":
        interpret_on_cpu()

    try:
        activations = ActivationSpec(
            args.median, args.channel_sigma, args.token_sigma, args.outlier_rate, args.outlier_min, args.outlier_max
        )
    except ValueError as e:
        parser.error(f"expert outputs: {e}")

    def build() -> LayerSetup:
        setup = LayerSetup(
            world_size=args.world,
            tokens_per_rank=args.tokens,
            hidden=args.hidden,
            num_experts=args.experts,
            topk=args.topk,
            seed=args.seed,
            device=str(device),
            provider=provider,
            fp8_dtype=FP8_TYPES.get(args.fp8_type),
            activations=activations,
        )
        for mode in args.modes:
            cli.check_wire(mode_config(setup, mode))
        return setup

    setup = cli.checked(parser, build)
    results = run(setup, tuple(args.modes))
    print(
        f"combine of {args.world} ranks x {args.tokens} tokens, hidden {args.hidden}, "
        f"top-{args.topk} of {args.experts} experts, seed {args.seed}, on {device}\n"
    )
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    cli.run(main, "python -m eval.layer_accuracy")
