"""Typed configuration of one dispatch/combine op, built from arguments or from the environment."""

from __future__ import annotations

import enum
import functools
import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from mori_sglang import env, wire_formats

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the knob and the accepted values."""


class DispatchDtype(str, enum.Enum):
    """Payload of a dispatched token. The quantized ones travel with an opaque per-token scale row.
    One member per row of ``wire_formats.DISPATCH_FORMATS``, whose values they are."""

    BF16 = "bf16"
    FP8 = "fp8"  # e4m3, one f32 scale per 128 elements
    MXFP8 = "mxfp8"  # e4m3, one e8m0 byte per 32 elements
    MXFP4 = "fp4"  # e2m1 packed two per byte (low nibble first), one e8m0 byte per 32 elements


class CombineDtype(str, enum.Enum):
    """Payload of an expert output travelling back to its source rank. One member per row of
    ``wire_formats.COMBINE_FORMATS``, whose long names they are."""

    BF16 = "bf16"
    FP8_BLOCKWISE = "fp8_blockwise"  # ours: scale = amax / fp8_max for every block
    FP8_BLOCKWISE_NATIVE = "fp8_blockwise_native"  # native MoRI's scales (1.0 unless amax > fp8_max)
    FP8_DIRECT_CAST = "fp8_direct_cast"  # saturating cast, no scale
    FP4_BLOCKWISE = "fp4_blockwise"  # native MoRI on gfx950 only


class Mode(str, enum.Enum):
    """How dispatch and combine are driven."""

    INTRANODE = "intranode"  # one call each, variable-size exchange
    LOW_LATENCY = "low_latency"  # fixed per-source slots, *_send / *_recv split
    SPLIT = "split"  # intranode dispatch + low-latency combine


class Provider(str, enum.Enum):
    AUTO = "auto"
    MORI = "mori"
    TRITON = "triton"
    TORCH = "torch"


# What users write (SGLANG_MORI_*_DTYPE, every command's format flags) -> the format (wire_formats.py).
COMBINE_ENV_VALUES = {f.env_name: CombineDtype(f.name) for f in wire_formats.COMBINE_FORMATS if f.env_name}
DISPATCH_ENV_VALUES = {f.name: DispatchDtype(f.name) for f in wire_formats.DISPATCH_FORMATS}
# The fp8 flavours, by their SGLANG_MORI_FP8_TYPE names.
FP8_TYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


# The fields that count something (sizes, ranks, bytes), and those of them where None picks the default.
_INTEGER_FIELDS = ("world_size", "rank", "hidden", "num_experts", "topk", "max_tokens_per_rank")
_OPTIONAL_INTEGER_FIELDS = ("scale_bytes", "combine_block")


def _integer(value: object, knob: str) -> int:
    """``value`` as an int: an int or numpy integer, never a float, a string or a bool. A float size
    (``4096.0``, a division's result) once passed the range checks and failed deep inside a dispatch."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ConfigError(f"{knob}={value!r} must be an integer, got {type(value).__name__}")


def _enum_value(enum_cls: type[enum.Enum], value: object, knob: str) -> enum.Enum:
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        accepted = ", ".join(m.value for m in enum_cls)
        raise ConfigError(f"{knob}={value!r} is not accepted; use one of: {accepted}") from None


@dataclass(frozen=True)
class EpConfig:
    """Everything that sizes the buffers and fixes the wire formats of one op.

    ``scale_bytes`` is the opaque per-token scale row the sender attaches to each dispatched token;
    None means the natural row of ``dispatch_dtype`` (224 B at hidden 7168 for fp8 / mxfp8 / fp4,
    none for bf16). ``combine_block`` is the blockwise-fp8 combine block in elements (None:
    the combine dtype's default, ``default_combine_block``; the last block may be short).
    ``peer_timeout_s``: how long a receive waits for a peer that never sends (SGLANG_MORI_PEER_TIMEOUT_S).
    """

    world_size: int
    rank: int
    hidden: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int = env.DEFAULT_MAX_TOKENS_PER_RANK
    dispatch_dtype: DispatchDtype = DispatchDtype.BF16
    combine_dtype: CombineDtype = CombineDtype.BF16
    mode: Mode = Mode.INTRANODE
    provider: Provider = Provider.AUTO
    scale_bytes: int | None = None
    fp8_dtype: torch.dtype | None = None
    combine_block: int | None = None
    peer_timeout_s: float = env.DEFAULT_PEER_TIMEOUT_S

    def __post_init__(self) -> None:
        for knob, enum_cls in (
            ("dispatch_dtype", DispatchDtype),
            ("combine_dtype", CombineDtype),
            ("mode", Mode),
            ("provider", Provider),
        ):
            object.__setattr__(self, knob, _enum_value(enum_cls, getattr(self, knob), knob))
        for knob in _INTEGER_FIELDS + _OPTIONAL_INTEGER_FIELDS:
            value = getattr(self, knob)
            if value is not None or knob in _INTEGER_FIELDS:
                object.__setattr__(self, knob, _integer(value, knob))
        if isinstance(self.peer_timeout_s, bool) or not isinstance(self.peer_timeout_s, numbers.Real):
            raise ConfigError(
                f"peer_timeout_s={self.peer_timeout_s!r} (SGLANG_MORI_PEER_TIMEOUT_S) must be a number of seconds"
            )
        if self.combine_block is None:
            object.__setattr__(self, "combine_block", default_combine_block(self.combine_dtype, self.hidden))
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.num_experts < 1 or self.num_experts % self.world_size:
            raise ConfigError(
                f"num_experts={self.num_experts} must be a positive multiple of world_size={self.world_size}"
            )
        if not 1 <= self.topk <= self.num_experts:
            raise ConfigError(f"topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        if not 1 <= self.max_tokens_per_rank <= env.MAX_TOKENS_PER_RANK:
            raise ConfigError(
                f"max_tokens_per_rank={self.max_tokens_per_rank} (SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK, "
                f"vLLM's --max-num-batched-tokens) must be in [1, {env.MAX_TOKENS_PER_RANK}]"
            )
        if not 0 < self.peer_timeout_s <= env.MAX_PEER_TIMEOUT_S:
            raise ConfigError(
                f"peer_timeout_s={self.peer_timeout_s} (SGLANG_MORI_PEER_TIMEOUT_S) must be a number of seconds "
                f"in (0, {env.MAX_PEER_TIMEOUT_S}]"
            )
        if self.hidden < 1:
            raise ConfigError(f"hidden={self.hidden} must be >= 1")
        if self.fp8_dtype is not None and self.fp8_dtype not in FP8_TYPES.values():
            raise ConfigError(f"fp8_dtype={self.fp8_dtype} is not accepted; use torch.float8_e4m3fn or e4m3fnuz")
        if self.scale_bytes is not None and (self.scale_bytes < 0 or self.scale_bytes % 4):
            # Every transport moves a scale row in 4-byte words (docs/api.md, "Inputs").
            raise ConfigError(
                f"scale_bytes={self.scale_bytes} must be a whole number of 4-byte words (0, 4, 8, ...), or None "
                "for the dispatch format's own scale row"
            )
        if self.combine_block < 1:
            raise ConfigError(f"combine_block={self.combine_block} must be >= 1")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def max_recv_tokens(self) -> int:
        """Receive capacity: every source may send every one of its tokens here."""
        return self.world_size * self.max_tokens_per_rank

    @property
    def dispatch_mode(self) -> Mode:
        return Mode.LOW_LATENCY if self.mode is Mode.LOW_LATENCY else Mode.INTRANODE

    @property
    def combine_mode(self) -> Mode:
        return Mode.INTRANODE if self.mode is Mode.INTRANODE else Mode.LOW_LATENCY

    def with_rank(self, rank: int) -> EpConfig:
        return replace(self, rank=rank)

    @classmethod
    def from_env(
        cls,
        *,
        world_size: int,
        rank: int,
        hidden: int,
        num_experts: int,
        topk: int,
        weight_dtype: torch.dtype | None = None,
        low_latency: bool = False,
        environ: Mapping[str, str] | None = None,
        **overrides: object,
    ) -> EpConfig:
        """The config SGLang's MoRI backend would build from ``SGLANG_MORI_*`` and the weight dtype.

        ``low_latency`` is SGLang's ``--deepep-mode low_latency``; ``SGLANG_MORI_SPLIT_DISPATCH_COMBINE``
        turns a normal-mode op into the split mode.
        """
        dispatch_dtype, combine_dtype = dtypes_from_env(weight_dtype, environ)
        split = env.get_bool("SGLANG_MORI_SPLIT_DISPATCH_COMBINE", environ)
        if low_latency:
            mode = Mode.LOW_LATENCY
            if split:  # a server of a disaggregated deployment may share the prefill's variables
                _warn_split_unused()
        elif split:
            mode = Mode.SPLIT
        else:
            mode = Mode.INTRANODE
        fp8_name = env.get_choice("SGLANG_MORI_FP8_TYPE", environ)
        scale_dim = env.get_int("MORI_FP8_COMBINE_SCALE_DIM", environ)
        values: dict[str, object] = {
            "world_size": world_size,
            "rank": rank,
            "hidden": hidden,
            "num_experts": num_experts,
            "topk": topk,
            "max_tokens_per_rank": env.get_int("SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", environ),
            "dispatch_dtype": dispatch_dtype,
            "combine_dtype": combine_dtype,
            "mode": mode,
            "provider": Provider(env.get_choice("SGLANG_MORI_BACKEND", environ)),
            "fp8_dtype": None if fp8_name == "auto" else FP8_TYPES[fp8_name],
            "peer_timeout_s": env.get_seconds("SGLANG_MORI_PEER_TIMEOUT_S", environ),
        }
        if scale_dim is not None:
            values["combine_block"] = combine_block_from_scale_dim(hidden, scale_dim)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@functools.cache
def _warn_split_unused() -> None:
    """Once per process: every MoE layer builds its config, and one line says it all."""
    logger.warning(
        "SGLANG_MORI_SPLIT_DISPATCH_COMBINE is on, and it splits the normal mode only: this process runs the "
        "low-latency mode (--deepep-mode low_latency, vLLM's mori_low_latency), which it does not change"
    )


def combine_block_from_scale_dim(hidden: int, scale_dim: int) -> int:
    """Native MoRI's rule: ``MORI_FP8_COMBINE_SCALE_DIM`` scales per token, block = ceil(hidden / dim)."""
    return math.ceil(hidden / scale_dim)


def default_combine_block(combine_dtype: CombineDtype, hidden: int) -> int:
    """The block of a blockwise combine where none is set, from the format table: MoRI's own format
    follows MoRI's default (56 scales per token: blocks of ceil(hidden / 56), 128 at hidden 7168); ours
    has blocks of 128. Unscaled formats have no block; they keep 128, which nothing reads."""
    fmt = wire_formats.COMBINE_BY_NAME[combine_dtype.value]
    if fmt.default_scales_per_token:
        return combine_block_from_scale_dim(hidden, fmt.default_scales_per_token)
    return fmt.default_block or wire_formats.FP8_BLOCK


def dtypes_from_env(
    weight_dtype: torch.dtype | None = None, environ: Mapping[str, str] | None = None
) -> tuple[DispatchDtype, CombineDtype]:
    """Dispatch and combine dtypes with SGLang's rules: the weight dtype picks, the env overrides.

    fp4 weights -> fp4 dispatch, and a bf16 combine under SGLang's EP v2 dispatcher (SGLANG_MORI_EP_V2,
    on by default) or an fp8 one under its v1 dispatcher; fp8 weights -> fp8 dispatch + bf16 combine;
    else bf16. The deprecated booleans count only where the new variable is unset.
    """
    dispatch = DispatchDtype.BF16
    combine = CombineDtype.BF16
    if weight_dtype == torch.float4_e2m1fn_x2:
        dispatch = DispatchDtype.MXFP4
        if not env.get_bool("SGLANG_MORI_EP_V2", environ):
            combine = CombineDtype.FP8_BLOCKWISE
    elif weight_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        dispatch = DispatchDtype.FP8

    if env.is_set("SGLANG_MORI_DISPATCH_DTYPE", environ):
        choice = env.get_choice("SGLANG_MORI_DISPATCH_DTYPE", environ)
        if choice != "auto":
            dispatch = DISPATCH_ENV_VALUES[choice]
    elif env.get_bool("SGLANG_MORI_FP4_DISP", environ):
        dispatch = DispatchDtype.MXFP4
    elif env.get_bool("SGLANG_MORI_FP8_DISP", environ):
        dispatch = DispatchDtype.FP8

    if env.is_set("SGLANG_MORI_COMBINE_DTYPE", environ):
        choice = env.get_choice("SGLANG_MORI_COMBINE_DTYPE", environ)
        if choice != "auto":
            combine = COMBINE_ENV_VALUES[choice]
    elif env.get_bool("SGLANG_MORI_FP8_COMB", environ):
        combine = CombineDtype.FP8_BLOCKWISE
    return dispatch, combine
