"""Every environment variable mori-sglang reads, in one table.

Users already configure SGLang's in-tree MoRI backend with ``SGLANG_MORI_*`` variables; we honour
the same names with the same meaning, but an unknown value is an error that names the variable and
the accepted values (upstream silently ignores it). ``README.md`` carries a table generated from
``ENV_VARS`` (``python -m mori_sglang.env --markdown``); a test keeps the two in sync.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from mori_sglang.wire_formats import COMBINE_ENV_NAMES, DISPATCH_ENV_NAMES

# SGLang's own booleans (sglang.srt.environ.EnvBool) take 1/true/yes/y and 0/false/no/n.
BOOL_TRUE = ("1", "true", "yes", "y", "on")
# The most tokens one rank may dispatch per call: far above any serving batch, and small enough that
# every row index of the buffers stays well inside int32.
MAX_TOKENS_PER_RANK = 1 << 20
DEFAULT_MAX_TOKENS_PER_RANK = 4096  # buffer capacity per rank where neither argument nor variable sets it
DEFAULT_PEER_TIMEOUT_S = 120
# The longest peer timeout accepted (about 31 years: "never" for any run). The Triton kernels wait until
# their clock plus the timeout in nanoseconds, an int64 (NVIDIA's clock counts from 1970, ~1.8e18 ns):
# a timeout past ~7e9 s wrapped that deadline negative (every receive gave up at once) and one past
# ~9.2e9 s did not fit a kernel argument at all.
MAX_PEER_TIMEOUT_S = 10**9
BOOL_FALSE = ("0", "false", "no", "n", "off", "")


class EnvError(ValueError):
    """A variable holds a value we do not accept; the message names the knob and the choices."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, accepted values (None = any integer), default and meaning."""

    name: str
    default: str
    help: str
    choices: tuple[str, ...] | None = None
    kind: str = "choice"  # choice | bool | int | seconds | size
    minimum: int = 1  # the smallest integer accepted (kind int)
    maximum: int | None = None  # the largest number accepted (kinds int and seconds), None: no bound
    # The providers (config.Provider values) that read it; empty: every provider. Set for another
    # provider, the op warns that it does nothing (upstream reads these only on its MoRI path), unless
    # ``others_set_it``: a framework writes or reads it for its own ends (SGLang's launcher writes
    # SGLANG_MORI_EP_V2, FlashInfer reads TRTLLM_ENABLE_PDL), so a value there says nothing of the user.
    providers: tuple[str, ...] = ()
    others_set_it: bool = False
    # SGLang reads it too (``sglang.srt.environ``), with this default; None: SGLang does not. Its parser
    # takes neither surrounding spaces nor on/off, so the SGLang launch writes such a boolean back as
    # 1 or 0 for every process (``integrations.sglang.plugin.share_booleans_with_sglang``).
    sglang_default: str | None = None

    def accepted(self) -> str:
        if self.kind == "bool":
            return "0/1 (true/false)"
        if self.kind == "int":
            if self.maximum is not None:
                return f"integer in [{self.minimum}, {self.maximum}]"
            return "integer > 0" if self.minimum == 1 else f"integer >= {self.minimum}"
        if self.kind == "seconds":
            return "number of seconds > 0" if self.maximum is None else f"number of seconds in (0, {self.maximum}]"
        if self.kind == "size":
            return "bytes, with an optional K/M/G/T suffix (e.g. 8G)"
        return " \\| ".join(self.choices or ())


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "SGLANG_MORI_DISPATCH_DTYPE",
        "auto",
        "Dispatch payload. auto follows the MoE weight dtype (fp8 weights -> fp8, fp4 weights -> fp4); "
        "fp4 is MXFP4 (e2m1 + e8m0 per 32).",
        ("auto", *DISPATCH_ENV_NAMES),
    ),
    EnvVar(
        "SGLANG_MORI_COMBINE_DTYPE",
        "auto",
        "Combine payload. fp8 is blockwise FP8 (one f32 scale per block); fp8_direct_cast is a plain "
        "saturating cast; fp4 is blockwise FP4 (native MoRI on gfx950 only). auto: bf16, except fp8 for fp4 "
        "weights with SGLANG_MORI_EP_V2=0 (as SGLang's v1 dispatcher; its EP v2 one combines in bf16).",
        ("auto", *COMBINE_ENV_NAMES),
    ),
    EnvVar(
        "SGLANG_MORI_FP8_DISP",
        "0",
        "Deprecated: fp8 dispatch. Read only when SGLANG_MORI_DISPATCH_DTYPE is unset.",
        kind="bool",
    ),
    EnvVar(
        "SGLANG_MORI_FP4_DISP",
        "0",
        "Deprecated: fp4 dispatch. Read only when SGLANG_MORI_DISPATCH_DTYPE is unset.",
        kind="bool",
    ),
    EnvVar(
        "SGLANG_MORI_FP8_COMB",
        "0",
        "Deprecated: blockwise fp8 combine. Read only when SGLANG_MORI_COMBINE_DTYPE is unset.",
        kind="bool",
    ),
    EnvVar(
        "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
        str(DEFAULT_MAX_TOKENS_PER_RANK),
        "Buffer capacity: the most tokens one rank may dispatch in one call. A larger batch is an error. "
        "SGLang only: under vLLM, --max-num-batched-tokens sets it.",
        kind="int",
        maximum=MAX_TOKENS_PER_RANK,
    ),
    EnvVar(
        "SGLANG_MORI_SPLIT_DISPATCH_COMBINE",
        "0",
        "1 = intranode dispatch with low-latency (async) combine: a variant of the normal mode; under the "
        "low-latency mode it changes nothing (logged once).",
        kind="bool",
    ),
    EnvVar(
        "SGLANG_MORI_BACKEND",
        "auto",
        "Provider: mori (the native MoRI library's HIP kernels), triton (our kernels over symmetric memory), "
        "torch (torch.distributed all_to_all). auto: mori on an AMD GPU (ROCm torch) where `import mori` works, "
        "else triton on a GPU when the ranks run on one host, else torch; triton across hosts is refused.",
        ("auto", "mori", "triton", "torch"),
    ),
    EnvVar(
        "SGLANG_MORI_EP_V2",
        "1",
        "SGLang's MoRI dispatcher version. Native MoRI: 1 runs the intranode mode with a bf16 combine within "
        "one host on MoRI's EP v2 (mori.ops.dispatch_combine_v2, its hip backend); the low-latency and split "
        "modes (AsyncLL), quantized combines and groups across hosts stay on v1. 0: v1 everywhere. Every "
        "provider: the combine default for fp4 weights follows it as SGLang's does (bf16 under EP v2, fp8 "
        "under v1). "
        "SGLang's launcher sets it (False) where its own EP v2 checks fail; a value set is written back as 1 or 0 "
        "at launch, before SGLang reads it, so both read it alike.",
        kind="bool",
        others_set_it=True,
        sglang_default="1",
    ),
    EnvVar(
        "SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD",
        "256",
        "Native MoRI across hosts: SGLang runs InterNodeV1LL when SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK "
        "is at most this; here InterNodeV1 runs at every size (InterNodeV1LL's receiver sends a dropped id, "
        "-1, to rank 0), so the value is checked and chooses nothing.",
        kind="int",
        providers=("mori",),
    ),
    EnvVar(
        "SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS",
        "0",
        "Native MoRI only: cap on the tokens one rank receives per call (MoRI's max_total_recv_tokens; "
        "0: every rank may send its whole buffer). EP v2's hip backend refuses a cap below that, and so "
        "does v1's IntraNode kernel here (it does not check the cap).",
        kind="int",
        minimum=0,
        providers=("mori",),
    ),
    EnvVar(
        "SGLANG_MORI_RECV_BOUND",
        "1",
        "SGLang only: 1, without two-batch overlap, hands the experts only SGLang's bound on the rows a "
        "dispatch can have received (the output's recv_cap); 0: the whole receive buffer. Upstream's "
        "default is 0 (AITER keeps its own view); on NVIDIA the Triton experts' work grows with the rows. "
        "SGLang's attention-DP bookkeeping reads it too, with its own parser and default (0): the launch writes "
        "it as 1 or 0, our reading (1 where unset), so both agree.",
        kind="bool",
        sglang_default="0",
    ),
    EnvVar(
        "SGLANG_MORI_FP8_TYPE",
        "auto",
        "FP8 flavour on the wire. auto: e4m3fnuz on gfx942, e4m3fn elsewhere.",
        ("auto", "e4m3fn", "e4m3fnuz"),
    ),
    EnvVar(
        "MORI_ENABLE_SDMA",
        "0",
        "Native MoRI only: copy intranode payloads with the SDMA engines.",
        kind="bool",
        providers=("mori",),
    ),
    EnvVar(
        "TRTLLM_ENABLE_PDL",
        "1",
        "Triton provider on NVIDIA sm_90+: 0 launches our kernels without programmatic dependent launch "
        "(the variable with which SGLang turns it off for FlashInfer's kernels).",
        kind="bool",
        providers=("triton",),
        others_set_it=True,
    ),
    EnvVar(
        "SGLANG_MORI_PEER_TIMEOUT_S",
        str(DEFAULT_PEER_TIMEOUT_S),
        "How long a receive waits for a peer that never sends before it raises PeerTimeoutError naming "
        "this rank (wall-clock seconds). Triton provider: in the kernels, every mode, naming the peer; torch "
        "provider: per peer over gloo, the whole all_to_all over NCCL / RCCL (a host wait per receive; inside "
        "a CUDA graph only synchronize() bounds it); native MoRI: only synchronize(), MoRI's kernels have no "
        "timeout (docs/api.md).",
        kind="seconds",
        maximum=MAX_PEER_TIMEOUT_S,
    ),
    EnvVar(
        "MORI_SHMEM_HEAP_SIZE",
        "",
        "MoRI's symmetric heap, read by MoRI. Under vLLM with --moe-backend aiter_mega_moe the manager sets "
        "native MoRI's default where it is unset: 8G, 16G with a fused mxfp4 shared expert.",
        kind="size",
    ),
    EnvVar(
        "SGLANG_MORI_MOE_MAX_INPUT_TOKENS",
        "0",
        "SGLang only: upstream's manual cap on the rows handed to the experts, which drops the received rows "
        "past it unseen. Checked, and not applied (a warning says so): the dispatcher hands the experts "
        "SGLang's proven bound (SGLANG_MORI_RECV_BOUND) or the whole buffer, never fewer rows than it received.",
        kind="int",
        minimum=0,
    ),
    EnvVar(
        "MORI_FP8_COMBINE_SCALE_DIM",
        "",
        "Scales per token of the blockwise fp8 combine; the block is ceil(hidden / value), the last one short "
        "where it does not divide hidden. Unset: MoRI's 56 for MoRI's format (fp8_blockwise_native, and "
        "native MoRI, which reads it itself), blocks of 128 for ours (fp8).",
        kind="int",
    ),
)

ENV_BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    value = env.get(name)
    return None if value is None else value.strip()


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    return _raw(name, environ) is not None


def get_choice(name: str, environ: Mapping[str, str] | None = None) -> str:
    var = ENV_BY_NAME[name]
    value = _raw(name, environ)
    if value is None or value == "":
        return var.default
    value = value.lower()
    if value not in (var.choices or ()):
        raise EnvError(f"{name}={value!r} is not accepted; use one of: {', '.join(var.choices or ())}")
    return value


def get_bool(name: str, environ: Mapping[str, str] | None = None) -> bool:
    var = ENV_BY_NAME[name]
    value = _raw(name, environ)
    value = var.default if value is None else value.lower()
    if value in BOOL_TRUE:
        return True
    if value in BOOL_FALSE:
        return False
    raise EnvError(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no, y/n or on/off")


def get_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The integer value, or None where the variable is unset and has no default."""
    var = ENV_BY_NAME[name]
    value = _raw(name, environ)
    value = var.default if value is None or value == "" else value
    if value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer; use {var.accepted()}") from None
    if number < var.minimum:
        accepted = "a positive integer" if var.minimum == 1 else f"an integer >= {var.minimum}"
        raise EnvError(f"{name}={number} must be {accepted}")
    if var.maximum is not None and number > var.maximum:
        raise EnvError(f"{name}={number} exceeds {var.maximum}, the largest value accepted")
    return number


def get_seconds(name: str, environ: Mapping[str, str] | None = None) -> float:
    """A positive, finite number of seconds, at most the variable's maximum."""
    var = ENV_BY_NAME[name]
    value = _raw(name, environ)
    value = var.default if value is None or value == "" else value
    try:
        seconds = float(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a number; use a {var.accepted()}") from None
    if not 0 < seconds < float("inf"):
        raise EnvError(f"{name}={value!r} must be a finite {var.accepted()}")
    if var.maximum is not None and seconds > var.maximum:
        raise EnvError(f"{name}={value!r} exceeds {var.maximum}, the largest value accepted")
    return seconds


SIZE = re.compile(r"\d+(\.\d+)?\s*([kmgt]i?b?|b)?", re.IGNORECASE)


def get_size(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A byte size as MoRI reads it (``8G``), checked and returned as written; None where unset."""
    value = _raw(name, environ)
    if value is None or value == "":
        return None
    if not SIZE.fullmatch(value):
        raise EnvError(f"{name}={value!r} is not a size; use {ENV_BY_NAME[name].accepted()}")
    return value


def ignored_by_provider(provider: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables set to something other than their default that only other providers read."""
    return [
        var.name
        for var in ENV_VARS
        if var.providers
        and provider not in var.providers
        and not var.others_set_it
        and _differs_from_default(var, environ)
    ]


def _differs_from_default(var: EnvVar, environ: Mapping[str, str] | None) -> bool:
    """Whether the variable, read as the project reads it, differs from its default (``true`` is the
    default ``1``); a value it refuses differs."""
    read = READERS[var.kind]
    try:
        return read(var.name, environ) != read(var.name, {})
    except EnvError:
        return True


def read_as_text(var: EnvVar, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value as the project reads it, written as it would be set (``1`` for true,
    ``120`` for 120.0 s, empty where unset without a default)."""
    value = READERS[var.kind](var.name, environ)
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def markdown_table() -> str:
    """The README table of every variable."""
    lines = ["| variable | default | accepted | meaning |", "| --- | --- | --- | --- |"]
    for var in ENV_VARS:
        default = var.default if var.default != "" else "(unset)"
        lines.append(f"| `{var.name}` | `{default}` | {var.accepted()} | {var.help} |")
    return "\n".join(lines)


# How each kind of variable is read (and checked); every EnvVar.kind has one.
READERS = {"choice": get_choice, "bool": get_bool, "int": get_int, "seconds": get_seconds, "size": get_size}


def check(var: EnvVar, environ: Mapping[str, str] | None = None) -> None:
    """Raise EnvError where the variable holds a value the project does not accept."""
    READERS[var.kind](var.name, environ)


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every variable of the table, read on this path or not; raises ``EnvError`` naming the
    first bad one (a typo in a variable another path reads must not wait for that path)."""
    for var in ENV_VARS:
        check(var, environ)


def main(argv: list[str] | None = None) -> int:
    """Print every variable as the project reads it (its value, or the default), after checking it."""
    parser = argparse.ArgumentParser(prog="python -m mori_sglang.env", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument(
        "--choices",
        nargs="+",
        metavar="VARIABLE",
        help="print the values each variable accepts, one line per variable, space-separated (for scripts)",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return 0
    if args.choices:
        for name in args.choices:
            var = ENV_BY_NAME.get(name)
            if var is None or var.choices is None:
                listed = ", ".join(v.name for v in ENV_VARS if v.choices)
                parser.error(f"--choices {name}: not a variable with a fixed set of values ({listed})")
            print(" ".join(var.choices))
        return 0
    errors = []
    for var in ENV_VARS:
        try:
            check(var)
        except EnvError as e:
            errors.append(str(e))
    if errors:
        for error in errors:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    for var in ENV_VARS:
        print(f"{var.name}={read_as_text(var)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
