"""The table of wire formats is the one source every layer reads: it covers every format exactly once,
its codes are distinct, and the names the environment, the config and the commands accept are its."""

from __future__ import annotations

from mori_sglang import cli, env, wire_formats
from mori_sglang.config import COMBINE_ENV_VALUES, DISPATCH_ENV_VALUES, CombineDtype, DispatchDtype
from mori_sglang.kernels import transport


def test_every_format_has_exactly_one_row() -> None:
    assert [f.name for f in wire_formats.DISPATCH_FORMATS] == [d.value for d in DispatchDtype]
    assert [f.name for f in wire_formats.COMBINE_FORMATS] == [c.value for c in CombineDtype]


def test_kernel_codes_are_distinct_and_the_kernels_compare_with_them() -> None:
    quant = [f.kernel_code for f in wire_formats.DISPATCH_FORMATS]
    combine = [f.kernel_code for f in wire_formats.COMBINE_FORMATS if f.kernel_code is not None]
    assert len(set(quant)) == len(quant) and len(set(combine)) == len(combine)
    assert transport.QUANT_MXFP4.value == wire_formats.QUANT_MXFP4
    assert transport.COMBINE_FP8_BLOCKWISE_NATIVE.value == wire_formats.COMBINE_FP8_BLOCKWISE_NATIVE


def test_the_names_users_write_come_from_the_table() -> None:
    choices = {var.name: var.choices for var in env.ENV_VARS}
    assert choices["SGLANG_MORI_DISPATCH_DTYPE"] == ("auto", *DISPATCH_ENV_VALUES)
    assert choices["SGLANG_MORI_COMBINE_DTYPE"] == ("auto", *COMBINE_ENV_VALUES)
    for fmt in wire_formats.COMBINE_FORMATS:
        dtype = CombineDtype(fmt.name)
        assert cli.combine_dtype(fmt.user_name) is dtype and cli.combine_dtype(fmt.name) is dtype
        assert cli.combine_name(dtype) == fmt.user_name
    for fmt in wire_formats.DISPATCH_FORMATS:
        assert cli.dispatch_dtype(fmt.name) is DispatchDtype(fmt.name)
