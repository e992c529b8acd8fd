"""The shared argument types: one vocabulary of formats (the env names, long combine names as
aliases), devices, ports and bounds, each refusing with a message argparse prints on one line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from mori_sglang import cli
from mori_sglang.config import COMBINE_ENV_VALUES, DISPATCH_ENV_VALUES, CombineDtype, DispatchDtype, Mode, Provider
from mori_sglang.env import ENV_BY_NAME
from mori_sglang.tools import bench
from mori_sglang.tools.workload import add_workload_args, workload_configs


def test_formats_take_the_env_names_and_the_long_names() -> None:
    env_combine = [v for v in ENV_BY_NAME["SGLANG_MORI_COMBINE_DTYPE"].choices if v != "auto"]
    env_dispatch = [v for v in ENV_BY_NAME["SGLANG_MORI_DISPATCH_DTYPE"].choices if v != "auto"]
    assert [cli.combine_dtype(name) for name in env_combine] == [COMBINE_ENV_VALUES[n] for n in env_combine]
    assert [cli.dispatch_dtype(name) for name in env_dispatch] == [DISPATCH_ENV_VALUES[n] for n in env_dispatch]
    for dtype in CombineDtype:
        assert cli.combine_dtype(dtype.value) is dtype  # the long names stay as aliases
        assert cli.combine_dtype(cli.combine_name(dtype)) is dtype
    assert cli.combine_name(CombineDtype.FP8_BLOCKWISE) == "fp8"
    assert cli.combine_name(CombineDtype.FP8_BLOCKWISE_NATIVE) == "fp8_blockwise_native"
    assert cli.combine_dtype(" FP8 ") is CombineDtype.FP8_BLOCKWISE
    assert cli.dispatch_dtype("MXFP8") is DispatchDtype.MXFP8
    with pytest.raises(argparse.ArgumentTypeError, match="'fp9' is not a combine format; use bf16, fp8, "):
        cli.combine_dtype("fp9")
    with pytest.raises(argparse.ArgumentTypeError, match="'fp8_blockwise' is not a dispatch format"):
        cli.dispatch_dtype("fp8_blockwise")


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("65535", 65535)])
def test_ports(text: str, value: int) -> None:
    assert cli.port(text) == value


@pytest.mark.parametrize(("text", "message"), [("0", "0 is below 1"), ("65536", "not a TCP port"), ("x", "'x'")])
def test_bad_ports(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        cli.port(text)


def test_bounds_and_devices() -> None:
    assert cli.positive_int("3") == 3 and cli.non_negative_int("0") == 0
    assert cli.at_least(0.5, float)("0.75") == 0.75
    with pytest.raises(argparse.ArgumentTypeError, match="-1 is below 0"):
        cli.non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'2\.5' is not a number"):
        cli.positive_int("2.5")
    for name in ("auto", "cpu", "cuda", "cuda:3"):
        assert cli.device_name(name) == name
    for name in ("gpu", "cuda:", "cuda:x", "CPU"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a device; use auto, cpu, cuda or cuda:N"):
            cli.device_name(name)
    assert cli.resolve_device("cpu") == torch.device("cpu")
    assert cli.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_gpu_comes_with_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's stream query takes a device index: ``cuda`` and ``auto`` name the current GPU by it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert cli.resolve_device("cuda") == torch.device("cuda", 2)
    assert cli.resolve_device("auto") == torch.device("cuda", 2)
    assert cli.resolve_device("cuda:3") == torch.device("cuda", 3)
    with pytest.raises(cli.SetupError, match="--device cuda:4: this machine has 4 GPU"):
        cli.resolve_device("cuda:4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a GPU this machine lacks")
def test_a_gpu_torch_does_not_see_is_a_setup_error() -> None:
    with pytest.raises(cli.SetupError, match="--device cuda:1: this torch sees no GPU; use --device cpu or auto"):
        cli.resolve_device("cuda:1")


def test_run_reports_a_configuration_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def main(argv: object) -> None:
        raise cli.SetupError("--device cuda: this torch sees no GPU")

    with pytest.raises(SystemExit) as exit_info:
        cli.run(main, "python -m tool")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "python -m tool: error: --device cuda: this torch sees no GPU\n"
    with pytest.raises(SystemExit) as exit_info:
        cli.run(lambda argv: [1, 2], "python -m tool")  # a main that returns its rows succeeds
    assert exit_info.value.code == 0
    with pytest.raises(ZeroDivisionError):  # a bug of ours keeps its traceback
        cli.run(lambda argv: 1 / 0, "python -m tool")


def test_the_benchmarks_default_workload_builds_every_point() -> None:
    """``bench``, ``tune`` and ``bench_dist`` without format flags: argparse hands a list default to the
    program unparsed, so the defaults must already be formats."""
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    points = workload_configs(parser.parse_args([]), world_size=8, rank=0, provider=Provider.TORCH)
    combines = [CombineDtype.BF16, CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_DIRECT_CAST]
    assert [(c.mode, tokens, c.combine_dtype) for c, tokens in points] == [
        (mode, tokens, combine)
        for mode in (Mode.INTRANODE, Mode.LOW_LATENCY)
        for tokens in (128, 4096)
        for combine in combines
    ]
    assert {c.dispatch_dtype for c, _ in points} == {DispatchDtype.FP8}


def test_output_files_are_checked_before_the_run(tmp_path: Path) -> None:
    """``--json`` / ``--plot`` that cannot be written fail while the arguments are parsed, not after a run."""
    assert cli.output_file(str(tmp_path / "rows.json")) == str(tmp_path / "rows.json")
    assert cli.output_file("rows.json") == "rows.json"  # the working folder
    with pytest.raises(argparse.ArgumentTypeError, match=r"folder .*missing does not exist"):
        cli.output_file(str(tmp_path / "missing" / "rows.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; name a file"):
        cli.output_file(str(tmp_path))


@pytest.mark.parametrize("command", ["roundtrip", "tools.bench", "tools.tune", "tools.bandwidth", "tools.launch_cost",
                                     "tools.op_overhead", "tools.bench_dist"])  # fmt: skip
def test_every_commands_json_is_checked_while_parsing(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"mori_sglang.{command}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--json", str(tmp_path / "missing" / "rows.json")])
    assert exit_info.value.code == 2
    assert "--json: " in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed here")
def test_bench_plot_without_matplotlib_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--plot", str(tmp_path / "bars.png")])
    assert exit_info.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
