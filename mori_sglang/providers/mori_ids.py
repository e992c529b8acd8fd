"""Expert ids the way MoRI's kernels must see them, and back.

MoRI sends a copy of a token to rank ``id / num_experts_per_rank`` (C++ integer division, towards
zero), once per rank. Which ids it drops depends on the kernel:

- IntraNode, InterNodeV1 and EP v2's hip backend skip negative ids and ranks outside
  ``[0, world_size)``: a dropped slot is sent as -1 (InterNodeV1LL's receiver does not skip it, one
  reason the provider does not run that kernel);
- AsyncLL skips only ranks outside ``[0, world_size)``, so -1 (``-1 / 32 == 0``) goes to rank 0, and
  its receiver asserts that every id of a received row names a rank. The one id it drops and its
  receiver accepts is a repeat of a rank an earlier slot of the same token already goes to: a
  dropped slot is sent as the token's first kept id (that slot is moved to the front, trading places
  with slot 0, so that the repeat comes later), and a token with no kept slot as ``num_experts``
  (its rank is past the last, so nothing is sent and nothing received). The receiver turns every
  repeat of a row's first id back into -1.

All of it is elementwise on the device: no host synchronisation.
"""

from __future__ import annotations

import torch

from mori_sglang.providers.device_status import DeviceStatus


def flag_past_last(ids: torch.Tensor, num_experts: int, status: DeviceStatus) -> torch.Tensor:
    """Record the largest id past the last expert, minus (num_experts - 1), in ``status`` (raised one
    call later; at least 1, and no overflow for any int64 id); returns the mask of dropped slots (those
    ids and negative ones). Compared as they come, so that no int64 id is truncated."""
    over = ids >= num_experts
    if ids.numel():
        flag = torch.where(over, ids.long() - (num_experts - 1), 0).amax()
        torch.maximum(status.flags[0], flag, out=status.flags[0])
    return over | (ids < 0)


def negative_for_dropped(ids: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """int32 ids with dropped slots as -1 (the kernels that skip negative ids)."""
    return torch.where(dropped, -1, ids.to(torch.int32)).contiguous()


def asyncll_routing(
    ids: torch.Tensor, weights: torch.Tensor, dropped: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ids, f32 weights) for AsyncLL: dropped slots repeat the token's first kept id, moved to
    slot 0 with its weight; tokens with nothing kept go nowhere."""
    kept = ~dropped
    first = kept.to(torch.int8).argmax(dim=1, keepdim=True)  # 0 where nothing is kept
    slots = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    order = torch.where(slots == 0, first, torch.where(slots == first, 0, slots))
    ids = ids.to(torch.int32).gather(1, order)
    dropped = dropped.gather(1, order)
    lead = torch.where(kept.any(dim=1, keepdim=True), ids[:, :1], num_experts)
    sent = torch.where(dropped, lead, ids)
    return sent.contiguous(), weights.to(torch.float32).gather(1, order).contiguous()


def asyncll_received(ids: torch.Tensor) -> torch.Tensor:
    """Received AsyncLL rows with the repeats of their first id back to -1."""
    repeat = ids == ids[:, :1]
    repeat[:, 0] = False
    return ids.masked_fill(repeat, -1)
