"""vLLM's modular prepare/finalize for the MoRI backend names, on a mori-sglang op.

prepare: the op dispatches the layer's tokens (quantizing them once to its wire format), then the
received rows become the experts' activation format (``ActivationPlan``), with every received token's
global top-k ids and weights. finalize: the experts' top-k weighting and reduction where they leave it to
us, then the op's combine sums each token's partial outputs from its destination ranks.

High-throughput (the op's intranode mode) reads the received count on the host once, as DeepEP's
high-throughput layout does, so the experts see exactly the received rows. A low-latency dispatch never
waits on the host, and neither does any dispatch inside CUDA-graph capture: the experts get the whole
receive capacity, the rows past the received count routed to an expert this rank does not own and
weighted 0. Low-latency and split modes implement ``prepare_async`` / ``finalize_async``, whose hooks
finish the receives, so vLLM overlaps shared experts with the combine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)

from mori_sglang.checks import capturing
from mori_sglang.config import Mode
from mori_sglang.integrations.vllm.activations import ActivationPlan, expert_format
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import DispatchOutput


class MoriSglangPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """Standard-format prepare/finalize whose output is reduced across the expert-parallel ranks."""

    def __init__(
        self,
        op: EpDispatchCombineOp,
        max_tokens_per_rank: int,
        num_dispatchers: int,
        use_fp8_dispatch: bool = False,
        use_fp4_dispatch: bool = False,
    ) -> None:
        """The signature of vLLM's native ``MoriPrepareAndFinalize``, which vLLM's selection calls.

        ``max_tokens_per_rank`` and the two dispatch flags repeat what vLLM passed the manager's
        ``get_handle`` for ``op``; the op's config already holds the capacity and the wire format.
        """
        super().__init__()
        self.op = op
        self.num_dispatchers_ = num_dispatchers
        config = op.config
        # Dropped top-k slots and rows past the received count name an expert another rank owns, which
        # the experts' expert_map turns into "skip": the last expert on rank 0, the first one elsewhere.
        self.foreign_expert = config.num_experts - 1 if config.rank == 0 else 0
        self._plan: ActivationPlan | None = None
        self._received: DispatchOutput | None = None
        self._combined: torch.Tensor | None = None

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int32

    def max_num_tokens_per_rank(self) -> int | None:
        return self.op.config.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.num_dispatchers_

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return self.op.config.mode is not Mode.INTRANODE

    def supports_dbo(self) -> bool:
        """One op carries one micro-batch at a time (vLLM's config refuses --enable-dbo for these names)."""
        return False

    def _whole_capacity(self, ids: torch.Tensor) -> bool:
        """Whether the experts get every receive row, which needs no host sync: always for a
        low-latency dispatch, and for a high-throughput one while a CUDA graph is being captured."""
        return capturing(ids) or self.op.config.dispatch_mode is Mode.LOW_LATENCY

    # -- prepare ----------------------------------------------------------------------------------

    def _dispatch_send(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool,
    ) -> None:
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(f"apply_router_weight_on_input needs top-1 routing, got top-{topk_ids.shape[1]}")
            a1 = a1 * topk_weights.to(a1.dtype)
        config = self.op.config
        self._plan = ActivationPlan(
            wire=config.dispatch_dtype,
            target=expert_format(quant_config, defer_input_quant, self.op.fp8_dtype),
            hidden=config.hidden,
            fp8_dtype=self.op.fp8_dtype,
            in_dtype=a1.dtype,
            quant_config=quant_config,
        )
        self._received = None
        self.op.dispatch_send(a1.to(torch.bfloat16), topk_weights, None, topk_ids)  # weights as the router made them

    def _dispatch_recv(self) -> None:
        """The receive hook: wait for the tokens routed to this rank."""
        self._received = self.op.dispatch_recv()

    def _expert_inputs(self) -> mk.PrepareResultType:
        """The receiver: received rows in the experts' format, with their global top-k ids and weights."""
        if self._received is None:
            self._dispatch_recv()
        out, plan = self._received, self._plan
        assert out is not None and plan is not None
        ids = out.topk_ids
        received = None
        if self._whole_capacity(ids):
            rows = ids.shape[0]
            received = torch.arange(rows, device=ids.device) < out.num_recv
            live = (ids >= 0) & received[:, None]
        else:
            rows = out.num_recv_host()
            ids = ids[:rows]
            live = ids >= 0
        ids = torch.where(live, ids, self.foreign_expert)
        weights = torch.where(live, out.topk_weights[:rows], 0.0)
        scales = out.scales[:rows] if out.scales is not None else None
        a1q, a1q_scale = plan.to_experts(out.tokens[:rows], scales, received)
        return a1q, a1q_scale, None, ids, weights

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        self._dispatch_send(a1, topk_weights, topk_ids, apply_router_weight_on_input, quant_config, defer_input_quant)
        return self._expert_inputs()

    def prepare_async(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> tuple[Callable, mk.ReceiverType]:
        self._dispatch_send(a1, topk_weights, topk_ids, apply_router_weight_on_input, quant_config, defer_input_quant)
        return self._dispatch_recv, self._expert_inputs

    # -- finalize ---------------------------------------------------------------------------------

    def _combine_send(
        self,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        if self._received is None:
            raise RuntimeError("finalize called without a prepare before it")
        if fused_expert_output.numel() == 0:
            y = fused_expert_output.reshape(0, self.op.config.hidden)
        else:
            if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
                weight_and_reduce_impl = TopKWeightAndReduceContiguous()
            y = weight_and_reduce_impl.apply(
                output=None,
                fused_expert_output=fused_expert_output,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        if y.dtype not in (torch.bfloat16, torch.float32):
            y = y.float()
        self._combined = None
        self.op.combine_send(y, self._received.handle)

    def _combine_recv(self) -> None:
        """The receive hook: wait for this rank's tokens to come back from their experts."""
        self._combined = self.op.combine_recv()

    def _write_output(self, output: torch.Tensor) -> None:
        if self._combined is None:
            self._combine_recv()
        assert self._combined is not None
        output.copy_(self._combined)
        self._received = self._combined = None

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        self._combine_send(
            fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, weight_and_reduce_impl
        )
        self._write_output(output)

    def finalize_async(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> tuple[Callable, Callable]:
        self._combine_send(
            fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, weight_and_reduce_impl
        )
        return self._combine_recv, functools.partial(self._write_output, output)
