"""Every command answers a typo without a traceback: a bad argument is argparse's one-line usage error
with exit status 2, a configuration this machine cannot run is one sentence naming the knob with exit
status 1. Each case runs the command as a user would, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mori_sglang.tools.bench_dist import TORCHRUN_ENV

REPO = Path(__file__).resolve().parents[2]
ROUNDTRIP = "mori_sglang.roundtrip"
BENCH = "mori_sglang.tools.bench"
TUNE = "mori_sglang.tools.tune"
BANDWIDTH = "mori_sglang.tools.bandwidth"
BENCH_DIST = "mori_sglang.tools.bench_dist"
ENV = "mori_sglang.env"
GSM8K = "eval.gsm8k"
AB = "eval.ab"
LAYER = "eval.layer_accuracy"
SCRIPTED = "eval.scripted_server"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a GPU this machine lacks")

USAGE_ERRORS = [
    (ROUNDTRIP, ["--world", "0"], "argument --world/--world-size: 0 is below 1"),
    (ROUNDTRIP, ["--tokens", "-1"], "argument --tokens: -1 is below 1"),
    (ROUNDTRIP, ["--hidden", "7", "--provider", "torch"], "hidden=7: fp4 dispatch packs two elements per byte"),
    (ROUNDTRIP, ["--topk", "300", "--provider", "torch"], "topk=300 must be in [1, num_experts=256]"),
    (ROUNDTRIP, ["--device", "gpu"], "argument --device: 'gpu' is not a device"),
    (ROUNDTRIP, ["--iters", "x"], "argument --iters: 'x' is not a number"),
    (BENCH, ["--world", "0"], "argument --world/--world-size: 0 is below 1"),
    (BENCH, ["--tokens", "4", "-1"], "argument --tokens: -1 is below 1"),
    (BENCH, ["--combine-dtype", "fp9"], "argument --combine-dtype: 'fp9' is not a combine format; use bf16, fp8"),
    (BENCH, ["--dispatch-dtype", "fp16"], "argument --dispatch-dtype: 'fp16' is not a dispatch format"),
    (BENCH, ["--provider", "torch", "--topk", "300"], "topk=300 must be in [1, num_experts=256]"),
    (BENCH, ["--provider", "torch", "--dispatch-dtype", "fp4", "--hidden", "7"], "hidden=7: fp4 dispatch packs"),
    (TUNE, ["--vary", "warp_count=2"], "--vary warp_count=2: warp_count is not a KernelTuning field"),
    (TUNE, ["--vary", "recv_warps=two"], "--vary recv_warps=two: the values must be integers"),
    (TUNE, ["--vary", "recv_warps=4,3"], "--vary recv_warps=3: KernelTuning.recv_warps=3: warps are powers of two"),
    (TUNE, ["--vary", "recv_warps=3"], "--vary recv_warps=3: KernelTuning.recv_warps=3: warps are powers of two"),
    (TUNE, ["--vary", "combine_recv_programs_per_sm=0"], "KernelTuning.combine_recv_programs_per_sm=0: must be >= 1"),
    (TUNE, ["--vary", "route_programs_per_sm=0"], "KernelTuning.route_programs_per_sm=0: must be >= 1"),
    (TUNE, ["--vary", "self_routing_max_tokens=-1"], "KernelTuning.self_routing_max_tokens=-1: must be >= 0"),
    (TUNE, ["--iters", "0"], "argument --iters: 0 is below 1"),
    (BANDWIDTH, ["--fan-out", "3"], "--fan-out [3]: destinations must be powers of two"),
    (BANDWIDTH, ["--hidden", "1536"], "--hidden 1536: the fan-out probe needs a multiple of a power-of-two tile"),
    (BANDWIDTH, ["--tokens", "0"], "argument --tokens: 0 is below 1"),
    (BENCH_DIST, ["--tokens", "0"], "argument --tokens: 0 is below 1"),
    (ENV, ["--bogus"], "unrecognized arguments: --bogus"),
    (GSM8K, ["--port", "99999"], "argument --port: 99999 is not a TCP port (1 to 65535)"),
    (GSM8K, ["--parallel", "0"], "argument --parallel: 0 is below 1"),
    (AB, ["--launch", "true", "--port", "0"], "argument --port: 0 is below 1"),
    (AB, ["--launch", "true", "--combine-dtypes", "fp4"], "argument --combine-dtypes: 'fp4': use a comma list"),
    (AB, ["--launch", "serve --gpus {gpus}"], "--launch: unknown placeholder 'gpus' in the launch command"),
    (LAYER, ["--world-size", "0"], "argument --world/--world-size: 0 is below 1"),
    (LAYER, ["--modes", "fp4"], "argument --modes: 'fp4' is not a mode"),
    (LAYER, ["--topk", "300", "--device", "cpu"], "topk=300 must be in [1, num_experts=256]"),
    (LAYER, ["--median", "-1", "--device", "cpu"], "expert outputs: median must be > 0"),
    (SCRIPTED, ["--port", "x"], "argument --port: 'x' is not a number"),
    (SCRIPTED, ["--port", "99999", "--script", "s.json"], "argument --port: 99999 is not a TCP port (1 to 65535)"),
    (SCRIPTED, ["--port", "1", "--script", "no-such.json"], "--script no-such.json: [Errno 2] No such file"),
]

CONFIGURATION_ERRORS = [
    pytest.param(ROUNDTRIP, ["--device", "cuda"], {}, "--device cuda: this torch sees no GPU", marks=NO_GPU),
    pytest.param(LAYER, ["--device", "cuda:0"], {}, "--device cuda:0: this torch sees no GPU", marks=NO_GPU),
    pytest.param(
        BENCH,
        ["--device", "cpu"],
        {},
        "python -m mori_sglang.tools.bench --provider triton runs our Triton kernels, which run on a CPU only in "
        "Triton's interpreter: set TRITON_INTERPRET=1",
    ),
    pytest.param(TUNE, ["--device", "cpu"], {}, "python -m mori_sglang.tools.tune runs our Triton kernels"),
    pytest.param(BANDWIDTH, ["--device", "cpu"], {}, "python -m mori_sglang.tools.bandwidth runs our Triton kernels"),
    pytest.param(
        BENCH_DIST,
        [],
        {},
        "python -m mori_sglang.tools.bench_dist runs one process per rank and needs RANK, LOCAL_RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun",
    ),
    pytest.param(
        ENV, [], {"SGLANG_MORI_BACKEND": "nccl"}, "SGLANG_MORI_BACKEND='nccl' is not accepted; use one of: auto"
    ),
]


def run(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command with a user's environment: no Triton interpreter unless asked, no torchrun."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", *TORCHRUN_ENV) and not k.startswith("SGLANG_MORI_")
    }
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=REPO, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=300)


def _key(module: str, args: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={v}" for k, v in env.items()), module, *args])


@pytest.fixture(scope="module")
def results() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's run, started together: each is mostly an interpreter importing torch."""
    skipped = torch.cuda.is_available()  # the cases marked NO_GPU
    cases = [(m, a, {}) for m, a, _ in USAGE_ERRORS]
    cases += [p.values[:3] for p in CONFIGURATION_ERRORS if not (p.marks and skipped)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {_key(m, a, e): pool.submit(run, m, a, e) for m, a, e in cases}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize(("module", "args", "message"), USAGE_ERRORS)
def test_a_bad_argument_is_a_usage_error(
    results: dict[str, subprocess.CompletedProcess[str]], module: str, args: list[str], message: str
) -> None:
    result = results[_key(module, args, {})]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"python -m {module}: error: ") and message in last, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(("module", "args", "env", "message"), CONFIGURATION_ERRORS)
def test_a_configuration_this_machine_cannot_run_is_one_sentence(
    results: dict[str, subprocess.CompletedProcess[str]],
    module: str,
    args: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    result = results[_key(module, args, env)]
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()]  # one line, no traceback
    assert result.stderr.startswith(f"python -m {module}: error: ") and message in result.stderr, result.stderr
