"""The register report compiles every kernel of a step for both GPU targets, on any machine, and says
how the send routes each batch: over worlds of every width of the send's rank lanes, so that a kernel
Triton cannot compile for some world fails here rather than on a GPU."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mori_sglang.kernels import interpreter
from mori_sglang.kernels.geometry import SELF_ROUTING_MAX_WORLD, KernelTuning
from mori_sglang.tools import registers
from mori_sglang.tools.launch_specs import KERNELS

REPO = Path(__file__).resolve().parents[2]
# The most registers a thread can hold: sm_90's 255, MI300's 512 vector registers (with AGPRs).
MOST_REGISTERS = {"sm_90": 255, "gfx942": 512}


# Worlds whose rank lanes fill part of a warp, a whole one, two and four (the send runs one warp). Past
# SELF_ROUTING_MAX_WORLD ranks the send routes in tasks whatever is asked.
WORLDS = (2, 33, 65, 128)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["self", "tasks"])
def test_every_kernel_compiles_for_both_targets_in_every_world(routing: str, tmp_path: Path) -> None:
    tokens = (1, 40)  # one token; three routing blocks
    assert tokens[-1] > KernelTuning().route_block * 2
    out = tmp_path / "registers.json"
    shape = ["--hidden", "256", "--local-experts", "4", "--topk", "6", "--world", *map(str, WORLDS)]
    command = [sys.executable, "-m", "mori_sglang.tools.registers", "--tokens", *map(str, tokens), *shape]
    command += ["--dispatch-dtype", "fp8", "bf16", "--target", "sm_90", "gfx942", "--routing", routing]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    batches = {(r["world"], r["tokens"], r["dispatch_dtype"], r["target"]) for r in rows}
    assert batches == set(itertools.product(WORLDS, tokens, ("fp8", "bf16"), ("sm_90", "gfx942")))
    for batch in batches:
        of_batch = [r for r in rows if (r["world"], r["tokens"], r["dispatch_dtype"], r["target"]) == batch]
        assert sorted(r["kernel"] for r in of_batch) == sorted(KERNELS)
        world, _, _, target = batch
        routed = "self" if routing == "self" and world <= SELF_ROUTING_MAX_WORLD else "tasks"
        for r in of_batch:
            assert 0 < r["registers"] <= MOST_REGISTERS[target], r
            assert r["routing"] == (routed if r["kernel"] == "dispatch_send_kernel" else "-"), r
    assert "| dispatch_send_kernel | 65 | 1 | fp8 | bf16 | tasks | gfx942 |" in done.stdout
    printed = [line for line in done.stdout.splitlines() if line.startswith(tuple(f"| {k} |" for k in KERNELS))]
    assert len(printed) == len(rows)  # the table once, on stdout


def test_a_config_the_op_refuses_is_an_error_naming_it() -> None:
    with pytest.raises(SystemExit, match="topk=9"):
        registers.main(["--tokens", "1", "--world", "2", "--experts", "8", "--topk", "9"])


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
        batch = {"world": 4, "tokens": 3, "dispatch_dtype": "fp8", "combine_dtype": "bf16"}
        assert all(e["batch"] == batch for e in recorded)
