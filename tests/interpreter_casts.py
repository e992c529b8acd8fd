"""Exact float conversions for Triton's CPU interpreter.

The interpreter converts floats with its own bit manipulation, which truncates f32 -> bf16, rounds
fp8 ties up and mis-handles saturation and NaN. The GPU does these casts in hardware with round to
nearest even, exactly as torch does; so the tests run the interpreter's conversions through torch,
which lets a kernel's wire bytes be compared bit for bit with the torch reference.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

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


def _torch_dtype(dtype: tl.dtype) -> torch.dtype:
    return _TORCH_FLOAT[dtype.name]


def _convert_float(input: np.ndarray, input_dtype: tl.dtype, output_dtype: tl.dtype, rounding_mode: object):
    """Drop-in for ``triton.runtime.interpreter._convert_float``: bits in, bits out, torch in between."""
    in_bits = input_dtype.primitive_bitwidth
    out_bits = output_dtype.primitive_bitwidth
    raw = np.frombuffer(input.tobytes(), dtype=getattr(np, f"int{in_bits}" if in_bits > 8 else "uint8"))
    values = torch.from_numpy(raw.copy()).view(_torch_dtype(input_dtype))
    converted = values.to(_torch_dtype(output_dtype)).view(_TORCH_BITS[out_bits]).numpy()
    return converted.view(getattr(np, f"uint{out_bits}")).reshape(input.shape)


def install() -> None:
    """Route the interpreter's float conversions through torch (idempotent)."""
    from triton.runtime import interpreter

    interpreter._convert_float = _convert_float
