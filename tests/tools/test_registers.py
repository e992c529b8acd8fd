"""The register report compiles every kernel of a step for both GPU targets, on any machine, and says
how the send routes each batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mori_sglang.kernels import interpreter
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.tools import registers
from mori_sglang.tools.launch_specs import KERNELS

REPO = Path(__file__).resolve().parents[2]
# The most registers a thread can hold: sm_90's 255, MI300's 512 vector registers (with AGPRs).
MOST_REGISTERS = {"sm_90": 255, "gfx942": 512}


@pytest.mark.slow
def test_every_kernel_of_each_batch_compiles_for_both_targets(tmp_path: Path) -> None:
    small, large = 1, KernelTuning().self_routing_max_tokens + 1
    out = tmp_path / "registers.json"
    shape = ["--hidden", "256", "--experts", "16", "--topk", "4", "--world", "4"]
    command = [sys.executable, "-m", "mori_sglang.tools.registers", "--tokens", str(small), str(large), *shape]
    command += ["--dispatch-dtype", "fp8", "fp4", "--target", "sm_90", "gfx942", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    batches = {(r["tokens"], r["dispatch_dtype"], r["target"]) for r in rows}
    assert batches == {(t, d, g) for t in (small, large) for d in ("fp8", "fp4") for g in ("sm_90", "gfx942")}
    for tokens, dispatch, target in batches:
        of_batch = [r for r in rows if (r["tokens"], r["dispatch_dtype"], r["target"]) == (tokens, dispatch, target)]
        assert sorted(r["kernel"] for r in of_batch) == sorted(KERNELS)
        for r in of_batch:
            assert 0 < r["registers"] <= MOST_REGISTERS[target], r
            assert r["spilled"] >= 0, r
            expected = ("self" if tokens == small else "tasks") if r["kernel"] == "dispatch_send_kernel" else "-"
            assert r["routing"] == expected, r
    assert "| dispatch_send_kernel | 1 | fp8 | bf16 | self | sm_90 |" in done.stdout


def test_refuses_to_run_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET"):
        registers.main(["--tokens", "1"])


@pytest.mark.skipif(
    not interpreter.interpreting(), reason="the provider binds launches on a CPU: needs TRITON_INTERPRET=1"
)
def test_the_send_routes_as_asked() -> None:
    """``--routing`` sets how the send routes every batch, whatever the tuning would pick."""
    shape = ["--hidden", "256", "--experts", "16", "--topk", "4", "--world", "4"]
    for routing, self_routed in (("self", True), ("tasks", False), ("auto", True)):
        recorded = registers.record(registers.parse_args(["--tokens", "3", *shape, "--routing", routing]))
        assert sorted(e["spec"]["kernel"] for e in recorded) == sorted(KERNELS)
        sends = [e["spec"] for e in recorded if e["spec"]["kernel"] == "dispatch_send_kernel"]
        assert [bool(s["constants"]["SELF_ROUTING"]) for s in sends] == [self_routed]
        assert all(e["batch"] == {"tokens": 3, "dispatch_dtype": "fp8", "combine_dtype": "bf16"} for e in recorded)
