"""Every wire format in one table: its names, its geometry, and the codes each layer knows it by.

The enums of ``config.py`` (``DispatchDtype``, ``CombineDtype``) name the formats in code; this table is
what every layer reads about them: the names users write (``SGLANG_MORI_DISPATCH_DTYPE`` /
``SGLANG_MORI_COMBINE_DTYPE`` and every command's format flags), the bits of an element, the block or
group size and the hidden sizes it allows, the Triton kernels' constexpr code, native MoRI's
quantization type and which fp8 flavour the format's elements take. ``formats.py`` holds the
quantizers and dequantizers that define the bytes.

A leaf module: it imports nothing from the package, so that ``env.py`` and the kernels can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Elements per f32 scale of blockwise fp8: the fp8 dispatch format's group, our combine format's block.
FP8_BLOCK = 128
# Elements per e8m0 scale byte of the MX formats (OCP Microscaling).
MX_GROUP = 32
# Native MoRI's blockwise fp8 combine: scales per token where MORI_FP8_COMBINE_SCALE_DIM is unset.
NATIVE_COMBINE_SCALES = 56

# The dispatch send kernel's QUANT codes: how it turns bf16 tokens into wire tokens.
QUANT_NONE = 0  # the payload travels as given
QUANT_FP8 = 1
QUANT_MXFP8 = 2
QUANT_MXFP4 = 3
# The combine kernels' FORMAT codes.
COMBINE_BF16 = 0
COMBINE_FP8_DIRECT = 1
COMBINE_FP8_BLOCKWISE = 2
COMBINE_FP8_BLOCKWISE_NATIVE = 3

# Which fp8 flavour a format's elements take.
OP_FP8 = "op"  # the op's: e4m3fnuz (max 240) on gfx942, e4m3fn (max 448) elsewhere, or SGLANG_MORI_FP8_TYPE
NO_FP8 = "none"


@dataclass(frozen=True)
class DispatchFormat:
    """A dispatched token's payload and its opaque per-token scale row."""

    name: str  # the DispatchDtype value, as users write it (SGLANG_MORI_DISPATCH_DTYPE and every command)
    element_bits: int  # bits of one element on the wire
    scale_group: int  # elements per scale; 0: no scales (a partial last group has a scale of its own)
    scale_bytes: int  # bytes of one scale: 4 (f32), 1 (e8m0); 0 without scales
    hidden_multiple: int  # hidden must be a multiple of this
    kernel_code: int  # the dispatch send kernel's QUANT code
    fp8: str  # OP_FP8 or NO_FP8
    hidden_rule: str = ""  # why hidden_multiple, for error messages

    def token_bytes(self, hidden: int) -> int:
        return hidden * self.element_bits // 8


@dataclass(frozen=True)
class CombineFormat:
    """An expert output's payload on its way back to its source rank."""

    name: str  # the CombineDtype value: the long name, accepted everywhere
    env_name: str | None  # the SGLANG_MORI_COMBINE_DTYPE value, what users write (None: not settable there)
    element_bits: int  # bits of one element on the wire
    # Blockwise formats: elements per f32 scale where EpConfig.combine_block is not set, as a fixed block
    # or as scales per token (block = ceil(hidden / scales)); a short last block is allowed. Both 0: no scales.
    default_block: int
    default_scales_per_token: int
    kernel_code: int | None  # the combine kernels' FORMAT code; None: no kernel of ours carries it
    mori_quant_type: str  # native MoRI v1's quant_type
    fp8: str  # OP_FP8 or NO_FP8

    @property
    def has_reference(self) -> bool:
        """Whether this package defines the bytes (a torch reference in ``formats.py`` and kernels of ours)."""
        return self.kernel_code is not None

    @property
    def block_scaled(self) -> bool:
        return bool(self.default_block or self.default_scales_per_token)

    @property
    def user_name(self) -> str:
        """What a user writes: the env name where there is one, else the long name."""
        return self.env_name or self.name


DISPATCH_FORMATS: tuple[DispatchFormat, ...] = (
    DispatchFormat("bf16", 16, 0, 0, 1, QUANT_NONE, NO_FP8),
    DispatchFormat("fp8", 8, FP8_BLOCK, 4, 1, QUANT_FP8, OP_FP8),
    DispatchFormat("mxfp8", 8, MX_GROUP, 1, 1, QUANT_MXFP8, OP_FP8),
    DispatchFormat(
        "fp4", 4, MX_GROUP, 1, 2, QUANT_MXFP4, NO_FP8, "packs two elements per byte, so hidden must be even"
    ),
)
COMBINE_FORMATS: tuple[CombineFormat, ...] = (
    CombineFormat("bf16", "bf16", 16, 0, 0, COMBINE_BF16, "none", NO_FP8),
    # Ours: every block scaled to the fp8 maximum.
    CombineFormat("fp8_blockwise", "fp8", 8, FP8_BLOCK, 0, COMBINE_FP8_BLOCKWISE, "fp8_blockwise", OP_FP8),
    # Native MoRI's bytes: a block is scaled only past the fp8 maximum.
    CombineFormat(
        "fp8_blockwise_native",
        None,
        8,
        0,
        NATIVE_COMBINE_SCALES,
        COMBINE_FP8_BLOCKWISE_NATIVE,
        "fp8_blockwise",
        OP_FP8,
    ),
    CombineFormat("fp8_direct_cast", "fp8_direct_cast", 8, 0, 0, COMBINE_FP8_DIRECT, "fp8_direct_cast", OP_FP8),
    # Native MoRI's own, on gfx950: no reference or kernel of ours; blocks as MoRI's blockwise fp8.
    CombineFormat("fp4_blockwise", "fp4", 4, 0, NATIVE_COMBINE_SCALES, None, "fp4_blockwise", NO_FP8),
)
DISPATCH_BY_NAME = {f.name: f for f in DISPATCH_FORMATS}
COMBINE_BY_NAME = {f.name: f for f in COMBINE_FORMATS}
DISPATCH_ENV_NAMES = tuple(f.name for f in DISPATCH_FORMATS)
COMBINE_ENV_NAMES = tuple(f.env_name for f in COMBINE_FORMATS if f.env_name)
# The SGLANG_MORI_COMBINE_DTYPE values whose bytes this package defines: every one but native MoRI's own.
REFERENCE_COMBINE_ENV_NAMES = tuple(f.env_name for f in COMBINE_FORMATS if f.env_name and f.has_reference)
