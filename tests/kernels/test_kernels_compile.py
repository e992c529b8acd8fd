"""Every kernel launch of the Triton provider compiles for an NVIDIA Hopper GPU (sm_90) and an AMD MI300
(gfx942) on this machine, GPU or not, and the row copies stay vectorized.

The provider runs a loopback step at the production shape (hidden 7168, top-8 of 256 experts, eight
ranks) while a recorder notes each launch: kernel, argument types, compile-time constants and options.
A subprocess without Triton's interpreter then compiles each distinct launch for both targets (Triton
ships both back ends and their assemblers), as the GPU would on its first call. Byte-wide global loads
and stores in the copy kernels' sm_90 code mean the compiler lost the rows' alignment: that made every
copy several times slower once, so it fails here.

The launches are recorded without programmatic dependent launch (the interpreter cannot run it) and
compiled for sm_90 a second time with it, as a Hopper GPU launches them: each kernel must wait for the
kernel before it ahead of its first global memory access, and only a kernel launched with PDL_EARLY may
let the kernel after it launch early.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.kernels import transport
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers import triton_provider
from mori_sglang.tools import launch_specs
from mori_sglang.tools.launch_specs import KERNELS, as_fnuz, as_gpu_launch, as_hopper_launch, recorded_launches
from tests.helpers import generator, routing_tuning

REPO = Path(__file__).resolve().parents[2]
PAIRS = [
    (DispatchDtype.BF16, CombineDtype.BF16),
    (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE),
    (DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE),
    (DispatchDtype.MXFP4, CombineDtype.FP8_DIRECT_CAST),
]


def _step(cfg: EpConfig, tokens: list[int], routing: str) -> None:
    world = LoopbackWorld(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    # Routing tasks of 64 tokens, so that a 65-token batch spans two blocks.
    world.set_kernel_tuning(routing_tuning(routing, max(tokens), route_block=64))
    gen = generator(0)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16).to(world.device) for n in tokens]
    ids = [torch.rand(n, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.to(world.device) for n in tokens]
    weights = [torch.rand(n, cfg.topk, generator=gen).to(world.device) for n in tokens]
    outs = world.dispatch(xs, weights, [None] * len(tokens), ids)
    ys = [torch.zeros(out.tokens.shape[0], cfg.hidden, dtype=torch.bfloat16, device=world.device) for out in outs]
    world.combine(ys, [out.handle for out in outs])


def _compile_in_subprocess(specs: dict[str, list[dict]], tmp_path: Path) -> dict:
    """Compile ``specs`` (launches per target) with ``compile_launches.py``, outside Triton's interpreter,
    and return its report."""
    spec_file = tmp_path / "launches.json"
    spec_file.write_text(json.dumps(specs))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_launches.py")), str(spec_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_every_launch_compiles_for_hopper_and_mi300(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(triton_provider, "programmatic_launch", lambda device: False)  # recorded as without it
    with recorded_launches() as launches:
        for i, (dispatch, combine) in enumerate(PAIRS):
            cfg = EpConfig(8, 0, 7168, 256, 8, max_tokens_per_rank=65, dispatch_dtype=dispatch, combine_dtype=combine,
                           mode=Mode.INTRANODE, provider="triton", fp8_dtype=torch.float8_e4m3fn)  # fmt: skip
            _step(cfg, [65 if i == 0 else 1] + [1] * 7, "self")
            if i == 0:  # the routing tasks in the send
                _step(cfg, [65] + [1] * 7, "tasks")
    monkeypatch.undo()
    unique = launch_specs.unique(launches)
    assert {s["kernel"] for s in unique} == set(KERNELS)
    assert all(s["constants"]["PDL"] == transport.PDL_OFF for s in unique)
    spins = triton_provider.COUNT_SPINS
    hopper = [as_hopper_launch(s, pdl) for pdl in (transport.PDL_WAIT, transport.PDL_EARLY) for s in unique]
    specs = {
        "sm_90": [as_gpu_launch(s, transport.CLOCK_CUDA, spins) for s in unique + hopper],
        "gfx942": [as_gpu_launch(as_fnuz(s), transport.CLOCK_HIP, spins) for s in unique],
    }
    report = _compile_in_subprocess(specs, tmp_path)
    assert report["compiled"] == sum(len(v) for v in specs.values())
    # Every kernel moves rows: its sm_90 code must not touch global memory a byte at a time.
    narrow = [f"{k}: {v}" for k, v in report["byte_wide"].items() if v]
    assert not narrow, "byte-wide global accesses in sm_90 row copies:\n" + "\n".join(narrow)
    # Every kernel waits for the one before it; a kernel launched with PDL_EARLY lets the next one launch
    # early.
    controls = list(report["grid_control"].values())
    assert [c["instructions"] for c in controls[: len(unique)]] == [[]] * len(unique)
    for spec, control in zip(hopper, controls[len(unique) :], strict=True):
        early = spec["constants"]["PDL"] == transport.PDL_EARLY
        assert control["instructions"] == (["launch_dependents", "wait"] if early else ["wait"]), spec["kernel"]
        assert control["waits_first"], f"{spec['kernel']} touches global memory before its grid wait"


@pytest.mark.slow
@pytest.mark.parametrize("width", ["i32", "i64"])
def test_every_launch_compiles_whatever_width_triton_gives_its_ints(width: str, tmp_path: Path) -> None:
    """Triton types an int argument that fits 32 bits as i32, else i64, and the arena's address is an
    int: a host whose heap lies below 2**31 (as where Python's binary is not position-independent) hands
    the interpreter's recorder such an address. Every launch compiles with all its ints of either width."""
    with recorded_launches() as launches:
        cfg = EpConfig(2, 0, 256, 8, 4, max_tokens_per_rank=4, dispatch_dtype=DispatchDtype.FP8,
                       combine_dtype=CombineDtype.FP8_BLOCKWISE, mode=Mode.INTRANODE, provider="triton",
                       fp8_dtype=torch.float8_e4m3fn)  # fmt: skip
        _step(cfg, [3, 1], "self")
    ints = {"i32", "i64"}
    unique = [
        {**s, "signature": {k: width if v in ints else v for k, v in s["signature"].items()}}
        for s in launch_specs.unique(launches)
    ]
    assert {s["kernel"] for s in unique} == set(KERNELS)
    assert all(width in s["signature"].values() for s in unique)
    spins = triton_provider.COUNT_SPINS
    specs = {
        "sm_90": [as_gpu_launch(as_hopper_launch(s), transport.CLOCK_CUDA, spins) for s in unique],
        "gfx942": [as_gpu_launch(s, transport.CLOCK_HIP, spins) for s in unique],
    }
    assert _compile_in_subprocess(specs, tmp_path)["compiled"] == 2 * len(unique)
