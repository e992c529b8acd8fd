"""Synthetic expert outputs with the shape of real post-MoE activations.

What decides how a combine format fares is the spread of magnitudes it must carry, so the generator
reproduces three features of real expert outputs (weighted down-projections): per-channel
magnitudes that differ by orders of magnitude (lognormal), per-token loudness that varies (lognormal),
and rare elements far outside the bulk (outliers, some beyond e4m3's 448). With the defaults the bulk
sits around 1e-2..1e-1, the range where a plain fp8 cast loses small values to its subnormals and
flushes the smallest to zero, while a handful of outliers exceed the fp8 maximum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

# The widest lognormal spread accepted: far past any real layer's (the defaults are 1.0 and 0.5), and
# the product of two draws a few sigma out (e^(2 * 4 * 10)) stays inside f32.
MAX_SIGMA = 10.0


@dataclass(frozen=True)
class ActivationSpec:
    median: float = 0.05  # median per-channel RMS
    channel_sigma: float = 1.0  # log-space spread of per-channel RMS
    token_sigma: float = 0.5  # log-space spread of per-token loudness
    outlier_rate: float = 1e-4  # fraction of elements replaced by an outlier
    outlier_min: float = 8.0  # outlier magnitudes are log-uniform in [outlier_min, outlier_max]
    outlier_max: float = 2000.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in dataclasses.astuple(self)):
            raise ValueError(f"every setting must be a finite number: {self}")
        if max(self.channel_sigma, self.token_sigma) > MAX_SIGMA:
            raise ValueError(f"the sigmas must be at most {MAX_SIGMA} (far past any real layer's spread)")
        if self.median <= 0 or self.channel_sigma < 0 or self.token_sigma < 0:
            raise ValueError("median must be > 0 and the sigmas >= 0")
        if not 0 <= self.outlier_rate <= 1:
            raise ValueError(f"outlier_rate={self.outlier_rate} must be in [0, 1]")
        if not 0 < self.outlier_min <= self.outlier_max:
            raise ValueError("outlier magnitudes need 0 < outlier_min <= outlier_max")


def channel_scales(hidden: int, spec: ActivationSpec, generator: torch.Generator) -> torch.Tensor:
    """Per-channel RMS, shared by every token of the layer: ``median * exp(sigma * N(0, 1))``."""
    return spec.median * torch.exp(spec.channel_sigma * torch.randn(hidden, generator=generator))


def expert_outputs(rows: int, channels: torch.Tensor, spec: ActivationSpec, generator: torch.Generator) -> torch.Tensor:
    """``[rows, hidden]`` bf16 expert outputs for the given channel scales.

    Generated on the CPU from ``generator`` so that every device sees the same numbers.
    """
    hidden = channels.numel()
    token = torch.exp(spec.token_sigma * torch.randn(rows, 1, generator=generator))
    y = torch.randn(rows, hidden, generator=generator) * channels * token
    is_outlier = torch.rand(rows, hidden, generator=generator) < spec.outlier_rate
    count = int(is_outlier.sum())
    if count:
        log_lo, log_hi = math.log(spec.outlier_min), math.log(spec.outlier_max)
        magnitude = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(count, generator=generator))
        sign = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
        y[is_outlier] = sign * magnitude
    return y.to(torch.bfloat16)
