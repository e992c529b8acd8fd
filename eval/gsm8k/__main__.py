"""``python -m eval.gsm8k``: few-shot GSM8K against a running SGLang or vLLM server."""

from __future__ import annotations

import argparse
import sys

from eval.gsm8k.client import RequestFailed
from eval.gsm8k.data import DataError
from eval.gsm8k.driver import base_url, run_eval, warn_failures
from eval.gsm8k.options import add_driver_args, config_from_args
from mori_sglang.cli import output_folder, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.gsm8k", description=__doc__)
    add_driver_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=30000)
    parser.add_argument(
        "--output-dir", type=output_folder, default="gsm8k_out", help="results.jsonl and summary.json go here"
    )
    args = parser.parse_args(argv)
    config = config_from_args(args, base_url(args.host, args.port), args.output_dir)
    try:
        summary, _ = run_eval(config)
    except (DataError, RequestFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.report())
    warn_failures(summary, config.output_dir)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
