"""Property-based: any op shape, format, batch, id and value the API accepts gives the reference's
bytes, and anything it does not accept gives the named error.

Hypothesis draws the hidden size (partial last blocks included), the formats, the world, top-k and
capacity, each rank's token count (0 up to the capacity), ids of either dtype (dropped ones of any
negative value, sometimes one past the last expert), NaN and ±inf at random places, pre-quantized or
bf16 inputs, expert outputs that are sometimes shorter than the received rows, and a call order that
sometimes combines with an older dispatch's handle. Each example runs one step of a loopback world on
one provider and compares it with a reference built here from formats.py: received rows (payload,
scale row, weights, ids) byte for byte, combined tokens bit for bit (a NaN's payload aside). The
Triton provider runs in Triton's interpreter on CPU, so its examples are few and tiny.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori_sglang import formats
from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.kernels import interpreter
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.types import InputError

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
FP8 = torch.float8_e4m3fn
COMBINES = (
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
)
# Hidden sizes with partial blocks (32-element MX groups, 128-element fp8 blocks); the Triton provider
# takes those whose tokens are whole 4-byte words in every format, the torch provider any of them.
TRITON_HIDDEN = (32, 96, 136, 200, 256)
TORCH_HIDDEN = (*TRITON_HIDDEN, 2, 50, 101, 130, 2880)
POISON = 1.0e30  # expert output rows past the received ones: a read of one shows in the sum

if not ON_GPU:
    interpreter.install_exact_casts()


@dataclass(frozen=True)
class Case:
    provider: str
    cfg: EpConfig
    prequantized: bool
    counts: tuple[int, ...]
    seed: int
    id_dtype: torch.dtype
    drop_values: tuple[int, ...]  # negative ids to sprinkle (dropped)
    bad_id: int | None  # an id past the last expert, or None
    specials: tuple[float, ...]  # NaN / ±inf values placed at random elements
    short_rows: int | None  # rank 0's expert outputs hold this many rows, or None for all
    stale_handle: bool  # dispatch twice, combine with the first dispatch's handles


@st.composite
def cases(draw: st.DrawFn, provider: str) -> Case:
    dispatch = draw(st.sampled_from(list(DispatchDtype)))
    hidden = draw(st.sampled_from(TRITON_HIDDEN if provider == "triton" else TORCH_HIDDEN))
    if dispatch is DispatchDtype.MXFP4 and hidden % 2:
        hidden += 1
    world = draw(st.integers(1, 2 if provider == "triton" else 3))
    experts = world * draw(st.integers(1, 3))
    cfg = EpConfig(
        world,
        0,
        hidden,
        experts,
        draw(st.integers(1, min(3, experts))),
        max_tokens_per_rank=draw(st.integers(1, 3)),
        dispatch_dtype=dispatch,
        combine_dtype=draw(st.sampled_from(COMBINES)),
        mode=draw(st.sampled_from(list(Mode))),
        provider=provider,
        combine_block=draw(st.sampled_from((128, 32, 48))),
        peer_timeout_s=5.0,
    )
    id_dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    low = -(2**63) if id_dtype == torch.int64 else -(2**31)
    high = 2**63 - 1 if id_dtype == torch.int64 else 2**31 - 1
    return Case(
        provider=provider,
        cfg=cfg,
        prequantized=draw(st.booleans()) and dispatch is not DispatchDtype.BF16,
        counts=tuple(draw(st.integers(0, cfg.max_tokens_per_rank)) for _ in range(world)),
        seed=draw(st.integers(0, 2**31 - 1)),
        id_dtype=id_dtype,
        drop_values=tuple(draw(st.lists(st.sampled_from((-1, low, max(low, -(2**32) + 3), -7)), max_size=3))),
        bad_id=draw(st.one_of(st.none(), st.sampled_from((experts, high, experts + 1)))),
        specials=tuple(draw(st.lists(st.sampled_from((float("nan"), float("inf"), float("-inf"))), max_size=3))),
        short_rows=draw(st.one_of(st.none(), st.integers(0, 2))),
        stale_handle=draw(st.booleans()),
    )


def _inputs(case: Case):
    """Per rank: bf16 tokens (NaN / inf placed), weights, ids (dropped and bad ones placed)."""
    cfg = case.cfg
    gen = torch.Generator().manual_seed(case.seed)
    xs, ws, ids = [], [], []
    for n in case.counts:
        magnitude = 10.0 ** torch.randint(-3, 3, (n, 1), generator=gen)
        x = (torch.randn(n, cfg.hidden, generator=gen) * magnitude).to(torch.bfloat16)
        rows = torch.randint(0, cfg.num_experts, (n, cfg.topk), generator=gen)
        if n:
            for value in case.specials:
                x[torch.randint(0, n, (1,), generator=gen), torch.randint(0, cfg.hidden, (1,), generator=gen)] = value
            for value in case.drop_values:
                rows[torch.randint(0, n, (1,), generator=gen), torch.randint(0, cfg.topk, (1,), generator=gen)] = value
        xs.append(x)
        ws.append(torch.rand(n, cfg.topk, generator=gen))
        ids.append(rows.to(case.id_dtype))
    if case.bad_id is not None:
        senders = [r for r, n in enumerate(case.counts) if n]
        if senders:
            ids[senders[-1]][0, 0] = case.bad_id
    return xs, ws, ids


def _destinations(row: list[int], cfg: EpConfig) -> list[int]:
    dests: list[int] = []
    for e in row:
        if 0 <= e < cfg.num_experts and e // cfg.num_local_experts not in dests:
            dests.append(e // cfg.num_local_experts)
    return dests


def _expert(payload: torch.Tensor, scales: torch.Tensor | None, cfg: EpConfig) -> torch.Tensor:
    """The expert every rank runs on its received rows: decode, times 1.5, in f32."""
    if scales is not None and cfg.dispatch_dtype is DispatchDtype.FP8:
        scales = scales.contiguous().view(torch.float32)
    return formats.dequantize_dispatch(payload, scales, cfg.dispatch_dtype, cfg.hidden) * 1.5


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan_a, nan_b = a.isnan(), b.isnan()
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.int16)[~nan_a], b.view(torch.int16)[~nan_b]))


def _reference(case: Case, xs, ws, ids):
    """Per rank: the rows it must receive (payload bytes, scale bytes, weights, ids) and what combine
    must return for its tokens."""
    cfg = case.cfg
    wire = [formats.quantize_dispatch(x, cfg.dispatch_dtype, FP8) for x in xs]
    arrivals = [[] for _ in range(cfg.world_size)]
    for src, rows in enumerate(ids):
        for t, row in enumerate(rows.tolist()):
            for dest in _destinations(row, cfg):
                arrivals[dest].append((src, t))
    received, outputs = [], []
    for dest in range(cfg.world_size):
        got = arrivals[dest]
        payload = torch.stack([wire[s][0][t] for s, t in got]) if got else None
        scales = None
        if cfg.dispatch_dtype is not DispatchDtype.BF16 and got:
            scales = torch.stack([wire[s][1][t].contiguous().view(torch.uint8) for s, t in got])
        weights = torch.stack([ws[s][t] for s, t in got]) if got else None
        wire_ids = torch.stack([formats.wire_ids(ids[s][t]) for s, t in got]) if got else None
        received.append((got, payload, scales, weights, wire_ids))
        outputs.append(_expert(payload, scales, cfg) if got else torch.zeros(0, cfg.hidden))
    combined = []
    for src, rows in enumerate(ids):
        acc = torch.zeros(len(rows), cfg.hidden)
        for t, row in enumerate(rows.tolist()):
            for dest in _destinations(row, cfg):
                y = outputs[dest][arrivals[dest].index((src, t))][None]
                back = formats.quantize_combine(y, cfg.combine_dtype, FP8, cfg.combine_block)
                acc[t] += formats.dequantize_combine(back, cfg.combine_dtype, cfg.hidden, FP8, cfg.combine_block)[0]
        combined.append(acc.to(torch.bfloat16))
    return received, combined


def _dispatch(world: LoopbackWorld, case: Case, xs, ws, ids):
    for op, x, w, i in zip(world.ops, xs, ws, ids, strict=True):
        scales = None
        if case.prequantized:
            x, scales = formats.quantize_dispatch(x, case.cfg.dispatch_dtype, FP8)
        op.dispatch_send(x.to(DEVICE), w.to(DEVICE), None if scales is None else scales.to(DEVICE), i.to(DEVICE))
    outs = [op.dispatch_recv() for op in world.ops]
    for op in world.ops:
        op.synchronize()
    return outs


def _expert_outputs(case: Case, outs) -> list[torch.Tensor]:
    cfg = case.cfg
    ys = []
    for rank, out in enumerate(outs):
        n = out.num_recv_host()
        scales = out.recv_scales()[:n] if out.scales is not None else None
        y = torch.full((cfg.max_recv_tokens, cfg.hidden), POISON)
        y[:n] = _expert(out.tokens[:n].cpu(), None if scales is None else scales.cpu(), cfg)
        if rank == 0 and case.short_rows is not None:
            y = y[: case.short_rows]
        ys.append(y.to(DEVICE))
    return ys


def _run(case: Case) -> None:
    cfg = case.cfg
    xs, ws, ids = _inputs(case)
    world = LoopbackWorld(cfg, DEVICE)
    bad = case.bad_id is not None and any(case.counts)
    if bad:
        with pytest.raises(InputError, match=rf"topk_ids h(?:eld|olds) expert {case.bad_id}; valid ids"):
            _dispatch(world, case, xs, ws, ids)
        return
    outs = _dispatch(world, case, xs, ws, ids)
    received, combined = _reference(case, xs, ws, ids)
    for out, (got, payload, scales, weights, wire_ids) in zip(outs, received, strict=True):
        n = out.num_recv_host()
        assert n == len(got)
        if not n:
            continue
        assert torch.equal(out.tokens[:n].cpu().view(torch.uint8), payload.view(torch.uint8))
        if scales is not None:
            assert torch.equal(out.recv_scales()[:n, : scales.shape[1]].cpu(), scales)
        assert torch.equal(out.topk_weights[:n].cpu().view(torch.int32), weights.view(torch.int32))
        assert torch.equal(out.topk_ids[:n].cpu(), wire_ids)
    ys = _expert_outputs(case, outs)
    handles = [o.handle for o in outs]
    if case.stale_handle:
        _dispatch(world, case, xs, ws, ids)
        if not world.ops[0].provider.capabilities.keeps_old_handles:
            with pytest.raises(InputError, match="has since reused its buffers"):
                world.ops[0].combine_send(ys[0], handles[0])
            return
    received_by_0 = len(received[0][0])
    if case.short_rows is not None and case.short_rows < received_by_0:
        with pytest.raises(InputError, match=rf"expert outputs had .*the dispatch received {received_by_0}"):
            world.combine(ys, handles)
            for op in world.ops:
                op.synchronize()
        return
    got = world.combine(ys, handles)
    for rank, (g, want) in enumerate(zip(got, combined, strict=True)):
        assert g.shape == want.shape and _same_bits(g.cpu(), want), f"rank {rank}"


COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=150, **COMMON)
@given(cases("torch"))
def test_torch_provider_matches_the_reference_or_names_the_error(case: Case) -> None:
    _run(case)


@settings(max_examples=25, **COMMON)
@given(cases("triton"))
def test_triton_provider_matches_the_reference_or_names_the_error(case: Case) -> None:
    _run(case)
