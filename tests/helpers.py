"""Shared helpers for the tests: routings, inputs, a scenario runner, reverse-map and combine checkers,
and a gloo multi-process launcher (the fixtures and hooks that use them are in conftest.py).

Every run draws a fresh base seed (printed with any failure; set ``MORI_SGLANG_TEST_SEED`` to replay it).
Each test derives its own seed from the base seed and its node id, so a failing test replays alone.
A scenario is a pure function of its fields: the loopback world and every gloo process rebuild the same
inputs from the same seed, which is what lets the gloo test demand bit-identical results.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import subprocess
import sys
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mori_sglang import formats
from mori_sglang.config import FP8_TYPES, CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import DispatchOutput

# In-process tests that run the Triton kernels on a CPU: the suite sets TRITON_INTERPRET=1 only where
# torch sees no GPU, and on a GPU machine the kernels are loaded for the GPU before such a test runs.
kernels_interpreted_here = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels in Triton's CPU interpreter: this process loaded them for the GPU "
    "(the suite sets TRITON_INTERPRET=1 only on a machine without a GPU)",
)
# A loop over a runtime bound, as every transport kernel has: what Triton 3.6's interpreter cannot run
# with NumPy 2 (its loop bound is a one-element array that NumPy no longer converts to an int).
_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def probe(out, n):
    total = 0
    for i in range(0, n * 2, 1):
        total += 1
    tl.store(out, total)
out = torch.zeros(1, dtype=torch.int32)
probe[(1,)](out, 3)
assert out.item() == 6, out.item()
"""


@functools.cache
def interpreter_failure() -> str | None:
    """How this machine's Triton interpreter fails on a loop like the kernels' (its last error line), or
    None where it runs it; checked once, in a process of its own that sees no GPU, as the CPU commands
    the CLI tests start run."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]


def skip_without_working_interpreter() -> None:
    """Skip a test whose command runs the kernels in Triton's interpreter where that interpreter fails
    on them (Triton 3.6 with NumPy 2; the README's set-up installs triton 3.7.1)."""
    failure = interpreter_failure()
    if failure is not None:
        pytest.skip(f"this Triton's interpreter cannot run the kernels' loops: {failure}")


SEED_ENV = "MORI_SGLANG_TEST_SEED"
BASE_SEED = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**31))
# The processes a test spawns (gloo ranks, workers) import this module anew: they draw the same inputs.
os.environ[SEED_ENV] = str(BASE_SEED)
TAG_MULTIPLIER = 100003  # a received row's tag is src_rank * TAG_MULTIPLIER + src_token
TAG_BYTES = 4
ROUTINGS = ("random", "round_robin", "spread", "all_to_one", "dropped")
INPUTS = ("normal", "lognormal", "outliers")
# 65 GSM8K test problems (MIT, see tests/data/gsm8k/LICENSE), one of them with a negative answer.
GSM8K_TEST_JSONL = Path(__file__).with_name("data") / "gsm8k" / "test.jsonl"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Where the Triton provider's dispatch send routes a batch: item by item, or in routing tasks.
ROUTING_REGIMES = ("self", "tasks")


def routing_tuning(regime: str, up_to: int, **fields: int) -> KernelTuning:
    """A tuning under which batches of at most ``up_to`` tokens route as ``regime`` says (larger ones,
    and every batch under "tasks", in routing tasks)."""
    assert regime in ROUTING_REGIMES, regime
    return KernelTuning(self_routing_max_tokens=up_to if regime == "self" else 0, **fields)


def generator(seed: int, *salt: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for the inputs of ``seed`` and ``salt`` in this run: the run's random base seed
    (``MORI_SGLANG_TEST_SEED`` replays it) mixed in, so a test's fixed numbers give other inputs each
    run while the ranks and processes of one run agree."""
    mixed = (BASE_SEED * 1_000_003 + seed) * 1_000_003 + zlib.crc32(repr(salt).encode())
    return torch.Generator(device).manual_seed(mixed % 2**63)


# ---------------------------------------------------------------------------------------------
# routings and inputs
# ---------------------------------------------------------------------------------------------


def make_topk_ids(
    kind: str, num_tokens: int, num_experts: int, topk: int, world_size: int, gen: torch.Generator
) -> torch.Tensor:
    """``[num_tokens, topk]`` int64 expert ids in the shapes MoRI's tests use.

    random: distinct random experts; round_robin: consecutive experts, token after token; spread: slot j on
    rank (t + j) % W, so a token touches min(topk, W) ranks; all_to_one: every expert on the last rank
    (rank 0 receives nothing); dropped: random with ~30% of slots and every third token entirely -1.
    """
    n, e, k, w = num_tokens, num_experts, topk, world_size
    local = e // w
    tokens = torch.arange(n)[:, None]
    slots = torch.arange(k)[None, :]
    if kind == "random":
        return torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k]
    if kind == "round_robin":
        return (tokens * k + slots) % e
    if kind == "spread":
        assert k <= e
        offset = torch.randint(local, (n, 1), generator=gen)
        return ((tokens + slots) % w) * local + (slots // w + offset) % local
    if kind == "all_to_one":
        assert k <= local
        return (w - 1) * local + torch.rand(n, local, generator=gen).argsort(dim=1)[:, :k]
    if kind == "dropped":
        ids = torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k]
        drop = (torch.rand(n, k, generator=gen) < 0.3) | (tokens % 3 == 1)
        return torch.where(drop, torch.full_like(ids, -1), ids)
    raise ValueError(f"unknown routing {kind!r}")


def make_tokens(kind: str, num_tokens: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """``[num_tokens, hidden]`` bf16 with no zeros (a zero would hide a row that never arrived).

    normal: N(0, 1); lognormal: random sign times exp(N(-1, 2^2)), magnitudes over ~6 decades;
    outliers: two buckets, 99% N(0, 1) and 1% N(0, 64^2) (the long-tail activations of MoE layers).
    """
    shape = (num_tokens, hidden)
    if kind == "normal":
        x = torch.randn(shape, generator=gen)
    elif kind == "lognormal":
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        x = sign * torch.exp(torch.randn(shape, generator=gen) * 2 - 1)
    elif kind == "outliers":
        big = torch.rand(shape, generator=gen) < 0.01
        x = torch.randn(shape, generator=gen) * torch.where(big, 64.0, 1.0)
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    x = x.to(torch.bfloat16)
    return torch.where(x == 0, torch.full_like(x, 2.0**-7), x)


# ---------------------------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One dispatch + expert + combine step of a whole world.

    ``tagged``: every token carries ``src_rank * 100003 + src_token`` as an int32 in an opaque scale row
    (after the dispatch format's own scales, which are then computed here and passed pre-quantized).
    Untagged quantized scenarios pass bf16 tokens and let the op quantize them.
    ``expert``: identity, or rank_scaled (rank d multiplies by 1 + d/8: a copy that lands on the wrong
    token or in the wrong order changes the bits of the combined sum).
    """

    world: int
    tokens: tuple[int, ...]
    hidden: int = 256
    experts: int = 0  # 0: 16 per rank
    topk: int = 8
    routing: str = "random"
    inputs: str = "normal"
    dispatch: DispatchDtype = DispatchDtype.BF16
    combine: CombineDtype = CombineDtype.BF16
    mode: Mode = Mode.INTRANODE
    fp8: str = "e4m3fn"
    tagged: bool = True
    expert: str = "identity"
    expert_dtype: torch.dtype = torch.float32
    max_tokens: int = 0  # 0: the largest batch
    combine_block: int = 128
    seed: int = 0
    steps: int = 1

    def __post_init__(self) -> None:
        assert len(self.tokens) == self.world

    @property
    def num_experts(self) -> int:
        return self.experts or 16 * self.world

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_TYPES[self.fp8]

    @property
    def natural_scale_bytes(self) -> int:
        return formats.dispatch_scale_bytes(self.dispatch, self.hidden)

    @property
    def scale_bytes(self) -> int:
        return self.natural_scale_bytes + (TAG_BYTES if self.tagged else 0)

    def config(self, rank: int = 0) -> EpConfig:
        return EpConfig(
            world_size=self.world,
            rank=rank,
            hidden=self.hidden,
            num_experts=self.num_experts,
            topk=self.topk,
            max_tokens_per_rank=self.max_tokens or max(max(self.tokens), 1),
            dispatch_dtype=self.dispatch,
            combine_dtype=self.combine,
            mode=self.mode,
            provider="torch",
            scale_bytes=self.scale_bytes,
            fp8_dtype=self.fp8_dtype,
            combine_block=self.combine_block,
        )


@dataclass
class RankInputs:
    """What one rank feeds dispatch, and the bf16 tokens it started from."""

    x: torch.Tensor  # bf16 source tokens
    payload: torch.Tensor  # what is passed as tokens: x, or its pre-quantized payload
    scales: torch.Tensor | None  # what is passed as scales
    weights: torch.Tensor
    ids: torch.Tensor
    wire_payload: torch.Tensor  # the payload bytes every receiver must see
    wire_scales: torch.Tensor  # [N, scale_bytes] uint8, the scale row every receiver must see

    def to(self, device: torch.device) -> RankInputs:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RankInputs(**{k: v if v is None else v.to(device) for k, v in values.items()})


def rank_inputs(scn: Scenario, rank: int, step: int = 0) -> RankInputs:
    n = scn.tokens[rank]
    gen = generator(scn.seed, rank, step)
    x = make_tokens(scn.inputs, n, scn.hidden, gen)
    ids = make_topk_ids(scn.routing, n, scn.num_experts, scn.topk, scn.world, gen)
    ids = ids.int() if rank % 2 else ids  # both accepted id dtypes travel
    weights = torch.rand(n, scn.topk, generator=gen) + 0.5
    tag = (rank * TAG_MULTIPLIER + torch.arange(n, dtype=torch.int32)).view(n, 1)
    if scn.dispatch is DispatchDtype.BF16:
        wire, natural = x, torch.empty(n, 0, dtype=torch.uint8)
    else:
        wire, q_scales = formats.quantize_dispatch(x, scn.dispatch, scn.fp8_dtype)
        natural = q_scales.contiguous().view(torch.uint8).view(n, scn.natural_scale_bytes)
    wire_scales = torch.cat([natural, tag.view(torch.uint8)], dim=1) if scn.tagged else natural
    if scn.tagged:
        payload, scales = wire, wire_scales.view(torch.int32)
    else:
        payload, scales = x, None
    return RankInputs(x, payload, scales, weights, ids, wire, wire_scales)


def world_inputs(scn: Scenario, step: int = 0) -> list[RankInputs]:
    return [rank_inputs(scn, r, step) for r in range(scn.world)]


def distinct_destinations(ids_row: Sequence[int], num_local: int) -> list[int]:
    """Destination ranks of one token in owning-k order (first slot that names a rank owns its copy)."""
    dests: list[int] = []
    for expert in ids_row:
        if expert >= 0 and expert // num_local not in dests:
            dests.append(expert // num_local)
    return dests


def expected_arrivals(scn: Scenario, inputs: Sequence[RankInputs], rank: int) -> list[tuple[int, int]]:
    """(source rank, source token) of every row ``rank`` must receive, in the order it must receive them."""
    local = scn.num_experts // scn.world
    return [
        (src, t)
        for src, inp in enumerate(inputs)
        for t, row in enumerate(inp.ids.tolist())
        if rank in distinct_destinations(row, local)
    ]


# ---------------------------------------------------------------------------------------------
# the expert and what combine must return
# ---------------------------------------------------------------------------------------------


def expert_factor(scn: Scenario, rank: int) -> float:
    return 1.0 + rank / 8 if scn.expert == "rank_scaled" else 1.0


def expert_rows(scn: Scenario, src_rows: torch.Tensor, src_scales: torch.Tensor, rank: int) -> torch.Tensor:
    """The expert of ``rank`` applied to received payload rows: dequantize, scale, cast to expert_dtype."""
    natural = src_scales[:, : scn.natural_scale_bytes].contiguous()
    scales = natural.view(torch.float32) if scn.dispatch is DispatchDtype.FP8 else natural
    values = formats.dequantize_dispatch(src_rows, scales, scn.dispatch, scn.hidden)
    return (values * expert_factor(scn, rank)).to(scn.expert_dtype)


def run_expert(scn: Scenario, out: DispatchOutput, rank: int, capacity: int) -> torch.Tensor:
    """Expert outputs sized to the receive capacity; rows past num_recv are poisoned (NaN / huge)."""
    n = out.num_recv_host()
    device = out.tokens.device
    y = torch.full((capacity, scn.hidden), float("nan"), dtype=scn.expert_dtype, device=device)
    if scn.expert_dtype == torch.bfloat16:
        y[n:] = 3.0e38
    scales = out.scales[:n] if out.scales is not None else torch.empty(n, 0, dtype=torch.uint8, device=device)
    y[:n] = expert_rows(scn, out.tokens[:n], scales, rank)
    return y


def expected_combine(scn: Scenario, inputs: Sequence[RankInputs], rank: int) -> torch.Tensor:
    """Per token of ``rank``: f32 sum over its distinct destinations, in owning-k order, of the dequantized
    combine row the destination's expert produced; cast once to bf16."""
    inp = inputs[rank]
    local = scn.num_experts // scn.world
    cfg = scn.config(rank)
    out = torch.zeros(inp.x.shape[0], scn.hidden, dtype=torch.float32)
    for t, row in enumerate(inp.ids.tolist()):
        for dest in distinct_destinations(row, local):
            y = expert_rows(scn, inp.wire_payload[t : t + 1], inp.wire_scales[t : t + 1], dest)
            if scn.combine is CombineDtype.BF16:
                back = y.to(torch.bfloat16).float()
            else:
                wire = formats.quantize_combine(y, scn.combine, scn.fp8_dtype, cfg.combine_block)
                back = formats.dequantize_combine(wire, scn.combine, scn.hidden, scn.fp8_dtype, cfg.combine_block)
            out[t] += back[0]
    return out.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# running a step and checking it
# ---------------------------------------------------------------------------------------------


@dataclass
class RankResult:
    """Everything a rank observed in one step, as plain CPU tensors (comparable across processes)."""

    num_recv: int
    tokens: torch.Tensor  # [num_recv, token bytes] uint8
    scale_region: torch.Tensor  # [num_recv, scale stride] uint8, pad bytes included
    scale_stride: int
    weights: torch.Tensor
    ids: torch.Tensor
    combined: torch.Tensor  # bf16 [num_tokens, hidden]
    capacity_rows: int = 0
    extras: dict[str, object] = field(default_factory=dict)


def _result(out: DispatchOutput, combined: torch.Tensor) -> RankResult:
    n = out.num_recv_host()
    stride = out.scale_stride
    if out.scales is not None:
        assert out.scales.stride() == (stride, 1), "scale rows must keep their padded stride"
        region = torch.as_strided(out.scales, (out.scales.shape[0], stride), (stride, 1))[:n].cpu()
    else:
        region = torch.empty(n, 0, dtype=torch.uint8)
    return RankResult(
        num_recv=n,
        tokens=out.tokens[:n].contiguous().view(torch.uint8).cpu(),
        scale_region=region,
        scale_stride=stride,
        weights=out.topk_weights[:n].cpu(),
        ids=out.topk_ids[:n].cpu(),
        combined=combined.cpu(),
        capacity_rows=out.tokens.shape[0],
        extras={"num_recv_dtype": out.num_recv.dtype, "num_recv_shape": tuple(out.num_recv.shape)},
    )


def run_step(scn: Scenario, ops: Sequence[EpDispatchCombineOp], inputs: Sequence[RankInputs]) -> list[RankResult]:
    """One step for the ranks in ``ops`` (all of a loopback world, or this process's one rank).

    Intranode calls are single calls where a rank drives itself; split calls are sends then receives.
    """
    ranks = [op.config.rank for op in ops]
    inputs = [inp.to(ops[0].device) for inp in inputs]
    single = len(ops) == 1
    if single and scn.mode is not Mode.LOW_LATENCY:
        inp = inputs[ranks[0]]
        outs = [ops[0].dispatch(inp.payload, inp.weights, inp.scales, inp.ids)]
    else:
        for op, r in zip(ops, ranks, strict=True):
            inp = inputs[r]
            op.dispatch_send(inp.payload, inp.weights, inp.scales, inp.ids)
        outs = [op.dispatch_recv() for op in ops]
    capacity = scn.config().max_recv_tokens
    ys = [run_expert(scn, out, r, capacity) for out, r in zip(outs, ranks, strict=True)]
    if single and scn.mode is Mode.INTRANODE:
        combined = [ops[0].combine(ys[0], outs[0].handle)]
    else:
        for op, y, out in zip(ops, ys, outs, strict=True):
            op.combine_send(y, out.handle)
        combined = [op.combine_recv() for op in ops]
    return [_result(out, c) for out, c in zip(outs, combined, strict=True)]


def run_loopback(scn: Scenario, device: str = "cpu") -> list[list[RankResult]]:
    """Every step of ``scn`` in a loopback world on ``device``: ``[step][rank]``, results on the CPU."""
    world = LoopbackWorld(scn.config(), device=device)
    return [run_step(scn, world.ops, world_inputs(scn, step)) for step in range(scn.steps)]


def check_dispatch(scn: Scenario, inputs: Sequence[RankInputs], rank: int, res: RankResult) -> None:
    """Every received row decodes to its source: count, order, payload, scales, weights, ids, zero pads."""
    arrivals = expected_arrivals(scn, inputs, rank)
    assert res.extras["num_recv_dtype"] == torch.int32 and res.extras["num_recv_shape"] == (1,)
    assert res.capacity_rows == scn.world * scn.config().max_tokens_per_rank
    assert res.num_recv == len(arrivals), f"rank {rank}: {res.num_recv} rows, expected {len(arrivals)}"
    stride = formats.scale_stride_bytes(scn.scale_bytes)
    assert res.scale_stride == stride and stride % 128 == 0
    if scn.tagged:
        tags = res.scale_region[:, scn.natural_scale_bytes : scn.scale_bytes].contiguous().view(torch.int32)
        got = [(int(v) // TAG_MULTIPLIER, int(v) % TAG_MULTIPLIER) for v in tags.view(-1)]
        assert got == arrivals, f"rank {rank}: rows arrived from {got}, expected {arrivals}"
    if not arrivals:
        return
    for name, got_rows, want_rows in (
        ("payload", res.tokens, [inp.wire_payload.contiguous().view(torch.uint8) for inp in inputs]),
        ("scales", res.scale_region[:, : scn.scale_bytes], [inp.wire_scales for inp in inputs]),
        ("topk_weights", res.weights, [inp.weights for inp in inputs]),
        ("topk_ids", res.ids, [inp.ids.int() for inp in inputs]),
    ):
        want = torch.stack([want_rows[s][t] for s, t in arrivals])
        bad = (got_rows.view(torch.uint8) != want.view(torch.uint8)).reshape(len(arrivals), -1).any(dim=1)
        assert not bad.any(), f"rank {rank}: {name} of rows {bad.nonzero().view(-1).tolist()} differ from source"
    assert res.ids.dtype == torch.int32 and res.weights.dtype == torch.float32
    assert not res.scale_region[:, scn.scale_bytes :].any(), f"rank {rank}: scale pad bytes are not zero"


def check_combine(scn: Scenario, inputs: Sequence[RankInputs], rank: int, res: RankResult) -> None:
    """Bit-exact against the reference pipeline; for the identity expert also within the format's bound."""
    want = expected_combine(scn, inputs, rank)
    assert res.combined.dtype == torch.bfloat16 and res.combined.shape == want.shape
    diff = (res.combined.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"rank {rank}: combined differs from reference at {diff[:8].tolist()}"
    if scn.expert == "identity" and scn.dispatch is DispatchDtype.BF16:
        check_combine_bound(scn, inputs[rank], res.combined)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Largest |deq(q(x)) - x| of a round-to-nearest-even e4m3 cast of x / scale, saturating at max.

    3 mantissa bits: half an ulp is 2^-4 of the value's power of two, so <= 2^-4 |x| for normals; below
    the smallest normal the spacing is the subnormal step (2^-9 e4m3fn, 2^-10 e4m3fnuz), half of it in
    absolute terms; values past max * scale saturate. 2^-20 |x| covers the f32 division and product.
    """
    limit = formats.fp8_max(fp8_dtype)
    half_sub = 2.0**-10 if fp8_dtype == torch.float8_e4m3fn else 2.0**-11
    ax = x.abs()
    return 2.0**-4 * ax + half_sub * scale + (ax - limit * scale).clamp(min=0) + 2.0**-20 * ax


def combine_scale_per_element(
    x: torch.Tensor, combine: CombineDtype, fp8_dtype: torch.dtype, block: int
) -> torch.Tensor:
    """The scale each element of ``x`` is quantized with (amax / max rounded either way: the bound's
    2^-20 slack absorbs the ulp)."""
    limit = formats.fp8_max(fp8_dtype)
    if combine is CombineDtype.FP8_DIRECT_CAST:
        return torch.ones_like(x)
    rows, hidden = x.shape
    blocks = formats.num_blocks(hidden, block)
    padded = torch.nn.functional.pad(x.abs(), (0, blocks * block - hidden))  # a partial last block
    amax = padded.view(rows, blocks, block).amax(dim=2, keepdim=True)
    if combine is CombineDtype.FP8_BLOCKWISE:
        scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    else:
        scale = torch.where(amax > limit, amax / limit, torch.ones_like(amax))
    return scale.expand(-1, -1, block).reshape(rows, blocks * block)[:, :hidden]


def check_combine_bound(scn: Scenario, inp: RankInputs, combined: torch.Tensor) -> None:
    """Identity expert: combined == x * (distinct ranks); exact for bf16, within the fp8 bound otherwise."""
    local = scn.num_experts // scn.world
    counts = torch.tensor([len(distinct_destinations(r, local)) for r in inp.ids.tolist()], dtype=torch.float32)
    x = inp.x.float()
    exact = x * counts[:, None]  # exact in f32: 8 significant bits times a count < 2^5
    if scn.combine is CombineDtype.BF16:
        assert torch.equal(combined, exact.to(torch.bfloat16)), "bf16 combine is not x * (distinct ranks)"
        return
    block = scn.config().combine_block
    scale = combine_scale_per_element(x, scn.combine, scn.fp8_dtype, block)
    bound = counts[:, None] * fp8_error_bound(x, scale, scn.fp8_dtype) + 2.0**-8 * exact.abs()
    err = (combined.float() - exact).abs()
    worst = (err - bound).max() if err.numel() else torch.tensor(0.0)
    assert worst <= 0, f"{scn.combine.value}: error exceeds its bound by {float(worst)}"


def check_step(scn: Scenario, inputs: Sequence[RankInputs], results: Sequence[RankResult]) -> None:
    for rank, res in enumerate(results):
        check_dispatch(scn, inputs, rank, res)
        check_combine(scn, inputs, rank, res)


def assert_results_identical(a: Sequence[RankResult], b: Sequence[RankResult], what: str) -> None:
    for rank, (ra, rb) in enumerate(zip(a, b, strict=True)):
        assert ra.num_recv == rb.num_recv, f"{what} rank {rank}: num_recv {ra.num_recv} != {rb.num_recv}"
        for name in ("tokens", "scale_region", "weights", "ids", "combined"):
            ta, tb = getattr(ra, name), getattr(rb, name)
            same = ta.shape == tb.shape and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
            assert same, f"{what} rank {rank}: {name} differ"


# ---------------------------------------------------------------------------------------------
# gloo launcher
# ---------------------------------------------------------------------------------------------


def _gloo_entry(rank: int, world_size: int, init_file: str, fn: Callable[..., None], args: tuple) -> None:
    """One rank: ``fn`` between the default group's creation and the destruction of every group, which
    must free the groups still registered when ``fn`` returns (a framework's own teardown inside ``fn``
    destroys the ones it made).

    A gloo group something still holds after ``destroy_process_group`` keeps its worker threads running
    into the interpreter's exit, where a thread finishing its last collective needs the GIL and aborts
    the process (``terminate called without an active exception``) now and then: a flaky crash. A
    held group is therefore an error here, every time, naming what holds it.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        gc.collect()  # objects in reference cycles that hold a group
        # torch.distributed lists its live groups in no public place; _world is where it keeps them.
        groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
        if dist.is_initialized():  # a framework's teardown in ``fn`` may have destroyed it already
            dist.destroy_process_group()
    held = [group() for group in groups if group() is not None]
    if held:
        holders = sorted({type(r).__name__ for group in held for r in gc.get_referrers(group)} - {"list"})
        raise RuntimeError(
            f"rank {rank}: {len(held)} process group(s) outlived destroy_process_group, held by {holders}: "
            "release them (close what was built over them) before the worker returns"
        )


def run_gloo(world_size: int, fn: Callable[..., None], args: tuple, tmp_path: Path, timeout_s: float = 240) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes over a gloo group.

    ``fn`` must be a module-level function. A child's exception is re-raised here; a group that has not
    finished after ``timeout_s`` (a hang: some rank waits on a collective nobody else entered) is killed
    and fails the test.
    """
    init_file = tmp_path / "gloo_init"
    context = mp.start_processes(
        _gloo_entry,
        args=(world_size, str(init_file), fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = timeout_s
    step = 1.0
    while not context.join(timeout=step):
        deadline -= step
        if deadline <= 0:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"gloo group of {world_size} did not finish in {timeout_s} s")
