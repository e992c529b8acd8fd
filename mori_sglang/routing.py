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
    """Group the owning (token, slot) pairs by destination rank, tokens ascending inside a group.

    No sort: a token's position in its group for rank d is the number of earlier tokens that also go
    to d, an exclusive prefix sum down the [N, W] matrix of "token n goes to rank d".
    """
    n, k = topk_ids.shape
    device = topk_ids.device
    dest = owning_destinations(topk_ids, num_local_experts)
    valid = dest >= 0
    # Column W collects the slots that send nothing.
    column = torch.where(valid, dest, torch.full_like(dest, world_size))
    goes_to = torch.zeros(n, world_size + 1, dtype=torch.long, device=device)
    goes_to.scatter_(1, column, 1)
    goes_to = goes_to[:, :world_size]
    before = torch.cumsum(goes_to, dim=0) - goes_to
    send_counts = goes_to.sum(dim=0)
    starts = torch.cumsum(send_counts, 0) - send_counts

    safe_dest = dest.clamp(min=0)
    position = before.gather(1, safe_dest)
    none = torch.full_like(dest, -1)
    copy_of_pair = torch.where(valid, starts[safe_dest] + position, none)
    slot_of_pair = torch.where(valid, safe_dest * max_tokens_per_rank + position, none)

    # Invert the copy numbering with a scatter; the unused tail points at a spare entry.
    spare = n * k
    target = torch.where(valid, copy_of_pair, torch.full_like(dest, spare)).view(-1)
    token = torch.arange(n, device=device).repeat_interleave(k)
    token_of_copy = torch.zeros(spare + 1, dtype=torch.long, device=device).scatter_(0, target, token)[:spare]
    slot_of_copy = torch.zeros(spare + 1, dtype=torch.long, device=device)
    slot_of_copy = slot_of_copy.scatter_(0, target, slot_of_pair.view(-1))[:spare]
    return SendPlan(
        copy_of_pair=copy_of_pair,
        slot_of_pair=slot_of_pair,
        token_of_copy=token_of_copy,
        slot_of_copy=slot_of_copy,
        send_counts=send_counts,
        num_copies=send_counts.sum(),
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
