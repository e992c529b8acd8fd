"""The Triton provider against the torch provider: identical wire bytes and outputs, bit for bit.

On a machine without a GPU the kernels run in Triton's interpreter on CPU tensors, with its float
conversions made exact (mori_sglang.kernels.interpreter); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from mori_sglang import formats
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.kernels import interpreter, transport
from mori_sglang.kernels.geometry import DISPATCH_RECV_PROGRAMS_PER_SM, KernelTuning
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.providers import triton_provider
from mori_sglang.providers.triton_provider import PeerTimeoutError
from mori_sglang.routing import source_of_rows
from mori_sglang.types import InputError
from tests.helpers import ROUTING_REGIMES, generator, routing_tuning

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
WORLD = 8 if ON_GPU else 4
HIDDEN = 7168 if ON_GPU else 256
EXPERTS = 256 if ON_GPU else 16
TOPK = 8 if ON_GPU else 4
MAX_TOKENS = 64 if ON_GPU else 6

if not ON_GPU:
    interpreter.install_exact_casts()


def _config(world: int = WORLD, hidden: int = HIDDEN, **overrides: object) -> EpConfig:
    """The tests' op shape; each test names only what it varies."""
    return EpConfig(world, 0, hidden, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, **overrides)


def _inputs(cfg: EpConfig, counts: list[int], seed: int):
    """Random tokens (magnitudes 1e-4 to 1e2), expert ids (10 % dropped as -1) and weights per rank, made
    on the device: the GPU soak's thousand rounds would otherwise spend minutes in the host's generator."""
    gen = generator(seed, device=DEVICE)
    xs, weights, ids = [], [], []
    for n in counts:
        magnitude = 10.0 ** torch.randint(-4, 3, (n, 1), generator=gen, device=DEVICE)
        xs.append((torch.randn(n, cfg.hidden, generator=gen, device=DEVICE) * magnitude).to(torch.bfloat16))
        topk = torch.rand(n, cfg.num_experts, generator=gen, device=DEVICE).topk(cfg.topk, dim=1).indices
        drop = torch.rand(n, cfg.topk, generator=gen, device=DEVICE) < 0.1
        ids.append(torch.where(drop, -1, topk).int())
        weights.append(torch.rand(n, cfg.topk, generator=gen, device=DEVICE))
    return xs, weights, ids


def _step(world: LoopbackWorld, xs, weights, ids):
    """One dispatch + identity expert + combine over every rank, split into send and receive phases."""
    for op, x, w, i in zip(world.ops, xs, weights, ids, strict=True):
        op.dispatch_send(x, w, None, i)
    outs = [op.dispatch_recv() for op in world.ops]
    counts = [o.num_recv_host() for o in outs]
    cfg = world.ops[0].config
    ys = []
    for out, n in zip(outs, counts, strict=True):
        scales = None
        if out.scales is not None:
            scales = out.recv_scales(torch.float32 if cfg.dispatch_dtype is DispatchDtype.FP8 else torch.uint8)[:n]
        y = formats.dequantize_dispatch(out.tokens[:n], scales, cfg.dispatch_dtype, cfg.hidden)
        ys.append((y * 1.5).to(torch.bfloat16))
    for op, y, out in zip(world.ops, ys, outs, strict=True):
        op.combine_send(y, out.handle)
    snapshots = [op.provider.arena.buffer.clone() for op in world.ops] if _is_triton(world) else None
    combined = [op.combine_recv() for op in world.ops]
    return outs, counts, ys, combined, snapshots


def _is_triton(world: LoopbackWorld) -> bool:
    return world.ops[0].provider_kind.value == "triton"


def _check_combine_wire(world: LoopbackWorld, outs, counts, ys, snapshots) -> None:
    """Every combine row in its source's arena equals the torch reference quantization of that output."""
    cfg = world.ops[0].config
    provider = world.ops[0].provider
    layout = provider.arena_layout
    row_bytes = formats.combine_row_bytes(cfg.combine_dtype, cfg.hidden, cfg.combine_block)
    for dest, (out, n) in enumerate(zip(outs, counts, strict=True)):
        if n == 0:
            continue
        src, pos = source_of_rows(out.handle.recv_counts.cpu(), n)
        expected = formats.quantize_combine(ys[dest], cfg.combine_dtype, provider.fp8_dtype, cfg.combine_block)
        for j in range(n):
            slot = dest * cfg.max_tokens_per_rank + int(pos[j])
            start = layout.combine_offset + slot * layout.combine_row_stride
            wire = snapshots[int(src[j])][start : start + row_bytes]
            assert torch.equal(wire.cpu(), expected[j].cpu()), f"combine row {j} of rank {dest}"


def _assert_same(ref, got, scale_bytes: int) -> None:
    """Every rank's received tokens, ids, weights, scale rows (pads zero) and combined output, bit for bit.
    Compared on the device and read back once: the GPU soak runs a thousand rounds."""
    ref_outs, ref_counts, _, ref_comb, _ = ref
    outs, counts, _, comb, _ = got
    assert counts == ref_counts
    flags: list[tuple[str, torch.Tensor]] = []  # what is checked, and whether it failed, on the device

    def differs(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} against {b.shape} {b.dtype}"
        flags.append((name, (a != b).any()))

    for r, n in enumerate(counts):
        a, b = ref_outs[r], outs[r]
        differs(f"tokens of rank {r}", a.tokens[:n].view(torch.uint8), b.tokens[:n].view(torch.uint8))
        differs(f"topk_ids of rank {r}", a.topk_ids[:n], b.topk_ids[:n])
        differs(f"topk_weights of rank {r}", a.topk_weights[:n].view(torch.int32), b.topk_weights[:n].view(torch.int32))
        differs(f"combined output of rank {r}", ref_comb[r].view(torch.int16), comb[r].view(torch.int16))
        if scale_bytes:
            differs(f"scales of rank {r}", a.recv_scales()[:n], b.recv_scales()[:n])
            padded = b.scales.as_strided((n, b.scale_stride), (b.scale_stride, 1))
            assert b.scale_stride % 128 == 0
            flags.append((f"scale row pad bytes of rank {r} (must be zero)", padded[:, scale_bytes:].any()))
    failed = torch.stack([flag for _, flag in flags]).tolist()
    assert not any(failed), [name for (name, _), bad in zip(flags, failed, strict=True) if bad]


COMBINES = [
    CombineDtype.BF16,
    CombineDtype.FP8_BLOCKWISE,
    CombineDtype.FP8_BLOCKWISE_NATIVE,
    CombineDtype.FP8_DIRECT_CAST,
]


# On a GPU every real MoE hidden size, gpt-oss's 2880 among them (a partial last block), in every mode.
MODEL_HIDDENS = (2048, 2880, 3584, 4096, 5120, 6144, 7168)
HIDDEN_MODES = [(h, m) for h in (MODEL_HIDDENS if ON_GPU else (HIDDEN,)) for m in Mode]


@pytest.mark.parametrize(("hidden", "mode"), HIDDEN_MODES)
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("dispatch", list(DispatchDtype))
def test_bit_identical_to_torch_provider(
    mode: Mode, combine: CombineDtype, dispatch: DispatchDtype, hidden: int, rng: random.Random
) -> None:
    seed = rng.randrange(1 << 30)
    counts = [rng.randint(0, MAX_TOKENS) for _ in range(WORLD)]
    counts[seed % WORLD] = 0  # a rank with no tokens
    runs = {}
    for provider in ("torch", "triton"):
        cfg = _config(
            hidden=hidden,
            dispatch_dtype=dispatch,
            combine_dtype=combine,
            mode=mode,
            provider=provider,
        )
        world = LoopbackWorld(cfg, DEVICE)
        runs[provider] = (world, _step(world, *_inputs(cfg, counts, seed)))
    world, got = runs["triton"]
    _assert_same(runs["torch"][1], got, world.ops[0].scale_bytes)
    _check_combine_wire(world, got[0], got[1], got[2], got[4])


@pytest.mark.parametrize("dispatch", [DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4])
@pytest.mark.parametrize(("hidden", "send_tile", "copy_block"), [(256, 64, 64), (384, 256, 128)])
def test_tokens_of_several_tiles_are_bit_identical_too(
    dispatch: DispatchDtype, hidden: int, send_tile: int, copy_block: int, rng: random.Random
) -> None:
    """Small send tiles split every token into several work items (the last one partial at hidden 384),
    so that a program's next item, loaded ahead of the current one, is a later tile of the same token
    or the first tile of another."""
    seed = rng.randrange(1 << 30)
    counts = [rng.randint(1, MAX_TOKENS) for _ in range(WORLD)]
    runs = []
    for provider in ("torch", "triton"):
        cfg = EpConfig(WORLD, 0, hidden, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, dispatch_dtype=dispatch,
                       mode=Mode.LOW_LATENCY, provider=provider)  # fmt: skip
        world = LoopbackWorld(cfg, DEVICE)
        if provider == "triton":
            world.set_kernel_tuning(KernelTuning(send_tile=send_tile, copy_block=copy_block))
        runs.append(_step(world, *_inputs(cfg, counts, seed)))
    _assert_same(runs[0], runs[1], world.ops[0].scale_bytes)


# Serving batches: hundreds to thousands of tokens per rank, routed in tasks over many blocks, one
# rank at the full batch and the others short of it.
LARGE_BATCHES = [
    (4096, DispatchDtype.FP8, CombineDtype.BF16, Mode.LOW_LATENCY),
    (1000, DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE, Mode.INTRANODE),
    (2048, DispatchDtype.MXFP4, CombineDtype.BF16, Mode.LOW_LATENCY),
    (4096, DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST, Mode.INTRANODE),
    (777, DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE_NATIVE, Mode.LOW_LATENCY),
]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: Triton's interpreter takes hours over thousands of tokens")
@pytest.mark.parametrize(("tokens", "dispatch", "combine", "mode"), LARGE_BATCHES)
def test_serving_batches_are_bit_identical_to_torch_provider(
    tokens: int, dispatch: DispatchDtype, combine: CombineDtype, mode: Mode, rng: random.Random
) -> None:
    seed = rng.randrange(1 << 30)
    counts = [rng.randint(tokens // 2, tokens) for _ in range(WORLD)]
    counts[seed % WORLD] = tokens
    runs = []
    for provider in ("torch", "triton"):
        cfg = _config(dispatch_dtype=dispatch, combine_dtype=combine, mode=mode, provider=provider)
        world = LoopbackWorld(replace(cfg, max_tokens_per_rank=tokens), DEVICE)
        runs.append(_step(world, *_inputs(world.ops[0].config, counts, seed)))
    _assert_same(runs[0], runs[1], world.ops[0].scale_bytes)


def test_the_dispatch_receive_keeps_about_32_kib_of_rows_in_flight_per_sm() -> None:
    """Its programs per SM follow the row size (the values measured best on an H200), as powers of two
    within DISPATCH_RECV_PROGRAMS_PER_SM."""
    tuning = KernelTuning()

    def programs(token_bytes: int, scale_bytes: int, **changes: int) -> int:
        row_bytes = formats.DispatchRowLayout(token_bytes, scale_bytes, 8).row_bytes
        return replace(tuning, **changes).dispatch_recv_programs_per_sm(row_bytes)

    assert programs(7168, 224) == 4  # fp8 at hidden 7168: 7488 B rows
    assert programs(4096, 128) == 8  # fp8 at hidden 4096: 4288 B rows
    assert programs(2048, 64) == 16
    assert programs(7168, 224, dispatch_recv_bytes_per_sm=65536) == 8
    fewest, most = DISPATCH_RECV_PROGRAMS_PER_SM
    assert programs(14336, 0) == fewest  # bf16 rows at hidden 7168: two would fit
    assert programs(64, 0) == most


@pytest.mark.parametrize("dispatch", [DispatchDtype.FP8, DispatchDtype.MXFP8, DispatchDtype.MXFP4])
def test_fused_dispatch_quantization_matches_the_reference_on_edge_values(dispatch: DispatchDtype) -> None:
    """Ties of e4m3, negatives that round to zero, saturation, all-zero groups, tiny groups, subnormal
    groups (the smallest e8m0 scale, whose inverse is 2^127), huge ones, groups with an infinity, and
    groups of largest magnitude 6, whose e8m0 scale is 1, so that the e2m1 ties stay ties."""
    edge = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 7.0, -2.5, 1.0625, 448.0, -0.0, 0.5, 3.0])
    rows = [edge.repeat(HIDDEN // 16) * scale for scale in (1.0, 0.0, 2.0**-100, 2.0**-130, 2.0**110)]
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.5])
    rows.append(ties.repeat(HIDDEN // 16))
    rows.append(torch.where(torch.arange(HIDDEN) % 37 == 5, float("inf"), ties.repeat(HIDDEN // 16)))
    x = torch.stack(rows).to(torch.bfloat16).to(DEVICE)
    n = x.shape[0]
    cfg = EpConfig(1, 0, HIDDEN, EXPERTS, TOPK, max_tokens_per_rank=n, dispatch_dtype=dispatch, provider="triton")
    world = LoopbackWorld(cfg, DEVICE)
    ids = torch.arange(TOPK, dtype=torch.int32, device=DEVICE).repeat(n, 1)
    out = world.dispatch([x], [torch.ones(n, TOPK, device=DEVICE)], None, [ids])[0]
    payload, scales = formats.quantize_dispatch(x, dispatch, world.ops[0].fp8_dtype)
    assert out.num_recv_host() == n
    assert torch.equal(out.tokens[:n].view(torch.uint8).cpu(), payload.view(torch.uint8).cpu())
    assert torch.equal(out.recv_scales()[:n].cpu(), scales.contiguous().view(torch.uint8).view(n, -1).cpu())


def test_rounds_reuse_buffers_without_reset(rng: random.Random) -> None:
    """Round counters: many rounds with random token counts (0 and full included) stay identical to torch."""
    rounds = 1000 if ON_GPU else 4  # the GPU run is the soak: random counts, 0 and full included
    worlds = {
        p: LoopbackWorld(
            _config(
                mode=Mode.LOW_LATENCY,
                combine_dtype=CombineDtype.FP8_BLOCKWISE,
                provider=p,
            ),
            DEVICE,
        )
        for p in ("torch", "triton")
    }
    cfg = worlds["torch"].ops[0].config
    for _ in range(rounds):
        seed = rng.randrange(1 << 30)
        counts = [rng.choice([0, 1, MAX_TOKENS, rng.randint(0, MAX_TOKENS)]) for _ in range(WORLD)]
        inputs = _inputs(cfg, counts, seed)
        _assert_same(_step(worlds["torch"], *inputs), _step(worlds["triton"], *inputs), 0)


@pytest.mark.parametrize("routing", ROUTING_REGIMES)
def test_routing_over_several_blocks_numbers_tokens_across_blocks(routing: str, rng: random.Random) -> None:
    """Batches wider than a routing task or chunk: tasks that wait for earlier blocks' counts (or count
    them themselves), items that count several chunks of earlier tokens."""
    max_tokens = 200
    worlds = {}
    for provider in ("torch", "triton"):
        cfg = replace(_config(world=2, provider=provider), max_tokens_per_rank=max_tokens)
        worlds[provider] = LoopbackWorld(cfg, DEVICE)
    worlds["triton"].set_kernel_tuning(routing_tuning(routing, max_tokens, route_block=64, self_route_chunk=16))
    for counts in ([max_tokens, 130], [65, 0], [rng.randint(1, max_tokens), 64]):
        inputs = _inputs(worlds["torch"].ops[0].config, counts, rng.randrange(1 << 30))
        _assert_same(_step(worlds["torch"], *inputs), _step(worlds["triton"], *inputs), 0)


def test_routing_tasks_read_earlier_counts_in_turns_and_leave_no_counter_set(
    monkeypatch: pytest.MonkeyPatch, rng: random.Random
) -> None:
    """Routing tasks of 16 tokens over batches of up to 13 blocks, earlier blocks' counts read two at a
    time (past 4096 tokens a task reads them in turns of 256): the slots are the torch provider's, and
    after every step the start order and the tickets are back to 0 for the next launch."""
    monkeypatch.setattr(triton_provider, "COUNT_LANES", 2)
    max_tokens = 200
    worlds = {}
    for provider in ("torch", "triton"):
        cfg = replace(_config(world=2, provider=provider), max_tokens_per_rank=max_tokens)
        worlds[provider] = LoopbackWorld(cfg, DEVICE)
    worlds["triton"].set_kernel_tuning(routing_tuning("tasks", 0, route_block=16))
    for counts in ([max_tokens, 33], [rng.randint(1, max_tokens), 0]):
        inputs = _inputs(worlds["torch"].ops[0].config, counts, rng.randrange(1 << 30))
        _assert_same(_step(worlds["torch"], *inputs), _step(worlds["triton"], *inputs), 0)
        for op in worlds["triton"].ops:
            assert not op.provider._start_order.any()
            assert not op.provider._tickets.any()


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("routing", ROUTING_REGIMES)
def test_every_routing_numbers_the_same_slots(routing: str, ids_dtype: torch.dtype, rng: random.Random) -> None:
    """Each regime gives every copy the slot the torch provider gives it, for batch sizes on both sides
    of a chunk of the routing made item by item (and of a task), none and a full one included, with
    dropped ids, in rounds that reuse the buffers. The slots are what the combine reads back."""
    chunk = 4 if ON_GPU else 2
    max_tokens = 4 * chunk + 3
    worlds = {}
    for provider in ("torch", "triton"):
        cfg = replace(_config(provider=provider, mode=Mode.LOW_LATENCY), max_tokens_per_rank=max_tokens)
        worlds[provider] = LoopbackWorld(cfg, DEVICE)
    worlds["triton"].set_kernel_tuning(routing_tuning(routing, max_tokens, self_route_chunk=chunk))
    sizes = [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk + 1, max_tokens]
    for _ in range(3):
        counts = [rng.choice(sizes) for _ in range(WORLD)]
        xs, weights, ids = _inputs(worlds["torch"].ops[0].config, counts, rng.randrange(1 << 30))
        ids = [i.to(ids_dtype) for i in ids]
        got = _step(worlds["triton"], xs, weights, ids)
        _assert_same(_step(worlds["torch"], xs, weights, ids), got, 0)
        for n, out in zip(counts, got[0], strict=True):
            assert out.handle.num_tokens == n


@pytest.mark.parametrize("world_size", [40, 65])
def test_worlds_of_more_than_32_and_64_ranks_route_alike(world_size: int, rng: random.Random) -> None:
    """A token's destinations fit a 64-bit word per token from 33 ranks on; past 64 ranks the send
    does not route item by item, and its routing tasks number the same slots."""
    worlds = {
        provider: LoopbackWorld(
            EpConfig(world_size, 0, 64, 2 * world_size, 6, max_tokens_per_rank=5, provider=provider), DEVICE
        )
        for provider in ("torch", "triton")
    }
    counts = [rng.randint(0, 5) for _ in range(world_size)]
    inputs = _inputs(worlds["torch"].ops[0].config, counts, rng.randrange(1 << 30))
    _assert_same(_step(worlds["torch"], *inputs), _step(worlds["triton"], *inputs), 0)


def test_a_rank_that_receives_nothing_and_programs_without_work_still_signal() -> None:
    """One rank sends one token to the other, which sends nothing, and the roles swap every round: the
    rank that receives nothing has no combine work (program 0 signals alone), the other one row (its
    other programs are idle). Every counter is back to 0 after each round and no receive gave up."""
    worlds = {p: LoopbackWorld(_config(2, mode=Mode.LOW_LATENCY, provider=p), DEVICE) for p in ("torch", "triton")}
    for op in worlds["triton"].ops:
        op.provider.peer_timeout_s = 1.0  # a missing signal fails fast: in a loopback world every send came first
    cfg = worlds["torch"].ops[0].config
    for seed in range(4):
        sender = seed % 2
        counts = [1, 0] if sender == 0 else [0, 1]
        xs, weights, _ = _inputs(cfg, counts, seed)
        experts = torch.arange(TOPK) + (1 - sender) * cfg.num_local_experts  # all on the other rank
        ids = [experts.int().to(DEVICE).unsqueeze(0).repeat(n, 1) for n in counts]
        ref, got = _step(worlds["torch"], xs, weights, ids), _step(worlds["triton"], xs, weights, ids)
        assert got[1] == counts[::-1]
        _assert_same(ref, got, 0)
        for op in worlds["triton"].ops:
            op.synchronize()  # raises if a receive gave up
            assert not op.provider._tickets.any()
            rounds = op.provider.rounds
            assert rounds[:, 0].tolist() == [seed + 1, seed + 1]  # one round of each kind per step
            assert rounds[:, 1].tolist() == [seed + 1, seed + 1]  # every receive saw its senders arrive
            assert not rounds[:, 2].any()


def test_stalled_peer_raises_timeout_naming_it_and_the_world_recovers() -> None:
    """Two good rounds, then rank 1 skips a dispatch: rank 0's receive of that round gives up (the gate
    still holds the round before). Once rank 1 catches up, the next round is received intact."""
    cfg = _config(2, mode=Mode.LOW_LATENCY, provider="triton")
    world = LoopbackWorld(cfg, DEVICE)
    ref_world = LoopbackWorld(replace(cfg, provider=Provider.TORCH), DEVICE)
    for op in world.ops:
        op.provider.peer_timeout_s = 0.2
    for seed in (1, 2):
        _step(world, *_inputs(cfg, [3, 3], seed))
    xs, weights, ids = _inputs(cfg, [3, 3], seed=7)
    world.ops[0].dispatch_send(xs[0], weights[0], None, ids[0])  # rank 1 does not send this round
    with pytest.raises(PeerTimeoutError, match="rank 1"):
        world.ops[0].dispatch_recv()
        world.ops[0].synchronize()
    rounds = world.ops[0].provider.rounds
    assert rounds[0].tolist() == [3, 2, 1]  # round 3; its senders never all arrived; a receive gave up
    with pytest.raises(RuntimeError, match="dispatch_recv called without a dispatch_send"):
        world.ops[0].dispatch_recv()  # that round was received (and given up on): no second receive
    world.ops[1].dispatch_send(xs[1], weights[1], None, ids[1])  # rank 1 catches up on round 3
    world.ops[1].dispatch_recv()
    # The next send clears the give-up, so round 4's receive waits for its senders again.
    xs, weights, ids = _inputs(cfg, [3, 2], seed=8)
    world.ops[0].dispatch_send(xs[0], weights[0], None, ids[0])
    assert rounds[0].tolist() == [4, 2, 0]
    world.ops[1].dispatch_send(xs[1], weights[1], None, ids[1])
    got = [op.dispatch_recv() for op in world.ops]
    ref = ref_world.dispatch(xs, weights, None, ids)
    for op in world.ops:
        op.synchronize()
    assert rounds[0].tolist() == [4, 4, 0]
    for r in range(2):
        n = ref[r].num_recv_host()
        assert got[r].num_recv_host() == n
        assert torch.equal(got[r].tokens[:n].view(torch.uint8).cpu(), ref[r].tokens[:n].view(torch.uint8).cpu())


def test_expert_id_out_of_range_is_an_error_without_a_host_sync() -> None:
    """The dispatch send range-checks ids on the device; the op raises at its next status check."""
    cfg = _config(2, provider="triton")
    world = LoopbackWorld(cfg, DEVICE)
    xs, weights, ids = _inputs(cfg, [3, 2], seed=11)
    ids[1][1, 0] = EXPERTS + 5
    with pytest.raises(InputError, match=f"expert {EXPERTS + 5}"):
        world.dispatch(xs, weights, None, ids)
        for op in world.ops:
            op.synchronize()


@pytest.mark.parametrize(
    ("cuda", "driver", "capability", "expected"),
    [
        ("13.0", (13, 0), (9, 0), True),
        ("12.3", (12, 4), (10, 0), True),
        ("12.2", (13, 0), (9, 0), False),
        ("12.4", (12, 2), (9, 0), False),
        ("13.0", (13, 0), (8, 9), False),
        (None, (13, 0), (9, 4), False),
    ],
)
def test_programmatic_launch_only_where_graphs_keep_it(
    monkeypatch: pytest.MonkeyPatch,
    cuda: str | None,
    driver: tuple[int, int],
    capability: tuple[int, int],
    expected: bool,
) -> None:
    """Hopper or later, CUDA 12.3 or later in torch and in the driver (ROCm builds have no CUDA version),
    never in the interpreter, and off with TRTLLM_ENABLE_PDL=0."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(triton_provider, "cuda_driver_version", lambda: driver)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRTLLM_ENABLE_PDL", raising=False)
    assert triton_provider.programmatic_launch(torch.device("cuda", 0)) is expected
    assert triton_provider.programmatic_launch(torch.device("cpu")) is False
    monkeypatch.setenv("TRTLLM_ENABLE_PDL", "0")
    assert triton_provider.programmatic_launch(torch.device("cuda", 0)) is False
    monkeypatch.setenv("TRTLLM_ENABLE_PDL", "1")
    assert triton_provider.programmatic_launch(torch.device("cuda", 0)) is expected
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_provider.programmatic_launch(torch.device("cuda", 0)) is False


@pytest.mark.parametrize("programmatic", [True, False])
def test_only_grids_up_to_the_tuned_size_let_the_next_kernel_launch_early(
    monkeypatch: pytest.MonkeyPatch, programmatic: bool
) -> None:
    """Under programmatic launch a kernel binds with PDL_EARLY where its grid has at most
    ``early_launch_max_programs`` programs, PDL_WAIT otherwise (and with the default, 0); without
    programmatic launch always PDL_OFF. Nothing is launched: the bound options are what a GPU would get."""
    monkeypatch.setattr(triton_provider, "programmatic_launch", lambda device: programmatic)
    provider = LoopbackWorld(_config(2, provider="triton"), DEVICE).ops[0].provider
    kernel = transport.combine_recv_kernel

    def pdl(grid: tuple[int, ...]) -> int:
        launch = provider._bind(kernel, grid, {}, {}, variable=tuple(kernel.arg_names[:-1]))
        return launch._jit_kwargs["PDL"]

    wait = transport.PDL_WAIT if programmatic else transport.PDL_OFF
    early = transport.PDL_EARLY if programmatic else transport.PDL_OFF
    assert [pdl((1,)), pdl((1000,))] == [wait, wait]
    provider.set_kernel_tuning(KernelTuning(early_launch_max_programs=6))
    assert [pdl((1,)), pdl((6,)), pdl((7,)), pdl((2, 3)), pdl((2, 4))] == [early, early, wait, early, wait]
    with pytest.raises(ValueError, match="early_launch_max_programs=-1"):
        KernelTuning(early_launch_max_programs=-1)


def _fp8_types(backend: str, arch: int | str) -> tuple[str, ...]:
    """The fp8 types Triton's own backend compiles for a GPU (read from its options, no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    return tuple(make_backend(target).parse_options({}).supported_fp8_dtypes)


FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.mark.parametrize(
    ("gpu", "fp8", "dispatch", "combine", "refused"),
    [
        (
            ("cuda", 90),
            FNUZ,
            DispatchDtype.FP8,
            CombineDtype.BF16,
            r"fp8 dispatch .* in e4m3fnuz .*SGLANG_MORI_FP8_TYPE=e4m3fn",
        ),
        (
            ("cuda", 90),
            FNUZ,
            DispatchDtype.BF16,
            CombineDtype.FP8_BLOCKWISE,
            r"fp8 combine \(SGLANG_MORI_COMBINE_DTYPE\)",
        ),
        (("cuda", 90), FN, DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE, None),
        (
            ("cuda", 80),
            FN,
            DispatchDtype.BF16,
            CombineDtype.FP8_DIRECT_CAST,
            r"fp8_direct_cast combine .*use bf16 formats",
        ),
        (("cuda", 80), FN, DispatchDtype.MXFP4, CombineDtype.BF16, None),  # fp4 packs e2m1 itself
        (("cuda", 80), FNUZ, DispatchDtype.BF16, CombineDtype.BF16, None),
        (("hip", "gfx942"), FNUZ, DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE, None),
        (("hip", "gfx942"), FN, DispatchDtype.FP8, CombineDtype.FP8_DIRECT_CAST, None),
    ],
)
def test_fp8_types_triton_cannot_compile_for_the_gpu_are_refused(
    gpu: tuple[str, int | str], fp8: torch.dtype, dispatch: DispatchDtype, combine: CombineDtype, refused: str | None
) -> None:
    """Triton compiles no e4m3fnuz for NVIDIA and no e4m3 at all before sm_89: such a configuration once
    built and then failed in Triton's compiler at the first dispatch or combine. It is refused when the
    op is built, naming the variables; formats that compile no fp8 type are not."""
    cfg = _config(dispatch_dtype=dispatch, combine_dtype=combine, provider="triton")
    supported = _fp8_types(*gpu)
    if refused is None:
        triton_provider.check_fp8_compiles(cfg, fp8, supported)
        return
    with pytest.raises(ConfigError, match=rf"the triton provider would run {refused}.*SGLANG_MORI_BACKEND=torch"):
        triton_provider.check_fp8_compiles(cfg, fp8, supported)


def test_the_provider_checks_the_fp8_types_of_its_gpu_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs when the op is built, with the GPU's table (an sm_80's here); a CPU has none."""
    assert triton_provider.compiled_fp8_types(torch.device("cpu")) is None
    monkeypatch.setattr(triton_provider, "compiled_fp8_types", lambda device: _fp8_types("cuda", 80))
    cfg = _config(dispatch_dtype=DispatchDtype.FP8, provider="triton")
    with pytest.raises(ConfigError, match=r"fp8 dispatch .* which Triton does not compile for this GPU"):
        LoopbackWorld(cfg, DEVICE)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graph capture needs a CUDA GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    cfg = _config(
        mode=Mode.LOW_LATENCY,
        dispatch_dtype=DispatchDtype.FP8,
        combine_dtype=CombineDtype.FP8_BLOCKWISE,
        provider="triton",
    )
    world = LoopbackWorld(cfg, DEVICE)
    ref_world = LoopbackWorld(replace(cfg, provider=Provider.TORCH), DEVICE)
    counts = [MAX_TOKENS] * WORLD
    xs, weights, ids = _inputs(cfg, counts, seed=3)
    _step(world, xs, weights, ids)  # warm-up compiles every kernel
    outs: list = [None] * WORLD
    results: list = [None] * WORLD
    ys = [torch.zeros(cfg.max_recv_tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE) for _ in range(WORLD)]
    rows = torch.arange(cfg.max_recv_tokens, device=DEVICE)[:, None]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op, x, w, i in zip(world.ops, xs, weights, ids, strict=True):
            op.dispatch_send(x, w, None, i)
        for r, op in enumerate(world.ops):
            outs[r] = op.dispatch_recv()
            expert_out = formats.dequantize_dispatch(
                outs[r].tokens, outs[r].recv_scales(torch.float32), cfg.dispatch_dtype, HIDDEN
            )
            # The expert of _step on the received rows, NaN past them (a combine that read one would show).
            ys[r].copy_(torch.where(rows < outs[r].num_recv, expert_out * 1.5, float("nan")).to(torch.bfloat16))
        for op, y, out in zip(world.ops, ys, outs, strict=True):
            op.combine_send(y, out.handle)
        for r, op in enumerate(world.ops):
            results[r] = op.combine_recv()
    for replay in range(3):
        new_x, new_w, new_ids = _inputs(cfg, counts, seed=100 + replay)
        for dst, src in zip(xs + weights + ids, new_x + new_w + new_ids, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = _step(ref_world, xs, weights, ids)
        for r in range(WORLD):
            n = ref[1][r]
            assert int(outs[r].num_recv.item()) == n
            assert torch.equal(outs[r].tokens[:n].view(torch.uint8), ref[0][r].tokens[:n].view(torch.uint8))
            assert torch.equal(results[r].view(torch.int16), ref[3][r].view(torch.int16)), (replay, r)
        for op in world.ops:  # the warm-up step and every replay advanced each round once (capture runs nothing)
            assert op.provider.rounds[:, :2].tolist() == [[replay + 2] * 2] * 2
    world.ops[0].synchronize()
