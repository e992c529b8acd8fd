"""Which ranks each token goes to, and where each copy lands: pure tensor ops, no host sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SendPlan:
    """The copies one rank sends, grouped by destination rank, then by token.

    ``copy_of_pair[n, k]`` is the index (in send order) of the copy owned by top-k slot k of token n,
    -1 where slot k is dropped (id < 0) or another slot k' < k already goes to the same rank.
    ``slot_of_pair`` is the same copy's fixed slot ``dest * max_tokens + position``, the address the
    low-latency mode uses in the destination's per-source region.
    """

    dest_of_pair: torch.Tensor  # [N, K] int64, -1 where the slot sends nothing
    copy_of_pair: torch.Tensor  # [N, K] int64
    slot_of_pair: torch.Tensor  # [N, K] int64
    token_of_copy: torch.Tensor  # [N * K] int64; entries past the number of copies are unspecified
    slot_of_copy: torch.Tensor  # [N * K] int64 fixed slot of each copy
    send_counts: torch.Tensor  # [W] int64 copies per destination
    num_copies: torch.Tensor  # [] int64


def owning_destinations(topk_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Destination rank of each top-k slot, -1 for dropped ids and for repeats of an earlier slot's rank."""
    dest = torch.where(topk_ids >= 0, topk_ids.long() // num_local_experts, torch.full_like(topk_ids, -1).long())
    k = dest.shape[1]
    same = dest[:, :, None] == dest[:, None, :]  # [N, K, K]: slot k vs slot j
    earlier = torch.ones(k, k, dtype=torch.bool, device=dest.device).tril(diagonal=-1)
    repeated = (same & earlier).any(dim=2)
    return torch.where(repeated, torch.full_like(dest, -1), dest)


def plan_dispatch(
    topk_ids: torch.Tensor, num_local_experts: int, world_size: int, max_tokens_per_rank: int
) -> SendPlan:
    """Group the owning (token, slot) pairs by destination rank, tokens ascending inside a group."""
    n, k = topk_ids.shape
    device = topk_ids.device
    dest = owning_destinations(topk_ids, num_local_experts)
    flat_dest = dest.reshape(-1)
    valid = flat_dest >= 0
    token = torch.arange(n, device=device).repeat_interleave(k)
    # Sort key: destination, then token; invalid pairs sort last.
    key = torch.where(valid, flat_dest * (n + 1) + token, torch.full_like(flat_dest, world_size * (n + 1)))
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount or boolean indexing: both synchronise with the host on GPUs.
    send_counts = torch.zeros(world_size + 1, dtype=torch.long, device=device)
    send_counts = send_counts.scatter_add_(0, flat_dest + 1, torch.ones_like(flat_dest))[1:]
    starts = torch.cumsum(send_counts, 0) - send_counts
    num_copies = valid.sum()

    sorted_dest = flat_dest[order]
    rank_in_order = torch.arange(n * k, device=device)
    position = rank_in_order - starts[sorted_dest.clamp(min=0)]
    slot_sorted = sorted_dest.clamp(min=0) * max_tokens_per_rank + position

    copy_of_pair = torch.full((n * k,), -1, dtype=torch.long, device=device)
    slot_of_pair = torch.full((n * k,), -1, dtype=torch.long, device=device)
    sorted_valid = valid[order]
    copy_of_pair[order] = torch.where(sorted_valid, rank_in_order, copy_of_pair[order])
    slot_of_pair[order] = torch.where(sorted_valid, slot_sorted, slot_of_pair[order])
    return SendPlan(
        dest_of_pair=dest,
        copy_of_pair=copy_of_pair.view(n, k),
        slot_of_pair=slot_of_pair.view(n, k),
        token_of_copy=order // k,
        slot_of_copy=slot_sorted,
        send_counts=send_counts,
        num_copies=num_copies,
    )


def source_of_rows(recv_counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For compact received rows ordered by source: each row's source rank and position in its source.

    Rows at and past the total are given source W-1 / a clamped position; callers mask them.
    """
    ends = torch.cumsum(recv_counts, 0)
    rows = torch.arange(capacity, device=recv_counts.device)
    src = torch.searchsorted(ends, rows, right=True).clamp(max=recv_counts.numel() - 1)
    pos = rows - (ends - recv_counts)[src]
    return src, pos
