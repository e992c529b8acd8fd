"""Command-line options shared by the GSM8K driver and the A/B runner (names and defaults as bench_sglang.py)."""

from __future__ import annotations

import argparse

from eval.gsm8k.client import RetryPolicy
from eval.gsm8k.driver import EvalConfig
from mori_sglang.cli import at_least


def add_driver_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("sglang", "openai"),
        default="sglang",
        help="sglang: POST /generate; openai: POST /v1/completions (vLLM)",
    )
    parser.add_argument("--model", help="model name for /v1/completions (default: the first of /v1/models)")
    parser.add_argument("--num-questions", type=at_least(1), default=200)
    parser.add_argument("--num-shots", type=at_least(0), default=5)
    parser.add_argument("--parallel", type=at_least(1), default=64, help="requests in flight")
    parser.add_argument("--data-path", help="GSM8K test.jsonl (default: download once and cache)")
    parser.add_argument("--timeout", type=at_least(0.001, float), default=600.0, help="seconds per request attempt")
    parser.add_argument("--retries", type=at_least(0), default=3, help="further attempts after a transient failure")
    parser.add_argument("--retry-wait", type=at_least(0, float), default=1.0, help="first wait between attempts (s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace, url: str, output_dir: str) -> EvalConfig:
    return EvalConfig(
        backend=args.backend,
        base_url=url,
        model=args.model,
        num_questions=args.num_questions,
        num_shots=args.num_shots,
        parallel=args.parallel,
        data_path=args.data_path,
        output_dir=output_dir,
        retry=RetryPolicy(retries=args.retries, timeout_s=args.timeout, backoff_s=args.retry_wait),
        progress=not args.no_progress,
    )
