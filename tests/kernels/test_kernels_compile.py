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

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from mori_sglang import formats
from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.kernels import transport
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers import triton_provider
from tests.helpers import routing_tuning

REPO = Path(__file__).resolve().parents[2]
KERNELS = [
    "dispatch_send_kernel",
    "dispatch_recv_kernel",
    "combine_send_kernel",
    "combine_recv_kernel",
]
# Kernels that move rows: their sm_90 code must not touch global memory a byte at a time.
ROW_COPIES = {"dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel", "combine_recv_kernel"}
PAIRS = [
    (DispatchDtype.BF16, CombineDtype.BF16),
    (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE),
    (DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE),
    (DispatchDtype.MXFP4, CombineDtype.FP8_DIRECT_CAST),
]
TORCH_TO_TRITON = {
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
}


def _describe(name: str, fn, args: tuple, kwargs: dict) -> dict:
    """One launch as JSON: runtime argument types (with Triton's alignment specialization),
    compile-time constants, and the launch options."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constants, aligned = {}, {}, []
    for pname, value in bound.items():
        if params[pname].annotation == "tl.constexpr":
            constants[pname] = {"dtype": str(value)} if isinstance(value, tl.dtype) else value
        elif isinstance(value, torch.Tensor):
            signature[pname] = "*" + TORCH_TO_TRITON[value.dtype]
            if value.data_ptr() % 16 == 0:  # Triton specializes 16-byte aligned pointers
                aligned.append(pname)
        else:
            signature[pname] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                aligned.append(pname)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return {"kernel": name, "signature": signature, "constants": constants, "aligned": aligned, "options": options}


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    launches: list[dict] = []

    class Recorder:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel
            self.arg_names = kernel.arg_names  # what the provider binds launches with

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                fn = getattr(self.kernel, "fn", self.kernel)
                launches.append(_describe(self.name, fn, args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in KERNELS:
        monkeypatch.setattr(transport, name, Recorder(name, getattr(transport, name)))
    return launches


def _step(cfg: EpConfig, tokens: list[int], routing: str) -> None:
    world = LoopbackWorld(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    # Routing tasks of 64 tokens, so that a 65-token batch spans two blocks.
    world.set_kernel_tuning(routing_tuning(routing, max(tokens), route_block=64))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16).to(world.device) for n in tokens]
    ids = [torch.rand(n, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.to(world.device) for n in tokens]
    weights = [torch.rand(n, cfg.topk, generator=gen).to(world.device) for n in tokens]
    outs = world.dispatch(xs, weights, [None] * len(tokens), ids)
    ys = [torch.zeros(out.tokens.shape[0], cfg.hidden, dtype=torch.bfloat16, device=world.device) for out in outs]
    world.combine(ys, [out.handle for out in outs])


def _as_fnuz(spec: dict) -> dict:
    """The same launch with e4m3fnuz on the wire (MI300's fp8), as the provider makes it: the fp8 type,
    its largest value (240) and, for mxfp8, its largest exponent (7). Triton's interpreter cannot run
    e4m3fnuz, so these launches are derived rather than recorded."""
    constants = dict(spec["constants"])
    if constants.get("FP8") == {"dtype": "fp8e4nv"}:
        constants["FP8"] = {"dtype": "fp8e4b8"}
        if "FP8_MAX" in constants:
            constants["FP8_MAX"] = float(formats.fp8_max(torch.float8_e4m3fnuz))
        if constants.get("QUANT") == transport.QUANT_MXFP8:
            constants["EMAX"] = formats.mx_emax(DispatchDtype.MXFP8, torch.float8_e4m3fnuz)
    signature = {k: v.replace("fp8e4nv", "fp8e4b8") for k, v in spec["signature"].items()}
    return {**spec, "constants": constants, "signature": signature}


def _with_clock(spec: dict, clock: int) -> dict:
    """The launch with the receive deadline's clock of the target (the interpreter records the host's)."""
    if "CLOCK" not in spec["constants"]:
        return spec
    return {**spec, "constants": {**spec["constants"], "CLOCK": clock}}


def _as_hopper_launch(spec: dict, pdl: int = transport.PDL_WAIT) -> dict:
    """The same launch as a Hopper GPU makes it: under programmatic dependent launch (``pdl``: waiting
    for the kernel before, or also letting the next one launch early), which the interpreter cannot run."""
    return {**spec, "constants": {**spec["constants"], "PDL": pdl}, "options": {**spec["options"], "launch_pdl": True}}


@pytest.mark.slow
def test_every_launch_compiles_for_hopper_and_mi300(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launches = _record_launches(monkeypatch)
    monkeypatch.setattr(triton_provider, "programmatic_launch", lambda device: False)  # recorded as without it
    for i, (dispatch, combine) in enumerate(PAIRS):
        cfg = EpConfig(8, 0, 7168, 256, 8, max_tokens_per_rank=65, dispatch_dtype=dispatch, combine_dtype=combine,
                       mode=Mode.INTRANODE, provider="triton", fp8_dtype=torch.float8_e4m3fn)  # fmt: skip
        _step(cfg, [65 if i == 0 else 1] + [1] * 7, "self")
        if i == 0:  # the routing tasks in the send
            _step(cfg, [65] + [1] * 7, "tasks")
    monkeypatch.undo()
    unique = [json.loads(u) for u in sorted({json.dumps(launch, sort_keys=True) for launch in launches})]
    assert {s["kernel"] for s in unique} == set(KERNELS)
    assert all(s["constants"]["PDL"] == transport.PDL_OFF for s in unique)
    hopper = [_as_hopper_launch(s, pdl) for pdl in (transport.PDL_WAIT, transport.PDL_EARLY) for s in unique]
    specs = {
        "sm_90": [_with_clock(s, transport.CLOCK_CUDA) for s in unique + hopper],
        "gfx942": [_with_clock(_as_fnuz(s), transport.CLOCK_HIP) for s in unique],
    }
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
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["compiled"] == sum(len(v) for v in specs.values())
    narrow = [f"{k}: {v}" for k, v in report["byte_wide"].items() if k.split(" ")[0] in ROW_COPIES and v]
    assert not narrow, "byte-wide global accesses in sm_90 row copies:\n" + "\n".join(narrow)
    # Every kernel waits for the one before it; a kernel launched with PDL_EARLY lets the next one launch
    # early.
    controls = list(report["grid_control"].values())
    assert [c["instructions"] for c in controls[: len(unique)]] == [[]] * len(unique)
    for spec, control in zip(hopper, controls[len(unique) :], strict=True):
        early = spec["constants"]["PDL"] == transport.PDL_EARLY
        assert control["instructions"] == (["launch_dependents", "wait"] if early else ["wait"]), spec["kernel"]
        assert control["waits_first"], f"{spec['kernel']} touches global memory before its grid wait"
