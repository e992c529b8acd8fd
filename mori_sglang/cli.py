"""What every command shares: argument types, the format vocabulary, the device, and clean failures.

Exit codes, the same for every command: 2 and argparse's one-line usage error for a bad argument
(a value out of range, an unknown name, sizes that do not fit a wire format); 1 and one sentence
naming the knob for a configuration this machine cannot run (no GPU for ``--device cuda``, Triton's
interpreter not enabled, not started by torchrun, a bad ``SGLANG_MORI_*`` value). A traceback means a
bug of ours.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import torch

from mori_sglang import formats, wire_formats
from mori_sglang.config import (
    COMBINE_ENV_VALUES,
    DISPATCH_ENV_VALUES,
    CombineDtype,
    ConfigError,
    DispatchDtype,
    EpConfig,
    Provider,
)
from mori_sglang.env import EnvError
from mori_sglang.formats import FormatError
from mori_sglang.kernels.interpreter import InterpreterError, install_exact_casts, interpreting

T = TypeVar("T")
DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")


class SetupError(RuntimeError):
    """This machine or environment cannot run what the arguments ask for; the message names the knob."""


# Errors that are a user's configuration, not a bug: reported as one sentence with exit status 1.
CONFIGURATION_ERRORS = (SetupError, ConfigError, EnvError, FormatError, InterpreterError)


def at_least(minimum: float, kind: Callable[[str], float] = int) -> Callable[[str], float]:
    """An argparse type that rejects values below ``minimum`` with a message naming the bound."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        return value

    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def output_file(text: str) -> str:
    """An argparse type for a file a command writes when it ends (``--json``, ``--plot``): refused at
    once, not after a run of minutes, where its folder is missing or not writable or it is a folder."""
    path = Path(text)
    folder = path.parent  # "." for a bare file name
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return text


def output_folder(text: str) -> str:
    """An argparse type for a folder a command creates and writes into (``--output-dir``): refused at
    once where the path is a file, or where the nearest folder that exists is not writable."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; name a folder")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not writable")
    return text


def port(text: str) -> int:
    """An argparse type for a TCP port: 1 to 65535."""
    number = at_least(1)(text)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1 to 65535)")
    return int(number)


def combine_dtype(text: str) -> CombineDtype:
    """A combine format by its ``SGLANG_MORI_COMBINE_DTYPE`` name (bf16, fp8, fp8_direct_cast, fp4) or
    its long name (fp8_blockwise, fp8_blockwise_native, fp4_blockwise)."""
    name = text.strip().lower()
    if name in COMBINE_ENV_VALUES:
        return COMBINE_ENV_VALUES[name]
    try:
        return CombineDtype(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a combine format; use {combine_names()}") from None


def dispatch_dtype(text: str) -> DispatchDtype:
    """A dispatch format by its ``SGLANG_MORI_DISPATCH_DTYPE`` name (bf16, fp8, mxfp8, fp4)."""
    name = text.strip().lower()
    if name in DISPATCH_ENV_VALUES:
        return DISPATCH_ENV_VALUES[name]
    raise argparse.ArgumentTypeError(f"{text!r} is not a dispatch format; use {', '.join(DISPATCH_ENV_VALUES)}")


def combine_names() -> str:
    """The accepted combine names, env names first, for help and error messages."""
    long_names = [d.value for d in CombineDtype if d.value not in COMBINE_ENV_VALUES]
    return ", ".join([*COMBINE_ENV_VALUES, *long_names])


def combine_name(dtype: CombineDtype) -> str:
    """What a user writes for a combine format: its env name where it has one, else its long name."""
    return wire_formats.COMBINE_BY_NAME[dtype.value].user_name


def device_name(text: str) -> str:
    """An argparse type for ``--device``: auto, cpu, cuda or cuda:N."""
    if not DEVICE_NAMES.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use auto, cpu, cuda or cuda:N")
    return text


def resolve_device(name: str) -> torch.device:
    """``auto``: the current GPU where torch sees one, else the CPU; a GPU with its index (``cuda`` is
    the current one), as Triton's stream and device queries take it. A GPU torch does not see is a
    SetupError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SetupError(f"--device {name}: this torch sees no GPU; use --device cpu or auto")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise SetupError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def check_wire(config: EpConfig) -> None:
    """What an op checks of its config when it is built (the formats' hidden-size rules, and the Triton
    kernels' 4-byte words), for a command to refuse sizes while it parses its arguments. Call it after
    choosing the interpreter: it imports the Triton provider for a triton config."""
    layout = formats.DispatchRowLayout(
        formats.dispatch_token_bytes(config.dispatch_dtype, config.hidden),
        formats.dispatch_scale_bytes(config.dispatch_dtype, config.hidden),
        config.topk,
    )
    formats.check_combine_reference(config.combine_dtype)
    if config.provider is Provider.TRITON:
        from mori_sglang.providers.triton_provider import check_word_rows

        check_word_rows(config, layout)


def check_triton_runs(device: torch.device, command: str) -> None:
    """For a command that times or probes our Triton kernels: on a CPU they run only in Triton's
    interpreter, which such a command does not turn on by itself (it would time the interpreter, not the
    kernels); where it is on, its exact float casts are installed."""
    if device.type != "cpu":
        return
    if not interpreting():
        raise SetupError(
            f"{command} runs our Triton kernels, which run on a CPU only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 (the times are then the interpreter's), run it on a GPU, or use --provider torch "
            "where the command has one"
        )
    install_exact_casts()


def checked(parser: argparse.ArgumentParser, build: Callable[[], T]) -> T:
    """``build()``, with a configuration the arguments describe but the formats refuse made a usage error."""
    try:
        return build()
    except (ConfigError, FormatError) as e:
        parser.error(str(e))


def run(main: Callable[[Sequence[str] | None], object], prog: str, argv: Sequence[str] | None = None) -> NoReturn:
    """Run a command's ``main`` and exit with its status; a configuration error is one line on stderr and 1."""
    try:
        status = main(argv)
    except CONFIGURATION_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)  # a command's main may return its rows
