"""``python -m mori_sglang.roundtrip``: the README's round-trip table, run at toy sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mori_sglang import roundtrip

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--world", "2", "--tokens", "3", "--hidden", "256", "--experts", "16", "--topk", "4", "--device", "cpu"]
# At hidden 256: bf16 512 B; fp8 / mxfp8 256 B + a 128 B scale stride; fp4 128 B + 128 B; blockwise combine
# 256 B + 2 f32 scales (ours, blocks of 128) or 52 (MoRI's, blocks of ceil(256 / 56) = 5).
ROWS = [
    ("bf16", "bf16", 512, 512),
    ("fp8", "bf16", 384, 512),
    ("mxfp8", "bf16", 384, 512),
    ("fp4", "bf16", 256, 512),
    ("bf16", "fp8_blockwise", 512, 264),
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
    assert 0 < err["bf16", "fp8_blockwise"] < 2.0**-4
    for combine in ("fp8_blockwise_native", "fp8_direct_cast"):
        if wide_range:
            assert err["bf16", "fp8_blockwise"] < err["bf16", combine]
        else:
            assert 0 < err["bf16", combine] < 2.0**-4
    for key, value in err_bf16.items():
        assert value >= 0 and (value > 0) == (key != ("bf16", "bf16"))


def test_cli_prints_the_table(tmp_path: Path) -> None:
    out_json = tmp_path / "table.json"
    cmd = [sys.executable, "-m", "mori_sglang.roundtrip", *TINY, "--iters", "2", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    assert "loopback world of 2 ranks on cpu" in proc.stdout
    rows = parse_table(proc.stdout)
    check_rows(rows)
    saved = json.loads(out_json.read_text())
    assert saved["settings"]["world"] == 2 and saved["settings"]["iters"] == 2
    assert [(r["dispatch"], r["combine"], r["dispatch_bytes"], r["combine_bytes"]) for r in saved["rows"]] == ROWS


@pytest.mark.parametrize("mode", ["low_latency", "split"])
def test_every_mode_round_trips(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    roundtrip.main(
        [*TINY, "--mode", mode, "--iters", "1", "--warmup", "0", "--input", "lognormal", "--provider", "torch"]
    )
    check_rows(parse_table(capsys.readouterr().out), wide_range=True)


def test_cpu_defaults() -> None:
    args = roundtrip.parse_args(["--device", "cpu"])
    assert (args.world, args.tokens, args.iters, args.hidden, args.experts, args.topk) == (4, 32, 3, 7168, 256, 8)


def test_bad_iters_is_refused() -> None:
    with pytest.raises(SystemExit):
        roundtrip.parse_args(["--device", "cpu", "--iters", "0"])
