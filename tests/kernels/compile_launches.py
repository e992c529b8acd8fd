"""Compile recorded kernel launches for their GPU targets (run by test_kernels_compile.py, outside
Triton's interpreter). Prints one JSON line: how many compiled, and per sm_90 launch the byte-wide
global loads and stores its PTX holds, and its grid dependency control (programmatic dependent launch)."""

from __future__ import annotations

import json
import re
import sys

from mori_sglang.tools.launch_specs import TARGETS, compile_launch

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
