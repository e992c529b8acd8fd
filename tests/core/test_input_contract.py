"""Every input gives the right answer or a clear error, on both providers and in every mode.

Hidden sizes that are not a multiple of the block (a partial last block with its own scale), tiny
blocks, NaN and infinity, int64 ids, stale handles, short expert outputs, a peer that never sends and
out-of-range knobs. The Triton provider runs in Triton's interpreter on CPU at small sizes (the real
hidden sizes run there only on a GPU); the torch provider runs every real hidden size everywhere.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mori_sglang import env, formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode
from mori_sglang.device_wait import wait_for
from mori_sglang.env import EnvError
from mori_sglang.exchange import DistExchange
from mori_sglang.kernels import interpreter
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.types import CombineHandle, DispatchOutput, InputError, PeerTimeoutError
from tests.helpers import (
    RankInputs,
    Scenario,
    check_step,
    distinct_destinations,
    generator,
    run_gloo,
    run_step,
    world_inputs,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
MODEL_HIDDEN = (2048, 2880, 3584, 4096, 5120, 6144, 7168)
COMBINES = (
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
)
MODES = tuple(Mode)
FP8 = torch.float8_e4m3fn

if not ON_GPU:
    interpreter.install_exact_casts()


def _world(scn: Scenario, provider: str, **overrides: object) -> LoopbackWorld:
    return LoopbackWorld(replace(scn.config(), provider=provider, **overrides), DEVICE)


def _check_both_providers(scn: Scenario) -> None:
    """Both providers against the reference pipeline (helpers.check_step), bit for bit."""
    inputs = world_inputs(scn)
    for provider in ("torch", "triton"):
        world = _world(scn, provider)
        check_step(scn, inputs, run_step(scn, world.ops, inputs))


# ---------------------------------------------------------------------------------------------
# 1. hidden sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", MODEL_HIDDEN)
@pytest.mark.parametrize("dispatch", list(DispatchDtype))
def test_model_hidden_sizes_every_format_torch_provider(hidden: int, dispatch: DispatchDtype, seed: int) -> None:
    """Every real MoE hidden size with every dispatch format and every combine format (one step each,
    the mode cycling), decoded through the reference; scale rows the op makes itself (untagged)
    and scale rows passed pre-quantized (tagged) alternate."""
    for i, combine in enumerate(COMBINES):
        scn = Scenario(
            world=2,
            tokens=(3, 2),
            hidden=hidden,
            topk=4,
            dispatch=dispatch,
            combine=combine,
            mode=MODES[i % len(MODES)],
            tagged=bool(i % 2),
            inputs="lognormal",
            seed=seed + i,
        )
        world = _world(scn, "torch")
        inputs = world_inputs(scn)
        check_step(scn, inputs, run_step(scn, world.ops, inputs))


@pytest.mark.parametrize("hidden", MODEL_HIDDEN)
@pytest.mark.parametrize("dispatch", list(DispatchDtype))
def test_model_hidden_sizes_every_format_triton_provider(hidden: int, dispatch: DispatchDtype, seed: int) -> None:
    """The same on the Triton provider: every combined column written, the partial last block included
    (2880 = 22.5 x 128), its bytes those of the reference."""
    for i, combine in enumerate(COMBINES):
        mode = MODES[i % len(MODES)]
        scn = Scenario(world=2, tokens=(2, 1), hidden=hidden, topk=2, experts=4, dispatch=dispatch,
                       combine=combine, mode=mode, tagged=bool(i % 2), inputs="lognormal", seed=seed + i)  # fmt: skip
        _check_both_providers(scn)


@pytest.mark.parametrize(
    ("hidden", "dispatch", "combine"),
    [
        (96, DispatchDtype.MXFP4, CombineDtype.FP8_BLOCKWISE),
        (200, DispatchDtype.FP8, CombineDtype.BF16),
        (200, DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST),
        (100, DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE_NATIVE),
        (104, DispatchDtype.MXFP4, CombineDtype.FP8_BLOCKWISE),
        (102, DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE),  # scales start on the dword after 102 B
    ],
)
def test_small_hidden_tails_on_both_providers(
    hidden: int, dispatch: DispatchDtype, combine: CombineDtype, seed: int
) -> None:
    for tagged in (False, True):
        scn = Scenario(world=2, tokens=(3, 2), hidden=hidden, topk=2, experts=4, dispatch=dispatch,
                       combine=combine, mode=Mode.SPLIT, tagged=tagged, seed=seed)  # fmt: skip
        _check_both_providers(scn)


@pytest.mark.parametrize("combine", [CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE])
@pytest.mark.parametrize("block", [2880, 2881, 2**21 + 1])
def test_a_combine_block_as_long_as_the_row_or_longer(combine: CombineDtype, block: int, seed: int) -> None:
    """One block over the whole row, however long ``combine_block`` says it is (past Triton's largest
    tensor too): both providers give the same bytes."""
    scn = Scenario(world=2, tokens=(2, 3), hidden=2880, topk=2, experts=4, combine=combine, combine_block=block,
                   mode=Mode.LOW_LATENCY, seed=seed)  # fmt: skip
    _check_both_providers(scn)


@pytest.mark.parametrize("combine", COMBINES)
def test_scale_dim_that_does_not_divide_hidden(combine: CombineDtype, seed: int) -> None:
    """MORI_FP8_COMBINE_SCALE_DIM=7 at hidden 2880: blocks of 412, the last of 408. The blockwise formats
    follow it (its own scale for the partial block); bf16 and the direct cast ignore it entirely."""
    cfg = EpConfig.from_env(world_size=2, rank=0, hidden=2880, num_experts=4, topk=2,
                            environ={"MORI_FP8_COMBINE_SCALE_DIM": "7"})  # fmt: skip
    assert cfg.combine_block == 412
    scn = Scenario(world=2, tokens=(2, 2), hidden=2880, topk=2, experts=4, combine=combine, combine_block=412,
                   mode=Mode.LOW_LATENCY, seed=seed)  # fmt: skip
    _check_both_providers(scn)
    if combine in (CombineDtype.BF16, CombineDtype.FP8_DIRECT_CAST):
        inputs = world_inputs(scn)
        default_block = run_step(scn, _world(scn, "triton", combine_block=128).ops, inputs)
        odd_block = run_step(scn, _world(scn, "triton").ops, inputs)
        for a, b in zip(default_block, odd_block, strict=True):
            assert torch.equal(a.combined.view(torch.int16), b.combined.view(torch.int16))


def test_blockwise_row_of_a_partial_block_byte_for_byte() -> None:
    """hidden 2880, block 128: 2880 fp8 bytes, then 23 f32 scales, the last for the 64 elements of the
    partial block, each amax / fp8_max of exactly its own elements."""
    y = torch.randn(3, 2880)
    y[:, 2816:] *= 1000.0  # the partial block's scale differs from every other block's
    wire = formats.quantize_combine(y, CombineDtype.FP8_BLOCKWISE, FP8)
    assert wire.shape == (3, 2880 + 4 * 23)
    scales = wire[:, 2880:].contiguous().view(torch.float32)
    amax = y[:, 2816:].abs().amax(dim=1)
    assert torch.equal(scales[:, 22], amax / torch.full_like(amax, 448.0))
    q = formats.saturating_fp8_cast(y[:, 2816:] * (448.0 / amax[:, None]), FP8)
    assert torch.equal(wire[:, 2816:2880], q.view(torch.uint8))


@pytest.mark.parametrize("dispatch", [DispatchDtype.MXFP8, DispatchDtype.MXFP4])
def test_mx_dispatch_at_2880_pads_its_own_scale_row(dispatch: DispatchDtype) -> None:
    """90 e8m0 bytes padded with two zero bytes to 92 B (whole dwords), made by the op from bf16 tokens."""
    cfg = EpConfig(1, 0, 2880, 8, 2, max_tokens_per_rank=2, dispatch_dtype=dispatch, provider="torch")
    op = EpDispatchCombineOp(cfg, device="cpu", loopback=LoopbackWorld(cfg).hub)
    assert op.scale_bytes == 92
    _, scales = formats.quantize_dispatch(torch.randn(2, 2880).to(torch.bfloat16), dispatch, FP8)
    assert scales.shape == (2, 92) and not scales[:, 90:].any()


def test_triton_refuses_tokens_that_are_not_whole_words() -> None:
    """Odd hidden: the torch provider carries it, the Triton provider refuses it when the op is built."""
    cfg = EpConfig(2, 0, 101, 4, 2, max_tokens_per_rank=2, provider="triton")
    with pytest.raises(ConfigError, match=r"hidden=101: .*4-byte words.*202 B.*even.*SGLANG_MORI_BACKEND=torch"):
        LoopbackWorld(cfg, DEVICE)
    with pytest.raises(ConfigError, match=r"hidden=102: .*fp8 tokens.*multiple of 4"):
        LoopbackWorld(replace(cfg, hidden=102, dispatch_dtype=DispatchDtype.FP8), DEVICE)
    scn = Scenario(world=2, tokens=(2, 3), hidden=101, topk=2, experts=4, combine=CombineDtype.FP8_BLOCKWISE)
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, _world(scn, "torch").ops, inputs))


# ---------------------------------------------------------------------------------------------
# 2. tiny blocks, 6. NaN and infinity
# ---------------------------------------------------------------------------------------------


def _combine_rows(world: LoopbackWorld, ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dispatch one token per rank to every rank's first expert, then combine the given expert outputs
    (``ys[r]``: rank r's rows, in receive order, one per source rank)."""
    cfg = world.ops[0].config
    w = cfg.world_size
    xs = [torch.randn(1, cfg.hidden).to(torch.bfloat16).to(DEVICE) for _ in range(w)]
    ids = torch.arange(w)[None, :] * cfg.num_local_experts
    outs = world.dispatch(xs, [torch.ones(1, w, device=DEVICE)] * w, None, [ids.to(DEVICE)] * w)
    assert [o.num_recv_host() for o in outs] == [w] * w
    return [c.cpu() for c in world.combine([y.to(DEVICE) for y in ys], [o.handle for o in outs])]


def _reference_combine(ys: list[torch.Tensor], cfg: EpConfig) -> list[torch.Tensor]:
    """Rank s's token comes back from every rank d as row s of ys[d]: the sum in rank order."""
    out = []
    for s in range(cfg.world_size):
        acc = torch.zeros(cfg.hidden)
        for y in ys:
            wire = formats.quantize_combine(y[s : s + 1], cfg.combine_dtype, FP8, cfg.combine_block)
            acc = acc + formats.dequantize_combine(wire, cfg.combine_dtype, cfg.hidden, FP8, cfg.combine_block)[0]
        out.append(acc.to(torch.bfloat16)[None])
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that a NaN's sign and payload are not specified (every NaN stays a NaN)."""
    nan_a, nan_b = a.isnan(), b.isnan()
    bits_a = a.contiguous().view(torch.int16) if a.dtype == torch.bfloat16 else a.contiguous().view(torch.int32)
    bits_b = b.contiguous().view(torch.int16) if b.dtype == torch.bfloat16 else b.contiguous().view(torch.int32)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(bits_a[~nan_a], bits_b[~nan_b]))


@pytest.mark.parametrize("combine", [CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE])
def test_blocks_of_tiny_magnitude_decode_without_nan(combine: CombineDtype) -> None:
    """A block whose largest magnitude is below fp8_max / f32 max (~1.3e-36) used to get an infinite
    inverse (0 x inf = NaN). Its scale is now that of fp8_max * 2^-126: the block decodes to its values
    as far as fp8 resolves them, on both providers and in the reference."""
    y = torch.randn(2, 256) * 1e-38
    y[1, :128] = 1e-40  # subnormal f32
    wire = formats.quantize_combine(y, combine, FP8)
    back = formats.dequantize_combine(wire, combine, 256, FP8)
    assert not back.isnan().any()
    close = (back - y).abs() <= 2.0**-126 * 2.0**-9 + 2.0**-4 * y.abs()
    if combine is CombineDtype.FP8_BLOCKWISE:
        assert close.all()
    else:  # MoRI's format scales only blocks past fp8_max: tiny values cast straight to fp8, i.e. to zero
        assert (close | (back == 0)).all()
    cfg = EpConfig(2, 0, 256, 4, 2, max_tokens_per_rank=1, combine_dtype=combine)
    for provider in ("torch", "triton"):
        world = LoopbackWorld(replace(cfg, provider=provider), DEVICE)
        got = _combine_rows(world, [y, y * 3])
        for g, want in zip(got, _reference_combine([y, y * 3], cfg), strict=True):
            assert not g.isnan().any() and torch.equal(g.view(torch.int16), want.view(torch.int16)), provider


NAN, INF = math.nan, math.inf


def test_nan_and_infinity_rules_of_every_combine_format() -> None:
    """docs/api.md "NaN and infinity": bf16 keeps both; the direct cast keeps NaN and saturates ±inf;
    blockwise formats keep a NaN in its own element (the rest of the block unaffected) and turn the
    whole block of an infinity to NaN."""
    y = torch.ones(1, 384)
    y[0, 5] = NAN
    y[0, 130] = -INF
    y[0, 300] = 2.0
    bf16 = formats.dequantize_combine(formats.quantize_combine(y, CombineDtype.BF16, FP8), CombineDtype.BF16, 384, FP8)
    assert bf16[0, 5].isnan() and bf16[0, 130] == -INF
    cast = formats.dequantize_combine(
        formats.quantize_combine(y, CombineDtype.FP8_DIRECT_CAST, FP8), CombineDtype.FP8_DIRECT_CAST, 384, FP8
    )
    assert cast[0, 5].isnan() and cast[0, 130] == -448.0 and cast.isnan().sum() == 1
    for combine in (CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE):
        wire = formats.quantize_combine(y, combine, FP8)
        back = formats.dequantize_combine(wire, combine, 384, FP8)
        assert back[0, :128].isnan().tolist() == [i == 5 for i in range(128)], combine
        assert back[0, 128:256].isnan().all(), combine  # the infinity's block
        assert torch.equal(back[0, 256:], y[0, 256:]), combine  # exact: powers of two
        assert wire[0, 5] == 0x7F  # the canonical NaN, whatever NaN came in


def test_nan_and_infinity_rules_of_every_dispatch_format() -> None:
    """fp8 (f32 scales) and mxfp8 keep a NaN in its element; an infinity turns its group to NaN; fp4
    holds no NaN, so a NaN turns its group to NaN too. Groups without either are unaffected."""
    x = torch.ones(1, 256, dtype=torch.bfloat16)
    x[0, 3] = NAN
    x[0, 200] = INF
    for dispatch in (DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4):
        payload, scales = formats.quantize_dispatch(x, dispatch, FP8)
        back = formats.dequantize_dispatch(payload, scales, dispatch, 256)
        group = 128 if dispatch is DispatchDtype.FP8 else 32
        nan_group = back[0, :group].isnan()
        if dispatch is DispatchDtype.MXFP4:
            assert nan_group.all()
        else:
            assert nan_group.tolist() == [i == 3 for i in range(group)], dispatch
        inf_group = 200 // group * group
        assert back[0, inf_group : inf_group + group].isnan().all(), dispatch
        clean = torch.ones(256, dtype=torch.bool)
        clean[:group] = False
        clean[inf_group : inf_group + group] = False
        assert torch.equal(back[0, clean], torch.ones(int(clean.sum()))), dispatch


@pytest.mark.parametrize("combine", COMBINES)
def test_nan_and_infinity_through_the_triton_combine(combine: CombineDtype) -> None:
    """The kernels follow the reference bit for bit (NaN payloads aside), NaN and ±inf in any block."""
    gen = generator(5)
    ys = [torch.randn(2, 256, generator=gen) for _ in range(2)]
    ys[0][0, 7], ys[0][1, 130], ys[1][0, 255], ys[1][1, 0] = NAN, INF, -INF, NAN
    cfg = EpConfig(2, 0, 256, 4, 2, max_tokens_per_rank=1, combine_dtype=combine)
    want = _reference_combine(ys, cfg)
    for provider in ("torch", "triton"):
        got = _combine_rows(LoopbackWorld(replace(cfg, provider=provider), DEVICE), ys)
        for g, w in zip(got, want, strict=True):
            assert _same_bits(g, w), provider
            assert g.isnan().any(), provider  # every row holds a NaN: it stays visible


@pytest.mark.parametrize("dispatch", [DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4])
def test_nan_and_infinity_through_the_fused_dispatch_quantization(dispatch: DispatchDtype) -> None:
    """The Triton send quantizes bf16 tokens holding NaN (either sign) and ±inf to the reference's bytes."""
    x = torch.randn(4, 256).to(torch.bfloat16)
    x[0, 3] = NAN
    x[1, 40] = -NAN
    x[2, 100] = INF
    x[3, 255] = -INF
    x = x.to(DEVICE)
    cfg = EpConfig(1, 0, 256, 4, 2, max_tokens_per_rank=4, dispatch_dtype=dispatch, provider="triton")
    world = LoopbackWorld(cfg, DEVICE)
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    out = world.dispatch([x], [torch.ones(4, 2, device=DEVICE)], None, [ids])[0]
    payload, scales = formats.quantize_dispatch(x.cpu(), dispatch, FP8)
    assert torch.equal(out.tokens[:4].view(torch.uint8).cpu(), payload.view(torch.uint8))
    assert torch.equal(out.recv_scales()[:4].cpu(), scales.contiguous().view(torch.uint8).view(4, -1))


# ---------------------------------------------------------------------------------------------
# 3. stale handles, 4. short expert outputs
# ---------------------------------------------------------------------------------------------


def _batch(cfg: EpConfig, n: int, seed: int):
    gen = generator(seed)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(cfg.world_size)]
    ws = [torch.rand(n, cfg.topk, generator=gen).to(DEVICE) for _ in range(cfg.world_size)]
    ids = [torch.randint(0, cfg.num_experts, (n, cfg.topk), generator=gen).to(DEVICE) for _ in range(cfg.world_size)]
    return xs, ws, ids


def _dispatch(world: LoopbackWorld, xs, ws, ids):
    for op, x, w, i in zip(world.ops, xs, ws, ids, strict=True):
        op.dispatch_send(x, w, None, i)
    return [op.dispatch_recv() for op in world.ops]


def _identity(outs) -> list[torch.Tensor]:
    """The identity expert: every received row as f32, the rows past them NaN (a combine that read one
    would show it)."""
    ys = []
    for out in outs:
        y = out.tokens.float().clone()
        y[out.num_recv_host() :] = float("nan")
        ys.append(y)
    return ys


def _identity_combined(cfg: EpConfig, xs, ids) -> list[torch.Tensor]:
    """The identity expert's combine from the inputs alone (bf16 both ways): each token times the
    ranks it went to, exact in f32 and rounded once."""
    local = cfg.num_experts // cfg.world_size
    combined = []
    for x, rows in zip(xs, ids, strict=True):
        copies = [len(distinct_destinations(row, local)) for row in rows.tolist()]  # ids all in range
        combined.append((x.float().cpu() * torch.tensor(copies, dtype=torch.float32)[:, None]).to(torch.bfloat16))
    return combined


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_a_combine_with_an_older_dispatchs_handle(mode: Mode) -> None:
    """dispatch A, dispatch B, combine A: the Triton provider's handle points at buffers B reused, so it
    refuses; the torch provider's handles own their tensors, so it combines A right."""
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=5, mode=mode)
    batch_a, batch_b = _batch(cfg, 5, 1), _batch(cfg, 4, 2)
    for provider in ("torch", "triton"):
        world = LoopbackWorld(replace(cfg, provider=provider), DEVICE)
        outs_a = _dispatch(world, *batch_a)
        ys_a = _identity(outs_a)
        fresh = world.combine(ys_a, [o.handle for o in outs_a])
        assert _equal(fresh, _identity_combined(cfg, batch_a[0], batch_a[2]))
        outs_a = _dispatch(world, *batch_a)
        _dispatch(world, *batch_b)
        if provider == "triton":
            with pytest.raises(InputError, match=r"dispatch #2, but dispatch #3 has since reused its buffers"):
                world.ops[0].combine_send(ys_a[0], outs_a[0].handle)
        else:
            late = world.combine(ys_a, [o.handle for o in outs_a])
            assert all(torch.equal(a, b) for a, b in zip(fresh, late, strict=True))


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_combine_with_another_ops_handle_is_refused(provider: str) -> None:
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=3, provider=provider)
    world, other = LoopbackWorld(cfg, DEVICE), LoopbackWorld(cfg, DEVICE)
    batch = _batch(cfg, 3, 3)
    outs = _dispatch(world, *batch)
    _dispatch(other, *batch)
    with pytest.raises(InputError, match="another op's dispatch"):
        other.ops[0].combine_send(_identity(outs)[0], outs[0].handle)
    with pytest.raises(InputError, match="another op's dispatch"):
        world.ops[1].combine_send(_identity(outs)[0], outs[0].handle)  # rank 0's handle on rank 1


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_combine_given_something_else_than_a_handle_is_refused(provider: str) -> None:
    """The dispatch's output itself, or None, where its ``.handle`` belongs: an error saying what to pass,
    and the world combines right afterwards."""
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=3, provider=provider)
    world = LoopbackWorld(cfg, DEVICE)
    batch = _batch(cfg, 3, 3)
    outs = _dispatch(world, *batch)
    ys = _identity(outs)
    for wrong in (outs[0], None):
        with pytest.raises(InputError, match=rf"DispatchOutput.handle\), got {type(wrong).__name__}"):
            world.ops[0].combine_send(ys[0], wrong)
    combined = world.combine(ys, [o.handle for o in outs])
    assert _equal(combined, _identity_combined(cfg, batch[0], batch[2]))


class _ResendingOp:
    """Rank 0's op, which tries every send a second time before its receive: with other tokens, and
    with expert outputs of NaN. Every other call goes to the op."""

    def __init__(self, op: EpDispatchCombineOp, other: RankInputs) -> None:
        self.op, self.other = op, other

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def dispatch_send(self, *inputs: object) -> None:
        self.op.dispatch_send(*inputs)
        other = self.other.to(self.op.device)
        with pytest.raises(RuntimeError, match="dispatch_send called again before dispatch_recv received"):
            self.op.dispatch_send(other.payload, other.weights, other.scales, other.ids)

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        self.op.combine_send(y, handle)
        with pytest.raises(RuntimeError, match="combine_send called again before combine_recv received"):
            self.op.combine_send(torch.full_like(y, math.nan), handle)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_second_send_before_its_receive_is_refused(provider: str, mode: Mode) -> None:
    """A provider keeps one send of each kind: a second dispatch_send (or combine_send) before the
    receive once replaced the first unseen, its receive returning the second batch. It is refused, and
    the first batch arrives and combines intact."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, mode=mode, expert="rank_scaled", seed=11)
    world = _world(scn, provider)
    other = world_inputs(replace(scn, seed=12))[0]
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, [_ResendingOp(world.ops[0], other), world.ops[1]], inputs))


class _DispatchingDuringCombineOp:
    """Rank 0's op, which tries the next batch's dispatch_send between its combine_send and combine_recv."""

    def __init__(self, op: EpDispatchCombineOp, other: RankInputs) -> None:
        self.op, self.other = op, other

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def combine_send(self, y: torch.Tensor, handle: CombineHandle) -> None:
        self.op.combine_send(y, handle)
        other = self.other.to(self.op.device)
        with pytest.raises(RuntimeError, match="dispatch_send called while a combine_send is not yet received"):
            self.op.dispatch_send(other.payload, other.weights, other.scales, other.ids)


@pytest.mark.parametrize("mode", MODES)
def test_a_dispatch_while_a_combine_is_in_flight_is_refused(mode: Mode) -> None:
    """The Triton provider's combine receive reads the routing of the latest dispatch: a dispatch_send
    between combine_send and combine_recv once overwrote it, and the combine summed the wrong rows
    unseen. It is refused, and the combine in flight returns its own batch intact."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, mode=mode, expert="rank_scaled", seed=14)
    world = _world(scn, "triton")
    other = world_inputs(replace(scn, seed=15))[0]
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, [_DispatchingDuringCombineOp(world.ops[0], other), world.ops[1]], inputs))


def test_the_torch_provider_dispatches_while_a_combine_is_in_flight() -> None:
    """Its handles keep their own routing: the next batch's dispatch_send may go out before the last
    combine is received, and both batches come back right."""
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=5, mode=Mode.LOW_LATENCY, provider="torch")
    batch_a, batch_b = _batch(cfg, 5, 16), _batch(cfg, 3, 17)
    world = LoopbackWorld(cfg, DEVICE)
    expected = [_identity_combined(cfg, batch[0], batch[2]) for batch in (batch_a, batch_b)]
    outs_a = _dispatch(world, *batch_a)
    for op, y, out in zip(world.ops, _identity(outs_a), outs_a, strict=True):
        op.combine_send(y, out.handle)
    for op, x, w, i in zip(world.ops, *batch_b, strict=True):
        op.dispatch_send(x, w, None, i)
    combined_a = [op.combine_recv() for op in world.ops]
    outs_b = [op.dispatch_recv() for op in world.ops]
    combined_b = world.combine(_identity(outs_b), [o.handle for o in outs_b])
    for got, want in zip((combined_a, combined_b), expected, strict=True):
        assert _equal(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_an_op_built_under_inference_mode_runs_outside_it(provider: str, mode: Mode) -> None:
    """A server may build the op inside its first forward, under torch.inference_mode(): buffers made
    there were inference tensors, and the first step outside it failed in torch ("Inplace update to
    inference tensor outside InferenceMode")."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, mode=mode, expert="rank_scaled", seed=18)
    inputs = world_inputs(scn)
    with torch.inference_mode():
        world = _world(scn, provider)
    check_step(scn, inputs, run_step(scn, world.ops, inputs))
    with torch.inference_mode():
        check_step(scn, inputs, run_step(scn, world.ops, inputs))
    check_step(scn, inputs, run_step(scn, world.ops, inputs))


class _RefusedBetweenOp:
    """Rank 0's op, which tries a dispatch without its scale rows between its receive and its combine."""

    def __init__(self, op: EpDispatchCombineOp, inputs: RankInputs) -> None:
        self.op, self.inputs = op, inputs

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def dispatch_recv(self) -> DispatchOutput:
        out = self.op.dispatch_recv()
        inp = self.inputs.to(self.op.device)
        with pytest.raises(InputError, match=r"the op carries 4 B scale rows; pass scales"):
            self.op.dispatch_send(inp.payload, inp.weights, None, inp.ids)
        return out


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_refused_dispatch_leaves_the_last_handle_valid(provider: str) -> None:
    """A dispatch_send refused by its checks sends nothing and reuses no buffer: the previous dispatch
    still combines (a refusal for missing scale rows once counted as a dispatch, so the Triton provider
    refused the handle as reused)."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, mode=Mode.LOW_LATENCY, seed=13)
    world = _world(scn, provider)
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, [_RefusedBetweenOp(world.ops[0], inputs[0]), world.ops[1]], inputs))


@pytest.mark.parametrize("rows", [0, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_expert_outputs_shorter_than_the_received_rows(provider: str, mode: Mode, rows: int) -> None:
    """No silent drop, no read past the outputs, no crash: a clear error, without a host sync on the
    device paths (on CPU it comes at this step's receive, on a GPU at the next call)."""
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=4, mode=mode, provider=provider)
    world = LoopbackWorld(cfg, DEVICE)
    batch = _batch(cfg, 4, 4)
    outs = _dispatch(world, *batch)
    received = outs[0].num_recv_host()
    assert received > rows
    ys = _identity(outs)
    ys[0] = ys[0][:rows].clone()
    with pytest.raises(InputError, match=rf"expert outputs had .*the dispatch received {received}"):
        for op, y, o in zip(world.ops, ys, outs, strict=True):
            op.combine_send(y, o.handle)
        for op in world.ops:
            op.combine_recv()
        for op in world.ops:
            op.synchronize()


# ---------------------------------------------------------------------------------------------
# 5. int64 ids
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_int64_ids_are_never_truncated(provider: str, mode: Mode) -> None:
    """Negative int64 ids of any size are dropped (and travel as -1), exactly like -1."""
    cfg = EpConfig(2, 0, 128, 8, 3, max_tokens_per_rank=4, mode=mode, provider=provider)
    xs, ws, ids = _batch(cfg, 4, 6)
    wide = [i.clone() for i in ids]
    plain = [i.clone() for i in ids]
    for k, value in enumerate((-(2**32) + 3, -(2**63), -(2**31) - 1)):
        wide[0][k, k] = value
        plain[0][k, k] = -1
    got = _dispatch(LoopbackWorld(cfg, DEVICE), xs, ws, wide)
    want = _dispatch(LoopbackWorld(cfg, DEVICE), xs, ws, plain)
    for g, w in zip(got, want, strict=True):
        n = w.num_recv_host()
        assert g.num_recv_host() == n
        assert torch.equal(g.topk_ids[:n].cpu(), w.topk_ids[:n].cpu())
        assert torch.equal(g.tokens[:n].view(torch.uint8).cpu(), w.tokens[:n].view(torch.uint8).cpu())


@pytest.mark.parametrize("bad", [2**32 + 3, 2**31 - 1, 2**63 - 1, 8])
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_ids_past_the_last_expert_raise_naming_the_id(provider: str, bad: int) -> None:
    cfg = EpConfig(2, 0, 128, 8, 3, max_tokens_per_rank=4, provider=provider)
    world = LoopbackWorld(cfg, DEVICE)
    xs, ws, ids = _batch(cfg, 4, 7)
    ids[1][2, 1] = bad
    with pytest.raises(InputError, match=rf"topk_ids h(?:eld|olds) expert {bad}; valid ids are \[0, 8\)"):
        world.dispatch(xs, ws, None, ids)
        for op in world.ops:
            op.synchronize()


# ---------------------------------------------------------------------------------------------
# 7. a peer that never sends
# ---------------------------------------------------------------------------------------------


def test_peer_timeout_variable() -> None:
    var = env.ENV_BY_NAME["SGLANG_MORI_PEER_TIMEOUT_S"]
    assert 0 < float(var.default) <= 120
    cfg = EpConfig.from_env(world_size=1, rank=0, hidden=128, num_experts=1, topk=1,
                            environ={"SGLANG_MORI_PEER_TIMEOUT_S": "2.5"})  # fmt: skip
    assert cfg.peer_timeout_s == 2.5
    for value in ("0", "-1", "inf", "soon"):
        with pytest.raises(EnvError, match=f"SGLANG_MORI_PEER_TIMEOUT_S={value!r}"):
            env.get_seconds("SGLANG_MORI_PEER_TIMEOUT_S", {"SGLANG_MORI_PEER_TIMEOUT_S": value})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_receive_whose_peer_never_sends_raises_in_time(provider: str, mode: Mode) -> None:
    """Rank 1 never sends: rank 0's receive raises PeerTimeoutError naming rank 0, rank 1 and the
    variable, within the timeout (wall clock, in the interpreter too); the torch provider's loopback
    exchange knows at once that the peer cannot send."""
    timeout = 0.5
    cfg = EpConfig(2, 0, 128, 4, 2, max_tokens_per_rank=2, mode=mode, provider=provider, peer_timeout_s=timeout)
    world = LoopbackWorld(cfg, DEVICE)
    xs, ws, ids = _batch(cfg, 2, 8)
    world.ops[0].dispatch_send(xs[0], ws[0], None, ids[0])
    start = time.monotonic()
    pattern = r"rank 0 waited 0.5 s \(SGLANG_MORI_PEER_TIMEOUT_S\) for rank 1|rank 1 would never send"
    with pytest.raises(PeerTimeoutError, match=pattern):
        world.ops[0].dispatch_recv()
        world.ops[0].synchronize()
    assert time.monotonic() - start < timeout + 20  # the interpreter's launch overhead on a shared CPU


def _stalled_peer(rank: int, world_size: int, mode: Mode) -> None:
    cfg = EpConfig(world_size, rank, 128, 4, 2, max_tokens_per_rank=2, mode=mode, provider="torch",
                   peer_timeout_s=1.0)  # fmt: skip
    op = EpDispatchCombineOp(cfg, device="cpu")
    if rank == 1:
        time.sleep(4.0)  # never sends; stays alive past rank 0's deadline
        return
    x = torch.randn(2, 128).to(torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"rank 0 waited 1 s \(SGLANG_MORI_PEER_TIMEOUT_S\) for rank 1"):
        op.dispatch_send(x, torch.ones(2, 2), None, torch.tensor([[0, 2], [1, 3]]))
        op.dispatch_recv()
    assert time.monotonic() - start < 3.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", [Mode.INTRANODE, Mode.LOW_LATENCY])
def test_gloo_receive_from_a_stalled_peer_raises_in_time(mode: Mode, tmp_path: Path) -> None:
    """Over gloo the torch provider no longer waits the process group's 30 minutes."""
    run_gloo(2, _stalled_peer, (mode,), tmp_path, timeout_s=60)


def _collective_round_then_stalled_peer(rank: int, world_size: int, mode: Mode, seed: int) -> None:
    """The all_to_all path NCCL and RCCL take, driven over gloo: a round trip equals the per-peer
    path's, then the last rank never sends and every other rank's receive raises in time."""
    cfg = EpConfig(world_size, rank, 128, 6, 2, max_tokens_per_rank=2, mode=mode, provider="torch",
                   peer_timeout_s=1.0)  # fmt: skip
    op = EpDispatchCombineOp(cfg, device="cpu")
    gen = generator(seed, rank)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    weights = torch.rand(2, 2, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(2)])
    combined = []
    for exchange in (op.provider.exchange, DistExchange(None, cfg.peer_timeout_s, collective=True)):
        op.provider.exchange = exchange
        op.dispatch_send(x, weights, None, ids)
        out = op.dispatch_recv()
        op.combine_send(out.tokens * (rank + 2), out.handle)
        combined.append(op.combine_recv())
    assert torch.equal(combined[0].view(torch.int16), combined[1].view(torch.int16))
    if rank == world_size - 1:
        time.sleep(4.0)  # never sends; stays alive past the others' deadline
        return
    peers = ", ".join(str(peer) for peer in range(world_size) if peer != rank)
    pattern = rf"rank {rank} waited 1 s \(SGLANG_MORI_PEER_TIMEOUT_S\) for the .* with ranks \[{peers}\]"
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=pattern):
        op.dispatch_send(x, weights, None, ids)
        op.dispatch_recv()
    assert time.monotonic() - start < 3.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", [Mode.INTRANODE, Mode.LOW_LATENCY])
def test_collective_receive_from_a_stalled_peer_raises_in_time(mode: Mode, tmp_path: Path, seed: int) -> None:
    """Over an all_to_all (NCCL, RCCL) the torch provider no longer waits the process group's timeout:
    the counts (intranode) and the rows (low-latency) are waited with SGLANG_MORI_PEER_TIMEOUT_S."""
    run_gloo(3, _collective_round_then_stalled_peer, (mode, seed), tmp_path, timeout_s=60)


class _Completion:
    """A device event's stand-in: done after ``polls`` queries (never, for None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_the_host_wait_for_the_device_gives_up_in_time() -> None:
    """The host's wait for the device (the only bound a native MoRI kernel waiting on a stalled peer
    has) raises PeerTimeoutError naming the rank and the variable after the timeout, and returns once
    the work is done."""
    start = time.monotonic()
    pattern = r"rank 3 waited 0.3 s \(SGLANG_MORI_PEER_TIMEOUT_S\) for its device work, which did not finish"
    with pytest.raises(PeerTimeoutError, match=pattern):
        wait_for(_Completion(None), 0.3, 3)
    assert 0.3 <= time.monotonic() - start < 2.0
    done = _Completion(5)
    wait_for(done, 10.0, 0)
    assert done.queries == 6


def test_num_recv_host_waits_with_the_ops_bounded_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EpConfig(1, 0, 128, 2, 1, max_tokens_per_rank=2, provider="torch")
    op = LoopbackWorld(cfg, DEVICE).ops[0]
    waits = []
    monkeypatch.setattr(op, "_wait_for_device", lambda: waits.append(1))
    x = torch.randn(2, 128, device=DEVICE).to(torch.bfloat16)
    out = op.dispatch(x, torch.ones(2, 1, device=DEVICE), None, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    assert waits == []
    assert out.num_recv_host() == 2 and waits == [1]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: a kernel that outlasts the timeout")
@pytest.mark.parametrize("wait", ["synchronize", "num_recv_host"])
def test_host_waits_give_up_on_device_work_past_the_timeout(wait: str) -> None:
    cfg = EpConfig(1, 0, 128, 2, 1, max_tokens_per_rank=2, provider="torch", peer_timeout_s=0.2)
    op = LoopbackWorld(cfg, DEVICE).ops[0]
    x = torch.randn(2, 128, device=DEVICE).to(torch.bfloat16)
    out = op.dispatch(x, torch.ones(2, 1, device=DEVICE), None, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    torch.cuda._sleep(int(10e9))  # seconds of spinning, as a kernel waiting on a stalled peer does
    try:
        with pytest.raises(PeerTimeoutError, match=r"rank 0 waited 0.2 s \(SGLANG_MORI_PEER_TIMEOUT_S\)"):
            op.synchronize() if wait == "synchronize" else out.num_recv_host()
    finally:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 8. clear errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_one_dimensional_scales_are_refused(provider: str) -> None:
    cfg = EpConfig(1, 0, 256, 4, 2, max_tokens_per_rank=2, dispatch_dtype=DispatchDtype.FP8, provider=provider)
    op = LoopbackWorld(cfg, DEVICE).ops[0]
    payload, scales = formats.quantize_dispatch(torch.randn(2, 256).to(torch.bfloat16), DispatchDtype.FP8, FP8)
    with pytest.raises(InputError, match=r"scales must be 2-D \[num_tokens, S\].*scale_bytes=8 B.*got shape \(4,\)"):
        op.dispatch_send(payload.to(DEVICE), torch.ones(2, 2, device=DEVICE), scales.reshape(-1).to(DEVICE),
                         torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))  # fmt: skip


def test_huge_buffer_capacity_is_refused_before_allocating() -> None:
    name = "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
    with pytest.raises(EnvError, match=rf"{name}=99999999999 exceeds 1048576"):
        EpConfig.from_env(world_size=8, rank=0, hidden=7168, num_experts=256, topk=8,
                          environ={name: "99999999999"})  # fmt: skip
    with pytest.raises(ConfigError, match=rf"max_tokens_per_rank=99999999999 \({name}.*\[1, 1048576\]"):
        EpConfig(8, 0, 7168, 256, 8, max_tokens_per_rank=99999999999)
    assert EpConfig(8, 0, 7168, 256, 8, max_tokens_per_rank=env.MAX_TOKENS_PER_RANK).max_tokens_per_rank > 0


@pytest.mark.parametrize("dispatch", [DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4])
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_bf16_tokens_the_op_quantizes_take_no_scale_rows_of_their_own(provider: str, dispatch: DispatchDtype) -> None:
    """The op quantizes bf16 tokens into the format's own scale row: scales passed with them (once
    dropped unseen) and an op built for scale rows of another size (once a reshape error) are refused,
    naming what to pass instead; pre-quantized tokens still carry the wider row."""
    gen = generator(7)
    hidden, n = 256, 2
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    weights, ids = torch.rand(n, 2, generator=gen), torch.randint(0, 4, (n, 2), generator=gen)
    natural = formats.dispatch_scale_bytes(dispatch, hidden)
    scales = torch.randint(0, 256, (n, natural), dtype=torch.uint8, generator=gen)
    cfg = EpConfig(1, 0, hidden, 4, 2, max_tokens_per_rank=n, dispatch_dtype=dispatch, provider=provider)
    op = LoopbackWorld(cfg, DEVICE).ops[0]
    with pytest.raises(InputError, match=rf"bf16 tokens are quantized to {dispatch.value} by the op.*scales=None"):
        op.dispatch_send(x.to(DEVICE), weights.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE))

    wide = EpConfig(1, 0, hidden, 4, 2, max_tokens_per_rank=n, dispatch_dtype=dispatch, provider=provider,
                    scale_bytes=natural + 16)  # fmt: skip
    op = LoopbackWorld(wide, DEVICE).ops[0]
    with pytest.raises(
        InputError, match=rf"makes {natural} B scale rows.*scale_bytes={natural + 16}.*scale_bytes=None"
    ):
        op.dispatch_send(x.to(DEVICE), weights.to(DEVICE), None, ids.to(DEVICE))
    payload, own = formats.quantize_dispatch(x, dispatch, FP8)
    tag = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=gen)
    row = torch.cat([own.contiguous().view(torch.uint8).view(n, natural), tag], dim=1)
    op.dispatch_send(payload.to(DEVICE), weights.to(DEVICE), row.to(DEVICE), ids.to(DEVICE))
    out = op.dispatch_recv()
    assert out.num_recv_host() == n
    assert torch.equal(out.scales[:n].cpu(), row)
    assert torch.equal(out.tokens[:n].cpu().view(torch.uint8), payload.contiguous().view(torch.uint8))


def test_peer_timeouts_past_what_the_kernels_deadline_holds_are_refused() -> None:
    """The Triton receive's deadline is a clock in ns plus the timeout, an int64 on the device: a timeout
    of 1e11 s once failed in the launch (OverflowError) and one of 1e10 s wrapped the deadline on a
    GPU (every receive gave up at once). The bound is named; the largest accepted value runs."""
    name = "SGLANG_MORI_PEER_TIMEOUT_S"
    for value in ("1e10", "99999999999", "1e300"):
        with pytest.raises(EnvError, match=rf"{name}='{value}' exceeds 1000000000"):
            EpConfig.from_env(world_size=1, rank=0, hidden=128, num_experts=1, topk=1, environ={name: value})
    for seconds in (1e10, math.nan):
        with pytest.raises(ConfigError, match=rf"peer_timeout_s=.* \({name}\) .* \(0, 1000000000\]"):
            EpConfig(1, 0, 128, 1, 1, peer_timeout_s=seconds)
    scn = Scenario(world=2, tokens=(2, 1), hidden=64, topk=2, mode=Mode.LOW_LATENCY)
    world = _world(scn, "triton", peer_timeout_s=float(env.MAX_PEER_TIMEOUT_S))
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, world.ops, inputs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_fp4_tokens_as_torchs_float4_type(provider: str, mode: Mode) -> None:
    """Pre-quantized fp4 tokens in torch's float4_e2m1fn_x2 (as SGLang's and vLLM's fp4 quantizers make
    them) are the packed bytes the op takes as uint8: they were accepted, then failed inside torch's
    indexing (torch provider) and Triton's type table (Triton provider)."""
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, dispatch=DispatchDtype.MXFP4, mode=mode,
                   expert="rank_scaled", seed=23)  # fmt: skip
    inputs = world_inputs(scn)
    float4 = [replace(i, payload=i.payload.view(torch.float4_e2m1fn_x2)) for i in inputs]
    check_step(scn, inputs, run_step(scn, _world(scn, provider).ops, float4))


NO_SUCH_GPU = "this machine has" if ON_GPU else "this torch sees no GPU"


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("gpu", r"device='gpu' is not a device; use 'cpu', 'cuda' or 'cuda:N'"),
        ("meta", r"device='meta': the op runs on 'cpu' or a GPU"),  # once failed at the first dispatch
        ("xpu", r"device='xpu': the op runs on 'cpu' or a GPU"),
        ("cuda:99", rf"device='cuda:99': {NO_SUCH_GPU}"),
        pytest.param(
            "cuda",
            "device='cuda': this torch sees no GPU; use device='cpu'",
            marks=pytest.mark.skipif(ON_GPU, reason="a GPU is there"),
        ),
    ],
)
def test_a_device_the_op_cannot_run_on_is_refused_by_name(device: str, match: str) -> None:
    cfg = EpConfig(2, 0, 64, 4, 2, max_tokens_per_rank=2, provider="torch")
    with pytest.raises(ConfigError, match=match):
        LoopbackWorld(cfg, device)
    with pytest.raises(ConfigError, match=match):
        EpDispatchCombineOp(cfg, device=device)


def test_a_cpu_device_with_an_index_takes_cpu_tensors() -> None:
    """The device "cpu:0" is the CPU; CPU tensors carry no index, so an op that kept it refused every input."""
    cfg = EpConfig(2, 0, 64, 4, 2, max_tokens_per_rank=2, provider="torch")
    world = LoopbackWorld(cfg, "cpu:0")
    assert world.ops[0].device == torch.device("cpu")
    batch = _batch(cfg, 2, 4)
    outs = _dispatch(world, *[[t.cpu() for t in ts] for ts in batch])
    assert sum(o.num_recv for o in outs) > 0


OTHER_DEVICE = torch.device("cpu") if ON_GPU else torch.device("meta")


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_scales_and_expert_outputs_on_another_device_are_refused(provider: str) -> None:
    """Every tensor a call takes is checked against the op's device (scales and expert outputs once
    were not: a kernel would read another device's address, the torch provider failed inside torch)."""
    scn = Scenario(world=2, tokens=(2, 2), hidden=64, topk=2, dispatch=DispatchDtype.FP8, seed=5)
    world = _world(scn, provider)
    inputs = [inp.to(DEVICE) for inp in world_inputs(scn)]
    inp = inputs[0]
    with pytest.raises(InputError, match=rf"scales is on {OTHER_DEVICE.type}.*, the op runs on {DEVICE.type}"):
        world.ops[0].dispatch_send(inp.payload, inp.weights, inp.scales.to(OTHER_DEVICE), inp.ids)
    for op, i in zip(world.ops, inputs, strict=True):
        op.dispatch_send(i.payload, i.weights, i.scales, i.ids)
    outs = [op.dispatch_recv() for op in world.ops]
    y = torch.ones(scn.config().max_recv_tokens, scn.hidden, device=OTHER_DEVICE)
    with pytest.raises(InputError, match=rf"expert_outputs is on {OTHER_DEVICE.type}.*, the op runs on {DEVICE.type}"):
        world.ops[0].combine_send(y, outs[0].handle)


def _starting_mid_word(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (1- or 2-byte elements) that starts one element into its storage."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 4
    return view


@pytest.mark.parametrize("dispatch", list(DispatchDtype))
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_tokens_and_scale_rows_that_start_mid_word(
    provider: str, dispatch: DispatchDtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contiguous views that start at an odd element (tokens, and scale rows as bytes) travel bit for
    bit; the Triton send, which reads both as 4-byte words, is handed them on a word boundary (a GPU
    faults on a misaligned word load; the interpreter does not, so the pointers are checked)."""
    from mori_sglang.kernels import launch, transport

    pointers: list[int] = []
    bound_call = launch.BoundLaunch.__call__

    def recording(self: launch.BoundLaunch, *values: object) -> None:
        if self.kernel is transport.dispatch_send_kernel:
            pointers.extend(v.data_ptr() for v in values if isinstance(v, torch.Tensor))
        bound_call(self, *values)

    monkeypatch.setattr(launch.BoundLaunch, "__call__", recording)
    scn = Scenario(world=2, tokens=(3, 2), hidden=64, topk=4, dispatch=dispatch, expert="rank_scaled", seed=17)
    inputs = world_inputs(scn)
    shifted = [
        replace(i, payload=_starting_mid_word(i.payload), scales=_starting_mid_word(i.scales.view(torch.uint8)))
        for i in (inp.to(DEVICE) for inp in inputs)
    ]
    check_step(scn, inputs, run_step(scn, _world(scn, provider).ops, shifted))
    if provider == "triton":
        assert pointers and all(address % 4 == 0 for address in pointers)
