"""The registers each kernel of a step needs on an NVIDIA Hopper GPU (sm_90) and an AMD MI300 (gfx942),
read from the compiled code on any machine, GPU or not.

    python -m mori_sglang.tools.registers --tokens 1 128 4096 --dispatch-dtype fp8 --combine-dtype bf16

A kernel's registers per thread decide how many of its programs share a multiprocessor, so a change
that adds code to a path only some batches take (the routing inside the send, say) can slow every batch:
this shows it before a GPU runs. Each batch is one low-latency step of a loopback world's rank 0 whose
launches are recorded without running them (``mori_sglang.tools.launch_specs``) and compiled for each
target as its GPU would launch them. ``--routing`` picks how the send routes (by default as the
provider would for the batch; worlds of more than ``SELF_ROUTING_MAX_WORLD`` ranks always route in
tasks). Rows print to
stderr as they compile, and the table to stdout at the end. Compiling needs Triton's compiler, not
its interpreter: run it without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mori_sglang import cli
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode
from mori_sglang.kernels import interpreter, transport
from mori_sglang.kernels.geometry import SELF_ROUTING_MAX_WORLD, KernelTuning
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers.triton_provider import COUNT_SPINS
from mori_sglang.tools import launch_specs

ROUTINGS = ("auto", "self", "tasks")
CLOCKS = {"sm_90": transport.CLOCK_CUDA, "gfx942": transport.CLOCK_HIP}


@dataclass
class Usage:
    """One kernel of one step, compiled for one target."""

    kernel: str
    world: int
    tokens: int
    dispatch_dtype: str
    combine_dtype: str
    routing: str  # how the send routes ("self" or "tasks"); "-" for the other kernels
    target: str
    registers: int  # per thread: sm_90's registers, gfx942's vector registers
    spilled: int  # sm_90: stack bytes; gfx942: spilled vector registers


def record_step(cfg: EpConfig, tokens: int, tuning: KernelTuning) -> list[dict]:
    """The distinct launches of one low-latency step of rank 0 with ``tokens`` tokens, unrun."""
    world = LoopbackWorld(cfg, "cpu")
    world.set_kernel_tuning(tuning)
    op = world.ops[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.int()
    weights = torch.rand(tokens, cfg.topk, generator=gen)
    with launch_specs.recorded_launches(run=False) as launches:
        op.dispatch_send(x, weights, None, ids)
        out = op.dispatch_recv()
        op.combine_send(torch.randn(out.tokens.shape[0], cfg.hidden, generator=gen).to(torch.bfloat16), out.handle)
        op.combine_recv()
    return launch_specs.unique(launches)


def as_target_launch(spec: dict, target: str) -> dict:
    """The recorded launch as ``target``'s GPU makes it: its clock and spins; Hopper under programmatic
    dependent launch, MI300 with its e4m3fnuz fp8."""
    spec = launch_specs.as_gpu_launch(spec, CLOCKS[target], COUNT_SPINS)
    return launch_specs.as_hopper_launch(spec) if target == "sm_90" else launch_specs.as_fnuz(spec)


def batches(args: argparse.Namespace) -> list[tuple[dict, EpConfig, KernelTuning]]:
    """Each batch the arguments name (ranks, tokens, dtypes), its op config and the tuning that routes
    its send as ``--routing`` asks. A config the op refuses raises ``ConfigError``."""
    made = []
    for world, tokens in itertools.product(args.world, args.tokens):
        experts = args.local_experts * world if args.local_experts else args.experts
        for dispatch, combine in itertools.product(args.dispatch_dtype, args.combine_dtype):
            cfg = EpConfig(
                world, 0, args.hidden, experts, args.topk, max_tokens_per_rank=tokens,
                dispatch_dtype=DispatchDtype(dispatch), combine_dtype=CombineDtype(combine), mode=Mode.LOW_LATENCY,
                provider="triton", fp8_dtype=torch.float8_e4m3fn,
            )  # fmt: skip
            tuning = KernelTuning()
            if args.routing != "auto":
                tuning = dataclasses.replace(tuning, self_routing_max_tokens=tokens if args.routing == "self" else 0)
            batch = {"world": world, "tokens": tokens, "dispatch_dtype": dispatch, "combine_dtype": combine}
            made.append((batch, cfg, tuning))
    return made


def record(args: argparse.Namespace) -> list[dict]:
    """Every batch's distinct launches, each spec with the batch it came from."""
    return [
        {"batch": batch, "spec": spec}
        for batch, cfg, tuning in batches(args)
        for spec in record_step(cfg, batch["tokens"], tuning)
    ]


def recorded_in_interpreter(argv: list[str]) -> list[dict]:
    """``record`` run in a child process under Triton's interpreter: the provider binds its launches on
    a CPU only there, while compiling them needs the compiler, so the two cannot share a process."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "launches.json"
        env = {**os.environ, interpreter.INTERPRET_ENV: "1"}
        command = [sys.executable, "-m", "mori_sglang.tools.registers", *argv, "--record-to", str(path)]
        done = subprocess.run(command, env=env)
        if done.returncode:  # the child printed why
            raise SystemExit(f"registers: recording the launches failed (exit status {done.returncode})")
        return json.loads(path.read_text())


def measure(recorded: list[dict], targets: list[str]) -> list[Usage]:
    rows = []
    for entry in recorded:
        spec, batch = entry["spec"], entry["batch"]
        routing = "-"
        if spec["kernel"] == "dispatch_send_kernel":
            routing = "self" if spec["constants"]["SELF_ROUTING"] else "tasks"
        for target in targets:
            compiled = launch_specs.compile_launch(as_target_launch(spec, target), launch_specs.TARGETS[target])
            registers, spilled = launch_specs.resource_usage(compiled, launch_specs.TARGETS[target])
            row = Usage(spec["kernel"], **batch, routing=routing, target=target, registers=registers, spilled=spilled)
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)  # progress
    return rows


HEADER = (
    "| kernel | ranks | tokens/rank | dispatch | combine | send routing | target | registers/thread | spilled |\n"
    "| --- | ---: | ---: | --- | --- | --- | --- | ---: | ---: |"
)


def _line(r: Usage) -> str:
    return (
        f"| {r.kernel} | {r.world} | {r.tokens} | {r.dispatch_dtype} | {r.combine_dtype} | {r.routing} "
        f"| {r.target} | {r.registers} | {r.spilled} |"
    )


def markdown(rows: list[Usage]) -> str:
    return "\n".join([HEADER, *map(_line, rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mori_sglang.tools.registers",
        description="The registers per thread each kernel of a step needs on sm_90 and gfx942, compiled without a GPU.",
    )
    parser.add_argument("--tokens", type=cli.positive_int, nargs="+", default=[1, 128, 4096], help="tokens per rank")
    parser.add_argument("--hidden", type=cli.positive_int, default=7168)
    parser.add_argument("--topk", type=cli.positive_int, default=8)
    parser.add_argument("--experts", type=cli.positive_int, default=256)
    parser.add_argument(
        "--local-experts", type=cli.positive_int, help="experts per rank, for every world (for --experts)"
    )
    parser.add_argument("--world", "--world-size", type=cli.positive_int, nargs="+", default=[8], help="ranks")
    parser.add_argument(
        "--dispatch-dtype", nargs="+", default=[DispatchDtype.FP8.value], choices=[d.value for d in DispatchDtype]
    )
    parser.add_argument(
        "--combine-dtype", nargs="+", default=[CombineDtype.BF16.value], choices=[c.value for c in CombineDtype]
    )
    parser.add_argument(
        "--routing",
        default="auto",
        choices=ROUTINGS,
        help=f"how the send routes: auto as tuned; worlds of more than {SELF_ROUTING_MAX_WORLD} ranks always in tasks",
    )
    parser.add_argument("--target", nargs="+", default=["sm_90"], choices=sorted(launch_specs.TARGETS))
    parser.add_argument("--json", type=cli.output_file, help="write the rows here")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # the recording child's output
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Usage]:
    args = parse_args(argv)
    if args.record_to:
        Path(args.record_to).write_text(json.dumps(record(args)))
        return []
    try:
        batches(args)
    except ConfigError as e:
        raise SystemExit(f"registers: {e}") from None
    if interpreter.interpreting():
        raise SystemExit(f"registers: unset {interpreter.INTERPRET_ENV}: the kernels must compile, not be interpreted")
    rows = measure(recorded_in_interpreter(sys.argv[1:] if argv is None else argv), args.target)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
