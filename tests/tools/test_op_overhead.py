"""The op-overhead tool: it times each call of a real step's host path with launches as no-ops, counts
those launches per call, prints a row per call and the step, and leaves launches real afterwards."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mori_sglang.kernels.launch import BoundLaunch
from mori_sglang.tools import op_overhead

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="binds the Triton provider's launches: needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = ["--world", "2", "--tokens", "5", "--hidden", "128", "--experts", "4", "--topk", "2", "--device", DEVICE]
FORMATS = [
    "--dispatch-dtype",
    "FP8",
    "--combine-dtype",
    "fp8",
]  # the env names, in any case, as every command takes them


@pytest.mark.parametrize("mode", ["intranode", "low_latency"])
def test_every_call_is_timed_with_its_launch_counted(mode: str, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    call = BoundLaunch.__call__
    out = tmp_path / "report.json"
    timing = ["--steps", "20", "--repeats", "2", "--iters", "3", "--rounds", "2"]
    report = op_overhead.main([*SMALL, *FORMATS, "--mode", mode, *timing, "--json", str(out)])
    assert BoundLaunch.__call__ is call and BoundLaunch.direct_launches  # launches are real and direct again
    rows = report.rows
    assert [r.phase for r in rows] == ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]
    assert [r.launches for r in rows] == [1, 1, 1, 1]  # one kernel per rank and call at this batch size
    assert all(r.python_us > 0 for r in rows)
    printed = capsys.readouterr().out
    if DEVICE == "cpu":  # launches are not timed in the interpreter
        assert report.rounds is None
        assert all(r.host_us is None and r.launch_us is None for r in rows)
        assert all(f"| {r.phase} | {r.python_us:.2f} | 1 | - | - | - | - | - |" in printed for r in rows)
    else:
        assert len(report.rounds.direct_us) == len(report.rounds.wrapper_us) == 2
        assert all(r.host_us > r.python_us and r.wrapper_host_us > r.python_us for r in rows)
        assert "direct minus Triton's launcher, round by round" in printed
    assert f"| step | {sum(r.python_us for r in rows):.2f} | 4 |" in printed
    assert f"hidden 128, fp8 dispatch, fp8 combine, {mode};" in printed
    assert [r["phase"] for r in json.loads(out.read_text())["rows"]] == [r.phase for r in rows]


def test_the_table_sums_the_step_and_compares_the_paths_round_by_round() -> None:
    rows = [
        op_overhead.OpOverhead(phase, python, 1.0, host, wrapper)
        for phase, python, host, wrapper in [("a", 2.0, 12.0, 15.0), ("b", 1.0, 9.0, 10.0), ("c", 1.0, 11.0, 11.0)]
    ]
    rounds = op_overhead.Rounds(direct_us=[32.0, 30.0, 40.0], wrapper_us=[36.0, 31.0, 38.0], torch_launch_us=[8, 10, 9])
    lines = op_overhead.markdown(op_overhead.Report(rows, rounds)).splitlines()
    assert "| a | 2.00 | 1 | 12.00 | 15.00 | 0.80 | 10.00 | 1.33 |" in lines  # 12 µs in 9 µs torch launches
    assert "| step | 4.00 | 3 | 32.00 | 36.00 | 0.89 | 9.33 | 3.56 |" in lines  # medians of the rounds' steps
    assert "one torch launch (in-place add): 9.00 µs, median of 3 rounds (8.00-10.00)" in lines
    assert (
        "direct minus Triton's launcher, round by round: median -1.00 µs, lower in 2 of 3 rounds; "
        "device kept busy: yes" in lines
    )
    rounds.device_kept_busy = False
    assert "device kept busy: no" in op_overhead.markdown(op_overhead.Report(rows, rounds))
    assert lines[-1].endswith(": 32.0 / 36.0 / 8.0, 30.0 / 31.0 / 10.0, 40.0 / 38.0 / 9.0")
    untimed = op_overhead.markdown(op_overhead.Report([op_overhead.OpOverhead("a", 2.0, 0.5)], None))
    assert untimed.splitlines()[-1] == "| step | 2.00 | 0.5 | - | - | - | - | - |"


def test_stubbed_launches_count_and_launch_nothing() -> None:
    class Kernel:
        arg_names = ("out_ptr",)
        __name__ = "kernel"

    bound = BoundLaunch(Kernel(), torch.device("cpu"), (1,), {}, {}, variable=("out_ptr",))
    with op_overhead.launches_stubbed():
        bound(torch.zeros(1))  # Kernel cannot launch: a real launch would raise
        bound(torch.zeros(1))
    assert bound.launches == 2
    with pytest.raises(TypeError):
        bound(torch.zeros(1))


def test_a_config_the_op_refuses_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        op_overhead.main([*SMALL, "--topk", "9"])  # more than the 4 experts
    assert "topk" in capsys.readouterr().err
