"""The launch recipes, run for real with --dry-run: argument checks, GPU counting and the printed recipe.

GPU tools are stand-in scripts on PATH that list a chosen number of GPUs, so the counting and the
error messages are exercised exactly as on a GPU host; the host's own GPU tools are hidden from the
recipes, so the tests mean the same on a GPU host.
"""

from __future__ import annotations

import atexit
import functools
import os
import random
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from mori_sglang import env

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SYSTEM_PATH = "/usr/bin:/bin"
GPU_TOOLS = ("nvidia-smi", "amd-smi", "rocm-smi")
SGLANG = ("sglang_deepseek_r1_mxfp4.sh", "sglang_h200_moe.sh")
VLLM = ("vllm_deepseek_r1_mxfp4.sh", "vllm_h200_moe.sh")
SCRIPTS = SGLANG + VLLM
COMBINE = ("bf16", "fp8", "fp8_direct_cast")
MORI_ENV = (
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "SGLANG_MORI_COMBINE_DTYPE",
    "SGLANG_MORI_DISPATCH_DTYPE",
    "SGLANG_MORI_SPLIT_DISPATCH_COMBINE",
    "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
    "SGLANG_MORI_BACKEND",
)


# The recipes for AMD GPUs only: SGLang's MoE layers of a Quark MXFP4 checkpoint run on AITER alone.
AMD_ONLY = ("sglang_deepseek_r1_mxfp4.sh",)


def expected_exports(script: str) -> tuple[str, ...]:
    """The variables a recipe's dry run exports, in order (on the GPUs of ``recipe_gpus``): the H200
    SGLang recipe also bounds the experts' rows, the AMD SGLang recipe turns AITER on."""
    own = {"sglang_h200_moe.sh": ("SGLANG_MORI_RECV_BOUND",), "sglang_deepseek_r1_mxfp4.sh": ("SGLANG_USE_AITER",)}
    return MORI_ENV + own.get(script, ())


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "DeepSeek-R1-MXFP4"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def recipe_gpus(tmp_path: Path, script: str) -> Path:
    """A bin directory listing eight GPUs of a vendor ``script`` serves."""
    return fake_gpu_tool(tmp_path, "amd-smi" if script in AMD_ONLY else "nvidia-smi", 8)


def fake_gpu_tool(tmp_path: Path, tool: str, count: int) -> Path:
    """A bin directory whose ``tool`` lists ``count`` GPUs in that tool's own output format."""
    lines = {
        "nvidia-smi": [f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08x})" for i in range(count)],
        "amd-smi": [f"GPU: {i}\n    BDF: 0000:{i:02x}:00.0" for i in range(count)],
        "rocm-smi": ["device,Device ID", *(f"card{i},0x74a1" for i in range(count))],
    }[tool]
    bin_dir = tmp_path / f"bin-{tool}-{count}"
    bin_dir.mkdir()
    script = bin_dir / tool
    script.write_text("#!/bin/sh\ncat <<'OUT'\n" + "\n".join(lines) + "\nOUT\n")
    script.chmod(0o755)
    return bin_dir


@functools.cache
def system_path() -> str:
    """SYSTEM_PATH without the host's GPU tools: where one is installed, a folder of links to every other
    command of SYSTEM_PATH stands in for it, so a recipe sees only the stand-in tools a test puts first."""
    if not any(shutil.which(tool, path=SYSTEM_PATH) for tool in GPU_TOOLS):
        return SYSTEM_PATH
    shadow = Path(tempfile.mkdtemp(prefix="system-path-without-gpu-tools-"))
    atexit.register(shutil.rmtree, shadow, True)
    for folder in SYSTEM_PATH.split(":"):
        for command in Path(folder).iterdir():
            link = shadow / command.name
            if command.name not in GPU_TOOLS and not link.is_symlink():
                link.symlink_to(command)
    return str(shadow)


def run(script: str, *args: str, bin_dir: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_MORI_", "CUDA_VISIBLE", "HIP_VISIBLE"))}
    base["PATH"] = f"{bin_dir}:{system_path()}" if bin_dir else system_path()
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


def parse_dry_run(stdout: str) -> tuple[dict[str, str], list[str]]:
    """The exported variables and the command of a dry run."""
    lines = stdout.strip().splitlines()
    exports = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
    return exports, shlex.split(lines[-1])


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_dry_run_prints_the_recipe(rng: random.Random, script: str, model: Path, tmp_path: Path) -> None:
    dtype, port, server_seed = rng.choice(COMBINE), rng.randrange(20000, 40000), rng.randrange(100)
    extra = ["--max-running-requests", str(rng.randrange(1, 512)), "two words"]
    result = run(
        script,
        "--model",
        str(model),
        "--combine-dtype",
        dtype,
        "--port",
        str(port),
        "--seed",
        str(server_seed),
        "--dry-run",
        "--",
        *extra,
        bin_dir=recipe_gpus(tmp_path, script),
    )
    assert result.returncode == 0, result.stderr
    exports, command = parse_dry_run(result.stdout)
    h200_sglang = script == "sglang_h200_moe.sh"
    assert tuple(exports) == expected_exports(script)
    assert exports["NCCL_NVLS_ENABLE"] == "0" and exports["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert exports["SGLANG_MORI_COMBINE_DTYPE"] == dtype
    # Split dispatch/combine is a variant of the normal mode: the DeepSeek recipes' default low-latency
    # mode runs both directions low-latency already (the split recipes with another mode: below).
    assert exports["SGLANG_MORI_SPLIT_DISPATCH_COMBINE"] == "0"
    assert exports["SGLANG_MORI_BACKEND"] == ("auto" if "deepseek" in script else "triton")
    assert command[-3:] == extra
    assert flag(command, "--port") == str(port)
    if script in SGLANG:
        assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        assert flag(command, "--model-path") == str(model)
        assert flag(command, "--moe-a2a-backend") == "mori"
        # Attention DP over the 8 ranks, spelled as SGLang 0.5.23 asks (its --dp-size N
        # --enable-dp-attention is deprecated); --dp-size would count whole replicas.
        assert [flag(command, f"--{p}-size") for p in ("tp", "ep", "attn-dp")] == ["8", "8", "8"]
        assert "--enable-dp-attention" not in command and "--dp-size" not in command
        assert flag(command, "--random-seed") == str(server_seed)
        assert flag(command, "--deepep-mode") == ("low_latency" if "deepseek" in script else "auto")
        if h200_sglang:
            # On NVIDIA the experts run on SGLang's Triton runner, over the rows the bound admits.
            assert flag(command, "--moe-runner-backend") == "triton"
            assert exports["SGLANG_MORI_RECV_BOUND"] == "1"
        else:
            assert "--moe-runner-backend" not in command
    else:
        assert command[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
        assert flag(command, "--data-parallel-size") == "8" and flag(command, "--tensor-parallel-size") == "1"
        assert "--enable-expert-parallel" in command
        assert flag(command, "--seed") == str(server_seed)
        mode = "mori_low_latency" if "deepseek" in script else "mori_high_throughput"
        assert flag(command, "--all2all-backend") == mode


@pytest.mark.parametrize(
    ("script", "mode", "split"),
    [
        ("sglang_deepseek_r1_mxfp4.sh", "normal", "1"),
        ("sglang_deepseek_r1_mxfp4.sh", "auto", "1"),
        ("sglang_deepseek_r1_mxfp4.sh", "low_latency", "0"),
        ("vllm_deepseek_r1_mxfp4.sh", "high_throughput", "1"),
        ("vllm_deepseek_r1_mxfp4.sh", "low_latency", "0"),
        ("sglang_h200_moe.sh", "normal", "0"),
        ("vllm_h200_moe.sh", "high_throughput", "0"),
    ],
)
def test_the_split_recipes_split_the_mode_that_has_one(
    script: str, mode: str, split: str, model: Path, tmp_path: Path
) -> None:
    """SGLANG_MORI_SPLIT_DISPATCH_COMBINE splits the normal (vLLM: high-throughput) mode; in the
    low-latency mode, which it would not change, the recipes export 0."""
    result = run(script, "--model", str(model), "--mode", mode, "--dry-run", bin_dir=recipe_gpus(tmp_path, script))
    assert result.returncode == 0, result.stderr
    assert parse_dry_run(result.stdout)[0]["SGLANG_MORI_SPLIT_DISPATCH_COMBINE"] == split


@pytest.mark.parametrize("script", SCRIPTS)
def test_combine_dtype_defaults_to_the_environment(
    rng: random.Random, script: str, model: Path, tmp_path: Path
) -> None:
    dtype = rng.choice(COMBINE)
    bin_dir = recipe_gpus(tmp_path, script)
    result = run(script, "--model", str(model), "--dry-run", bin_dir=bin_dir, SGLANG_MORI_COMBINE_DTYPE=dtype)
    assert result.returncode == 0, result.stderr
    assert parse_dry_run(result.stdout)[0]["SGLANG_MORI_COMBINE_DTYPE"] == dtype
    result = run(script, "--model", str(model), "--dry-run", bin_dir=bin_dir)
    assert parse_dry_run(result.stdout)[0]["SGLANG_MORI_COMBINE_DTYPE"] == "bf16"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_option(script: str) -> None:
    result = run(script, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("Usage: ")
    for option in ("--model", "--combine-dtype", "--gpus", "--port", "--dry-run", "bf16 fp8 fp8_direct_cast"):
        assert option in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "error: --model is required"),
        (("--model",), "error: --model needs a value"),
        (
            ("--model", "M", "--combine-dtype", "fp16"),
            "--combine-dtype 'fp16' is not accepted; use one of: auto bf16 fp8 fp8_direct_cast fp4",
        ),
        (("--model", "M", "--gpus", "0"), "--gpus '0' is not a positive integer up to 1024"),
        (
            ("--model", "M", "--gpus", "1"),
            "--gpus '1' is below 2: the recipe runs expert parallelism over --gpus GPUs, and on one GPU it "
            "dispatches nothing (the MoRI all-to-all never runs); use --gpus 2 or more",
        ),
        (("--model", "M", "--gpus", "18446744073709551617"), "--gpus '18446744073709551617' is not a positive"),
        (
            ("--model", "M", "--max-dispatch-tokens", "2000000"),
            "--max-dispatch-tokens '2000000' is not a positive integer up to 1048576",
        ),
        (("--model", "M", "--seed", "99999999999"), "--seed '99999999999' is not an integer from 0 to 4294967295"),
        (("--model", "M", "--port", "9223372036854775808"), "is not a TCP port (1 to 65535)"),
        (("--model", "M", "--mode", "fast"), "--mode 'fast' is not accepted"),
        (
            ("--model", "M", "--provider", "nccl"),
            "--provider 'nccl' is not accepted; use one of: auto mori triton torch",
        ),
        (("--model", "M", "--bogus"), "unknown argument '--bogus'"),
        (("--model", "M", "--port", "99999"), "--port '99999' is not a TCP port (1 to 65535)"),
        (("--model", "M", "--port=0"), "--port '0' is not a TCP port (1 to 65535)"),
        (("--model=",), "--model needs a value"),
        (("--model", "M", "--host", ""), "--host needs a value"),
    ],
)
def test_usage_errors(rng: random.Random, args: tuple[str, ...], message: str) -> None:
    result = run(rng.choice(SCRIPTS), *args, "--dry-run")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Usage: " in result.stderr and result.stdout == ""


def test_model_path_checks(rng: random.Random, tmp_path: Path) -> None:
    script = rng.choice(SCRIPTS)
    bin_dir = recipe_gpus(tmp_path, script)
    missing = tmp_path / "no-such-model"
    result = run(script, "--model", str(missing), "--dry-run", bin_dir=bin_dir)
    assert result.returncode == 1
    assert f"error: model path '{missing}' does not exist" in result.stderr
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    result = run(script, "--model", str(a_file), "--dry-run", bin_dir=bin_dir)
    assert f"model path '{a_file}' is not a directory" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(script, "--model", str(empty), "--dry-run", bin_dir=bin_dir)
    assert result.returncode == 1
    assert f"model path '{empty}' has no config.json" in result.stderr


@pytest.mark.parametrize("tool", ["nvidia-smi", "amd-smi", "rocm-smi"])
def test_too_few_gpus(rng: random.Random, tool: str, model: Path, tmp_path: Path) -> None:
    count = rng.randrange(0, 8)
    result = run(
        "vllm_deepseek_r1_mxfp4.sh", "--model", str(model), "--dry-run", bin_dir=fake_gpu_tool(tmp_path, tool, count)
    )
    assert result.returncode == 1
    assert f"error: this recipe needs 8 GPUs; found {count} ({tool}" in result.stderr


@pytest.mark.parametrize("tool", ["amd-smi", "rocm-smi"])
def test_deepseek_recipe_on_rocm_enables_aiter(tool: str, model: Path, tmp_path: Path) -> None:
    bin_dir = fake_gpu_tool(tmp_path, tool, 8)
    for script, knob in (
        ("sglang_deepseek_r1_mxfp4.sh", "SGLANG_USE_AITER"),
        ("vllm_deepseek_r1_mxfp4.sh", "VLLM_ROCM_USE_AITER"),
    ):
        result = run(script, "--model", str(model), "--dry-run", bin_dir=bin_dir)
        assert result.returncode == 0, result.stderr
        assert parse_dry_run(result.stdout)[0][knob] == "1"
    result = run("vllm_deepseek_r1_mxfp4.sh", "--model", str(model), "--dry-run", bin_dir=recipe_gpus(tmp_path, "-"))
    assert result.returncode == 0, result.stderr
    assert "VLLM_ROCM_USE_AITER" not in parse_dry_run(result.stdout)[0]


def test_the_sglang_mxfp4_recipe_needs_amd(model: Path, tmp_path: Path) -> None:
    """SGLang runs the MoE layers of a Quark MXFP4 checkpoint on AITER only (with mori too): on NVIDIA
    the recipe stops before the server starts."""
    bin_dir = fake_gpu_tool(tmp_path, "nvidia-smi", 8)
    result = run("sglang_deepseek_r1_mxfp4.sh", "--model", str(model), "--dry-run", bin_dir=bin_dir)
    assert result.returncode == 1
    assert "error: this recipe is for amd GPUs; found nvidia (nvidia-smi -L)" in result.stderr


def test_visible_devices_narrow_the_count(rng: random.Random, model: Path, tmp_path: Path) -> None:
    bin_dir = recipe_gpus(tmp_path, "sglang_h200_moe.sh")
    gpus = rng.randrange(3, 8)  # the recipes need 2 GPUs or more, and gpus - 1 runs
    visible = ",".join(map(str, rng.sample(range(8), gpus - 1)))
    result = run(
        "sglang_h200_moe.sh",
        "--model",
        str(model),
        "--gpus",
        str(gpus),
        "--dry-run",
        bin_dir=bin_dir,
        CUDA_VISIBLE_DEVICES=visible,
    )
    assert result.returncode == 1
    assert f"needs {gpus} GPUs; found {gpus - 1} (nvidia-smi -L, CUDA_VISIBLE_DEVICES={visible})" in result.stderr
    result = run(
        "sglang_h200_moe.sh",
        "--model",
        str(model),
        "--gpus",
        str(gpus - 1),
        "--dry-run",
        bin_dir=bin_dir,
        CUDA_VISIBLE_DEVICES=visible,
    )
    assert result.returncode == 0, result.stderr
    command = parse_dry_run(result.stdout)[1]
    assert flag(command, "--ep-size") == str(gpus - 1)


@pytest.mark.parametrize("script", ["sglang_h200_moe.sh", "vllm_h200_moe.sh"])
def test_h200_recipes_need_nvidia(script: str, model: Path, tmp_path: Path) -> None:
    result = run(script, "--model", str(model), "--dry-run", bin_dir=fake_gpu_tool(tmp_path, "amd-smi", 8))
    assert result.returncode == 1
    assert "error: this recipe is for nvidia GPUs; found amd (amd-smi list)" in result.stderr


def test_no_gpu_tool(rng: random.Random, model: Path, tmp_path: Path) -> None:
    """A dry run works anywhere: it says the GPUs were not checked. A real launch needs a GPU tool."""
    script = rng.choice(SCRIPTS)
    result = run(script, "--model", str(model), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "# GPUs not checked: none of nvidia-smi, amd-smi or rocm-smi is on PATH" in result.stdout.splitlines()
    exports, command = parse_dry_run(result.stdout)
    assert tuple(exports) == expected_exports(script) and str(model) in command
    result = run(script, "--model", str(model), PYTHON="/bin/false")
    assert result.returncode == 1
    assert "error: no GPU tool found: none of nvidia-smi, amd-smi or rocm-smi is on PATH" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_options_take_their_value_after_an_equals_sign(
    rng: random.Random, script: str, model: Path, tmp_path: Path
) -> None:
    dtype, port = rng.choice(COMBINE), rng.randrange(1, 65536)
    result = run(
        script,
        f"--model={model}",
        f"--combine-dtype={dtype}",
        f"--port={port}",
        "--gpus=2",
        "--dry-run",
        bin_dir=recipe_gpus(tmp_path, script),
    )
    assert result.returncode == 0, result.stderr
    exports, command = parse_dry_run(result.stdout)
    assert exports["SGLANG_MORI_COMBINE_DTYPE"] == dtype
    assert flag(command, "--port") == str(port) and str(model) in command


@pytest.mark.parametrize(
    ("script", "extra", "message"),
    [
        (
            "sglang_h200_moe.sh",
            ["--moe-a2a-backend", "deepep"],
            "'-- --moe-a2a-backend deepep' contradicts the recipe, which runs --moe-a2a-backend mori; "
            "this recipe does not change it",
        ),
        (
            "sglang_deepseek_r1_mxfp4.sh",
            ["--deepep-mode=normal"],
            "'-- --deepep-mode=normal' contradicts the recipe, which runs --deepep-mode low_latency; "
            "set it with the script's --mode option",
        ),
        (
            "sglang_h200_moe.sh",
            ["--tp", "4"],
            "'-- --tp 4' contradicts the recipe, which runs --tp-size 8; set it with the script's --gpus option",
        ),
        (
            "sglang_h200_moe.sh",
            ["--mem-fraction-static", "0.8", "--port", "1"],
            "'-- --port 1' contradicts the recipe, which runs --port 30000; set it with the script's --port option",
        ),
        (
            "sglang_h200_moe.sh",
            ["--moe-runner-backend", "deep_gemm"],
            "'-- --moe-runner-backend deep_gemm' contradicts the recipe, which runs --moe-runner-backend triton; "
            "this recipe does not change it",
        ),
        (
            "vllm_h200_moe.sh",
            ["--all2all-backend", "deepep_low_latency"],
            "'-- --all2all-backend deepep_low_latency' contradicts the recipe, which runs --all2all-backend "
            "mori_high_throughput; set it with the script's --mode option",
        ),
        (
            "vllm_deepseek_r1_mxfp4.sh",
            ["-tp", "8"],
            "'-- -tp 8' contradicts the recipe, which runs --tensor-parallel-size 1; this recipe does not change it",
        ),
        (
            "vllm_h200_moe.sh",
            ["--disable-expert-parallel"],
            "'-- --disable-expert-parallel' contradicts the recipe, which runs --enable-expert-parallel; "
            "this recipe does not change it",
        ),
        (
            "vllm_deepseek_r1_mxfp4.sh",
            ["--no-enable-expert-parallel", "--max-running-requests", "4"],
            "'-- --no-enable-expert-parallel' contradicts the recipe, which runs --enable-expert-parallel; "
            "this recipe does not change it",
        ),
        (
            "sglang_h200_moe.sh",
            ["--attn-dp-size", "4"],
            "'-- --attn-dp-size 4' contradicts the recipe, which runs --attn-dp-size 8; "
            "set it with the script's --gpus option",
        ),
        (
            "sglang_deepseek_r1_mxfp4.sh",
            ["--attention-data-parallel-size=4"],
            "'-- --attention-data-parallel-size=4' contradicts the recipe, which runs --attn-dp-size 8; "
            "set it with the script's --gpus option",
        ),
        (
            "vllm_h200_moe.sh",
            ["--max-num-batched-tokens=8192"],
            "'-- --max-num-batched-tokens=8192' contradicts the recipe, which runs --max-num-batched-tokens 4096; "
            "set it with the script's --max-dispatch-tokens option",
        ),
    ],
)
def test_server_args_that_contradict_the_recipe_are_refused(
    script: str, extra: list[str], message: str, model: Path, tmp_path: Path
) -> None:
    bin_dir = recipe_gpus(tmp_path, script)
    for dry_run in (["--dry-run"], []):
        result = run(script, "--model", str(model), *dry_run, "--", *extra, bin_dir=bin_dir, PYTHON="/bin/false")
        assert result.returncode == 2
        assert result.stderr == f"error: {message}\n" and result.stdout == ""


@pytest.mark.parametrize(("script", "module"), [("sglang_h200_moe.sh", "sglang"), ("vllm_h200_moe.sh", "vllm")])
def test_launch_needs_the_framework(script: str, module: str, model: Path, tmp_path: Path) -> None:
    """Without --dry-run the script checks the interpreter before it execs anything."""
    bin_dir = recipe_gpus(tmp_path, script)
    fake_python = bin_dir / "python-without-frameworks"
    fake_python.write_text(f'#!/bin/sh\ncase "$2" in "import {module}") exit 1;; esac\necho "ran: $*"\n')
    fake_python.chmod(0o755)
    result = run(script, "--model", str(model), bin_dir=bin_dir, PYTHON=str(fake_python))
    assert result.returncode == 1
    assert f"error: '{fake_python}' cannot import {module}; install it or set PYTHON" in result.stderr
    assert "ran:" not in result.stdout


@pytest.mark.parametrize(
    ("script", "entry"),
    [("sglang_h200_moe.sh", "sglang.launch_server"), ("vllm_h200_moe.sh", "vllm.entrypoints.cli.main")],
)
def test_launch_shows_settings_then_execs_the_server(
    rng: random.Random, script: str, entry: str, model: Path, tmp_path: Path
) -> None:
    bin_dir = recipe_gpus(tmp_path, script)
    fake_python = bin_dir / "python"
    fake_python.write_text('#!/bin/sh\necho "ran: $* combine=$SGLANG_MORI_COMBINE_DTYPE pid=$$"\n')
    fake_python.chmod(0o755)
    dtype = rng.choice(COMBINE)
    result = run(script, "--model", str(model), "--combine-dtype", dtype, bin_dir=bin_dir, PYTHON=str(fake_python))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ran: -m mori_sglang.env combine={dtype}")
    assert lines[1].startswith(f"ran: -m {entry} ") and f"combine={dtype}" in lines[1]
    assert len(lines) == 2


@pytest.mark.parametrize("script", SCRIPTS)
def test_server_args_that_agree_with_the_recipe_pass(script: str, model: Path, tmp_path: Path) -> None:
    """Repeating a switch or a value the recipe sets contradicts nothing."""
    extra = ["--trust-remote-code", "--port", "31234", "--enable-expert-parallel", "--max-running-requests", "4"]
    if script in SGLANG:
        extra[-2:-2] = ["--moe-a2a-backend", "mori", "--attn-dp-size", "8"]
    result = run(
        script, "--model", str(model), "--port", "31234", "--dry-run", "--", *extra,
        bin_dir=recipe_gpus(tmp_path, script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert parse_dry_run(result.stdout)[1][-len(extra) :] == extra


# Each option's choices are the values of the variable it exports, as mori_sglang/env.py lists them.
OPTION_VARIABLES = {
    "--combine-dtype": "SGLANG_MORI_COMBINE_DTYPE",
    "--dispatch-dtype": "SGLANG_MORI_DISPATCH_DTYPE",
    "--provider": "SGLANG_MORI_BACKEND",
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_options_accept_the_values_of_the_variables_they_set(script: str) -> None:
    """One vocabulary: the help lists, for each option, the accepted values of the variable it exports."""
    usage = run(script, "--help").stdout.splitlines()
    for option, variable in OPTION_VARIABLES.items():
        (line,) = (line for line in usage if line.lstrip().startswith(option + " "))
        listed = re.split("[:(]", line.split(maxsplit=2)[2])[0]  # the values, before ': VARIABLE (default: ..)'
        assert tuple(listed.split()) == env.ENV_BY_NAME[variable].choices, (option, line)


def test_the_choices_are_read_from_the_table_of_the_scripts_checkout(model: Path, tmp_path: Path) -> None:
    """A checkout whose table has one dispatch format and one provider more (and no torch, no installed
    mori_sglang: the system python3) accepts them, and its help lists them; this checkout refuses them."""
    checkout = tmp_path / "checkout"
    shutil.copytree(LAUNCH, checkout / "launch")
    package = checkout / "mori_sglang"
    package.mkdir()
    source = LAUNCH.parent / "mori_sglang"
    for name in ("__init__.py", "env.py", "wire_formats.py"):
        shutil.copy(source / name, package / name)
    table = (package / "wire_formats.py").read_text()
    rows = "DISPATCH_FORMATS: tuple[DispatchFormat, ...] = (\n"
    assert rows in table
    (package / "wire_formats.py").write_text(
        table.replace(rows, rows + '    DispatchFormat("nvfp4", 4, 16, 1, 2, 9, NO_FP8),\n')
    )
    providers = '("auto", "mori", "triton", "torch")'
    variables = (package / "env.py").read_text()
    assert providers in variables
    (package / "env.py").write_text(variables.replace(providers, providers[:-1] + ', "nccl")'))
    args = ("--model", str(model), "--dispatch-dtype", "nvfp4", "--provider", "nccl", "--dry-run")
    bin_dir = recipe_gpus(tmp_path, "sglang_h200_moe.sh")
    done = subprocess.run(
        ["bash", str(checkout / "launch" / "sglang_h200_moe.sh"), *args],
        env={"PATH": f"{bin_dir}:{system_path()}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    exports = parse_dry_run(done.stdout)[0]
    assert (exports["SGLANG_MORI_DISPATCH_DTYPE"], exports["SGLANG_MORI_BACKEND"]) == ("nvfp4", "nccl")
    result = run("sglang_h200_moe.sh", *args, bin_dir=bin_dir)
    assert result.returncode == 2
    assert "--dispatch-dtype 'nvfp4' is not accepted; use one of: auto bf16 fp8 mxfp8 fp4" in result.stderr


def test_the_scripts_need_python3_to_read_the_choices(model: Path, tmp_path: Path) -> None:
    bin_dir = recipe_gpus(tmp_path, "vllm_h200_moe.sh")
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    result = run("vllm_h200_moe.sh", "--model", str(model), "--dry-run", bin_dir=bin_dir)
    assert result.returncode == 1 and result.stdout == ""
    assert "error: python3 on PATH cannot read the accepted values from " in result.stderr
    assert result.stderr.rstrip().endswith("/mori_sglang/env.py")


def test_the_token_bound_is_the_env_tables() -> None:
    """The scripts refuse --max-dispatch-tokens past what SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK accepts."""
    from mori_sglang import env

    text = (LAUNCH / "common.sh").read_text()
    assert f"MAX_TOKENS_PER_RANK={env.MAX_TOKENS_PER_RANK}\n" in text
