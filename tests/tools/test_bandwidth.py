"""The access-pattern probe: its fan-out kernel writes exactly the bytes it claims to move, and the
CLI prints every pattern beside the copy roofline."""

from __future__ import annotations

import os

import pytest
import torch

from mori_sglang.tools import bandwidth

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the fan-out probe is a Triton kernel: needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_fan_out_writes_the_high_byte_of_every_element_to_every_destination(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-(1 << 15), 1 << 15, (5, 256), generator=gen, dtype=torch.int32).to(torch.int16).to(DEVICE)
    expected = (x.to(torch.int32) >> 8).to(torch.uint8)
    for poison in (0xA5, 0x5A):  # an unwritten byte keeps one of two poisons, which no element matches twice
        out = torch.full((4, 5, 256), poison, dtype=torch.uint8, device=DEVICE)
        bandwidth.fan_out(x, out, warps=1, programs=2)
        for d in range(4):
            assert torch.equal(out[d], expected), f"destination {d}, poison {poison:#x}"


def test_a_hidden_size_the_tile_does_not_divide_is_refused() -> None:
    x = torch.zeros(2, 1536, dtype=torch.int16, device=DEVICE)
    out = torch.empty(1, 2, 1536, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="--hidden 1536"):
        bandwidth.fan_out(x, out, warps=1, programs=2)


def test_cli_prints_each_pattern_against_the_copy_roofline(capsys: pytest.CaptureFixture[str]) -> None:
    patterns = bandwidth.main(["--tokens", "4", "--hidden", "256", "--fan-out", "1", "2", "--iters", "2"])
    kinds = [p.name.split(" (")[0] for p in patterns]
    assert list(dict.fromkeys(kinds)) == ["copy", "fill", "fan-out to 1", "fan-out to 2"]  # a GPU times more shapes
    assert all(p.gbs > 0 for p in patterns)
    text = capsys.readouterr().out
    assert text.count("\n| ") == len(patterns) + 1  # header rule and one row per pattern


def test_cli_refuses_a_fan_out_that_is_not_a_power_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bandwidth.main(["--fan-out", "3"])
    assert stop.value.code == 2
    assert "--fan-out" in capsys.readouterr().err
