"""The op API in a loopback world: every routing, format and mode, checked through the reverse map.

Each scenario runs dispatch -> expert -> combine for every rank of one process and checks, per rank:
the received rows decode to exactly the expected (source rank, source token) pairs in order, with their
payload, scale row, weights and ids bit-equal to the source and zero pad bytes; combine is bit-equal to
the reference pipeline and, for the identity expert, equals x * (distinct ranks) within the format's bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from mori_sglang import LoopbackWorld
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.exchange import ExchangeError, LoopbackHub
from mori_sglang.formats import FormatError
from mori_sglang.kernels.geometry import KernelTuning
from mori_sglang.op import EpDispatchCombineOp, InputError
from mori_sglang.types import DispatchOutput
from tests.helpers import (
    INPUTS,
    ROUTINGS,
    RankInputs,
    Scenario,
    assert_results_identical,
    check_step,
    generator,
    make_tokens,
    make_topk_ids,
    needs_cuda,
    run_expert,
    run_loopback,
    run_step,
    world_inputs,
)

MODES = list(Mode)
COMBINES = [
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
]
UNEVEN = (5, 0, 7, 3)  # rank 1 sends nothing


def run_and_check(scn: Scenario) -> None:
    for step, results in enumerate(run_loopback(scn)):
        check_step(scn, world_inputs(scn, step), results)


@pytest.mark.parametrize("topk", [8, 9])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", MODES)
def test_routings(mode: Mode, routing: str, topk: int, seed: int) -> None:
    run_and_check(Scenario(world=4, tokens=UNEVEN, topk=topk, routing=routing, mode=mode, seed=seed))


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("dispatch", list(DispatchDtype))
@pytest.mark.parametrize("fp8", ["e4m3fn", "e4m3fnuz"])
def test_formats(fp8: str, dispatch: DispatchDtype, combine: CombineDtype, seed: int) -> None:
    """Pre-quantized payloads with the tag after their scales, so the fp8 scales travel bit-exact."""
    inputs = INPUTS[(list(DispatchDtype).index(dispatch) + COMBINES.index(combine)) % len(INPUTS)]
    scn = Scenario(world=4, tokens=(6, 4, 0, 5), dispatch=dispatch, combine=combine, fp8=fp8, inputs=inputs, seed=seed)
    run_and_check(scn)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dispatch", [DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4])
def test_op_quantizes_bf16_tokens(dispatch: DispatchDtype, mode: Mode, seed: int) -> None:
    """bf16 in, natural scale rows (no tag): the receiver sees the reference quantizer's bytes."""
    scn = Scenario(world=4, tokens=UNEVEN, dispatch=dispatch, mode=mode, tagged=False, routing="dropped", seed=seed)
    run_and_check(scn)


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("inputs", INPUTS)
def test_identity_combine_is_x_times_distinct_ranks(inputs: str, combine: CombineDtype, seed: int) -> None:
    run_and_check(Scenario(world=4, tokens=(8, 8, 8, 8), topk=9, inputs=inputs, combine=combine, seed=seed))


@pytest.mark.parametrize("expert_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("mode", MODES)
def test_each_rank_contribution_lands_in_order(
    mode: Mode, combine: CombineDtype, expert_dtype: torch.dtype, seed: int
) -> None:
    """Rank d's expert scales by 1 + d/8: a copy summed into the wrong token, or in another order than
    the owning k, changes the bits."""
    scn = Scenario(
        world=4, tokens=UNEVEN, mode=mode, combine=combine, expert="rank_scaled", expert_dtype=expert_dtype, seed=seed
    )
    run_and_check(scn)


@pytest.mark.parametrize(("world", "tokens"), [(1, (6,)), (2, (3, 6)), (8, (2, 0, 3, 1, 4, 0, 2, 5))])
@pytest.mark.parametrize("mode", MODES)
def test_world_sizes(world: int, tokens: tuple[int, ...], mode: Mode, seed: int) -> None:
    combine = CombineDtype.FP8_BLOCKWISE if world == 8 else CombineDtype.BF16
    run_and_check(Scenario(world=world, tokens=tokens, mode=mode, combine=combine, topk=9, seed=seed))


@pytest.mark.parametrize("hidden", [7168, 4096])
@pytest.mark.parametrize("dispatch", list(DispatchDtype))
def test_model_hidden_sizes(hidden: int, dispatch: DispatchDtype, seed: int) -> None:
    combine = COMBINES[list(DispatchDtype).index(dispatch)]
    mode = MODES[list(DispatchDtype).index(dispatch) % len(MODES)]
    scn = Scenario(
        world=4, tokens=(3, 0, 4, 2), hidden=hidden, dispatch=dispatch, combine=combine, mode=mode, seed=seed
    )
    run_and_check(scn)


@pytest.mark.parametrize("mode", MODES)
def test_no_tokens_anywhere(mode: Mode, seed: int) -> None:
    run_and_check(Scenario(world=4, tokens=(0, 0, 0, 0), mode=mode, combine=CombineDtype.FP8_BLOCKWISE, seed=seed))


@pytest.mark.parametrize("mode", MODES)
def test_fully_dropped_tokens_go_nowhere(mode: Mode, seed: int) -> None:
    """Tokens whose every id is -1 reach no rank (not even rank 0) and combine to zeros."""
    scn = Scenario(world=4, tokens=(4, 4, 4, 4), mode=mode, seed=seed)
    world = LoopbackWorld(scn.config())
    inputs = world_inputs(scn)
    for inp in inputs:
        inp.ids[:] = -1
    results = run_step(scn, world.ops, inputs)
    check_step(scn, inputs, results)
    assert [r.num_recv for r in results] == [0, 0, 0, 0]
    assert all(not r.combined.any() for r in results)


@pytest.mark.parametrize("mode", MODES)
def test_repeated_steps_reuse_the_op(mode: Mode, seed: int) -> None:
    """Three steps with fresh inputs on the same ops; capacity larger than any batch."""
    routing = ROUTINGS[seed % len(ROUTINGS)]
    scn = Scenario(world=4, tokens=UNEVEN, mode=mode, routing=routing, max_tokens=11, steps=3, seed=seed)
    run_and_check(scn)


@pytest.mark.parametrize("combine", [CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE])
def test_combine_scale_dim_block(combine: CombineDtype, seed: int) -> None:
    """MORI_FP8_COMBINE_SCALE_DIM=8 at hidden 512: blocks of ceil(512 / 8) = 64 elements, end to end."""
    scn = Scenario(world=2, tokens=(4, 5), hidden=512, combine=combine, inputs="lognormal", combine_block=64, seed=seed)
    cfg = EpConfig.from_env(
        world_size=2,
        rank=0,
        hidden=512,
        num_experts=scn.num_experts,
        topk=scn.topk,
        environ={"MORI_FP8_COMBINE_SCALE_DIM": "8", "SGLANG_MORI_COMBINE_DTYPE": "fp8", "SGLANG_MORI_BACKEND": "torch"},
    )
    assert cfg.combine_block == 64 and cfg.combine_dtype is CombineDtype.FP8_BLOCKWISE
    run_and_check(scn)


def test_loopback_world_helpers_match_per_op_calls(seed: int) -> None:
    """``LoopbackWorld.dispatch`` / ``combine`` give the same bytes as driving each op; ``recv_scales``
    views the f32 scales and the int32 tag of each row through its padded stride."""
    scn = Scenario(world=4, tokens=UNEVEN, dispatch=DispatchDtype.FP8, combine=CombineDtype.FP8_BLOCKWISE, seed=seed)
    inputs = world_inputs(scn)
    world = LoopbackWorld(scn.config())
    outs = world.dispatch(
        [i.payload for i in inputs], [i.weights for i in inputs], [i.scales for i in inputs], [i.ids for i in inputs]
    )
    ref = run_step(scn, LoopbackWorld(scn.config()).ops, inputs)
    capacity = scn.config().max_recv_tokens
    combined = world.combine(
        [run_expert(scn, out, r, capacity) for r, out in enumerate(outs)], [o.handle for o in outs]
    )
    for out, c, r in zip(outs, combined, ref, strict=True):
        n = out.num_recv_host()
        assert n == r.num_recv and torch.equal(out.tokens[:n].view(torch.uint8), r.tokens)
        natural = r.scale_region[:, : scn.natural_scale_bytes].contiguous().view(torch.float32)
        assert torch.equal(out.recv_scales(torch.float32)[:n, : natural.shape[1]], natural)
        tags = r.scale_region[:, scn.natural_scale_bytes : scn.scale_bytes].contiguous().view(torch.int32)
        assert torch.equal(out.recv_scales(torch.int32)[:n, -1:], tags)
        assert torch.equal(c.view(torch.int16), r.combined.view(torch.int16))
    assert world.ops[0].max_recv_tokens == capacity == 4 * 7 and world.ops[0].scale_stride_bytes() == 128


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_loopback_matches_cpu(mode: Mode, seed: int) -> None:
    """The torch provider on a GPU: every rank's buffers on one device, the CPU's bytes."""
    pairs = [
        (DispatchDtype.BF16, CombineDtype.BF16, True),
        (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE, True),
        (DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST, False),
        (DispatchDtype.MXFP4, CombineDtype.FP8_BLOCKWISE_NATIVE, False),
    ]
    for i, (dispatch, combine, tagged) in enumerate(pairs):
        kinds = {"inputs": INPUTS[i % len(INPUTS)], "routing": ROUTINGS[i], "tagged": tagged}
        scn = Scenario(world=4, tokens=UNEVEN, hidden=512, topk=9, mode=mode, seed=seed + i, steps=2, **kinds)
        scn = replace(scn, dispatch=dispatch, combine=combine)
        for step, (gpu, cpu) in enumerate(zip(run_loopback(scn, "cuda"), run_loopback(scn), strict=True)):
            check_step(scn, world_inputs(scn, step), gpu)
            assert_results_identical(cpu, gpu, f"{dispatch.value}/{combine.value} step {step}")


# ---------------------------------------------------------------------------------------------
# errors: clear, and raised before anything is sent
# ---------------------------------------------------------------------------------------------


def small(**overrides: object) -> Scenario:
    return Scenario(**{"world": 2, "tokens": (4, 4), "seed": 7, **overrides})  # type: ignore[arg-type]


def assert_world_still_works(scn: Scenario, world: LoopbackWorld) -> None:
    """A rejected call posted nothing: a full step on the same world still meets up and is correct."""
    inputs = world_inputs(scn)
    check_step(scn, inputs, run_step(scn, world.ops, inputs))


def rejected_dispatch(scn: Scenario, error: type[Exception], match: str, **replace_inputs: object) -> None:
    world = LoopbackWorld(scn.config())
    inp = replace(world_inputs(scn)[0], **replace_inputs)
    with pytest.raises(error, match=match):
        world.ops[0].dispatch_send(inp.payload, inp.weights, inp.scales, inp.ids)
    assert_world_still_works(scn, world)


def test_too_many_tokens() -> None:
    scn = small(max_tokens=4)
    inp = world_inputs(replace(scn, tokens=(5, 4)))[0]
    fields = {"payload": inp.payload, "weights": inp.weights, "ids": inp.ids, "scales": inp.scales}
    rejected_dispatch(scn, InputError, "5 tokens exceed SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK=4", **fields)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_expert_id_out_of_range(id_dtype: torch.dtype) -> None:
    scn = small()
    ids = world_inputs(scn)[0].ids.clone().to(id_dtype)
    ids[2, 3] = scn.num_experts
    rejected_dispatch(scn, InputError, rf"expert {scn.num_experts}; valid ids are \[0, {scn.num_experts}\)", ids=ids)


@pytest.mark.parametrize(
    ("field", "make", "match"),
    [
        ("payload", lambda i: i.payload[0], "2-D"),
        ("ids", lambda i: i.ids[:, :-1], "topk_ids"),
        ("weights", lambda i: i.weights[:3], "topk_weights"),
        ("scales", lambda i: i.scales[:3], "3 rows for 4 tokens"),
        ("scales", lambda i: torch.zeros(4, 2, dtype=torch.int32), "scale rows must be 4 B"),
        ("ids", lambda i: i.ids.float(), "int32 or int64"),
        ("weights", lambda i: i.weights.to(torch.complex64), "topk_weights must be one of .* got torch.complex64"),
        ("weights", lambda i: i.weights > 0.5, "topk_weights must be one of .* got torch.bool"),
        ("weights", lambda i: (i.weights * 100).long(), "topk_weights must be one of .* got torch.int64"),
    ],
)
def test_bad_shapes_and_dtypes(field: str, make: Callable[[RankInputs], torch.Tensor], match: str) -> None:
    scn = small()
    rejected_dispatch(scn, InputError, match, **{field: make(world_inputs(scn)[0])})


def test_wrong_hidden() -> None:
    scn = small()
    x = make_tokens("normal", 4, 128, generator(1))
    rejected_dispatch(scn, InputError, "hidden 128", payload=x)


def test_scales_missing_for_the_opaque_row() -> None:
    rejected_dispatch(small(), InputError, "pass scales", scales=None)


def test_prequantized_tokens_need_scales() -> None:
    rejected_dispatch(small(dispatch=DispatchDtype.FP8), InputError, "need their scales", scales=None)


@pytest.mark.parametrize(
    ("dispatch", "dtype", "width"),
    [
        (DispatchDtype.BF16, torch.float16, 256),  # same bytes per row as bf16
        (DispatchDtype.BF16, torch.float32, 128),  # same bytes per row as bf16
        (DispatchDtype.FP8, torch.float8_e4m3fnuz, 256),  # the other fp8 flavour
        (DispatchDtype.FP8, torch.int8, 256),
        (DispatchDtype.MXFP4, torch.int8, 128),
    ],
)
def test_token_dtype_must_match_the_dispatch_format(dispatch: DispatchDtype, dtype: torch.dtype, width: int) -> None:
    """Tokens are bf16 or the op's own payload dtype; a same-size row of another dtype is refused rather
    than reinterpreted (fp16 bits read as bf16 are a silent wrong answer)."""
    x = torch.ones(4, width, dtype=torch.float32).to(dtype)
    rejected_dispatch(small(dispatch=dispatch), InputError, "tokens", payload=x)


def test_split_calls_are_required_where_the_mode_splits() -> None:
    for mode, call in (
        (Mode.LOW_LATENCY, "dispatch_send"),
        (Mode.LOW_LATENCY, "combine_send"),
        (Mode.SPLIT, "combine_send"),
    ):
        scn = small(mode=mode)
        world = LoopbackWorld(scn.config())
        inp = world_inputs(scn)[0]
        if call == "dispatch_send":
            with pytest.raises(InputError, match="dispatch_send, then dispatch_recv"):
                world.ops[0].dispatch(inp.payload, inp.weights, inp.scales, inp.ids)
            assert_world_still_works(scn, world)
            continue
        inputs = world_inputs(scn)
        for op, i in zip(world.ops, inputs, strict=True):
            op.dispatch_send(i.payload, i.weights, i.scales, i.ids)
        outs = [op.dispatch_recv() for op in world.ops]
        with pytest.raises(InputError, match="combine_send, then combine_recv"):
            world.ops[0].combine(outs[0].tokens, outs[0].handle)


@pytest.mark.parametrize(
    ("make_y", "match"),
    [
        (lambda out: out.tokens[:, :128], "hidden=256"),
        (lambda out: out.tokens.half(), "bf16 or f32"),
        (lambda out: out.tokens[: out.num_recv_host() - 1], "dispatch received"),
    ],
)
def test_bad_expert_outputs(make_y: Callable[[DispatchOutput], torch.Tensor], match: str) -> None:
    scn = small(tokens=(4, 4), routing="spread")
    world = LoopbackWorld(scn.config())
    inputs = world_inputs(scn)
    for op, i in zip(world.ops, inputs, strict=True):
        op.dispatch_send(i.payload, i.weights, i.scales, i.ids)
    outs = [op.dispatch_recv() for op in world.ops]
    with pytest.raises(InputError, match=match):
        world.ops[0].combine_send(make_y(outs[0]), outs[0].handle)


def test_receive_before_every_rank_sent() -> None:
    scn = small(world=4, tokens=(2, 2, 2, 2))
    world = LoopbackWorld(scn.config())
    inp = world_inputs(scn)[0]
    with pytest.raises(ExchangeError, match=r"ranks \[1, 2, 3\] have not posted.*every rank's \*_send"):
        world.ops[0].dispatch(inp.payload, inp.weights, inp.scales, inp.ids)


@pytest.mark.parametrize("mode", [Mode.INTRANODE, Mode.SPLIT])
def test_ranks_out_of_step_are_named(mode: Mode) -> None:
    """Rank 0's combine_send is refused (short outputs, known on the host) while rank 1's goes out: the
    ranks' exchanges no longer pair up, and the next dispatch says so instead of failing inside the
    mailbox (an AssertionError) or in torch (a size mismatch)."""
    cfg = EpConfig(2, 0, 64, 4, 2, max_tokens_per_rank=4, mode=mode, provider="torch")
    world = LoopbackWorld(cfg)
    gen = generator(0)
    xs = [torch.randn(3, 64, generator=gen).bfloat16() for _ in range(2)]
    ids = [torch.tensor([[0, 2], [1, 3], [2, 0]], dtype=torch.int32)] * 2
    weights = [torch.rand(3, 2, generator=gen)] * 2
    outs = world.dispatch(xs, weights, None, ids)
    with pytest.raises(InputError, match="expert outputs"):
        world.ops[0].combine_send(outs[0].tokens[:1].float(), outs[0].handle)
    world.ops[1].combine_send(outs[1].tokens.float(), outs[1].handle)
    with pytest.raises(ExchangeError, match="have not posted"):
        world.ops[1].combine_recv()
    for op, x, w, i in zip(world.ops, xs, weights, ids, strict=True):
        op.dispatch_send(x, w, None, i)
    with pytest.raises(ExchangeError, match=r"rank 0's exchange #1 .* does not match rank 1's .* out of step"):
        world.ops[0].dispatch_recv()


def test_scales_viewed_as_a_wider_type_than_the_row_holds_are_refused() -> None:
    cfg = EpConfig(2, 0, 384, 4, 2, max_tokens_per_rank=4, dispatch_dtype=DispatchDtype.FP8, provider="torch")
    world = LoopbackWorld(cfg)
    xs = [torch.randn(2, 384).bfloat16() for _ in range(2)]
    ids = [torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)] * 2
    out = world.dispatch(xs, [torch.rand(2, 2)] * 2, None, ids)[0]
    assert out.recv_scales(torch.float32).shape[1] == 3  # three blocks of 128, one f32 each
    with pytest.raises(InputError, match=r"recv_scales\(torch.float64\): the scale row holds 12 B"):
        out.recv_scales(torch.float64)


def test_receive_without_send() -> None:
    world = LoopbackWorld(small().config())
    with pytest.raises(RuntimeError, match="without a dispatch_send"):
        world.ops[0].dispatch_recv()
    with pytest.raises(RuntimeError, match="without a combine_send"):
        world.ops[0].combine_recv()


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"hidden": 101, "dispatch_dtype": DispatchDtype.MXFP4, "scale_bytes": None}, FormatError, "hidden=101"),
        ({"combine_dtype": CombineDtype.FP4_BLOCKWISE}, ConfigError, "SGLANG_MORI_COMBINE_DTYPE.*gfx950"),
        ({"provider": "mori"}, ConfigError, "SGLANG_MORI_BACKEND=mori"),
    ],
)
def test_bad_op_config(overrides: dict[str, object], error: type[Exception], match: str) -> None:
    cfg = replace(small().config(), **overrides)
    with pytest.raises(error, match=match):
        LoopbackWorld(cfg)


def test_kernel_tuning_is_refused_where_no_kernels_of_ours_run() -> None:
    world = LoopbackWorld(replace(small().config(), provider=Provider.TORCH))
    with pytest.raises(
        ConfigError, match=r"the torch provider runs no Triton kernels of ours.*SGLANG_MORI_BACKEND=triton"
    ):
        world.set_kernel_tuning(KernelTuning(send_tile=2048))


def test_loopback_hub_size_must_match() -> None:
    with pytest.raises(ConfigError, match="loopback world of 3 ranks"):
        EpDispatchCombineOp(small().config(), device="cpu", loopback=LoopbackHub(3))


def test_routing_generator_shapes() -> None:
    """The helpers the whole suite leans on: ids in range, distinct per token, the promised structure."""
    gen = generator(0)
    for kind in ROUTINGS:
        ids = make_topk_ids(kind, 12, 64, 9, 4, gen)
        assert ids.shape == (12, 9) and int(ids.max()) < 64
        for row in ids.tolist():
            kept = [e for e in row if e >= 0]
            assert len(set(kept)) == len(kept)
    assert (make_topk_ids("all_to_one", 5, 64, 9, 4, gen) // 16 == 3).all()
    spread = make_topk_ids("spread", 5, 64, 9, 4, gen) // 16
    assert all(set(r) == {0, 1, 2, 3} for r in spread.tolist())
    dropped = make_topk_ids("dropped", 6, 64, 9, 4, gen)
    assert (dropped[1] == -1).all() and (dropped[4] == -1).all()
    assert not (make_tokens("lognormal", 4, 256, gen) == 0).any()


def test_the_torch_provider_under_cuda_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a CUDA graph is captured no host read is allowed: the torch.distributed provider skips its
    host check of the expert ids there (low latency captures), and its intranode mode, which exchanges
    row counts through the host, is refused by name instead of failing inside torch."""
    from mori_sglang import checks

    capturing = {"now": False}
    monkeypatch.setattr(checks, "capturing", lambda tensor: capturing["now"])
    cfg = EpConfig(2, 0, 64, 4, 2, max_tokens_per_rank=3, provider="torch")
    past_last = torch.tensor([[0, 4]], dtype=torch.int32)
    with pytest.raises(InputError, match="topk_ids holds expert 4"):
        checks.check_expert_ids_on_host(cfg, past_last)
    capturing["now"] = True
    checks.check_expert_ids_on_host(cfg, past_last)
    x, weights = torch.randn(2, 64).to(torch.bfloat16), torch.rand(2, 2)
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    low_latency = LoopbackWorld(replace(cfg, mode=Mode.LOW_LATENCY))
    for op in low_latency.ops:
        op.dispatch_send(x, weights, None, ids)
    assert [int(op.dispatch_recv().num_recv) for op in low_latency.ops] == [4, 4]  # two tokens from each rank
    op = LoopbackWorld(cfg).ops[0]
    with pytest.raises(RuntimeError, match="intranode mode exchanges row counts through the host"):
        op.dispatch_send(x, weights, None, ids)


@needs_cuda
def test_the_torch_provider_captures_a_low_latency_dispatch_and_refuses_a_captured_intranode_one(
    seed: int,
) -> None:
    """On a GPU: the low-latency dispatch (fixed slots, no host read once the ids' host check steps
    aside) is captured and replays what it did eagerly; the intranode one is refused by name inside
    the capture instead of failing in torch."""
    cfg = EpConfig(2, 0, 256, 4, 2, max_tokens_per_rank=4, mode=Mode.LOW_LATENCY, provider="torch")
    gen = torch.Generator().manual_seed(seed)
    inputs = [
        (torch.randn(3, 256, generator=gen).to(torch.bfloat16).cuda(), torch.rand(3, 2, generator=gen).cuda(),
         torch.rand(3, 4, generator=gen).topk(2, dim=1).indices.int().cuda())
        for _ in range(2)
    ]  # fmt: skip
    world = LoopbackWorld(cfg, "cuda")

    def dispatch() -> list[DispatchOutput]:
        for op, (x, w, i) in zip(world.ops, inputs, strict=True):
            op.dispatch_send(x, w, None, i)
        return [op.dispatch_recv() for op in world.ops]

    eager = [out.tokens.clone() for out in dispatch()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dispatch()
    for out in captured:
        out.tokens.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for out, want in zip(captured, eager, strict=True):
        n = int(out.num_recv)
        assert n > 0 and torch.equal(out.tokens[:n].view(torch.int16), want[:n].view(torch.int16))
    op = LoopbackWorld(replace(cfg, mode=Mode.INTRANODE), "cuda").ops[0]
    x, w, i = inputs[0]
    refused = pytest.raises(RuntimeError, match="intranode mode exchanges row counts through the host")
    with torch.cuda.graph(torch.cuda.CUDAGraph()), refused:
        op.dispatch_send(x, w, None, i)
