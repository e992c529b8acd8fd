"""Fixtures and hooks of the suite; the helpers the tests share are in tests/helpers.py."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Generator

import pytest
import torch

# Triton reads this when it is first imported (SGLang's import brings it in at collection time):
# without a GPU our kernels run in its interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import BASE_SEED, SEED_ENV


def pytest_report_header() -> str:
    return f"random seed: {SEED_ENV}={BASE_SEED}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        report.sections.append(("random seed", f"replay with {SEED_ENV}={BASE_SEED}"))
    return report


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's seed: stable for a given base seed, different for every test."""
    return (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31


@pytest.fixture(autouse=True)
def _seeded_global_generators(seed: int) -> None:
    """Draws from torch's and Python's global generators replay with the suite's seed as well: a test
    that draws without a generator of its own is still reproduced by the replay line."""
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture
def rng(seed: int) -> random.Random:
    """Random inputs that replay with the suite's MORI_SGLANG_TEST_SEED."""
    return random.Random(seed)
