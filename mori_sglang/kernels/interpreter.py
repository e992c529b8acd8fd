"""Triton's CPU interpreter, with exact float conversions.

The interpreter converts floats with its own bit manipulation, which truncates f32 -> bf16, rounds
fp8 ties up and mis-handles saturation and NaN. The GPU does these casts in hardware with round to
nearest even, exactly as torch does. Wherever the project runs the interpreter it routes the
interpreter's conversions through torch (``install_exact_casts``), so that the kernels' wire bytes
equal the torch reference's bit for bit and an accuracy a command reports is the format's, not the
interpreter's (about half of it otherwise).

``TRITON_INTERPRET=1`` has to be set before a kernel is defined (Triton reads it when ``@triton.jit``
runs), i.e. before ``mori_sglang.kernels.transport`` is imported; ``interpret_on_cpu`` sets it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # numpy and triton come with the triton extra; only the interpreter needs them
    import numpy as np
    import triton.language as tl

INTERPRET_ENV = "TRITON_INTERPRET"
_KERNEL_MODULES = ("mori_sglang.kernels.transport", "mori_sglang.kernels.probes")


class InterpreterError(RuntimeError):
    """The kernels were defined for a GPU before the interpreter was asked for; the message says how to fix it."""


def interpreting() -> bool:
    """Whether ``@triton.jit`` kernels run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def interpret_on_cpu() -> None:
    """Run our Triton kernels in the interpreter with exact casts: for a command that runs them on a CPU."""
    if not interpreting():
        defined = [name for name in _KERNEL_MODULES if name in sys.modules]
        if defined:
            raise InterpreterError(
                f"{defined[0]} was imported before {INTERPRET_ENV}=1 was set; set {INTERPRET_ENV}=1 in the "
                "environment to run the Triton kernels on a CPU"
            )
        os.environ[INTERPRET_ENV] = "1"
    install_exact_casts()


def install_exact_casts() -> None:
    """Route the interpreter's float conversions through torch (idempotent)."""
    from triton.runtime import interpreter

    interpreter._convert_float = _convert_float


_TORCH_FLOAT = {
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e4b8": torch.float8_e4m3fnuz,
    "fp8e5": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
_TORCH_BITS = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def _convert_float(
    input: np.ndarray, input_dtype: tl.dtype, output_dtype: tl.dtype, rounding_mode: object
) -> np.ndarray:
    """Drop-in for ``triton.runtime.interpreter._convert_float``: bits in, bits out, torch in between."""
    import numpy as np

    in_bits = input_dtype.primitive_bitwidth
    out_bits = output_dtype.primitive_bitwidth
    raw = np.frombuffer(input.tobytes(), dtype=getattr(np, f"int{in_bits}" if in_bits > 8 else "uint8"))
    values = torch.from_numpy(raw.copy()).view(_TORCH_FLOAT[input_dtype.name])
    converted = values.to(_TORCH_FLOAT[output_dtype.name]).view(_TORCH_BITS[out_bits]).numpy()
    return converted.view(getattr(np, f"uint{out_bits}")).reshape(input.shape)
