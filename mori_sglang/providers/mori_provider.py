"""The native MoRI provider: AMD's compiled HIP kernels behind our op API.

MoRI has two APIs and the provider drives the one SGLang drives for the same configuration:

- EP v2 (``mori.ops.dispatch_combine_v2``, ``mori_v2.py``) for the intranode mode within one host
  with a bf16 combine, unless ``SGLANG_MORI_EP_V2=0``;
- v1 (``mori.ops.EpDispatchCombineOp``, ``mori_v1.py``) everywhere else: across hosts, the
  low-latency and split modes (AsyncLL, the only kernel with separate send and receive calls) and
  the quantized combines (whose wire format is MoRI v1's own, ``formats.FP8_BLOCKWISE_NATIVE``).

Both hand out views of buffers MoRI owns, overwritten by the next call. Building either op is a
collective over the group. Expert ids past the last expert are dropped (see ``mori_ids``) and raised
one call later, without a host synchronisation (as the Triton provider does).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from mori_sglang import env, formats
from mori_sglang.config import FP8_TYPES, CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.providers.base import (
    ALL_DISPATCH,
    ALL_MODES,
    OUR_COMBINE_FORMATS,
    Capabilities,
    EpProvider,
    ProviderSetup,
)
from mori_sglang.providers.device_status import DeviceStatus
from mori_sglang.types import expert_id_error, short_expert_outputs_error

# The most ranks MoRI's intranode kernels (v1 IntraNode, EP v2) serve, all on one host, as SGLang runs
# them; more ranks, or ranks on several hosts, take v1's inter-node kernels.
INTRANODE_MAX_RANKS = 8
V2_ROW_ALIGN = 16  # EP v2 moves token rows in 16 B pieces
# The name MoRI's shmem bootstrap looks the process group up by (the one SGLang and vLLM register).
SHMEM_GROUP_NAME = "mori"

_shmem_ready = False


def _bootstrap_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """MoRI's bootstrap exchanges host buffers: a gloo group over the same ranks (SGLang and vLLM
    hand the op their CPU group). Building one here is a collective over the default group, which
    every rank must join: only for callers without a CPU group."""
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def init_shmem(group: dist.ProcessGroup) -> None:
    """Register a CPU group under MoRI's name and bootstrap MoRI's shmem over it, once per process. A
    name registered already means the serving framework bootstrapped MoRI itself."""
    global _shmem_ready
    if _shmem_ready:
        return
    import mori

    bootstrap = _bootstrap_group(group)
    try:
        torch._C._distributed_c10d._register_process_group(SHMEM_GROUP_NAME, bootstrap)
    except RuntimeError as err:
        if "already" not in str(err):
            raise
        _shmem_ready = True
        return
    _bootstrap_shmem(mori.shmem, bootstrap)
    _shmem_ready = True


def _bootstrap_shmem(shmem: ModuleType, group: dist.ProcessGroup) -> None:
    """MoRI's shmem over ``group``, from a unique id its first rank makes. MoRI's own torch bootstrap
    (``shmem_torch_process_group_init``) broadcasts the id from *global* rank 0, which the group of a
    later pipeline stage does not hold: there it raises."""
    rank = dist.get_rank(group)
    unique_id = [shmem.shmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, dist.get_world_size(group), unique_id[0])


def finalize_shmem() -> None:
    """Tear MoRI's shmem down and drop the group registration (before the process group is destroyed)."""
    global _shmem_ready
    if not _shmem_ready:
        return
    import mori

    mori.shmem.shmem_finalize()
    torch._C._distributed_c10d._unregister_process_group(SHMEM_GROUP_NAME)
    _shmem_ready = False


def receive_cap() -> int:
    """``SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS``: MoRI's cap on the tokens one rank receives per call (0:
    none, every rank may send its whole buffer)."""
    return env.get_int("SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS") or 0


def capped_recv_tokens(config: EpConfig, tokens_per_rank: int | None = None) -> int:
    """The rows MoRI's receive buffer holds (its ``MaxNumTokensToRecv``): every rank's share of the cap,
    rounded up and at most its whole buffer (``tokens_per_rank``, the op's unless MoRI's differs),
    times the ranks."""
    cap = receive_cap()
    per_rank = tokens_per_rank or config.max_tokens_per_rank
    if cap:
        per_rank = min(-(-cap // config.world_size), per_rank)
    return config.world_size * per_rank


def intranode_kernels_serve(config: EpConfig, ranks_per_host: int) -> bool:
    """Whether MoRI's intranode kernels serve the group: every rank on one host, and no more of them
    than those kernels take (``ranks_per_host``: as ``ProviderSetup.host_ranks``)."""
    return ranks_per_host >= config.world_size and config.world_size <= INTRANODE_MAX_RANKS


def uses_ep_v2(config: EpConfig, ranks_per_host: int) -> bool:
    """SGLang's choice (``SGLANG_MORI_EP_V2``, on unless 0) where EP v2 applies: the intranode mode
    (v2 has no split kernels) within one host, with a bf16 combine (v2's quantized combines are
    another wire format than v1's, which is the one ``fp8_blockwise_native`` names), tokens whose
    dispatch and combine rows are whole 16 B (v2 copies them in 16 B pieces), and no receive cap
    below every rank's whole buffer (v2's hip backend drops no tokens)."""
    token_bytes = formats.dispatch_token_bytes(config.dispatch_dtype, config.hidden)
    cap = receive_cap()
    return (
        env.get_bool("SGLANG_MORI_EP_V2")
        and config.mode is Mode.INTRANODE
        and intranode_kernels_serve(config, ranks_per_host)
        and config.combine_dtype is CombineDtype.BF16
        and token_bytes % V2_ROW_ALIGN == 0
        and (2 * config.hidden) % V2_ROW_ALIGN == 0
        and (cap == 0 or cap >= config.max_recv_tokens)
    )


def mori_token_dtype(config: EpConfig, payload_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The element type MoRI is told its tokens have: packed e2m1 pairs for fp4 (as SGLang passes them);
    on a GPU, fp8 tokens in the flavour MoRI compiles its kernels for there (e4m3fnuz on gfx942,
    e4m3fn on gfx950: it builds no kernel for the other), whatever ``SGLANG_MORI_FP8_TYPE`` makes the
    op's. The dispatch copies bytes, and the receive views them back as the op's flavour."""
    if config.dispatch_dtype is DispatchDtype.MXFP4:
        return torch.float4_e2m1fn_x2
    if payload_dtype in FP8_TYPES.values() and device.type == "cuda":
        return formats.fp8_dtype_for_device(device)
    return payload_dtype


class MoriProvider(EpProvider):
    """Our op API over a native MoRI op; ``MoriProvider(setup)`` builds the v1 or the v2 one."""

    name = "mori"
    display_name = "native MoRI"
    capabilities = Capabilities(
        dispatch_formats=ALL_DISPATCH,
        combine_formats=OUR_COMBINE_FORMATS | {CombineDtype.FP4_BLOCKWISE},
        fused_quantization=frozenset(),
        # On a GPU a bad id raises at the next receive; on a CPU (MoRI's stand-in) the op checks ids
        # before sending (a synchronisation costs nothing there).
        id_checks_on_device=frozenset({"cuda"}),
        modes=ALL_MODES,
        loopback=False,  # MoRI's shmem spans processes
        keeps_old_handles=False,  # MoRI's combine reads the state of the op's last dispatch
        format_notes={CombineDtype.FP4_BLOCKWISE: "MoRI's own fp4 combine, on gfx950 only"},
    )

    def __new__(cls, setup: ProviderSetup) -> MoriProvider:
        if cls is MoriProvider:
            if uses_ep_v2(setup.config, setup.host_ranks()):
                from mori_sglang.providers.mori_v2 import MoriV2Provider

                cls = MoriV2Provider
            else:
                from mori_sglang.providers.mori_v1 import MoriV1Provider

                cls = MoriV1Provider
        return super().__new__(cls)

    def __init__(self, setup: ProviderSetup) -> None:
        self.config = setup.config
        self.layout = setup.layout
        self.token_dtype = mori_token_dtype(setup.config, setup.payload_dtype, setup.device)
        self._max_recv_tokens = capped_recv_tokens(setup.config)
        # [the largest expert id past the last, minus (num_experts - 1); rows a combine needed, plus 1]
        self._status = DeviceStatus(2, setup.device)

    @property
    def max_recv_tokens(self) -> int:
        """Under ``SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS`` MoRI's receive holds fewer rows than every rank
        may send (a receive past them is MoRI's device assert)."""
        return self._max_recv_tokens

    def check_status(self) -> None:
        """Raise if a dispatch met an expert id past the last expert (those copies were dropped) or a
        combine got fewer expert output rows than its dispatch received."""
        bad_id, rows_needed = self._status.read()
        if bad_id:
            raise expert_id_error(bad_id + self.config.num_experts - 1, self.config.num_experts, dropped=True)
        if rows_needed:
            raise short_expert_outputs_error(rows_needed - 1)

    def _flag_short_outputs(self, y: torch.Tensor, num_recv: torch.Tensor) -> None:
        """Flag expert outputs with fewer rows than the dispatch received, compared on the device (no
        host sync) and raised after the combine: MoRI's combine takes no row count and reads every
        received row, past the end of ``y`` for the missing ones. Enqueued before the combine, which
        clears v1's count."""
        received = num_recv.reshape(()).long()
        needed = torch.where(received > y.shape[0], received + 1, 0)
        torch.maximum(self._status.flags[1], needed, out=self._status.flags[1])
