"""Compile recorded kernel launches for their GPU targets (run by test_kernels_compile.py, outside
Triton's interpreter). Prints one JSON line: how many compiled, and per sm_90 launch the byte-wide
global loads and stores its PTX holds, and its grid dependency control (programmatic dependent launch)."""

from __future__ import annotations

import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mori_sglang.kernels import transport

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}
BYTE_WIDE = re.compile(r"\b(?:ld|st)\.global(?:\.\w+)*\.[bsu]8\b")
GRID_CONTROL = re.compile(r"\bgriddepcontrol\.(\w+)")
GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red)\.(?:\w+\.)*global\b")


def grid_control(ptx: str) -> dict:
    """The grid dependency control instructions of a kernel, and whether its wait for the kernel before
    it comes ahead of its first global memory access (what makes programmatic dependent launch safe)."""
    wait, access = ptx.find("griddepcontrol.wait"), GLOBAL_ACCESS.search(ptx)
    return {
        "instructions": sorted(set(GRID_CONTROL.findall(ptx))),
        "waits_first": wait >= 0 and (access is None or wait < access.start()),
    }


def compile_launch(spec: dict, target: GPUTarget):
    fn = getattr(transport, spec["kernel"])
    constants = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in spec["constants"].items()}
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec["aligned"]}
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=constants, attrs=attrs)
    return triton.compile(source, target=target, options=spec["options"])


def main(path: str) -> None:
    with open(path) as f:
        specs = json.load(f)
    compiled, byte_wide, controls = 0, {}, {}
    for target_name, launches in specs.items():
        for i, spec in enumerate(launches):
            kernel = compile_launch(spec, TARGETS[target_name])
            compiled += 1
            if target_name == "sm_90":
                label = f"{spec['kernel']} #{i} {spec['constants']}"
                byte_wide[label] = sorted(set(BYTE_WIDE.findall(kernel.asm["ptx"])))
                controls[label] = grid_control(kernel.asm["ptx"])
    print(json.dumps({"compiled": compiled, "byte_wide": byte_wide, "grid_control": controls}))


if __name__ == "__main__":
    main(sys.argv[1])
