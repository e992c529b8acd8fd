"""The launch-cost probe: its kernels run and store what they say (so a row times a real launch), and
the CLI prints one row per path and argument count beside torch's own launch."""

from __future__ import annotations

import os

import pytest
import torch

from mori_sglang import cli
from mori_sglang.kernels.probes import (
    idle_probe_kernel,
    launch_probe_kernel,
    launch_probe_wide_kernel,
    send_end_probe_kernel,
)
from mori_sglang.tools import launch_cost

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the launch probes are Triton kernels: needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_the_probes_store_their_word() -> None:
    out = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)  # poison
    launch_probe_kernel[(1,)](out)
    assert out.item() == 1
    values = [int(v) for v in torch.randint(-1000, 1000, (launch_cost.WIDE_ARGUMENTS,))]
    launch_probe_wide_kernel[(1,)](out, *values)
    assert out.item() == sum(values)
    out.fill_(-7)
    idle_probe_kernel[(3,)](out, -1, PDL=False)  # no program stores
    assert out.item() == -7
    idle_probe_kernel[(3,)](out, 2, PDL=False)  # the store the compiler cannot drop is real
    assert out.item() == 1


def test_the_send_end_probe_publishes_like_a_send_and_leaves_its_ticket_at_zero() -> None:
    """Every launch: the counter of tickets back to 0, the round one further, this rank's counts in
    every rank's words and its arrival one higher there (the words start poisoned)."""
    kernel, args, _buffers = launch_cost._floor_probe("dispatch send's end", DEVICE)
    assert kernel is send_end_probe_kernel
    ranks = launch_cost.SIGNALLED_RANKS
    words = _buffers[0]
    words.fill_(-5)
    args = {**args, "rank": 3, "send_counts_ptr": torch.randint(0, 100, (ranks,), device=DEVICE)}
    for launched in (1, 2):
        send_end_probe_kernel[(3,)](**args, PDL=False)
        assert args["tickets_ptr"].item() == 0
        assert args["round_ptr"][0].item() == launched
        assert torch.equal(words[:, 3], args["send_counts_ptr"])
        assert torch.equal(words[:, ranks + 3], torch.full((ranks,), -5 + launched, device=DEVICE))
    others = [r for r in range(ranks) if r != 3]
    assert (words[:, others] == -5).all() and (words[:, [ranks + r for r in others]] == -5).all()


def test_cli_prints_every_path_for_both_kernels(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    rows = launch_cost.main(["--iters", "2", "--device", DEVICE.type, "--json", str(tmp_path / "rows.json")])
    paths = ["Triton JIT (kernel[grid](...))", "BoundLaunch, fixed arguments", "BoundLaunch, one tensor per launch"]
    if DEVICE.type == "cuda":
        paths += ["compiled kernel's launcher, prepared arguments", "C launcher, prepared arguments"]
    want = [("torch (in-place add)", 1)] + [(p, 1) for p in paths] + [(p, 21) for p in paths]
    assert [(r.path, r.runtime_arguments) for r in rows] == want
    assert all(r.host_us > 0 for r in rows) and rows[0].ratio_to_torch == 1.0
    printed = capsys.readouterr().out
    assert all(f"| {r.path} | {r.runtime_arguments} | {r.host_us:.2f} |" in printed for r in rows)
    assert (tmp_path / "rows.json").read_text().count('"path"') == len(rows)
    assert ("device cost of an idle kernel" in printed) == (DEVICE.type == "cuda")
    if DEVICE.type != "cuda":  # no device runs ahead of the calls: neither kept busy nor not
        assert all(r.device_kept_busy is None for r in rows)
        lines = printed.splitlines()
        assert all(
            f"| {r.path} | {r.runtime_arguments} | {r.host_us:.2f} | {r.ratio_to_torch:.2f} | no device |" in lines
            for r in rows
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph replay needs a GPU")
def test_the_device_floor_covers_every_grid_and_launch_mode() -> None:
    rows = launch_cost.measure_device_floor(DEVICE, replays=3)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    grids = [1, sms, *(per_sm * sms for per_sm in launch_cost.PROGRAMS_PER_SM)]
    modes = sorted({r.programmatic_launch for r in rows})
    want = [(k, g, m) for k in launch_cost.FLOOR_KERNELS for m in modes for g in grids]
    assert [(r.kernel, r.programs, r.programmatic_launch) for r in rows] == want
    assert all(r.device_us > 0 for r in rows)


def test_the_floor_table_has_a_row_per_grid_and_mode() -> None:
    rows = [launch_cost.DeviceFloor("idle", 1, False, 2.214), launch_cost.DeviceFloor("idle", 6336, True, 4.88)]
    assert launch_cost.floor_markdown(rows).splitlines()[2:] == [
        "| idle | 1 | no | 2.21 |",
        "| idle | 6336 | yes | 4.88 |",
    ]


def test_on_a_cpu_without_the_interpreter_the_cli_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli, "interpreting", lambda: False)
    with pytest.raises(cli.SetupError, match="TRITON_INTERPRET=1"):
        launch_cost.main(["--device", "cpu", "--iters", "1"])
