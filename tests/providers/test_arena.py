"""The arena layout keeps every row where the kernels' alignment hints say it is."""

from __future__ import annotations

import pytest
import torch

from mori_sglang.providers.arena import Arena, ArenaLayout


def test_offsets_and_rows_are_aligned() -> None:
    layout = ArenaLayout(world_size=8, max_tokens=129, dispatch_row_bytes=7488, combine_row_stride=7392)
    assert layout.combine_offset % 128 == 0
    assert layout.dispatch_arrivals_offset % 128 == 0
    assert layout.counts_offset - layout.dispatch_arrivals_offset == 2 * 8 * 8
    assert layout.nbytes >= layout.counts_offset + 8 * 8


@pytest.mark.parametrize("field", ["dispatch_row_bytes", "combine_row_stride"])
def test_a_row_size_off_the_alignment_is_refused(field: str) -> None:
    sizes = {"dispatch_row_bytes": 7488, "combine_row_stride": 7392, field: 7400}
    with pytest.raises(ValueError, match=f"{field}=7400 is not a multiple of 16"):
        ArenaLayout(world_size=2, max_tokens=4, **sizes)


def test_a_buffer_off_the_alignment_is_refused() -> None:
    layout = ArenaLayout(world_size=1, max_tokens=1, dispatch_row_bytes=16, combine_row_stride=16)
    storage = torch.zeros(layout.nbytes + 64, dtype=torch.uint8)
    start = (-storage.data_ptr()) % 16 + 8  # 8 bytes past a 16-byte boundary
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        Arena(layout, storage[start : start + layout.nbytes], torch.zeros(1, dtype=torch.int64))
