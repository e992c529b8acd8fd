"""Row offsets in the kernels: a batch's elements pass int32 long before its rows do (hidden 7168 from
299,594 tokens, under the 2^20 tokens per rank the config accepts), so every kernel that reads or
writes a dense ``[rows, hidden]`` tensor starts its rows with ``transport._row_start``, in int64."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from mori_sglang import env
from mori_sglang.kernels import transport

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN_SIZES = (2048, 2880, 3584, 4096, 5120, 6144, 7168)
BLOCK = 64


@triton.jit
def _row_start_kernel(rows_ptr, starts_ptr, n, ROW_ELEMENTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(starts_ptr + offs, transport._row_start(tl.load(rows_ptr + offs, mask=mask), ROW_ELEMENTS), mask=mask)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_row_starts_past_int32_are_exact(hidden: int, rng: random.Random) -> None:
    """int32 row indices up to every row a receive can hold (a world of 8 at the token cap), with the
    first row whose elements pass int32, against the product in Python's integers; the output is
    poisoned first."""
    most_rows = 8 * env.MAX_TOKENS_PER_RANK
    first_past = (2**31 - 1) // hidden + 1
    rows = [0, 1, first_past - 1, first_past, most_rows - 1] + [rng.randrange(most_rows) for _ in range(59)]
    starts = torch.full((len(rows),), -1, dtype=torch.int64, device=DEVICE)
    row_tensor = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    _row_start_kernel[(triton.cdiv(len(rows), BLOCK),)](row_tensor, starts, len(rows), ROW_ELEMENTS=hidden, BLOCK=BLOCK)
    assert starts.cpu().tolist() == [row * hidden for row in rows]


@triton.jit
def _count_before_kernel(
    ids_ptr, counts_ptr, out_ptr, d, b, target, num_tokens, num_experts, num_local_experts,
    K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    before = transport._count_before(
        ids_ptr, counts_ptr, d, b, target, num_tokens, num_experts, num_local_experts, K, KP, W, BLOCK_N, LANES, 1
    )
    tl.store(out_ptr, before)


@pytest.mark.parametrize("target", [3, 2**31 + 7, 2**33 + 5, 2**42 - 1])
def test_routing_tasks_read_published_counts_in_every_round(target: int, rng: random.Random) -> None:
    """A routing task publishes ``round << TASK_TAG_SHIFT | count``; a later task takes the count where
    the tag names this round and recounts the block from the ids otherwise. The published counts here
    differ from the ids' (every id dropped: a recount gives 0), so the sum shows which was read. With a
    32-bit shift the round reached the sign bit after 2**31 rounds (days of serving a deep model), and
    from then on every task recounted every earlier block."""
    world, block, blocks, k = 2, 4, 5, 2
    assert triton.next_power_of_2(env.MAX_TOKENS_PER_RANK) < transport.TASK_COUNT_LIMIT.value
    ids = torch.full((blocks * block, k), -1, dtype=torch.int32, device=DEVICE)
    published = torch.tensor([rng.randrange(1, block + 1) for _ in range(blocks * world)], dtype=torch.int64)
    counts = ((target << transport.TASK_TAG_SHIFT.value) | published).to(DEVICE)
    out = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    d, b = rng.randrange(world), rng.randrange(1, blocks)
    _count_before_kernel[(1,)](
        ids, counts, out, d, b, target, blocks * block, 4, 2, K=k, KP=2, W=world, BLOCK_N=block, LANES=4
    )
    assert int(out.item()) == int(published.view(blocks, world)[:b, d].sum())
