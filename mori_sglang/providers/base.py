"""The provider contract: what the op hands a transport and what it may expect back.

The op (``mori_sglang.op``) checks every input, quantizes where the provider does not, and then calls
exactly the methods below; it never looks past them. A provider declares what it can do in
``capabilities`` (read before it is built, so an unsupported configuration is refused by name), is
built from one ``ProviderSetup`` and keeps its routing in a ``CombineHandle`` subclass of its own.
``registry.py`` maps each ``config.Provider`` to its class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from mori_sglang import formats, wire_formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode
from mori_sglang.exchange import LoopbackHub
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.types import CombineHandle, DispatchOutput

ALL_DISPATCH = frozenset(DispatchDtype)
ALL_MODES = frozenset(Mode)
# The combine formats our own providers carry, those with a reference (native MoRI adds its fp4 combine).
OUR_COMBINE_FORMATS = frozenset(CombineDtype(f.name) for f in wire_formats.COMBINE_FORMATS if f.has_reference)


@dataclass(frozen=True)
class Capabilities:
    """What a provider carries and does, declared on its class.

    ``id_checks_on_device``: device types on which the provider range-checks expert ids itself, on the
    device, and raises one call later (elsewhere the op checks them on the host before sending).
    ``keeps_old_handles``: a combine may use the handle of any earlier dispatch (each handle holds its
    own tensors); otherwise only the latest dispatch's handle is valid, because the next dispatch
    reuses the buffers it points at.
    """

    dispatch_formats: frozenset[DispatchDtype]
    combine_formats: frozenset[CombineDtype]
    fused_quantization: frozenset[DispatchDtype]  # bf16 tokens quantized inside the send, no scales from the op
    id_checks_on_device: frozenset[str]
    modes: frozenset[Mode]
    loopback: bool  # runs in a one-process loopback world (LoopbackWorld)
    keeps_old_handles: bool
    # Where a format it carries needs more than the provider itself (e.g. a GPU generation).
    format_notes: Mapping[DispatchDtype | CombineDtype, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderSetup:
    """Everything a provider is built from; the op makes it once per rank.

    ``payload_dtype``: the element type of a dispatched token on the wire. ``group``: the ranks' process
    group (None: the world group); ``loopback``: the shared state of a one-process world instead;
    ``cpu_group``: a gloo group over the same ranks for host-side bootstraps (native MoRI's shmem), where
    the caller has one: making one is a collective over the default group, which ranks outside
    ``group`` (another pipeline stage's) do not join at the same moment. ``ranks_per_host``: how many
    consecutive ranks each host runs (``providers.ranks_per_host``), where a provider needs it (native
    MoRI's kernel choice); None: every rank on this one host.
    """

    config: EpConfig
    device: torch.device
    fp8_dtype: torch.dtype
    layout: formats.DispatchRowLayout
    payload_dtype: torch.dtype
    group: dist.ProcessGroup | None = None
    loopback: LoopbackHub | None = None
    cpu_group: dist.ProcessGroup | None = None
    ranks_per_host: int | None = None

    def host_ranks(self) -> int:
        """The ranks of one host (the whole world unless ``ranks_per_host`` says otherwise)."""
        return self.ranks_per_host or self.config.world_size


class EpProvider(ABC):
    """One rank's transport: moves dispatch rows to the ranks that own their experts and combine rows back.

    Every call is asynchronous with respect to the host where the provider can make it so; errors found
    on the device (a stalled peer, an id past the last expert, short expert outputs) are raised by
    ``check_status``, which the provider also runs after its receives.
    """

    config: EpConfig
    name: ClassVar[str]  # the provider's config.Provider value
    display_name: ClassVar[str]  # how messages name it
    capabilities: ClassVar[Capabilities]

    @abstractmethod
    def __init__(self, setup: ProviderSetup) -> None: ...

    @property
    def max_recv_tokens(self) -> int:
        """The most rows one receive can hand back: what every rank may send, unless the provider caps its
        receive buffer (native MoRI under ``SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS``)."""
        return self.config.max_recv_tokens

    def refuse_fused_quantization(self, quantize: bool) -> None:
        """Guard of a provider whose ``fused_quantization`` is empty: the op quantizes its tokens first."""
        if quantize:
            raise RuntimeError(
                f"the {self.display_name} provider carries pre-quantized tokens (it fuses no quantization)"
            )

    def set_kernel_tuning(self, tuning: KernelTuning) -> None:
        """Launch this provider's Triton kernels with ``tuning`` from the next call on (benchmarks, tuning
        sweeps). Only a provider that runs our kernels has launch shapes to set; the others refuse."""
        raise ConfigError(
            f"the {self.display_name} provider runs no Triton kernels of ours, so it takes no kernel tuning; "
            "use the triton provider (SGLANG_MORI_BACKEND=triton)"
        )

    @abstractmethod
    def dispatch_send(
        self,
        payload: torch.Tensor,
        scales: torch.Tensor | None,
        weights: torch.Tensor,
        ids: torch.Tensor,
        layout: formats.DispatchRowLayout,
        quantize: bool = False,
    ) -> None:
        """Start sending each token to the distinct ranks among its top-k experts. ``payload``: wire tokens
        (or bf16 tokens with ``quantize``, for a format in ``fused_quantization``); ``scales``: uint8 scale
        rows of ``layout.scale_bytes`` (None with ``quantize`` or without scales)."""

    @abstractmethod
    def dispatch_recv(self, layout: formats.DispatchRowLayout, token_dtype: torch.dtype) -> DispatchOutput:
        """Finish the latest dispatch_send: the received rows, compact, and the handle combine needs."""

    @abstractmethod
    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        """Start returning expert outputs (one row per received row, weights applied) to their sources."""

    @abstractmethod
    def combine_recv(self) -> torch.Tensor:
        """Finish the latest combine_send: per source token, the sum of its returned rows, as bf16."""

    def close(self) -> None:  # noqa: B027 - optional: most providers hold nothing past garbage collection
        """Release what the provider holds beyond Python's memory, collectively where building was; the
        op calls it once. Buffers that garbage collection frees need nothing here."""

    @abstractmethod
    def check_status(self) -> None:
        """Raise what the device found since the last check (stalled peer, bad id, short expert outputs)."""
