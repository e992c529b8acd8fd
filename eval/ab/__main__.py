"""``python -m eval.ab``: GSM8K for each combine dtype, one freshly started server per dtype.

Each run starts the launch command with ``SGLANG_MORI_COMBINE_DTYPE`` set to the dtype (the command
may also use the ``{combine_dtype}``, ``{host}``, ``{port}`` and ``{seed}`` placeholders), waits for
health, runs the driver, stops the server's process group, and finally prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from eval.ab.server import HEALTH_PATHS, ManagedServer, ServerError, port_in_use, render_command
from eval.ab.table import AB_DTYPES, Row, markdown_table
from eval.gsm8k.client import RequestFailed
from eval.gsm8k.data import DataError
from eval.gsm8k.driver import base_url, labelled_questions, run_eval, warn_failures
from eval.gsm8k.options import add_driver_args, config_from_args
from mori_sglang import cli

COMBINE_ENV = "SGLANG_MORI_COMBINE_DTYPE"


def parse_dtypes(text: str) -> list[str]:
    """A comma list of combine dtypes by their SGLANG_MORI_COMBINE_DTYPE names (long names are aliases)."""
    dtypes = []
    for name in (d.strip() for d in text.split(",") if d.strip()):
        try:
            dtype = cli.combine_name(cli.combine_dtype(name))
        except argparse.ArgumentTypeError:
            dtype = None
        if dtype not in AB_DTYPES:
            raise argparse.ArgumentTypeError(f"{name!r}: use a comma list of {', '.join(AB_DTYPES)}")
        if dtype in dtypes:  # e.g. fp8 and its long name fp8_blockwise: one server run, one row each
            raise argparse.ArgumentTypeError(f"{name!r} names {dtype} a second time")
        dtypes.append(dtype)
    if not dtypes:
        raise argparse.ArgumentTypeError(f"use a comma list of {', '.join(AB_DTYPES)}")
    return dtypes


def run_one(args: argparse.Namespace, dtype: str, url: str, output_dir: Path) -> Row:
    """Start, wait, evaluate, stop: one row of the table. A server that never comes up is a failed row."""
    if port_in_use(args.host, args.port):
        return Row(dtype, None, f"port {args.port} is already in use; stop that server first")
    command = render_command(args.launch, combine_dtype=dtype, host=args.host, port=args.port, seed=args.seed)
    print(f"[{COMBINE_ENV}={dtype}] {' '.join(command)}", file=sys.stderr, flush=True)
    run_dir = output_dir / dtype
    try:
        with ManagedServer(command, {**os.environ, COMBINE_ENV: dtype}, run_dir / "server.log") as server:
            waited = server.wait_healthy(url + HEALTH_PATHS[args.backend], args.health_timeout)
            print(f"[{COMBINE_ENV}={dtype}] healthy after {waited:.0f} s", file=sys.stderr, flush=True)
            summary, _ = run_eval(config_from_args(args, url, str(run_dir)))
    except (OSError, ServerError, RequestFailed, DataError) as e:  # OSError: the command could not be started
        print(f"[{COMBINE_ENV}={dtype}] failed: {e}", file=sys.stderr)
        return Row(dtype, None, str(e))
    print(f"combine dtype {dtype}:\n{summary.report()}", flush=True)
    warn_failures(summary, str(run_dir))
    return Row(dtype, summary.accuracy, f"{summary.failed} questions failed" if summary.failed else None)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through ManagedServer, which stops the server group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--launch", required=True, help="server command, e.g. 'launch/sglang_h200_moe.sh --model M'")
    parser.add_argument("--combine-dtypes", type=parse_dtypes, default=list(AB_DTYPES), help="comma list")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=cli.port, default=30000)
    parser.add_argument("--seed", type=int, default=1, help="server seed, for the {seed} placeholder")
    parser.add_argument(
        "--hidden", type=cli.positive_int, default=7168, help="model hidden size, for the payload column"
    )
    parser.add_argument(
        "--health-timeout", type=cli.at_least(1e-3, float), default=1800.0, help="seconds to wait for a server"
    )
    parser.add_argument(
        "--output-dir", type=cli.output_folder, default="ab_out", help="per-dtype results, server logs, the table"
    )
    add_driver_args(parser)
    args = parser.parse_args(argv)
    try:  # a bad placeholder is the command line's error, not the first run's
        render_command(
            args.launch, combine_dtype=args.combine_dtypes[0], host=args.host, port=args.port, seed=args.seed
        )
    except ValueError as e:
        parser.error(f"--launch: {e}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    try:  # the data set is resolved (downloaded) and checked once, before any server is started
        _, data_path, _ = labelled_questions(args.data_path, args.num_questions)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.data_path = str(data_path)
    url = base_url(args.host, args.port)
    output_dir = Path(args.output_dir)
    rows = [run_one(args, dtype, url, output_dir) for dtype in args.combine_dtypes]

    table = markdown_table(rows, args.hidden)
    notes = "".join(f"\n- {r.combine_dtype}: {r.error.splitlines()[0]}" for r in rows if r.error)
    table += notes and f"\n{notes}"
    title = f"GSM8K, seed {args.seed}, {args.num_questions} questions, {args.num_shots} shots, hidden {args.hidden}"
    print(f"\n{title}\n\n{table}")
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "table.md").write_text(f"{title}\n\n{table}\n")
    (output_dir / "ab_summary.json").write_text(
        json.dumps({"seed": args.seed, "hidden": args.hidden, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
