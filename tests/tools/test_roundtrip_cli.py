"""``python -m mori_sglang.roundtrip``: the README's round-trip table, run at toy sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mori_sglang import roundtrip
from tests.helpers import kernels_interpreted_here, skip_without_working_interpreter

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--world", "2", "--tokens", "3", "--hidden", "256", "--experts", "16", "--topk", "4", "--device", "cpu"]
# At hidden 256: bf16 512 B; fp8 / mxfp8 256 B + a 128 B scale stride; fp4 128 B + 128 B; blockwise combine
# 256 B + 2 f32 scales (ours, blocks of 128) or 52 (MoRI's, blocks of ceil(256 / 56) = 5).
ROWS = [
    ("bf16", "bf16", 512, 512),
    ("fp8", "bf16", 384, 512),
    ("mxfp8", "bf16", 384, 512),
    ("fp4", "bf16", 256, 512),
    ("bf16", "fp8", 512, 264),
    ("bf16", "fp8_blockwise_native", 512, 464),
    ("bf16", "fp8_direct_cast", 512, 256),
]


def parse_table(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(roundtrip.COLUMNS)
    assert set(lines[1].replace("|", "").split()) == {"---"}
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def check_rows(rows: list[list[str]], wide_range: bool = False) -> None:
    """Row order and sizes exactly; errors within what each format can do.

    Per element, e4m3 is off by at most 2^-4 of the value once scaled into range, e2m1 by 2^-2 (plus
    saturation at 6 of the MX scale's [4, 8) range). With ``wide_range`` (lognormal tokens) small values
    fall under e4m3's normals unless a block scale lifts them: blockwise must then beat native and cast.
    """
    assert [(r[0], r[1], int(r[4]), int(r[5])) for r in rows] == ROWS
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0
    err = {(r[0], r[1]): float(r[6]) for r in rows}
    err_bf16 = {(r[0], r[1]): float(r[7]) for r in rows}
    assert err_bf16["bf16", "bf16"] == 0.0
    assert err["bf16", "bf16"] <= 2.0**-8  # one bf16 rounding of an exact f32 sum
    assert 0 < err["fp8", "bf16"] < 2.0**-4 and 0 < err["mxfp8", "bf16"] < 2.0**-3
    assert 0 < err["fp4", "bf16"] < 0.35
    assert 0 < err["bf16", "fp8"] < 2.0**-4
    for combine in ("fp8_blockwise_native", "fp8_direct_cast"):
        if wide_range:
            assert err["bf16", "fp8"] < err["bf16", combine]
        else:
            assert 0 < err["bf16", combine] < 2.0**-4
    for key, value in err_bf16.items():
        assert value >= 0 and (value > 0) == (key != ("bf16", "bf16"))


def run_cli(*args: str, interpret: bool = False) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: TRITON_INTERPRET unset unless ``interpret``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "mori_sglang.roundtrip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env, timeout=300)


def test_cli_prints_the_table_and_its_legend(tmp_path: Path) -> None:
    out_json = tmp_path / "table.json"
    proc = run_cli(*TINY, "--provider", "torch", "--input", "normal", "--iters", "2", "--json", str(out_json))
    assert proc.stdout.startswith("loopback world of 2 ranks on cpu")
    assert "normal input" in proc.stdout and "provider torch (" in proc.stdout
    rows = parse_table(proc.stdout)
    check_rows(rows)
    legend = proc.stdout.split("\n\n")[-1]
    assert legend.strip() == roundtrip.LEGEND
    for column in ("dispatch, combine:", "dispatch ms, combine ms:", "B/token/dest:", "rel err vs f32:"):
        assert column in legend
    assert "[7/7] dispatch bf16, combine fp8_direct_cast:" in proc.stderr  # progress, off the table's stream
    saved = json.loads(out_json.read_text())
    assert saved["settings"]["world"] == 2 and saved["settings"]["iters"] == 2
    assert saved["settings"]["provider"] == "torch"
    assert [(r["dispatch"], r["combine"], r["dispatch_bytes"], r["combine_bytes"]) for r in saved["rows"]] == ROWS


def test_cpu_runs_the_triton_kernels_in_the_interpreter_with_exact_casts(tmp_path: Path) -> None:
    """By default on a CPU the table comes from our kernels in Triton's interpreter, which the command
    enables itself; with the exact casts installed their errors equal the torch provider's (the wire
    bytes are bit-identical), where the interpreter's own casts would report about twice as much."""
    skip_without_working_interpreter()
    tables = {}
    for provider in ("auto", "torch"):
        out_json = tmp_path / f"{provider}.json"
        proc = run_cli(*TINY, "--provider", provider, "--iters", "1", "--warmup", "0", "--json", str(out_json))
        tables[provider] = json.loads(out_json.read_text())
        if provider == "auto":
            assert (
                "provider triton (our Triton kernels in Triton's CPU interpreter, with exact float casts" in proc.stdout
            )
            assert tables[provider]["settings"]["provider"] == "triton"
    errors = {p: [(r["rel_err_f32"], r["rel_err_bf16"]) for r in t["rows"]] for p, t in tables.items()}
    assert errors["auto"] == errors["torch"]


def test_default_input_is_heavy_tailed(capsys: pytest.CaptureFixture[str]) -> None:
    """Outliers past e4m3's range: the direct cast saturates them, a per-block scale keeps them."""
    roundtrip.main([*TINY, "--provider", "torch", "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "lognormal input" in out
    err = {(r[0], r[1]): float(r[6]) for r in parse_table(out)}
    assert err["bf16", "fp8_direct_cast"] > 10 * err["bf16", "fp8"]


@pytest.mark.parametrize("mode", ["low_latency", "split"])
def test_every_mode_round_trips(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    roundtrip.main(
        [*TINY, "--mode", mode, "--iters", "1", "--warmup", "0", "--input", "lognormal", "--provider", "torch"]
    )
    out = capsys.readouterr().out
    assert f", mode {mode}, provider torch" in out.splitlines()[0]  # the mode asked for is the one run
    check_rows(parse_table(out), wide_range=True)


@kernels_interpreted_here
def test_cpu_defaults() -> None:
    args = roundtrip.parse_args(["--device", "cpu", "--provider", "torch"])
    assert (args.world, args.tokens, args.iters, args.hidden, args.experts, args.topk) == (4, 16, 3, 1024, 256, 8)
    args = roundtrip.parse_args(["--device", "cpu", "--provider", "triton"])
    assert (args.world, args.tokens, args.iters, args.warmup, args.hidden) == (4, 16, 1, 0, 1024)
    assert args.input == "lognormal"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--iters", "0"], "argument --iters: 0 is below 1"),
        (["--world", "0"], "argument --world/--world-size: 0 is below 1"),
        (["--hidden", "7"], "hidden=7: fp4 dispatch packs two elements per byte, so hidden must be even"),
        (["--topk", "300"], "topk=300 must be in [1, num_experts=256]"),
        (["--world", "3"], "num_experts=256 must be a positive multiple of world_size=3"),
    ],
)
def test_bad_arguments_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        roundtrip.parse_args(["--device", "cpu", "--provider", "torch", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m mori_sglang.roundtrip: error: {message}"


@kernels_interpreted_here
def test_a_size_only_the_torch_provider_moves_is_a_usage_error_for_triton(capsys: pytest.CaptureFixture[str]) -> None:
    roundtrip.parse_args(["--device", "cpu", "--provider", "torch", "--hidden", "6"])
    with pytest.raises(SystemExit) as exit_info:
        roundtrip.parse_args(["--device", "cpu", "--provider", "triton", "--hidden", "6"])
    assert exit_info.value.code == 2
    assert "hidden=6: the triton provider moves fp8 tokens in 4-byte words" in capsys.readouterr().err
