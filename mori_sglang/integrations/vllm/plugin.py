"""vLLM general plugin: ``--all2all-backend mori_high_throughput|mori_low_latency`` runs through mori-sglang.

vLLM 0.33 has no registry for out-of-tree all2all backends, but it already knows the two MoRI names and
reaches their objects through names it looks up when it needs them:

- ``CudaCommunicator`` imports ``MoriAll2AllManager`` from ``vllm.distributed.device_communicators.all2all``
  when it builds the expert-parallel group;
- ``maybe_make_prepare_finalize`` calls ``MoriPrepareAndFinalize`` from
  ``vllm.model_executor.layers.fused_moe.all2all_utils`` (bound there only where native MoRI imports);
- ``FusedMoEConfig.__post_init__`` refuses the MoRI names unless AITER's fused experts run, because native
  MoRI hands the experts a token count only AITER reads.

``register`` rebinds the first two to ours and lets any experts pass the third, which also refuses, as each
MoE layer is built, an expert count the expert-parallel ranks do not divide. Other backends and vLLM's
selection logic are untouched. vLLM calls it in every process, possibly more than once: it is idempotent.
``VLLM_PLUGINS`` (a list of plugin names that leaves out ``mori_sglang``) turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from vllm.distributed.device_communicators import all2all
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import all2all_utils
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

from mori_sglang.integrations.vllm.all2all import BACKENDS, MoriSglangAll2AllManager
from mori_sglang.integrations.vllm.prepare_finalize import MoriSglangPrepareAndFinalize

logger = init_logger(__name__)

PATCHED = "__mori_sglang_patched__"
# The backend name the wrapped __post_init__ sees: vLLM's default, which has no experts restriction.
NEUTRAL_BACKEND = "allgather_reducescatter"


def check_even_experts(moe: FusedMoEConfig) -> None:
    """Refuse a layer whose experts the expert-parallel ranks do not divide, where our op dispatches.

    The op routes expert ``e`` to rank ``e // (num_experts / ep_size)``, while vLLM gives the first
    ``num_experts % ep_size`` ranks one expert more (``determine_expert_map``), and ``get_handle`` only sees
    ``num_experts // ep_size`` local experts: such a layer would send tokens to ranks that lack their
    expert, silently, and fail on the last ids. ``FusedMoEConfig`` is built with the model, before any
    weight loads, and holds the layer's global expert count (redundant EPLB experts included).
    """
    parallel = moe.moe_parallel_config
    if not parallel.use_mori_kernels or moe.num_experts % parallel.ep_size == 0:
        return
    raise ValueError(
        f"--all2all-backend {parallel.all2all_backend} (mori-sglang) needs an expert count the expert-parallel "
        f"ranks divide: this MoE layer has {moe.num_experts} experts over {parallel.ep_size} ranks, which vLLM "
        f"splits unevenly; serve on a number of GPUs (--data-parallel-size x --tensor-parallel-size) that "
        f"divides {moe.num_experts}, or pick another --all2all-backend"
    )


def any_experts_for_mori(post_init: Callable[[FusedMoEConfig], None]) -> Callable[[FusedMoEConfig], None]:
    """Wrap ``FusedMoEConfig.__post_init__`` so that the MoRI names accept any experts.

    The AITER assertion reads the backend name from ``moe_parallel_config``; the original runs while that
    field names vLLM's default backend, then the real one is put back. AITER's fused shared experts stay
    refused, as upstream: they add top-k slots past the routed experts, which no rank owns. Experts the
    expert-parallel ranks do not divide are refused too (``check_even_experts``).
    """

    @functools.wraps(post_init)
    def wrapped(self: FusedMoEConfig) -> None:
        parallel = self.moe_parallel_config
        if parallel.all2all_backend not in BACKENDS:
            post_init(self)
            return
        self.moe_parallel_config = dataclasses.replace(parallel, all2all_backend=NEUTRAL_BACKEND)
        try:
            post_init(self)
        finally:
            self.moe_parallel_config = parallel
        if self.aiter_fmoe_shared_expert_enabled:
            raise ValueError(
                f"--all2all-backend {parallel.all2all_backend} does not support AITER's fused shared experts; "
                "set VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"
            )
        check_even_experts(self)

    setattr(wrapped, PATCHED, True)
    return wrapped


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route the two MoRI names to mori-sglang."""
    all2all.MoriAll2AllManager = MoriSglangAll2AllManager
    all2all_utils.MoriPrepareAndFinalize = MoriSglangPrepareAndFinalize
    if not getattr(FusedMoEConfig.__post_init__, PATCHED, False):
        FusedMoEConfig.__post_init__ = any_experts_for_mori(FusedMoEConfig.__post_init__)
    logger.debug("mori-sglang serves --all2all-backend %s", "|".join(BACKENDS))
