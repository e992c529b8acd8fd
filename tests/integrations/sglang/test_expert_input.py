"""The glue between a MoRI dispatch output and SGLang's Triton experts (``expert_input``), against torch
references; no SGLang needed. On a GPU the same tests run at serving size (8 ranks x 4096 tokens x
top-8, hidden 7168), and also check that the glue never synchronises with the host and replays in a
CUDA graph with the received count changed on the device.
"""

from __future__ import annotations

import pytest
import torch

from mori_sglang import formats
from mori_sglang.config import DispatchDtype
from mori_sglang.integrations.sglang.expert_input import (
    ExpertInput,
    dispatch_dtype_of,
    expert_input,
    expert_rows,
    local_expert_counts,
    local_expert_ids,
)
from mori_sglang.wire_formats import FP8_BLOCK
from tests.helpers import generator

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
WORLD = 8 if ON_GPU else 4
CAP = 4096 if ON_GPU else 16
HIDDEN = 7168 if ON_GPU else 256
EXPERTS = 256 if ON_GPU else 16
TOPK = 8 if ON_GPU else 4
LOCAL = EXPERTS // WORLD
ROWS = WORLD * CAP
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (host syncs and CUDA graphs)")


def received_ids(seed: int, num_recv: int) -> torch.Tensor:
    """A receive buffer's global ids: real rows with ~10% dropped slots; the rows past ``num_recv``
    hold stale ids of every kind (in range, other ranks', -1), as an earlier batch leaves them."""
    gen = generator(seed, "ids", num_recv)
    ids = torch.randint(0, EXPERTS, (ROWS, TOPK), generator=gen, dtype=torch.int32)
    dropped = torch.rand(ROWS, TOPK, generator=gen) < 0.1
    return torch.where(dropped, -1, ids).to(DEVICE)


def reference_local_ids(ids: torch.Tensor, num_recv: int, rank: int) -> torch.Tensor:
    ref = ids.cpu().long().clone()
    first = rank * LOCAL
    ref[(ref < first) | (ref >= first + LOCAL)] = -1
    ref[ref >= 0] -= first
    ref[num_recv:] = -1
    return ref.int()


@pytest.mark.parametrize("num_recv", [0, 1, CAP + 3, ROWS])
@pytest.mark.parametrize("rank", [0, WORLD - 1])
def test_local_ids_mask_rows_past_the_count_and_other_ranks_experts(seed: int, num_recv: int, rank: int) -> None:
    ids = received_ids(seed, num_recv)
    count = torch.tensor([num_recv], dtype=torch.int32, device=DEVICE)
    got = local_expert_ids(ids, count, rank * LOCAL, LOCAL)
    assert got.dtype == torch.int32 and got.shape == ids.shape and got.device == ids.device
    assert torch.equal(got.cpu(), reference_local_ids(ids, num_recv, rank))


@pytest.mark.parametrize("num_recv", [0, CAP + 3, ROWS])
def test_local_counts_are_the_per_expert_pairs(seed: int, num_recv: int) -> None:
    rank = WORLD // 2
    ids = received_ids(seed, num_recv)
    local = local_expert_ids(ids, torch.tensor([num_recv], device=DEVICE), rank * LOCAL, LOCAL)
    got = local_expert_counts(local, LOCAL)
    ref = reference_local_ids(ids, num_recv, rank)
    want = torch.bincount(ref[ref >= 0].long(), minlength=LOCAL)
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()
    assert int(got.sum()) == int(((ids[:num_recv] >= rank * LOCAL) & (ids[:num_recv] < (rank + 1) * LOCAL)).sum())


@pytest.mark.parametrize(
    ("bound", "rows"), [(0, ROWS), (32, 32), (ROWS - 1, ROWS - 1), (ROWS, ROWS), (ROWS + 32, ROWS)]
)
def test_rows_are_bounded_only_by_a_real_bound(bound: int, rows: int) -> None:
    assert expert_rows(ROWS, bound) == rows


# ---------------------------------------------------------------------------------------------
# payloads
# ---------------------------------------------------------------------------------------------


def received_payload(seed: int, dtype: DispatchDtype, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Payload and scales as the dispatcher hands them to SGLang: fp8 scales as a strided f32 view of
    128-byte-aligned scale rows, MX scales as e8m0, fp4 as ``float4_e2m1fn_x2``."""
    x = torch.randn(rows, HIDDEN, generator=generator(seed, "x", dtype.value)).to(torch.bfloat16).to(DEVICE)
    payload, scales = formats.quantize_dispatch(x, dtype, torch.float8_e4m3fn)
    if scales is None:
        return payload, None
    width = scales.contiguous().view(torch.uint8).view(rows, -1).shape[1]
    stride = formats.scale_stride_bytes(width)
    padded = torch.zeros(rows, stride, dtype=torch.uint8, device=DEVICE)
    padded[:, :width] = scales.contiguous().view(torch.uint8).view(rows, width)
    if dtype is DispatchDtype.FP8:
        return payload, padded.view(torch.float32)[:, : width // 4]
    view = padded.view(torch.float8_e8m0fnu)[:, :width]
    if dtype is DispatchDtype.MXFP4:
        payload = payload.view(torch.float4_e2m1fn_x2)
    return payload, view


@pytest.mark.parametrize("dtype", list(DispatchDtype), ids=lambda d: d.value)
def test_dispatch_dtype_is_read_from_the_payload(seed: int, dtype: DispatchDtype) -> None:
    payload, scales = received_payload(seed, dtype, 4)
    assert dispatch_dtype_of(payload, scales) is dtype


def test_a_payload_of_no_dispatch_format_is_refused() -> None:
    with pytest.raises(ValueError, match="not a mori-sglang dispatch format"):
        dispatch_dtype_of(torch.zeros(2, 8, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="not a mori-sglang dispatch format"):
        dispatch_dtype_of(torch.zeros(2, 8, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.float16))


ROWS_HANDED = 40 if ON_GPU else 5


def test_bf16_goes_through_as_a_view(seed: int) -> None:
    payload, _ = received_payload(seed, DispatchDtype.BF16, ROWS_HANDED + 3)
    got = expert_input(payload, None, ROWS_HANDED, HIDDEN, block_fp8_weights=True)
    assert got.a1_q is None and got.a1_scale is None
    assert got.hidden_states.data_ptr() == payload.data_ptr() and got.hidden_states.shape == (ROWS_HANDED, HIDDEN)


def test_fp8_goes_through_unquantized_again_to_block_fp8_experts(seed: int) -> None:
    """No second quantization: the up GEMM reads the received bytes and scales themselves."""
    payload, scales = received_payload(seed, DispatchDtype.FP8, ROWS_HANDED + 3)
    got = expert_input(payload, scales, ROWS_HANDED, HIDDEN, block_fp8_weights=True)
    assert got.a1_q is not None and got.a1_q.data_ptr() == payload.data_ptr()
    assert got.a1_q.shape == (ROWS_HANDED, HIDDEN) and got.a1_q.is_contiguous()
    assert got.a1_scale.data_ptr() == scales.data_ptr() and torch.equal(got.a1_scale, scales[:ROWS_HANDED])
    assert got.hidden_states.shape == (ROWS_HANDED, HIDDEN) and got.hidden_states.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "block_fp8_weights"),
    [
        (DispatchDtype.FP8, False),
        (DispatchDtype.MXFP8, True),
        (DispatchDtype.MXFP4, True),
        (DispatchDtype.MXFP4, False),
    ],
    ids=["fp8-bf16-experts", "mxfp8", "fp4-fp8-experts", "fp4-bf16-experts"],
)
def test_other_payloads_are_dequantized_to_bf16(seed: int, dtype: DispatchDtype, block_fp8_weights: bool) -> None:
    payload, scales = received_payload(seed, dtype, ROWS_HANDED + 3)
    got = expert_input(payload, scales, ROWS_HANDED, HIDDEN, block_fp8_weights)
    raw = payload.view(torch.uint8) if dtype is DispatchDtype.MXFP4 else payload
    want = formats.dequantize_dispatch(raw[:ROWS_HANDED], scales[:ROWS_HANDED], dtype, HIDDEN).to(torch.bfloat16)
    assert got.a1_q is None and got.a1_scale is None
    assert torch.equal(got.hidden_states, want)


@pytest.mark.parametrize("dtype", [DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.MXFP4], ids=lambda d: d.value)
def test_rows_past_the_count_are_zeroed_for_per_tensor_experts(seed: int, dtype: DispatchDtype) -> None:
    payload, scales = received_payload(seed, dtype, ROWS_HANDED + 3)
    received = ROWS_HANDED // 2
    plain = expert_input(payload, scales, ROWS_HANDED, HIDDEN, block_fp8_weights=False)
    got = expert_input(
        payload, scales, ROWS_HANDED, HIDDEN, block_fp8_weights=False, zero_past=torch.tensor([received]).to(DEVICE)
    )
    assert torch.equal(got.hidden_states[:received], plain.hidden_states[:received])
    assert not got.hidden_states[received:].any() and plain.hidden_states[received:].any()


# ---------------------------------------------------------------------------------------------
# the expert path it feeds: a grouped torch MoE on the handed-on rows, summed over ranks
# ---------------------------------------------------------------------------------------------


def experts_on(activations: ExpertInput, ids: torch.Tensor, weights: torch.Tensor, w13, w2) -> torch.Tensor:
    """What SGLang's fused experts compute from this input: per row, the sum over its local slots of
    weight * down(silu(gate) * up), in f32 (the real kernels round differently; the glue does not)."""
    if activations.a1_q is None:
        x = activations.hidden_states.float()
    else:
        groups = activations.a1_q.float().view(ids.shape[0], -1, FP8_BLOCK)
        x = (groups * activations.a1_scale.float()[:, :, None]).view(ids.shape[0], -1)
    out = torch.zeros(ids.shape[0], w2.shape[1], device=x.device)
    for expert in range(w13.shape[0]):
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate_up = x[rows] @ w13[expert].T
        gate, up = gate_up.chunk(2, dim=1)
        out.index_add_(0, rows, weights[rows, slots, None] * (torch.nn.functional.silu(gate) * up) @ w2[expert].T)
    return out


@pytest.mark.parametrize("dtype", [DispatchDtype.BF16, DispatchDtype.FP8], ids=lambda d: d.value)
def test_ranks_experts_on_the_glue_sum_to_the_layer_without_ep(seed: int, dtype: DispatchDtype) -> None:
    """Every rank takes the same receive buffer (all tokens, stale rows after them): its local ids
    and input, through the experts, summed over ranks, give the layer on all experts."""
    tokens, inter = (96, 64) if ON_GPU else (6, 16)
    gen = generator(seed, "layer")
    w13 = (torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen) / HIDDEN**0.5).to(DEVICE)
    w2 = (torch.randn(EXPERTS, HIDDEN, inter, generator=gen) / inter**0.5).to(DEVICE)
    payload, scales = received_payload(seed, dtype, tokens + 5)
    ids = received_ids(seed, tokens)[: tokens + 5]
    weights = torch.rand(tokens + 5, TOPK, generator=gen).to(DEVICE)
    count = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)
    bound = tokens + 2  # a host bound above the count: the extra rows must come out masked
    total = torch.zeros(bound, HIDDEN, device=DEVICE)
    for rank in range(WORLD):
        local = local_expert_ids(ids[:bound], count, rank * LOCAL, LOCAL)
        activations = expert_input(payload, scales, bound, HIDDEN, block_fp8_weights=True)
        mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
        total += experts_on(activations, local, weights[:bound], w13[mine], w2[mine])
    raw = payload if scales is None else formats.dequantize_dispatch(payload, scales, dtype, HIDDEN)
    everyone = torch.where(torch.arange(tokens + 5, device=DEVICE)[:, None] < tokens, ids, -1)[:bound]
    want = experts_on(ExpertInput(raw[:bound].float()), everyone, weights[:bound], w13, w2)
    assert torch.equal(total[tokens:], torch.zeros_like(total[tokens:]))
    assert float((total - want).norm() / want.norm()) < 1e-5


# ---------------------------------------------------------------------------------------------
# no host sync, CUDA graphs
# ---------------------------------------------------------------------------------------------


@needs_gpu
def test_glue_never_synchronises_with_the_host(seed: int) -> None:
    ids = received_ids(seed, CAP)
    count = torch.tensor([CAP], dtype=torch.int32, device=DEVICE)
    payload, scales = received_payload(seed, DispatchDtype.FP8, 64)
    bf16_payload, _ = received_payload(seed, DispatchDtype.BF16, 64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        local = local_expert_ids(ids, count, 0, LOCAL)
        counts = local_expert_counts(local, LOCAL)
        expert_input(payload, scales, 64, HIDDEN, block_fp8_weights=True)
        expert_input(bf16_payload, None, 64, HIDDEN, block_fp8_weights=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = reference_local_ids(ids, CAP, 0)
    assert torch.equal(local.cpu(), want)
    assert counts.tolist() == torch.bincount(want[want >= 0].long(), minlength=LOCAL).tolist()


@needs_gpu
def test_glue_replays_in_a_cuda_graph_with_the_count_changed_on_the_device(seed: int) -> None:
    ids = received_ids(seed, ROWS)
    count = torch.tensor([CAP], dtype=torch.int32, device=DEVICE)
    rank = 3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as SGLang's graph runner does
        local_expert_counts(local_expert_ids(ids, count, rank * LOCAL, LOCAL), LOCAL)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        local = local_expert_ids(ids, count, rank * LOCAL, LOCAL)
        counts = local_expert_counts(local, LOCAL)
    for num_recv in (CAP, 0, ROWS, 17):
        count.fill_(num_recv)
        graph.replay()
        want = reference_local_ids(ids, num_recv, rank)
        assert torch.equal(local.cpu(), want), num_recv
        assert counts.tolist() == torch.bincount(want[want >= 0].long(), minlength=LOCAL).tolist(), num_recv
