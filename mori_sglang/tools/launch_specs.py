"""The Triton provider's kernel launches as specs that compile for a GPU on any machine, GPU or not.

A spec (JSON-ready dict) is what a launch hands Triton's compiler: the kernel's name, its runtime
argument types with Triton's alignment specialization, its compile-time constants and its launch
options. Recording the launches the provider makes, rather than writing them out, keeps the specs true
to the code: the compile test checks every launch for an NVIDIA Hopper GPU (sm_90) and an AMD MI300
(gfx942) with them, and ``mori_sglang.tools.registers`` reports the registers each one needs. Triton
ships both back ends and their assemblers, so no GPU is needed to compile.

Launches recorded in the CPU interpreter carry the interpreter's constants (the host's clock, no spins);
``as_gpu_launch``, ``as_hopper_launch`` and ``as_fnuz`` make them the launches a GPU would make.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mori_sglang import formats
from mori_sglang.config import DispatchDtype
from mori_sglang.kernels import transport

# The provider's kernels, in the order of a step.
KERNELS = ("dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel", "combine_recv_kernel")
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}
TORCH_TO_TRITON = {
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
}
# Triton specializes pointers and integers on this alignment (bytes).
ALIGNMENT = 16


def describe(name: str, fn, args: tuple, kwargs: dict) -> dict:
    """One launch of kernel ``name`` (its Python function ``fn``) as a spec."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constants, aligned = {}, {}, []
    for pname, value in bound.items():
        if params[pname].annotation == "tl.constexpr":
            constants[pname] = {"dtype": str(value)} if isinstance(value, tl.dtype) else value
        elif isinstance(value, torch.Tensor):
            signature[pname] = "*" + TORCH_TO_TRITON[value.dtype]
            if value.data_ptr() % ALIGNMENT == 0:
                aligned.append(pname)
        else:
            signature[pname] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % ALIGNMENT == 0:
                aligned.append(pname)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return {"kernel": name, "signature": signature, "constants": constants, "aligned": aligned, "options": options}


class _Recorder:
    """Stands in for one of ``transport``'s kernels: notes each launch, and runs it where ``run``."""

    def __init__(self, name: str, kernel, launches: list[dict], run: bool) -> None:
        self.name, self.kernel, self.launches, self.run = name, kernel, launches, run
        self.arg_names = kernel.arg_names  # what the provider binds launches with
        self.__name__ = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(describe(self.name, getattr(self.kernel, "fn", self.kernel), args, kwargs))
            return self.kernel[grid](*args, **kwargs) if self.run else None

        return launch


@contextmanager
def recorded_launches(run: bool = True) -> Iterator[list[dict]]:
    """Every launch of the provider's kernels while active, as specs, in order. ``run=False`` launches
    nothing: enough for a low-latency step, whose host never waits on a kernel. Bind the provider's
    launches inside (``set_kernel_tuning`` drops the ones bound before)."""
    launches: list[dict] = []
    kernels = {name: getattr(transport, name) for name in KERNELS}
    for name, kernel in kernels.items():
        setattr(transport, name, _Recorder(name, kernel, launches, run))
    try:
        yield launches
    finally:
        for name, kernel in kernels.items():
            setattr(transport, name, kernel)


def unique(specs: list[dict]) -> list[dict]:
    """The distinct specs, in the order they first appear."""
    seen: dict[str, dict] = {}
    for spec in specs:
        seen.setdefault(json.dumps(spec, sort_keys=True), spec)
    return list(seen.values())


def _with_constants(spec: dict, **values: object) -> dict:
    """``spec`` with the constants it has among ``values`` set to them."""
    changed = {k: v for k, v in values.items() if k in spec["constants"]}
    return {**spec, "constants": {**spec["constants"], **changed}}


def as_gpu_launch(spec: dict, clock: int, count_spins: int) -> dict:
    """The launch as a GPU makes it: the receive deadline reads the GPU's ``clock`` (the interpreter
    records the host's) and a routing wait polls ``count_spins`` times before it counts a late block
    itself (the interpreter, running programs one at a time, never polls)."""
    return _with_constants(spec, CLOCK=clock, COUNT_SPINS=count_spins)


def as_hopper_launch(spec: dict, pdl: int = transport.PDL_WAIT) -> dict:
    """The launch under programmatic dependent launch, as a Hopper GPU makes it: waiting for the kernel
    before (``PDL_WAIT``), or also letting the next one launch early (``PDL_EARLY``)."""
    return {**spec, "constants": {**spec["constants"], "PDL": pdl}, "options": {**spec["options"], "launch_pdl": True}}


def as_fnuz(spec: dict) -> dict:
    """The launch with e4m3fnuz on the wire (MI300's fp8), as the provider makes it: the fp8 type, its
    largest value (240) and, for mxfp8, its largest exponent (7). The interpreter cannot run e4m3fnuz, so
    these launches are derived rather than recorded."""
    constants = dict(spec["constants"])
    if constants.get("FP8") == {"dtype": "fp8e4nv"}:
        constants["FP8"] = {"dtype": "fp8e4b8"}
        if "FP8_MAX" in constants:
            constants["FP8_MAX"] = float(formats.fp8_max(torch.float8_e4m3fnuz))
        if constants.get("QUANT") == transport.QUANT_MXFP8:
            constants["EMAX"] = formats.mx_emax(DispatchDtype.MXFP8, torch.float8_e4m3fnuz)
    signature = {k: v.replace("fp8e4nv", "fp8e4b8") for k, v in spec["signature"].items()}
    return {**spec, "constants": constants, "signature": signature}


def compile_launch(spec: dict, target: GPUTarget):
    """The kernel ``spec`` describes, compiled for ``target``. Outside Triton's interpreter only: in it,
    the kernels are interpreted functions the compiler cannot take."""
    fn = getattr(transport, spec["kernel"])
    constants = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in spec["constants"].items()}
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", ALIGNMENT]] for a in spec["aligned"]}
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=constants, attrs=attrs)
    return triton.compile(source, target=target, options=spec["options"])


CUDA_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)")
HIP_VGPRS = re.compile(r"\.vgpr_count:\s+(\d+)")
HIP_SPILLS = re.compile(r"\.vgpr_spill_count:\s+(\d+)")


def resource_usage(compiled, target: GPUTarget) -> tuple[int, int]:
    """The registers a compiled kernel needs per thread and what it spills: for CUDA, the registers
    and stack bytes Triton's bundled ``cuobjdump`` reads from the cubin; for HIP, the vector registers
    and spilled vector registers of the code object's metadata."""
    if target.backend == "cuda":
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            dump = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
            ).stdout
        found = CUDA_USAGE.search(dump)
        if found is None:
            raise RuntimeError(f"cuobjdump printed no register count:\n{dump}")
        return int(found[1]), int(found[2])
    amdgcn = compiled.asm["amdgcn"]
    vgprs = HIP_VGPRS.search(amdgcn)
    if vgprs is None:
        raise RuntimeError("the code object's metadata names no .vgpr_count")
    spills = HIP_SPILLS.search(amdgcn)
    return int(vgprs[1]), int(spills[1]) if spills else 0
