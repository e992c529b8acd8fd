"""Configuration from arguments and from the environment, and the one table that documents every variable."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mori_sglang import config, env
from mori_sglang.config import (
    CombineDtype,
    ConfigError,
    DispatchDtype,
    EpConfig,
    Mode,
    Provider,
    dtypes_from_env,
)
from mori_sglang.env import EnvError

ROOT = Path(__file__).resolve().parents[2]
FP4 = torch.float4_e2m1fn_x2
SHAPE = {"world_size": 8, "rank": 3, "hidden": 7168, "num_experts": 256, "topk": 8}


def from_env(environ: dict[str, str], **kwargs: object) -> EpConfig:
    return EpConfig.from_env(**{**SHAPE, **kwargs}, environ=environ)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "dispatch", "combine"),
    [
        (None, DispatchDtype.BF16, CombineDtype.BF16),
        (torch.bfloat16, DispatchDtype.BF16, CombineDtype.BF16),
        (torch.float8_e4m3fn, DispatchDtype.FP8, CombineDtype.BF16),
        (torch.float8_e4m3fnuz, DispatchDtype.FP8, CombineDtype.BF16),
        (FP4, DispatchDtype.MXFP4, CombineDtype.BF16),
    ],
)
def test_auto_follows_the_weight_dtype(
    weights: torch.dtype | None, dispatch: DispatchDtype, combine: CombineDtype
) -> None:
    assert dtypes_from_env(weights, {}) == (dispatch, combine)
    auto = {"SGLANG_MORI_DISPATCH_DTYPE": "auto", "SGLANG_MORI_COMBINE_DTYPE": "auto"}
    assert dtypes_from_env(weights, auto) == (dispatch, combine)


@pytest.mark.parametrize(("ep_v2", "combine"), [("1", CombineDtype.BF16), ("0", CombineDtype.FP8_BLOCKWISE)])
def test_fp4_weights_combine_as_sglangs_dispatcher_of_that_ep_version_does(ep_v2: str, combine: CombineDtype) -> None:
    """SGLang's EP v2 dispatcher (the default) combines in bf16 whatever the weights; its v1 one in fp8
    for fp4 weights. A combine the user sets wins either way."""
    assert dtypes_from_env(FP4, {"SGLANG_MORI_EP_V2": ep_v2}) == (DispatchDtype.MXFP4, combine)
    chosen = {"SGLANG_MORI_EP_V2": ep_v2, "SGLANG_MORI_COMBINE_DTYPE": "fp8_direct_cast"}
    assert dtypes_from_env(FP4, chosen)[1] is CombineDtype.FP8_DIRECT_CAST


@pytest.mark.parametrize(
    ("value", "dispatch"),
    [
        ("bf16", DispatchDtype.BF16),
        ("fp8", DispatchDtype.FP8),
        ("mxfp8", DispatchDtype.MXFP8),
        ("fp4", DispatchDtype.MXFP4),
    ],
)
@pytest.mark.parametrize("weights", [None, torch.float8_e4m3fn, FP4])
def test_dispatch_dtype_overrides_the_weights(value: str, dispatch: DispatchDtype, weights: torch.dtype | None) -> None:
    assert dtypes_from_env(weights, {"SGLANG_MORI_DISPATCH_DTYPE": value})[0] is dispatch
    assert dtypes_from_env(weights, {"SGLANG_MORI_DISPATCH_DTYPE": value.upper()})[0] is dispatch


@pytest.mark.parametrize(
    ("value", "combine"),
    [
        ("bf16", CombineDtype.BF16),
        ("fp8", CombineDtype.FP8_BLOCKWISE),
        ("fp8_direct_cast", CombineDtype.FP8_DIRECT_CAST),
        ("fp4", CombineDtype.FP4_BLOCKWISE),
    ],
)
@pytest.mark.parametrize("weights", [None, FP4])
def test_combine_dtype_overrides_the_weights(value: str, combine: CombineDtype, weights: torch.dtype | None) -> None:
    assert dtypes_from_env(weights, {"SGLANG_MORI_COMBINE_DTYPE": value})[1] is combine


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("SGLANG_MORI_DISPATCH_DTYPE", "fp16"),
        ("SGLANG_MORI_DISPATCH_DTYPE", "nvfp4"),
        ("SGLANG_MORI_COMBINE_DTYPE", "fp8_blockwise"),
        ("SGLANG_MORI_BACKEND", "deepep"),
        ("SGLANG_MORI_FP8_TYPE", "e5m2"),
    ],
)
def test_unknown_choice_names_the_variable_and_every_accepted_value(name: str, bad: str) -> None:
    with pytest.raises(EnvError) as err:
        from_env({name: bad})
    message = str(err.value)
    assert name in message and bad in message
    for choice in env.ENV_BY_NAME[name].choices or ():
        assert choice in message


@pytest.mark.parametrize(
    "name",
    [
        "SGLANG_MORI_FP8_DISP",
        "SGLANG_MORI_FP4_DISP",
        "SGLANG_MORI_FP8_COMB",
        "SGLANG_MORI_SPLIT_DISPATCH_COMBINE",
    ],
)
def test_bad_boolean_names_the_variable(name: str) -> None:
    with pytest.raises(EnvError, match=rf"{name}='maybe'.*1/0"):
        from_env({name: "maybe"})


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " 1 "])
def test_truthy_booleans(value: str) -> None:
    assert env.get_bool("MORI_ENABLE_SDMA", {"MORI_ENABLE_SDMA": value})


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_falsy_booleans(value: str) -> None:
    assert not env.get_bool("MORI_ENABLE_SDMA", {"MORI_ENABLE_SDMA": value})
    assert not env.get_bool("MORI_ENABLE_SDMA", {})


def test_bad_sdma_value_names_the_variable() -> None:
    with pytest.raises(EnvError, match="MORI_ENABLE_SDMA"):
        env.get_bool("MORI_ENABLE_SDMA", {"MORI_ENABLE_SDMA": "2"})


# ---------------------------------------------------------------------------------------------
# deprecated booleans
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "dispatch"),
    [
        ({"SGLANG_MORI_FP8_DISP": "1"}, DispatchDtype.FP8),
        ({"SGLANG_MORI_FP4_DISP": "true"}, DispatchDtype.MXFP4),
        ({"SGLANG_MORI_FP8_DISP": "0"}, DispatchDtype.BF16),
    ],
)
def test_deprecated_dispatch_flags_count_when_the_new_variable_is_unset(
    flags: dict[str, str], dispatch: DispatchDtype
) -> None:
    assert dtypes_from_env(None, flags)[0] is dispatch


@pytest.mark.parametrize("new", ["bf16", "mxfp8", "auto"])
@pytest.mark.parametrize("flag", ["SGLANG_MORI_FP8_DISP", "SGLANG_MORI_FP4_DISP"])
def test_deprecated_dispatch_flags_are_ignored_when_the_new_variable_is_set(new: str, flag: str) -> None:
    want = DispatchDtype.BF16 if new == "auto" else DispatchDtype(new)
    assert dtypes_from_env(None, {"SGLANG_MORI_DISPATCH_DTYPE": new, flag: "1"})[0] is want


def test_deprecated_combine_flag() -> None:
    assert dtypes_from_env(None, {"SGLANG_MORI_FP8_COMB": "1"})[1] is CombineDtype.FP8_BLOCKWISE
    assert dtypes_from_env(None, {"SGLANG_MORI_FP8_COMB": "0"})[1] is CombineDtype.BF16
    for new, want in (("bf16", CombineDtype.BF16), ("fp8_direct_cast", CombineDtype.FP8_DIRECT_CAST)):
        got = dtypes_from_env(None, {"SGLANG_MORI_COMBINE_DTYPE": new, "SGLANG_MORI_FP8_COMB": "1"})[1]
        assert got is want


# ---------------------------------------------------------------------------------------------
# EpConfig.from_env
# ---------------------------------------------------------------------------------------------


def test_from_env_defaults() -> None:
    cfg = from_env({})
    assert cfg.max_tokens_per_rank == 4096
    assert (cfg.dispatch_dtype, cfg.combine_dtype, cfg.mode) == (DispatchDtype.BF16, CombineDtype.BF16, Mode.INTRANODE)
    assert cfg.provider is Provider.AUTO and cfg.fp8_dtype is None and cfg.combine_block == 128
    assert (cfg.world_size, cfg.rank, cfg.num_local_experts, cfg.max_recv_tokens) == (8, 3, 32, 8 * 4096)


def test_from_env_reads_every_knob() -> None:
    cfg = from_env(
        {
            "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "256",
            "SGLANG_MORI_DISPATCH_DTYPE": "mxfp8",
            "SGLANG_MORI_COMBINE_DTYPE": "fp8",
            "SGLANG_MORI_SPLIT_DISPATCH_COMBINE": "1",
            "SGLANG_MORI_BACKEND": "torch",
            "SGLANG_MORI_FP8_TYPE": "e4m3fnuz",
            "MORI_FP8_COMBINE_SCALE_DIM": "56",
        },
        hidden=4096,
    )
    assert cfg.max_tokens_per_rank == 256 and cfg.max_recv_tokens == 8 * 256
    assert cfg.dispatch_dtype is DispatchDtype.MXFP8 and cfg.combine_dtype is CombineDtype.FP8_BLOCKWISE
    assert cfg.mode is Mode.SPLIT and cfg.provider is Provider.TORCH
    assert cfg.fp8_dtype == torch.float8_e4m3fnuz
    assert cfg.combine_block == 74  # ceil(4096 / 56), as native MoRI sizes its blocks


@pytest.mark.parametrize(("hidden", "dim", "block"), [(7168, "56", 128), (7168, "64", 112), (7168, "", 128)])
def test_combine_scale_dim(hidden: int, dim: str, block: int) -> None:
    assert from_env({"MORI_FP8_COMBINE_SCALE_DIM": dim}, hidden=hidden).combine_block == block


@pytest.mark.parametrize(
    ("low_latency", "split", "mode"),
    [
        (False, "0", Mode.INTRANODE),
        (False, "1", Mode.SPLIT),
        (True, "0", Mode.LOW_LATENCY),
        (True, "1", Mode.LOW_LATENCY),
    ],
)
def test_modes(low_latency: bool, split: str, mode: Mode, caplog: pytest.LogCaptureFixture) -> None:
    """The split variable splits the normal mode; under the low-latency mode it changes nothing, and
    the config says so rather than leave the knob silently unread."""
    config._warn_split_unused.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mori_sglang.config"):
        for _ in range(3):  # one config per MoE layer: one line
            cfg = from_env({"SGLANG_MORI_SPLIT_DISPATCH_COMBINE": split}, low_latency=low_latency)
    assert cfg.mode is mode
    ignored = [r.getMessage() for r in caplog.records if "SGLANG_MORI_SPLIT_DISPATCH_COMBINE is on" in r.getMessage()]
    assert len(ignored) == (low_latency and split == "1")


@pytest.mark.parametrize(
    ("mode", "dispatch_mode", "combine_mode"),
    [
        (Mode.INTRANODE, Mode.INTRANODE, Mode.INTRANODE),
        (Mode.LOW_LATENCY, Mode.LOW_LATENCY, Mode.LOW_LATENCY),
        (Mode.SPLIT, Mode.INTRANODE, Mode.LOW_LATENCY),
    ],
)
def test_split_mode_is_intranode_dispatch_and_low_latency_combine(
    mode: Mode, dispatch_mode: Mode, combine_mode: Mode
) -> None:
    cfg = EpConfig(**SHAPE, mode=mode)
    assert (cfg.dispatch_mode, cfg.combine_mode) == (dispatch_mode, combine_mode)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
@pytest.mark.parametrize("name", ["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "MORI_FP8_COMBINE_SCALE_DIM"])
def test_bad_integer_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(EnvError, match=name):
        from_env({name: value})


def test_weight_dtype_and_overrides() -> None:
    cfg = from_env({"SGLANG_MORI_EP_V2": "0"}, weight_dtype=FP4, max_tokens_per_rank=17, rank=0)
    assert cfg.dispatch_dtype is DispatchDtype.MXFP4 and cfg.combine_dtype is CombineDtype.FP8_BLOCKWISE
    assert cfg.max_tokens_per_rank == 17 and cfg.rank == 0


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_MORI_DISPATCH_DTYPE", "fp8")
    monkeypatch.setenv("SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "64")
    cfg = EpConfig.from_env(**SHAPE)
    assert cfg.dispatch_dtype is DispatchDtype.FP8 and cfg.max_tokens_per_rank == 64


# ---------------------------------------------------------------------------------------------
# EpConfig from arguments
# ---------------------------------------------------------------------------------------------


def test_enum_fields_accept_their_values() -> None:
    cfg = EpConfig(**SHAPE, dispatch_dtype="fp4", combine_dtype="fp8_direct_cast", mode="split", provider="torch")
    assert cfg.dispatch_dtype is DispatchDtype.MXFP4 and cfg.combine_dtype is CombineDtype.FP8_DIRECT_CAST
    assert cfg.mode is Mode.SPLIT and cfg.provider is Provider.TORCH
    assert cfg.with_rank(5).rank == 5 and cfg.with_rank(5).dispatch_dtype is DispatchDtype.MXFP4


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("dispatch_dtype", "fp16", [d.value for d in DispatchDtype]),
        ("combine_dtype", "int8", [d.value for d in CombineDtype]),
        ("mode", "normal", [m.value for m in Mode]),
        ("provider", "deepep", [p.value for p in Provider]),
    ],
)
def test_bad_enum_field_lists_accepted_values(field: str, value: str, accepted: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        EpConfig(**SHAPE, **{field: value})
    assert field in str(err.value) and all(a in str(err.value) for a in accepted)


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [
        ({"world_size": 0, "rank": 0}, "world_size"),
        ({"rank": 8}, "rank"),
        ({"rank": -1}, "rank"),
        ({"num_experts": 250}, "num_experts"),
        ({"topk": 0}, "topk"),
        ({"topk": 257}, "topk"),
        ({"max_tokens_per_rank": 0}, "max_tokens_per_rank"),
        ({"hidden": 0}, "hidden"),
        ({"fp8_dtype": torch.float16}, "fp8_dtype"),
        ({"combine_block": 0}, "combine_block"),
        ({"scale_bytes": 6}, "scale_bytes=6 must be a whole number of 4-byte words"),
        ({"scale_bytes": -4}, "scale_bytes=-4"),
        ({"peer_timeout_s": 2e9}, r"SGLANG_MORI_PEER_TIMEOUT_S\) must be a number of seconds in \(0, 1000000000\]"),
    ],
)
def test_out_of_range_config_names_the_knob(overrides: dict[str, object], knob: str) -> None:
    with pytest.raises(ConfigError, match=knob):
        EpConfig(**{**SHAPE, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens_per_rank", 4096 / 2),  # a division's result: once a scatter dtype error at dispatch
        ("hidden", 7168.0),
        ("topk", "8"),
        ("num_experts", True),
        ("rank", None),
        ("scale_bytes", 8.0),  # once "the op carries 8.0 B scale rows" at every dispatch
        ("combine_block", 64.0),
    ],
)
def test_non_integer_sizes_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{field}={value!r} must be an integer, got {type(value).__name__}"):
        EpConfig(**{**SHAPE, field: value})  # type: ignore[arg-type]


def test_numpy_integers_are_sizes_and_a_timeout_must_be_a_number() -> None:
    cfg = EpConfig(**{**SHAPE, "hidden": np.int64(7168), "scale_bytes": np.int32(8)})
    assert type(cfg.hidden) is int and type(cfg.scale_bytes) is int and cfg.hidden == 7168
    with pytest.raises(ConfigError, match=r"peer_timeout_s='5' \(SGLANG_MORI_PEER_TIMEOUT_S\) must be a number"):
        EpConfig(**{**SHAPE, "peer_timeout_s": "5"})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# one place documents every variable
# ---------------------------------------------------------------------------------------------


def test_every_variable_the_package_reads_is_documented() -> None:
    """Any ``SGLANG_MORI_*`` / ``MORI_*`` name in the package source must be a row of the env table (but
    an attribute, such as ``shmem.MORI_SHMEM_INIT_WITH_UNIQUEID``, MoRI's flag constant)."""
    pattern = re.compile(r"(?<![.\w])(?:SGLANG_)?MORI_[A-Z0-9_]*[A-Z0-9]\b")
    names = set()
    for path in (ROOT / "mori_sglang").rglob("*.py"):
        names |= set(pattern.findall(path.read_text()))
    assert names, "found no variable names: the scan is broken"
    assert names <= set(env.ENV_BY_NAME), f"undocumented: {sorted(names - set(env.ENV_BY_NAME))}"


def test_markdown_table_has_one_row_per_variable() -> None:
    table = env.markdown_table().splitlines()
    assert table[0].startswith("| variable |") and len(table) == 2 + len(env.ENV_VARS)
    for var, row in zip(env.ENV_VARS, table[2:], strict=True):
        assert row.startswith(f"| `{var.name}` | `{var.default or '(unset)'}` |")
        for choice in var.choices or ():
            assert choice in row


def test_env_cli_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mori_sglang.env", "--markdown"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == env.markdown_table()


def test_env_cli_prints_the_choices_of_the_variables_asked_for() -> None:
    """One line per variable, for the launch scripts; a variable without a fixed set of values is refused."""
    names = ["SGLANG_MORI_BACKEND", "SGLANG_MORI_COMBINE_DTYPE"]
    command = [sys.executable, "-m", "mori_sglang.env", "--choices"]
    out = subprocess.run([*command, *names], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert [tuple(line.split()) for line in out.splitlines()] == [env.ENV_BY_NAME[n].choices for n in names]
    proc = subprocess.run([*command, "SGLANG_MORI_EP_V2"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "error: --choices SGLANG_MORI_EP_V2: not a variable with a fixed set of values (" in proc.stderr


def test_env_cli_prints_checked_values_without_warnings() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_MORI_", "MORI_", "TRTLLM_"))}
    command = [sys.executable, "-m", "mori_sglang.env"]
    proc = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**clean, "SGLANG_MORI_BACKEND": "torch"}
    )
    assert proc.returncode == 0 and proc.stderr == ""  # no RuntimeWarning from runpy
    lines = proc.stdout.splitlines()
    assert lines == [f"{v.name}={'torch' if v.name == 'SGLANG_MORI_BACKEND' else v.default}" for v in env.ENV_VARS]
    bad = {
        **clean,
        "SGLANG_MORI_COMBINE_DTYPE": "fp9",
        "SGLANG_MORI_FP8_COMB": "maybe",
        "MORI_FP8_COMBINE_SCALE_DIM": "0",
    }
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=bad)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "python -m mori_sglang.env: error: SGLANG_MORI_COMBINE_DTYPE='fp9' is not accepted; use one of: "
        "auto, bf16, fp8, fp8_direct_cast, fp4",
        "python -m mori_sglang.env: error: SGLANG_MORI_FP8_COMB='maybe' is not a boolean; use 1/0, true/false, "
        "yes/no, y/n or on/off",
        "python -m mori_sglang.env: error: MORI_FP8_COMBINE_SCALE_DIM=0 must be a positive integer",
    ]


def test_package_exports_load_on_first_use() -> None:
    import mori_sglang

    for name in mori_sglang.__all__:
        assert getattr(mori_sglang, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = mori_sglang.nothing


def test_readme_env_table_is_generated() -> None:
    """README.md carries exactly ``markdown_table()`` between its markers (regenerate with
    ``python -m mori_sglang.env --markdown``)."""
    readme = ROOT / "README.md"
    assert readme.exists(), "README.md is missing"
    text = readme.read_text()
    start, end = "<!-- env-table:start -->", "<!-- env-table:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, "README.md needs one pair of env-table markers"
    body = text.split(start, 1)[1].split(end, 1)[0]
    assert body.strip() == env.markdown_table(), "README env table is stale: python -m mori_sglang.env --markdown"


@pytest.mark.parametrize(
    ("value", "ok"),
    [("8G", True), ("16g", True), ("2147483648", True), ("1.5GiB", True), ("lots", False), ("-8G", False)],
)
def test_sizes_read_as_moris_heap_size_is_written(value: str, ok: bool) -> None:
    environ = {"MORI_SHMEM_HEAP_SIZE": value}
    if ok:
        assert env.get_size("MORI_SHMEM_HEAP_SIZE", environ) == value
    else:
        with pytest.raises(env.EnvError, match=f"MORI_SHMEM_HEAP_SIZE='{value}' is not a size"):
            env.get_size("MORI_SHMEM_HEAP_SIZE", environ)
    assert env.get_size("MORI_SHMEM_HEAP_SIZE", {}) is None


# ---------------------------------------------------------------------------------------------
# variables of one provider
# ---------------------------------------------------------------------------------------------


def test_only_native_moris_variables_say_so() -> None:
    """The table's help and its providers field agree: a variable documented as native MoRI's is read
    by no other provider, and every provider a variable names exists."""
    for var in env.ENV_VARS:
        assert var.help.startswith("Native MoRI") == (var.providers == ("mori",)), var.name
        assert set(var.providers) <= {p.value for p in Provider}, var.name


@pytest.mark.parametrize(
    ("environ", "provider", "ignored"),
    [
        ({"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "4096"}, "triton", ["SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS"]),
        ({"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "4096"}, "mori", []),
        ({"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "0"}, "torch", []),  # the default asks for nothing
        ({"SGLANG_MORI_EP_V2": "true", "MORI_ENABLE_SDMA": "off"}, "torch", []),
        ({"SGLANG_MORI_EP_V2": "0", "MORI_ENABLE_SDMA": "1"}, "torch", ["MORI_ENABLE_SDMA"]),
        # SGLang's launcher writes SGLANG_MORI_EP_V2=False; FlashInfer reads TRTLLM_ENABLE_PDL
        ({"SGLANG_MORI_EP_V2": "False", "TRTLLM_ENABLE_PDL": "0"}, "triton", []),
        ({"TRTLLM_ENABLE_PDL": "0"}, "mori", []),
        (
            {"SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD": "64"},
            "triton",
            ["SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD"],
        ),
        ({"TRTLLM_ENABLE_PDL": "0"}, "triton", []),
        ({"SGLANG_MORI_PEER_TIMEOUT_S": "5", "SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD": ""}, "torch", []),
    ],
)
def test_variables_another_provider_reads(environ: dict[str, str], provider: str, ignored: list[str]) -> None:
    assert env.ignored_by_provider(provider, environ) == ignored


def test_op_warns_of_a_variable_its_provider_does_not_read(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mori_sglang import op as op_module
    from mori_sglang.loopback import LoopbackWorld

    op_module._warn_ignored_env.cache_clear()
    for var in env.ENV_VARS:  # whatever the caller's shell holds
        if var.providers:
            monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS", "256")
    cfg = EpConfig(2, 0, 256, 8, 2, max_tokens_per_rank=4, provider=Provider.TORCH)
    with caplog.at_level("WARNING", logger="mori_sglang.op"):
        LoopbackWorld(cfg, "cpu")
        LoopbackWorld(cfg, "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.name == "mori_sglang.op"]
    assert warnings == [
        "SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS set, but the torch provider does not read it "
        "(see `python -m mori_sglang.env`)"
    ]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SGLANG_MORI_EP_V2", "maybe"),
        ("MORI_ENABLE_SDMA", "x"),
        ("SGLANG_MORI_RECV_BOUND", "maybe"),
        ("SGLANG_MORI_MOE_MAX_INPUT_TOKENS", "-5"),
        ("MORI_SHMEM_HEAP_SIZE", "lots"),
        ("SGLANG_MORI_FP8_COMB", "2"),
    ],
)
def test_op_refuses_a_bad_value_of_any_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """Also variables this provider or path never reads: a typo must not wait for the path that reads it."""
    from mori_sglang.loopback import LoopbackWorld

    monkeypatch.setenv(name, value)
    cfg = EpConfig(2, 0, 256, 8, 2, max_tokens_per_rank=4, provider=Provider.TORCH)
    with pytest.raises(EnvError, match=name):
        LoopbackWorld(cfg, "cpu")


def test_values_print_as_the_project_reads_them() -> None:
    environ = {
        "SGLANG_MORI_COMBINE_DTYPE": " FP8 ",
        "SGLANG_MORI_DISPATCH_DTYPE": "",
        "SGLANG_MORI_PEER_TIMEOUT_S": "",
        "SGLANG_MORI_EP_V2": "on",
        "MORI_ENABLE_SDMA": "False",
        "SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "64",
    }
    got = {var.name: env.read_as_text(var, environ) for var in env.ENV_VARS}
    assert got["SGLANG_MORI_COMBINE_DTYPE"] == "fp8"
    assert got["SGLANG_MORI_DISPATCH_DTYPE"] == "auto"
    assert got["SGLANG_MORI_PEER_TIMEOUT_S"] == str(env.DEFAULT_PEER_TIMEOUT_S)
    assert got["SGLANG_MORI_EP_V2"] == "1" and got["MORI_ENABLE_SDMA"] == "0"
    assert got["SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS"] == "64"
    assert got["MORI_SHMEM_HEAP_SIZE"] == "" and got["MORI_FP8_COMBINE_SCALE_DIM"] == ""
