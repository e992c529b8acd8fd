"""What an eager step of the Triton provider costs the host, counted rather than timed: one kernel
launch per call whatever the batch (the dispatch send routes in its own launch, item by item up to
``self_routing_max_tokens`` and in routing tasks past it, over one routing block or several), and, once
a batch size has been seen, no torch operation at all in any call (no allocation, dtype conversion,
contiguous copy, view or read of a device value), in every mode and wire format, at hidden 256 and
2880, for int32 and int64 ids. The benchmark's ``--eager`` flag times the same steps on a GPU.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.kernels import transport
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers.base import OUR_COMBINE_FORMATS
from tests.helpers import routing_tuning

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts launches through Triton's interpreter (CPU); `bench --eager` on a GPU"
)

# Two ranks, tiny rows; routing blocks of 64 tokens, which 70 tokens overflow.
WORLD, HIDDEN, EXPERTS, TOPK, CAPACITY, ROUTE_BLOCK = 2, 256, 4, 2, 72, 64
BATCHES = (3, 70)
CALLS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


# One kernel per call, whatever the routing and the batch size.
LAUNCHES_PER_CALL = dict.fromkeys(CALLS, 1)


# Kernels running now: the interpreter's own tensor work inside a launch is not the provider's.
_IN_KERNEL = [0]


class TorchOps(TorchDispatchMode):
    """Records every torch operator that runs while it is active, outside kernel launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_KERNEL[0]:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def kernel_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Counts every launch of every transport kernel, by kernel name (independently of the provider)."""
    runs: Counter = Counter()
    for name in dir(transport):
        kernel = getattr(transport, name)
        if name.endswith("_kernel") and hasattr(kernel, "run"):

            def counted(*args, _kernel=kernel, _run=kernel.run, **kwargs):
                runs[_kernel.__name__] += 1
                _IN_KERNEL[0] += 1
                try:
                    return _run(*args, **kwargs)
                finally:
                    _IN_KERNEL[0] -= 1

            monkeypatch.setattr(kernel, "run", counted)
    yield runs


def _config(
    mode: Mode,
    provider: Provider = Provider.TRITON,
    dispatch: DispatchDtype = DispatchDtype.FP8,
    combine: CombineDtype = CombineDtype.BF16,
    hidden: int = HIDDEN,
) -> EpConfig:
    return EpConfig(
        WORLD,
        0,
        hidden,
        EXPERTS,
        TOPK,
        max_tokens_per_rank=CAPACITY,
        dispatch_dtype=dispatch,
        combine_dtype=combine,
        mode=mode,
        provider=provider,
    )


def _inputs(n: int, gen: torch.Generator, ids_dtype: torch.dtype, hidden: int = HIDDEN):
    """One rank's batch: bf16 tokens, f32 weights, ids of ``ids_dtype`` (some dropped), random every call."""
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(n, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    ids = torch.where(torch.rand(n, TOPK, generator=gen) < 0.2, -1, ids).to(ids_dtype)
    return x, torch.rand(n, TOPK, generator=gen), ids


class CallRecorder:
    """Per (call, rank): the kernels launched (``kernel_runs`` is counting them) and the torch
    operators run."""

    def __init__(self, kernel_runs: Counter) -> None:
        self.kernel_runs = kernel_runs
        self.launches: dict[tuple[str, int], int] = {}
        self.ops: dict[tuple[str, int], list[str]] = {}

    @contextmanager
    def __call__(self, call: str, rank: int) -> Iterator[None]:
        before = sum(self.kernel_runs.values())
        with TorchOps() as mode:
            yield
        self.launches[(call, rank)] = sum(self.kernel_runs.values()) - before
        self.ops[(call, rank)] = mode.ops


def _step(world: LoopbackWorld, batches, expert_outputs, record=None):
    """One dispatch + combine over every rank, call by call; ``record(call, rank)`` wraps each call."""
    record = record or (lambda call, rank: nullcontext())
    for r, (op, (x, w, i)) in enumerate(zip(world.ops, batches, strict=True)):
        with record("dispatch_send", r):
            op.dispatch_send(x, w, None, i)
    outs = []
    for r, op in enumerate(world.ops):
        with record("dispatch_recv", r):
            outs.append(op.dispatch_recv())
    for r, (op, y, out) in enumerate(zip(world.ops, expert_outputs, outs, strict=True)):
        with record("combine_send", r):
            op.combine_send(y, out.handle)
    combined = []
    for r, op in enumerate(world.ops):
        with record("combine_recv", r):
            combined.append(op.combine_recv())
    return combined


def _expert_outputs(gen: torch.Generator, hidden: int = HIDDEN) -> list[torch.Tensor]:
    return [torch.randn(CAPACITY * WORLD, hidden, generator=gen).to(torch.bfloat16) for _ in range(WORLD)]


def _recorded_step(
    world: LoopbackWorld, reference: LoopbackWorld, batches, expert_outputs, kernel_runs: Counter
) -> CallRecorder:
    """One step of ``world`` with every call recorded; the bound launches read this step's tensors, so
    its results are the torch provider's (``reference``), bit for bit."""
    record = CallRecorder(kernel_runs)
    combined = _step(world, batches, expert_outputs, record)
    for got, want in zip(combined, _step(reference, batches, expert_outputs), strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    return record


@pytest.mark.parametrize(
    ("routing", "routed_in_send_up_to"), [("self", CAPACITY), ("self", BATCHES[0]), ("tasks", CAPACITY)]
)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mode", [Mode.LOW_LATENCY, Mode.INTRANODE])
def test_each_call_launches_its_kernels_and_runs_no_torch_op(
    mode: Mode, ids_dtype: torch.dtype, routing: str, routed_in_send_up_to: int, kernel_runs: Counter
) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    world = LoopbackWorld(_config(mode))
    world.set_kernel_tuning(routing_tuning(routing, routed_in_send_up_to, route_block=ROUTE_BLOCK))
    reference = LoopbackWorld(_config(mode, Provider.TORCH))
    for n in BATCHES:  # the first step of a batch size binds its launches and views
        _step(world, [_inputs(n, gen, ids_dtype) for _ in range(WORLD)], _expert_outputs(gen))
    for n in (*BATCHES, BATCHES[0]):
        batches = [_inputs(n, gen, ids_dtype) for _ in range(WORLD)]
        record = _recorded_step(world, reference, batches, _expert_outputs(gen), kernel_runs)
        assert record.launches == {(call, r): LAUNCHES_PER_CALL[call] for call in CALLS for r in range(WORLD)}, n
        assert not any(record.ops.values()), (n, {k: v for k, v in record.ops.items() if v})
        assert sum(op.provider.launch_count() for op in world.ops) == sum(kernel_runs.values())


def test_kernel_tuning_applies_from_the_next_call(kernel_runs: Counter, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches bound under the default tuning (70 tokens route item by item in the send) give way to a
    tuning set after them (routing tasks of 64 tokens: two blocks), still one launch per send, with the
    same results as the torch provider."""
    send = transport.dispatch_send_kernel
    item_by_item: list[bool] = []

    def noted(*args, _run=send.run, **kwargs):
        item_by_item.append(kwargs["SELF_ROUTING"])
        return _run(*args, **kwargs)

    monkeypatch.setattr(send, "run", noted)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    world = LoopbackWorld(_config(Mode.LOW_LATENCY))
    reference = LoopbackWorld(_config(Mode.LOW_LATENCY, Provider.TORCH))
    n = BATCHES[1]
    for self_routed, tuning in ((True, None), (False, routing_tuning("tasks", 0, route_block=ROUTE_BLOCK))):
        if tuning is not None:
            world.set_kernel_tuning(tuning)
        item_by_item.clear()
        batches = [_inputs(n, gen, torch.int32) for _ in range(WORLD)]
        record = _recorded_step(world, reference, batches, _expert_outputs(gen), kernel_runs)
        assert [record.launches[("dispatch_send", r)] for r in range(WORLD)] == [1] * WORLD
        assert item_by_item == [self_routed] * WORLD


# Every dispatch format and every combine format of ours, each pair in every mode.
FORMAT_PAIRS = [
    (DispatchDtype.BF16, CombineDtype.BF16),
    (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE),
    (DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE),
    (DispatchDtype.MXFP4, CombineDtype.FP8_DIRECT_CAST),
]


@pytest.mark.parametrize(("dispatch", "combine"), FORMAT_PAIRS, ids=lambda d: d.value)
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
@pytest.mark.parametrize("hidden", [HIDDEN, 2880])
def test_every_format_and_mode_launches_once_per_call_and_runs_no_torch_op(
    hidden: int, mode: Mode, dispatch: DispatchDtype, combine: CombineDtype, kernel_runs: Counter
) -> None:
    """The same counts for every wire format in both directions and every mode (bf16 tokens quantized
    inside the send), at a hidden size of whole tiles and at gpt-oss's 2880, with the torch provider's
    results."""
    assert {d for d, _ in FORMAT_PAIRS} == set(DispatchDtype) and {c for _, c in FORMAT_PAIRS} == OUR_COMBINE_FORMATS
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    world = LoopbackWorld(_config(mode, Provider.TRITON, dispatch, combine, hidden))
    reference = LoopbackWorld(_config(mode, Provider.TORCH, dispatch, combine, hidden))
    n = BATCHES[0]
    _step(world, [_inputs(n, gen, torch.int64, hidden) for _ in range(WORLD)], _expert_outputs(gen, hidden))
    batches = [_inputs(n, gen, torch.int64, hidden) for _ in range(WORLD)]
    record = _recorded_step(world, reference, batches, _expert_outputs(gen, hidden), kernel_runs)
    assert record.launches == {(call, r): 1 for call in CALLS for r in range(WORLD)}
    assert not any(record.ops.values()), {k: v for k, v in record.ops.items() if v}
