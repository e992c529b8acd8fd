"""Exact float conversions for Triton's CPU interpreter.

The interpreter converts floats with its own bit manipulation, which truncates f32 -> bf16, rounds
fp8 ties up and mis-handles saturation and NaN. The GPU does these casts in hardware with round to
nearest even, exactly as torch does; so the tests run the interpreter's conversions through torch,
which lets a kernel's wire bytes be compared bit for bit with the torch reference.

Its ``tl.dot`` multiplies bf16 operands as their raw 16-bit integers (bf16 is stored as uint16); the
GPU multiplies the values. ``install`` also decodes bf16 (and fp8) operands to f32 first: every such
value is exact in f32, so the product is what the tensor cores compute before accumulation order.
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


def _operand_f32(handle) -> np.ndarray:
    """A dot operand's values as f32 (exact for bf16, fp16 and fp8; f32 unchanged)."""
    dtype = handle.dtype.scalar
    if dtype.is_floating() and dtype.primitive_bitwidth < 32:
        return _convert_float(handle.data, dtype, tl.float32, None).view(np.float32)
    return handle.data


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """Drop-in for ``InterpreterBuilder.create_dot``: the product of the operands' values."""
    from triton.runtime.interpreter import TensorHandle

    product = np.matmul(_operand_f32(a), _operand_f32(b), dtype=np.float32).astype(d.data.dtype)
    return TensorHandle(product + d.data, d.dtype.scalar)


def install() -> None:
    """Route the interpreter's float conversions and dot operands through torch (idempotent)."""
    from triton.runtime import interpreter

    interpreter._convert_float = _convert_float
    interpreter.InterpreterBuilder.create_dot = _create_dot
