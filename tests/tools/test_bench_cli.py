"""The benchmark CLIs run end to end on a CPU: the loopback bench (torch and, through Triton's
interpreter, triton providers) and the distributed bench under torchrun over gloo."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import kernels_interpreted_here, skip_without_working_interpreter

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "256", "--experts", "8", "--topk", "2", "--iters", "2", "--combine-dtype", "bf16", "fp8_blockwise"]


def _run(args: list[str], tmp_path: Path, runs_kernels: bool = True) -> subprocess.CompletedProcess[str]:
    """The command on a CPU (a GPU this machine has is hidden from it), the kernels in the interpreter;
    skipped where that interpreter cannot run them and the command would (``runs_kernels``)."""
    if runs_kernels:
        skip_without_working_interpreter()
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_loopback_bench_prints_triton_rows_beside_the_torch_baseline(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _run(
        [sys.executable, "-m", "mori_sglang.tools.bench", "--world", "2", "--tokens", "4", "--mode", "low_latency",
         "--dispatch-dtype", "fp8", "--json", str(out), *SMALL],
        tmp_path,
    )  # fmt: skip
    text = done.stdout
    assert "copy roofline" in text
    progress = [line.split(":")[0] for line in done.stderr.splitlines() if line.startswith("[")]
    assert progress == ["[1/2] low_latency, 4 tokens, combine bf16", "[2/2] low_latency, 4 tokens, combine fp8"]
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["triton", "torch", "triton", "torch"]
    assert [r[4] for r in rows] == ["bf16", "bf16", "fp8", "fp8"]  # the env name of the long name asked for
    assert all(float(r[5]) > 0 and float(r[6]) > 0 for r in rows)
    assert [r[16:] for r in rows] == [["-"] * 3] * 4  # no CUDA graph of the step or its copy floor on a CPU
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 4 and data["copy_gbs"] > 0
    assert all(r["step_graph_us"] is None and r["copy_floor_us"] is None for r in data["rows"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the step is replayed from a CUDA graph)")
def test_bench_times_the_whole_step_in_one_graph_beside_its_phases() -> None:
    """On a GPU each triton row also replays the whole step, and its copy floor, from one graph each (the
    torch baseline runs eagerly, so it has neither); the bench checks every received row after the
    replays."""
    from mori_sglang.tools import bench

    rows = bench.main(["--world", "2", "--tokens", "4", "--mode", "low_latency", "--device", "cuda", *SMALL])
    assert [r.provider for r in rows] == ["triton", "torch"] * 2
    for row in rows:
        if row.provider == "triton":
            for us in (row.step_graph_us, row.copy_floor_us):
                assert us is not None and math.isfinite(us) and us > 0
        else:
            assert row.step_graph_us is None and row.copy_floor_us is None


def test_bench_table_gives_the_step_over_its_copy_floor() -> None:
    """The graph table's last columns: the step's graph µs, its copy floor's, and their ratio."""
    from mori_sglang.tools import bench

    row = bench.Row("triton", "low_latency", 128, 128, "fp8", "bf16", *[1.0] * 13, step_graph_us=250.0)
    row.copy_floor_us = 137.5
    cells = _table_rows(bench.markdown([row], {}, 4000.0))[0]
    assert cells[-3:] == ["250.0", "137.5", "1.82"]
    row.copy_floor_us = None
    assert _table_rows(bench.markdown([row], {}, 4000.0))[0][-3:] == ["250.0", "-", "-"]


def test_copy_floor_that_does_not_fit_is_left_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device without memory for the copy floor's buffers beside the step's gets no floor ("-" in the
    table) and a line saying why, not a failed benchmark."""
    from mori_sglang.tools import bench

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(bench, "CopyFloorStep", out_of_memory)
    assert bench._copy_floor_us([2**30, 2**30, 0, 0], 8, torch.device("cpu"), 2) is None
    assert "copy floor not measured: its 2.0 GiB of buffers do not fit" in capsys.readouterr().err


def test_eager_bench_reports_host_time_per_rank_and_phase(tmp_path: Path) -> None:
    """``--eager`` adds a table of steps launched from Python; on a CPU only the host column has values,
    and no device was kept busy (there is none)."""
    out = tmp_path / "bench.json"
    text = _run(
        [sys.executable, "-m", "mori_sglang.tools.bench", "--world", "2", "--tokens", "4", "--mode", "intranode",
         "--no-baseline", "--eager", "--json", str(out), *SMALL[:-1]],
        tmp_path,
    ).stdout  # fmt: skip
    eager = text[text.index("eager steps, per rank") :]
    rows = _table_rows(eager[eager.index("| provider") :])
    assert [(r[0], r[1], r[4]) for r in rows] == [("triton", "intranode", "bf16")]
    host = [float(cell) for cell in rows[0][5:10]]
    assert all(h > 0 for h in host) and abs(sum(host[:4]) - host[4]) < 0.2
    assert rows[0][10:15] == ["-"] * 5  # no device time on a CPU
    assert rows[0][28] == "no device"
    torch_launch, in_launches = float(rows[0][26]), float(rows[0][27])
    assert torch_launch > 0 and in_launches > 0
    eager_json = json.loads(out.read_text())["rows"][0]["eager"]
    assert len(eager_json["host_us"]) == 4 and eager_json["launches"] is None
    assert eager_json["torch_launch_us"] == pytest.approx(torch_launch, abs=0.005)
    assert eager_json["host_in_torch_launches"] == pytest.approx(in_launches, abs=0.05)
    assert eager_json["device_kept_busy"] is None


def test_eager_step_is_counted_in_the_torch_launches_of_its_own_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch launches an eager step is measured in run as one more phase of every iteration, and the
    step's size in them is the median of each iteration's own ratio, not the ratio of the two medians,
    which may come from iterations the host ran at different speeds."""
    from mori_sglang.tools import bench

    world, fractions = 2, [0.4, 0.3, 0.2, 0.1]  # each call's share of a step
    step_us = [10, 4, 4, 10, 10]  # per rank, each iteration
    launch_us = [2, 1, 1, 1, 2]  # one torch launch, each iteration: ratios 5, 4, 4, 10, 5
    added = []

    def time_eager(phases, device, iters):
        assert iters == len(step_us) and len(phases) == 5  # the step's four calls, then the reference
        real_add = torch.Tensor.add_
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "add_", lambda t, *a: added.append(1) or real_add(t, *a))
            phases[-1]()
        host = [[f * world * s * 1e-6 for s in step_us] for f in fractions]
        host.append([bench.STEP_TORCH_LAUNCHES * t * 1e-6 for t in launch_us])
        return host, [[1e-6] * iters for _ in phases], True

    calls = [0, 0, 0, 0]
    phases = [lambda i=i: calls.__setitem__(i, calls[i] + 1) for i in range(4)]
    monkeypatch.setattr(bench, "time_eager", time_eager)
    row = bench._eager_row(phases, torch.device("cpu"), len(step_us), world, None)
    assert calls == [1, 1, 1, 1]  # each call warmed up once, outside the timing
    assert len(added) == bench.STEP_TORCH_LAUNCHES
    assert row.host_us == pytest.approx([4.0, 3.0, 2.0, 1.0])  # medians per call and rank
    assert row.torch_launch_us == pytest.approx(1.0)
    assert row.host_in_torch_launches == pytest.approx(5.0)  # the ratio of the medians would be 10
    assert row.device_us == pytest.approx([0.5] * 4) and row.device_kept_busy is True


@kernels_interpreted_here
@pytest.mark.parametrize(
    ("phase_bytes", "world", "block"), [([4096, 1000, 8, 77777], 2, 4096), ([2**17, 3, 512, 2**16 + 6], 8, 1024)]
)
def test_copy_floor_copies_each_ranks_share_of_every_phase_into_its_own_place(
    phase_bytes: list[int], world: int, block: int
) -> None:
    """The copy floor is one copy per rank and phase, in the step's order, of that rank's share of the
    phase's traffic (half read, half written) in whole words, each between regions no other copy
    touches, each starting on a whole block; a run (the kernels in the interpreter) writes every word of
    its destinations from its sources (random sources, destinations poisoned first) and nothing else."""
    from mori_sglang.tools import measure

    step = measure.CopyFloorStep(phase_bytes, world, torch.device("cpu"), block)
    regions = step.regions
    assert [dst.numel() for _, dst in regions] == [
        max(1, total // (2 * world) // 4) for total in phase_bytes for _ in range(world)
    ]
    assert all(src.numel() == dst.numel() and src.dtype == dst.dtype == torch.int32 for src, dst in regions)
    spans = sorted((t.data_ptr(), t.numel() * 4) for pair in regions for t in pair)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))  # no two share a byte
    for side in (0, 1):
        first = regions[0][side].data_ptr()
        assert all((pair[side].data_ptr() - first) % (4 * block) == 0 for pair in regions)
    whole = regions[0][1].untyped_storage()
    whole_dst = torch.empty(0, dtype=torch.int32).set_(whole)
    whole_dst.fill_(-7)  # poison outside the regions too
    for src, dst in regions:
        src.copy_(torch.randint(-(2**31), 2**31 - 1, src.shape, dtype=torch.int32))
        dst.copy_(~src)  # differs from the source in every bit
    step()
    assert all(torch.equal(dst, src) for src, dst in regions)
    covered = torch.zeros(whole_dst.numel(), dtype=torch.bool)
    base = whole_dst.data_ptr()
    for _, dst in regions:
        at = (dst.data_ptr() - base) // 4
        covered[at : at + dst.numel()] = True
    assert bool((whole_dst[~covered] == -7).all())


def test_eager_launches_are_counted_after_every_row_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's profiler makes every later launch of the process cost the host more: the bench counts
    launches only once every row's host time is taken, each row on a step of its own configuration."""
    from mori_sglang.tools import bench

    events: list[tuple[str, int]] = []
    time_eager, count_launches = bench.time_eager, bench.count_launches

    def timed(phases, device, iters):
        events.append(("time", len(phases)))
        return time_eager(phases, device, iters)

    def counted(phase, device):
        assert count_launches(phase, device) is None  # a CPU launches nothing
        events.append(("count", 1))
        return (2, 1)

    monkeypatch.setattr(bench, "time_eager", timed)
    monkeypatch.setattr(bench, "count_launches", counted)
    rows = bench.main(
        ["--provider", "torch", "--world", "2", "--tokens", "3", "5", "--mode", "intranode", "--eager",
         "--device", "cpu", *SMALL[:-1]]
    )  # fmt: skip
    kinds = [kind for kind, _ in events]
    assert kinds.index("count") > len(kinds) - 1 - kinds[::-1].index("time")
    assert kinds.count("count") == 4 * len(rows) == 8
    assert all(r.eager.launches == [1.0] * 4 and r.eager.d2h_copies == 2.0 for r in rows)


def test_bench_runs_small_batches_in_buffers_sized_for_large_ones(tmp_path: Path) -> None:
    """Decode batches run far below the buffers' capacity in a server: the capacity is its own flag."""
    out = tmp_path / "bench.json"
    common = [sys.executable, "-m", "mori_sglang.tools.bench", "--world", "2", "--mode", "low_latency", *SMALL]
    text = _run([*common, "--tokens", "3", "5", "--max-tokens-per-rank", "16", "--json", str(out)], tmp_path).stdout
    assert "buffers sized for 16 tokens per rank" in text
    rows = json.loads(out.read_text())["rows"]
    assert sorted({(r["tokens"], r["max_tokens_per_rank"]) for r in rows}) == [(3, 16), (5, 16)]
    done = subprocess.run([*common, "--tokens", "32", "--max-tokens-per-rank", "16"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and "--max-tokens-per-rank 16 is below the largest --tokens value 32" in done.stderr


@pytest.mark.slow
def test_distributed_bench_under_torchrun(tmp_path: Path) -> None:
    """On CPUs the default provider (auto) is torch: one row per point, not torch beside itself."""
    out = tmp_path / "dist.json"
    text = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mori_sglang.tools.bench_dist",
         "--tokens", "6", "--mode", "intranode", "low_latency", "--json", str(out), *SMALL],
        tmp_path,
        runs_kernels=False,
    ).stdout  # fmt: skip
    rows = _table_rows(text)
    assert [(r[1], r[5]) for r in rows] == [
        ("intranode", "bf16"), ("intranode", "fp8"), ("low_latency", "bf16"), ("low_latency", "fp8")
    ]  # fmt: skip
    assert all(r[2] == "2" and float(r[6]) > 0 and float(r[7]) > 0 for r in rows)
    assert json.loads(out.read_text())["world"] == 2


def test_tuning_sweep_times_each_variant_beside_the_defaults(tmp_path: Path) -> None:
    out = tmp_path / "tune.json"
    text = _run(
        [sys.executable, "-m", "mori_sglang.tools.tune", "--world", "2", "--tokens", "4", "--mode", "low_latency",
         "--vary", "send_tile=512,2048", "route_block=64+combine_recv_tile=512", "--json", str(out), *SMALL],
        tmp_path,
    ).stdout  # fmt: skip
    rows = _table_rows(text)
    variants = ["defaults", "send_tile=512", "send_tile=2048", "route_block=64+combine_recv_tile=512"]
    assert [r[0] for r in rows] == [v for v in variants for _ in ("bf16", "fp8")]
    assert all(float(cell.split(" ")[0]) > 0 for r in rows for cell in r[4:8])
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]][::2] == variants


def test_tuning_sweep_names_the_fields_it_accepts(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mori_sglang.tools.tune", "--vary", "warp_count=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert "warp_count is not a KernelTuning field" in done.stderr and "recv_warps" in done.stderr
    assert "Traceback" not in done.stderr
