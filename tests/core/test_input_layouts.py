"""Property-based: every input in any memory layout torch makes gives the bits its contiguous form gives.

A serving engine hands the op views: slices of wider buffers, transposed or column-major tensors,
contiguous views that start at an odd element of their storage, top-k weights in 16-bit or f64, expert
outputs in bf16 or f32 laid out the same ways. Hypothesis draws a world and formats, then a layout for
each tensor of one rank's step (tokens, scale rows, weights, ids, expert outputs); the step must match
the reference pipeline (tests.helpers.check_step) bit for bit, as the contiguous step does. The
Triton provider runs in Triton's interpreter on CPU, so its examples are few and tiny.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mori_sglang.config import CombineDtype, DispatchDtype, Mode
from mori_sglang.kernels import interpreter
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import CombineHandle, DispatchOutput
from tests.helpers import Scenario, check_step, run_step, world_inputs

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
COMBINES = (
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
)
# Top-k weight dtypes a router may hand over; each holds the drawn weights exactly once rounded to it.
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

if not ON_GPU:
    interpreter.install_exact_casts()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """Column-major as a buffer allocated transposed is (DeepGEMM's scale layout, ``empty(k, n).t()``):
    a single column keeps the stride n, which ``t.t().contiguous().t()`` would normalise to 1."""
    out = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=t.device).t()
    return out.copy_(t)


def _wider_slice(t: torch.Tensor) -> torch.Tensor:
    """The left half of a buffer twice as wide: rows twice as far apart as a contiguous tensor's."""
    return torch.cat([t, t], dim=1)[:, : t.shape[1]]


def _mid_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view one element into its storage (off a 4-byte word for 1- and 2-byte elements)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "column_major": _column_major,
    "wider_slice": _wider_slice,
    "mid_storage": _mid_storage,
}


class _RelaidOp:
    """An op whose caller hands it every tensor in the drawn layouts (and weights in the drawn dtype)."""

    def __init__(self, op: EpDispatchCombineOp, layouts: dict[str, str], weight_dtype: torch.dtype) -> None:
        self.op, self.layouts, self.weight_dtype = op, layouts, weight_dtype

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def _laid(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return LAYOUTS[self.layouts[name]](t)

    def dispatch_send(
        self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor
    ) -> None:
        # Scale rows are opaque bytes: passed as bytes, so a view one element in is off a word.
        laid_scales = None if scales is None else self._laid("scales", scales.view(torch.uint8))
        self.op.dispatch_send(
            self._laid("tokens", x),
            self._laid("weights", weights.to(self.weight_dtype)),
            laid_scales,
            self._laid("ids", ids),
        )

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        self.op.combine_send(self._laid("expert_outputs", y), handle)

    def dispatch(self, *inputs: torch.Tensor | None) -> DispatchOutput:
        self.dispatch_send(*inputs)
        return self.op.dispatch_recv()

    def combine(self, y: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        self.combine_send(y, handle)
        return self.op.combine_recv()


@st.composite
def _steps(draw: st.DrawFn, provider: str) -> tuple[Scenario, dict[str, str], torch.dtype]:
    dispatch = draw(st.sampled_from(list(DispatchDtype)))
    world = draw(st.integers(1, 2 if provider == "triton" else 3))
    scn = Scenario(
        world=world,
        tokens=tuple(draw(st.integers(0, 3)) for _ in range(world)),
        hidden=draw(st.sampled_from((32, 96, 136))),
        experts=world * draw(st.integers(1, 3)),
        topk=draw(st.integers(1, 3)),
        dispatch=dispatch,
        combine=draw(st.sampled_from(COMBINES)),
        mode=draw(st.sampled_from(list(Mode))),
        tagged=draw(st.booleans()),
        expert="rank_scaled",
        expert_dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
        max_tokens=3,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    scn = replace(scn, topk=min(scn.topk, scn.num_experts))
    names = ("tokens", "scales", "weights", "ids", "expert_outputs")
    layouts = {name: draw(st.sampled_from(sorted(LAYOUTS))) for name in names}
    return scn, layouts, draw(st.sampled_from(WEIGHT_DTYPES))


def _check(provider: str, scn: Scenario, layouts: dict[str, str], weight_dtype: torch.dtype) -> None:
    # The reference sees the weights as the op receives them: once rounded to the caller's dtype.
    inputs = [replace(i, weights=i.weights.to(weight_dtype).float()) for i in world_inputs(scn)]
    world = LoopbackWorld(replace(scn.config(), provider=provider), DEVICE)
    ops = [_RelaidOp(op, layouts, weight_dtype) for op in world.ops]
    check_step(scn, inputs, run_step(scn, ops, inputs))


def _all_laid(layout: str) -> dict[str, str]:
    return dict.fromkeys(("tokens", "scales", "weights", "ids", "expert_outputs"), layout)


# A step that once failed inside torch ("stride(-1) must be 1 to view BFloat16 as Byte"): column-major
# expert outputs sliced to the rows received, here none.
NO_ROWS = Scenario(world=1, tokens=(0,), hidden=32, experts=1, topk=1, tagged=False, expert="rank_scaled", max_tokens=3)


COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **COMMON)
@given(_steps("torch"))
@example((NO_ROWS, _all_laid("column_major"), torch.float32))
def test_torch_provider_takes_any_layout(step: tuple[Scenario, dict[str, str], torch.dtype]) -> None:
    _check("torch", *step)


@settings(max_examples=10, **COMMON)
@given(_steps("triton"))
@example((NO_ROWS, _all_laid("column_major"), torch.float32))
def test_triton_provider_takes_any_layout(step: tuple[Scenario, dict[str, str], torch.dtype]) -> None:
    _check("triton", *step)


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_column_major_scales_of_one_column(provider: str) -> None:
    """Pre-quantized fp8 tokens of at most 128 elements have one f32 scale each: in DeepGEMM's
    column-major layout that column has the stride of the token count, which the op's byte view of
    the scale rows once refused ("stride(-1) must be 1")."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=128, topk=2, dispatch=DispatchDtype.FP8, tagged=False,
                   expert="rank_scaled", seed=19)  # fmt: skip
    inputs = world_inputs(scn)
    passed = [
        replace(i, payload=i.wire_payload, scales=_column_major(i.wire_scales.view(torch.float32))) for i in inputs
    ]
    assert passed[0].scales.stride() == (1, 3)
    world = LoopbackWorld(replace(scn.config(), provider=provider), DEVICE)
    check_step(scn, inputs, run_step(scn, world.ops, passed))
