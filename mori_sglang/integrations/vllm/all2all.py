"""vLLM's all2all manager for the two MoRI backend names, backed by mori-sglang ops.

vLLM's EP group builds ``MoriAll2AllManager(cpu_group, backend_name)``; ``maybe_make_prepare_finalize``
then asks it for one handle per MoE layer shape through ``get_handle`` with native MoRI's keywords. We
map those keywords, and the ``SGLANG_MORI_*`` environment with the SGLang plugin's meaning, to an
``EpConfig`` and keep one op per config in vLLM's handle cache, as native MoRI does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import vllm.envs as envs
from vllm.config import get_current_vllm_config
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache
from vllm.distributed.parallel_state import get_ep_group
from vllm.logger import init_logger
from vllm.utils import deep_gemm

from mori_sglang.config import EpConfig
from mori_sglang.integrations import current_device
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.providers.mori_provider import init_shmem
from mori_sglang.wire_formats import FP8_BLOCK

logger = init_logger(__name__)

HIGH_THROUGHPUT = "mori_high_throughput"
LOW_LATENCY = "mori_low_latency"
BACKENDS = (HIGH_THROUGHPUT, LOW_LATENCY)


def wire_weight_dtype(quant_dtype: torch.dtype | str, scale_dim: int, hidden: int) -> torch.dtype | None:
    """The weight dtype SGLang's ``auto`` dtype rule should see for the dispatch vLLM asked MoRI for.

    vLLM asks for packed fp4 (MXFP4 experts), fp8 with a scale per 128 elements (block-quantized
    experts), one scale per token (per-token or per-tensor fp8, mxfp8: ``quant_dtype`` may be a string)
    or unquantized tokens. Only the first two are wire formats of ours; the others travel as bf16 and
    vLLM's quantizer runs once, on arrival. So do block-fp8 tokens where vLLM's DeepGEMM takes
    power-of-two (UE8M0) activation scales: it would round the wire's.

    vLLM asks by the layer's quant config alone: the keywords do not say whether the experts quantize
    their own inputs (``expects_unquantized_inputs``), as FlashInfer's CUTLASS block-fp8 experts do. For
    those, vLLM still asks for block fp8, so their tokens are quantized on the wire, dequantized on arrival
    and quantized again by the experts; ``SGLANG_MORI_DISPATCH_DTYPE=bf16`` sends them unquantized.
    """
    if quant_dtype == torch.float4_e2m1fn_x2:
        return quant_dtype
    block_fp8 = quant_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) and scale_dim * FP8_BLOCK == hidden
    if block_fp8 and not deep_gemm.is_deep_gemm_e8m0_used():
        return quant_dtype
    return None


def ep_config_from_vllm(backend: str, kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> EpConfig:
    """The op config of one MoE layer from the keywords vLLM passes native MoRI's ``get_handle``.

    vLLM fixes the shape and the capacity: ``max_num_tokens_per_dp_rank`` is its
    ``--max-num-batched-tokens``, the most tokens a rank ever hands one layer, so
    ``SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` does not apply. The other ``SGLANG_MORI_*``
    variables pick wire dtypes, provider, fp8 flavour and split mode as in SGLang;
    ``mori_low_latency`` is SGLang's low-latency mode.
    """
    if backend not in BACKENDS:
        raise ValueError(f"all2all backend {backend!r} is not one of {', '.join(BACKENDS)}")
    world_size = kwargs["num_ep_ranks"]
    hidden = kwargs["token_hidden_size"]
    return EpConfig.from_env(
        world_size=world_size,
        rank=kwargs["rank"],
        hidden=hidden,
        num_experts=kwargs["num_local_experts"] * world_size,
        topk=kwargs["num_experts_per_token"],
        weight_dtype=wire_weight_dtype(kwargs["quant_dtype"], kwargs["scale_dim"], hidden),
        low_latency=backend == LOW_LATENCY,
        environ=environ,
        max_tokens_per_rank=kwargs["max_num_tokens_per_dp_rank"],
    )


MEGA_MOE = "aiter_mega_moe"


def bootstrap_mega_moe(cpu_group: dist.ProcessGroup, vllm_config: Any) -> None:
    """``--moe-backend aiter_mega_moe``: AITER's MegaMoE runs its own dispatch and combine on MoRI's
    symmetric heap and never asks the manager for a handle, so the manager bootstraps MoRI's shmem when
    it is built, as vLLM's native MoRI manager does, with its heap size unless ``MORI_SHMEM_HEAP_SIZE``
    is set (8G, 16G where a fused mxfp4 shared expert may be placed there too)."""
    if vllm_config.kernel_config.moe_backend != MEGA_MOE:
        return
    targets = getattr(vllm_config.model_config.quantization_config, "targets", None) or {}
    fused_shared = envs.VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS and "mxfp4" in targets.values()
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "16G" if fused_shared else "8G")
    try:
        import mori  # noqa: F401
    except ModuleNotFoundError:
        raise RuntimeError(
            f"--moe-backend {MEGA_MOE} runs on MoRI's shmem, and MoRI does not import here: install MoRI "
            "(https://github.com/ROCm/mori) or pick another --moe-backend"
        ) from None
    init_shmem(cpu_group)


class MoriSglangAll2AllManager(All2AllManagerBase):
    """vLLM's ``All2AllManagerBase`` for the MoRI names; ``get_handle`` returns an ``EpDispatchCombineOp``.

    Layers of one shape share an op (vLLM's ``Cache`` keeps it while a prepare/finalize holds it).
    """

    def __init__(self, cpu_group: dist.ProcessGroup, all2all_backend: str) -> None:
        if all2all_backend not in BACKENDS:
            raise ValueError(f"all2all backend {all2all_backend!r} is not one of {', '.join(BACKENDS)}")
        vllm_config = get_current_vllm_config()
        if vllm_config.parallel_config.enable_elastic_ep:
            raise ValueError(
                f"--all2all-backend {all2all_backend} (mori-sglang) does not run with --enable-elastic-ep: elastic "
                "EP's stateless groups are unknown to torch.distributed, which builds the op's exchange; serve "
                "without elastic EP or with another all2all backend"
            )
        super().__init__(cpu_group)
        self.all2all_backend = all2all_backend
        self.handle_cache = Cache()
        self._ops: list[EpDispatchCombineOp] = []  # vLLM's cache holds them weakly; destroy() closes them all
        bootstrap_mega_moe(cpu_group, vllm_config)

    def get_handle(self, kwargs: dict[str, Any]) -> EpDispatchCombineOp:
        config = ep_config_from_vllm(self.all2all_backend, kwargs)
        if kwargs.get("input_dtype", torch.bfloat16) != torch.bfloat16:
            logger.warning_once(
                "mori-sglang carries %s activations as bf16 both ways (dispatch and combine round them to 8 "
                "significant bits); serve the model in bfloat16 (--dtype bfloat16) to keep them as they are",
                kwargs["input_dtype"],
            )
        return self.handle_cache.get_or_create({"config": config}, self._make_op)

    def _make_op(self, config: EpConfig) -> EpDispatchCombineOp:
        device = current_device()
        op = EpDispatchCombineOp(config, group=self._group_for(device), device=device, cpu_group=self.cpu_group)
        self._ops.append(op)
        return op

    def _group_for(self, device: torch.device) -> dist.ProcessGroup:
        """CPU tensors travel over the manager's gloo group; GPU tensors need the EP group's device group.

        vLLM hands the manager only the cpu group, and builds it while the EP group is still being
        made, so the device group is looked up when the first op is, by then the EP group exists.
        """
        if device.type == "cpu":
            return self.cpu_group
        ep = get_ep_group()
        if ep.cpu_group is not self.cpu_group:
            raise RuntimeError(
                "mori-sglang's all2all manager only serves vLLM's expert-parallel group; "
                "this manager was built for another group"
            )
        return ep.device_group

    def destroy(self) -> None:
        """vLLM's teardown: close every op this manager built, as vLLM's native managers destroy their
        handles, so that native MoRI's windows and communicators are freed; later handles are built anew."""
        for op in self._ops:
            op.close()
        self._ops.clear()
        self.handle_cache = Cache()
