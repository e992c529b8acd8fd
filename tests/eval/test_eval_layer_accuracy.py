"""The layer-accuracy tool: its activations, its metrics, and the combine error it reports per mode."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eval.layer_accuracy.activations import ActivationSpec, channel_scales, expert_outputs
from eval.layer_accuracy.metrics import (
    flushed_fraction,
    median_element_error,
    relative_error,
    saturated_fraction,
)
from eval.layer_accuracy.run import MODES, LayerSetup, make_workload, run
from mori_sglang import CombineDtype, Provider
from tests.helpers import distinct_destinations

REPO = Path(__file__).resolve().parents[2]
E4M3_MAX = 448.0


def small_setup(rng: random.Random, **activations: float) -> LayerSetup:
    world = rng.choice([2, 4])
    return LayerSetup(
        world_size=world,
        tokens_per_rank=rng.randrange(8, 24),
        hidden=128 * rng.randrange(2, 5),
        num_experts=world * rng.randrange(2, 5),
        topk=rng.randrange(2, 4),  # tokens reach several ranks, so combine really sums
        seed=rng.randrange(2**31),
        provider=Provider.TORCH,
        fp8_dtype=torch.float8_e4m3fn,
        activations=ActivationSpec(**activations),
    )


def test_activations_are_heavy_tailed(rng: random.Random) -> None:
    spec = ActivationSpec(median=rng.uniform(0.005, 0.02), outlier_rate=1e-3, outlier_min=100.0)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    channels = channel_scales(4096, spec, gen)
    assert float(channels.median()) == pytest.approx(spec.median, rel=0.1)
    assert float(channels.log().std()) == pytest.approx(spec.channel_sigma, rel=0.1)  # lognormal spread
    y = expert_outputs(512, channels, spec, gen)
    assert y.dtype == torch.bfloat16 and y.shape == (512, 4096)
    magnitude = y.float().abs()
    expected = spec.outlier_rate * y.numel()  # the bulk stays far below outlier_min
    assert abs(int((magnitude >= 0.99 * spec.outlier_min).sum()) - expected) < 5 * math.sqrt(expected)
    assert float(magnitude.max()) <= spec.outlier_max * 1.01
    assert (magnitude > E4M3_MAX).any()  # some exceed the fp8 maximum
    assert float(magnitude.median()) < 0.05  # the bulk is small


def test_activation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="outlier_rate"):
        ActivationSpec(outlier_rate=2.0)
    with pytest.raises(ValueError, match="outlier_min <= outlier_max"):
        ActivationSpec(outlier_min=10.0, outlier_max=1.0)
    for bad in ({"median": math.nan}, {"channel_sigma": math.inf}, {"outlier_max": math.inf}):
        with pytest.raises(ValueError, match="every setting must be a finite number"):
            ActivationSpec(**bad)
    with pytest.raises(ValueError, match="the sigmas must be at most 10"):
        ActivationSpec(channel_sigma=100.0)


def test_metrics_on_known_values() -> None:
    ref = torch.tensor([[3.0, 0.0, 4.0, 1.0]])
    out = torch.tensor([[3.0, 1.0, 4.0, 0.0]])
    assert relative_error(out, ref) == pytest.approx(math.sqrt(2) / math.sqrt(26))
    assert flushed_fraction(out, ref) == pytest.approx(1 / 3)
    assert median_element_error(out, ref) == 0.0  # errors |0|, |0|, |1| over nonzero refs -> median 0
    y = torch.tensor([[500.0, -452.0, 448.0, 1.0] * 32], dtype=torch.bfloat16)  # exact in bf16
    fp8 = torch.float8_e4m3fn
    assert saturated_fraction(y, CombineDtype.FP8_DIRECT_CAST, fp8, 128) == pytest.approx(0.5)
    assert saturated_fraction(y, CombineDtype.FP8_BLOCKWISE, fp8, 128) == 0.0
    assert saturated_fraction(y, CombineDtype.FP8_BLOCKWISE_NATIVE, fp8, 128) == 0.0
    assert saturated_fraction(y, CombineDtype.BF16, fp8, 128) == 0.0


@pytest.mark.parametrize("hidden", [101, 102, 2880])
@pytest.mark.parametrize("dtype", [CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_BLOCKWISE_NATIVE])
def test_saturation_reads_the_scales_past_the_tokens_pad(hidden: int, dtype: CombineDtype) -> None:
    """Where hidden is not a multiple of 4 the scales start after a pad: read from byte ``hidden`` they
    were misaligned (an error in torch's view) or wrong."""
    block = 64
    y = torch.linspace(-600.0, 600.0, 3 * hidden).view(3, hidden).to(torch.bfloat16)
    assert saturated_fraction(y, dtype, torch.float8_e4m3fn, block) == 0.0
    assert saturated_fraction(y, CombineDtype.FP8_DIRECT_CAST, torch.float8_e4m3fn, block) > 0.0


def test_reference_is_the_exact_sum_of_routed_rows(rng: random.Random) -> None:
    setup = small_setup(rng)
    work = make_workload(setup)
    per_rank = setup.num_experts // setup.world_size
    total_rows = sum(
        len(distinct_destinations(row, per_rank)) for ids in work.topk_ids for row in ids.tolist()
    )  # each token goes once to each distinct rank of its top-k
    assert sum(y.shape[0] for y in work.expert_outputs) == total_rows
    # Token by token: a destination's rows come by source rank, then source token (as dispatch
    # delivers them); each token's reference is its rows added in destination order, in f32.
    want = [torch.zeros(ids.shape[0], setup.hidden) for ids in work.topk_ids]
    for dest, y in enumerate(work.expert_outputs):
        row = 0
        for src, ids in enumerate(work.topk_ids):
            for t, experts in enumerate(ids.tolist()):
                if dest in distinct_destinations(experts, per_rank):
                    want[src][t] += y[row].float()
                    row += 1
        assert row == y.shape[0]
    assert all(torch.equal(got, exact) for got, exact in zip(work.reference, want, strict=True))


def test_modes_rank_as_their_formats_predict(rng: random.Random) -> None:
    # small bulk (fp8 subnormal range) and outliers beyond 448
    setup = small_setup(rng, median=0.01, outlier_rate=2e-3, outlier_min=500.0, outlier_max=2000.0)
    results = {r.mode: r for r in run(setup)}
    assert tuple(results) == MODES
    bf16, ours, native, cast = (results[m] for m in MODES)
    assert 0 < bf16.relative_error < 2**-8 and bf16.flushed == 0 and bf16.saturated == 0
    assert bf16.median_element_error < 2**-8
    assert ours.saturated == 0 and native.saturated == 0 and cast.saturated > 0
    assert ours.relative_error < 2**-4  # blocks scaled to the fp8 range
    assert cast.relative_error > 0.3  # outliers clamped at 448
    assert ours.flushed < cast.flushed and cast.flushed > 0.01  # the bulk falls below fp8's subnormals
    assert ours.median_element_error < cast.median_element_error


def test_same_inputs_for_every_mode_and_device_independent(rng: random.Random) -> None:
    setup = small_setup(rng)
    first = make_workload(setup)
    again = make_workload(replace(setup, device="cpu", provider=Provider.AUTO))
    for a, b in zip(first.expert_outputs, again.expert_outputs, strict=True):
        assert torch.equal(a, b)


def test_command_prints_a_row_per_mode(rng: random.Random) -> None:
    """Modes by their env names (long names are aliases); --world-size / --tokens-per-rank as aliases."""
    env_names = {"bf16": "bf16", "fp8_blockwise": "fp8", "fp8_blockwise_native": "fp8_blockwise_native"}
    env_names["fp8_direct_cast"] = "fp8_direct_cast"
    long_names = rng.sample([m.value for m in MODES], rng.randrange(1, 5))
    modes = [env_names[m] for m in long_names]
    written = [rng.choice([m, env_names[m]]) for m in long_names]
    command = [
        sys.executable,
        "-m",
        "eval.layer_accuracy",
        rng.choice(["--world", "--world-size"]),
        "2",
        rng.choice(["--tokens", "--tokens-per-rank"]),
        "8",
        "--hidden",
        "256",
        "--experts",
        "4",
        "--topk",
        "2",
        "--device",
        "cpu",
        "--modes",
        ",".join(written),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("combine of 2 ranks x 8 tokens, hidden 256")
    assert lines[2] == "| combine mode | relative error | median element error | flushed to zero | saturated |"
    assert [line.split(" | ")[0].lstrip("| ") for line in lines[4:]] == modes
    bad = subprocess.run([*command[:3], "--modes", "fp4"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == (
        "python -m eval.layer_accuracy: error: argument --modes: 'fp4' is not a mode; "
        "use a comma list of bf16, fp8, fp8_blockwise_native, fp8_direct_cast"
    )
