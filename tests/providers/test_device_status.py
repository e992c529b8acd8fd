"""``MappedStatus``: the host sees a flag a kernel sets at any word, without a copy, and reading clears
it; with no flag raised a receive's check passes without calling the provider's raise."""

from __future__ import annotations

import random

import pytest
import torch

from mori_sglang.providers.device_status import MappedStatus

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("size", [1, 3, 5])
def test_a_flag_at_any_word_is_seen_and_read_clears_it(size: int) -> None:
    status = MappedStatus(size, DEVICE)
    assert not status.pending() and status.read() == [0] * size
    raised: list[int] = []
    for word in range(size):
        value = random.choice([1, -1, 2**40, -(2**63)])  # any nonzero int64, a high byte only too
        status.flags[word] = value  # as a kernel writes it
        assert status.pending()
        status.after_step(lambda: raised.append(word))  # noqa: B023 (called at once)
        assert raised[-1:] == [word]
        assert status.read() == [value if i == word else 0 for i in range(size)]
        assert not status.pending() and status.flags.eq(0).all()


def test_no_flag_calls_nothing() -> None:
    status = MappedStatus(3, DEVICE)
    status.after_step(lambda: pytest.fail("no flag is raised"))
