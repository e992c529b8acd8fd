"""The native MoRI provider against a stand-in with MoRI's Python API (tests/fake_mori): SGLang's
configuration, provider choice, and a dispatch/combine round trip on gloo ranks equal to the torch
provider's. The stand-in checks every call's shapes, dtypes and kernel type as MoRI documents them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mori_sglang import formats, providers
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.providers.device_status import DeviceStatus
from mori_sglang.providers.mori_provider import MoriProvider, finalize_shmem, kernel_type_name, mori_config_kwargs
from mori_sglang.types import InputError
from tests.helpers import run_gloo

FAKE_MORI = str(Path(__file__).parents[1] / "fake_mori")
HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 256, 8, 3, 6


@pytest.fixture
def fake_mori(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in importable as ``mori`` for one test, and forgotten afterwards."""
    monkeypatch.syspath_prepend(FAKE_MORI)
    yield
    for name in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
        del sys.modules[name]


def test_auto_picks_native_mori_on_a_gpu_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    assert providers.resolve_provider(Provider.AUTO, torch.device("cuda", 0)) is Provider.MORI
    assert providers.resolve_provider(Provider.AUTO, torch.device("cpu")) is Provider.TORCH
    monkeypatch.setattr(providers, "mori_available", lambda: False)
    assert providers.resolve_provider(Provider.AUTO, torch.device("cpu")) is Provider.TORCH
    with pytest.raises(ConfigError, match="SGLANG_MORI_BACKEND=mori but the native MoRI package does not import"):
        providers.resolve_provider(Provider.MORI, torch.device("cpu"))


@pytest.mark.parametrize(
    ("mode", "world", "kernel"),
    [
        (Mode.INTRANODE, 8, "IntraNode"),
        (Mode.INTRANODE, 16, "InterNodeV1"),
        (Mode.LOW_LATENCY, 8, "AsyncLL"),
        (Mode.SPLIT, 8, "AsyncLL"),
    ],
)
def test_kernel_type_per_mode_as_sglang_picks_it(mode: Mode, world: int, kernel: str) -> None:
    assert kernel_type_name(EpConfig(world, 0, 7168, 256, 8, mode=mode)) == kernel


@pytest.mark.parametrize(
    ("dispatch", "combine", "scale_dim", "quant_type"),
    [
        (DispatchDtype.BF16, CombineDtype.BF16, 0, "none"),
        (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE, 256, "fp8_blockwise"),  # 224 B of f32 scales, padded
        (DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST, 256, "fp8_direct_cast"),
        (DispatchDtype.MXFP4, CombineDtype.FP4_BLOCKWISE, 256, "fp4_blockwise"),
    ],
)
def test_mori_config_carries_padded_scale_rows_and_the_combine_quantization(
    dispatch: DispatchDtype, combine: CombineDtype, scale_dim: int, quant_type: str
) -> None:
    cfg = EpConfig(8, 3, 7168, 256, 8, max_tokens_per_rank=4096, dispatch_dtype=dispatch, combine_dtype=combine)
    layout = formats.DispatchRowLayout(
        formats.dispatch_token_bytes(dispatch, 7168), formats.dispatch_scale_bytes(dispatch, 7168), 8
    )
    payload = formats.dispatch_payload_dtype(dispatch, torch.float8_e4m3fnuz)
    kwargs = mori_config_kwargs(cfg, layout, payload)
    assert kwargs["scale_dim"] == scale_dim and kwargs["scale_type_size"] == (1 if scale_dim else 0)
    assert kwargs["quant_type"] == quant_type
    assert (kwargs["rank"], kwargs["world_size"], kwargs["hidden_dim"]) == (3, 8, 7168)
    assert (kwargs["num_experts_per_rank"], kwargs["num_experts_per_token"]) == (32, 8)
    assert kwargs["max_num_inp_token_per_rank"] == 4096
    assert kwargs["data_type"] is (torch.float4_e2m1fn_x2 if dispatch is DispatchDtype.MXFP4 else payload)
    assert (kwargs["warp_num_per_block"], kwargs["block_num"], kwargs["rdma_block_num"]) == (16, 80, 0)
    assert kwargs["gpu_per_node"] == 8 and kwargs["max_token_type_size"] == 2


def test_a_loopback_world_refuses_native_mori(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    with pytest.raises(ConfigError, match="native MoRI provider runs on real ranks"):
        LoopbackWorld(EpConfig(2, 0, HIDDEN, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, provider="mori"))
    assert providers.resolve_provider(Provider.AUTO, torch.device("cuda", 0), real_ranks=False) is not Provider.MORI


@pytest.mark.parametrize(
    ("mode", "world", "combine"),
    [
        (Mode.LOW_LATENCY, 8, CombineDtype.FP4_BLOCKWISE),
        (Mode.SPLIT, 8, CombineDtype.FP4_BLOCKWISE),
        (Mode.INTRANODE, 16, CombineDtype.FP4_BLOCKWISE),
        (Mode.INTRANODE, 16, CombineDtype.FP8_BLOCKWISE),
    ],
)
def test_combine_quantization_a_mori_kernel_lacks_is_refused(
    fake_mori: None, mode: Mode, world: int, combine: CombineDtype
) -> None:
    cfg = EpConfig(world, 0, 7168, 256, 8, mode=mode, dispatch_dtype=DispatchDtype.MXFP4, combine_dtype=combine)
    layout = formats.DispatchRowLayout(3584, 224, 8)
    with pytest.raises(ConfigError, match=f"SGLANG_MORI_COMBINE_DTYPE={combine.value} is not offered by MoRI"):
        MoriProvider(cfg, torch.device("cpu"), layout, torch.uint8)


def test_ids_past_the_last_expert_are_dropped_and_flagged_on_the_device() -> None:
    cfg = EpConfig(2, 0, HIDDEN, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS)
    provider = SimpleNamespace(config=cfg, _status=DeviceStatus(1, torch.device("cpu")))
    ids = torch.tensor([[0, 7, -1], [8, 3, 12]])
    checked = MoriProvider._checked_ids(provider, ids)
    assert checked.dtype == torch.int32 and checked.tolist() == [[0, 7, -1], [-1, 3, -1]]
    with pytest.raises(InputError, match="topk_ids held expert 12"):
        MoriProvider.check_status(provider)
    MoriProvider.check_status(provider)  # cleared once raised


CASES = [
    (Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16),
    (Mode.INTRANODE, DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE),
    (Mode.LOW_LATENCY, DispatchDtype.FP8, CombineDtype.FP8_DIRECT_CAST),
    (Mode.LOW_LATENCY, DispatchDtype.MXFP4, CombineDtype.BF16),
    (Mode.SPLIT, DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE),
]
# Relative error of the combined output against the torch provider's: the bf16 and direct-cast wires
# are the same bytes (only the f32 summation order differs); blockwise is MoRI's format against ours.
TOLERANCE = {
    CombineDtype.BF16: 1e-3,
    CombineDtype.FP8_DIRECT_CAST: 1e-3,
    CombineDtype.FP8_BLOCKWISE: 0.08,
    CombineDtype.FP8_BLOCKWISE_NATIVE: 0.08,
}


def _rows(out, n: int) -> list[tuple]:
    """Received rows as sortable tuples of bytes (the providers may order them differently)."""
    scales = out.recv_scales()
    rows = []
    for j in range(n):
        scale = bytes(scales[j].contiguous().numpy()) if scales is not None else b""
        rows.append(
            (
                bytes(out.tokens[j].contiguous().view(torch.uint8).numpy()),
                bytes(out.topk_ids[j].int().numpy()),
                bytes(out.topk_weights[j].float().numpy()),
                scale,
            )
        )
    return sorted(rows)


def _round_trip_worker(rank: int, world: int, seed: int) -> None:
    sys.path.insert(0, FAKE_MORI)
    try:
        _round_trips(rank, world, seed)
    finally:
        finalize_shmem()


def _round_trips(rank: int, world: int, seed: int) -> None:
    import mori

    for i, (mode, dispatch, combine) in enumerate(CASES):
        base = EpConfig(world, rank, HIDDEN, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS)
        cfg = replace(base, mode=mode, dispatch_dtype=dispatch, combine_dtype=combine)
        ops = {p: EpDispatchCombineOp(replace(cfg, provider=p), device="cpu") for p in ("torch", "mori")}
        assert isinstance(ops["mori"].provider.op, mori.ops.EpDispatchCombineOp)
        gen = torch.Generator().manual_seed(seed + 100 * i + rank)
        n = (MAX_TOKENS, 2)[rank % 2]
        x = (torch.randn(n, HIDDEN, generator=gen) * 3).to(torch.bfloat16)
        ids = torch.rand(n, EXPERTS, generator=gen).topk(TOPK, dim=1).indices.int()
        weights = torch.rand(n, TOPK, generator=gen)
        results = {}
        for name, op in ops.items():
            op.dispatch_send(x, weights, None, ids)
            out = op.dispatch_recv()
            received = out.num_recv_host()
            if out.scales is not None:
                padded = out.scales.as_strided((received, out.scale_stride), (out.scale_stride, 1))
                assert out.scale_stride % 128 == 0 and not padded[:, op.scale_bytes :].any(), name
            scales = None
            if out.scales is not None:
                scales = out.recv_scales(torch.float32 if dispatch is DispatchDtype.FP8 else torch.uint8)[:received]
            y = formats.dequantize_dispatch(out.tokens[:received], scales, dispatch, HIDDEN) * 1.5
            op.combine_send(y.to(torch.bfloat16), out.handle)
            results[name] = (_rows(out, received), op.combine_recv())
        assert results["mori"][0] == results["torch"][0], f"case {i}: received rows differ"
        got, ref = results["mori"][1].float(), results["torch"][1].float()
        assert got.shape == (n, HIDDEN)
        assert (got - ref).norm() <= TOLERANCE[combine] * ref.norm(), f"case {i}: combine differs"
        split = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]
        expected = {Mode.INTRANODE: ["dispatch", "combine"], Mode.LOW_LATENCY: split, Mode.SPLIT: split}[mode]
        assert ops["mori"].provider.op.calls == expected


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_through_mori_equals_the_torch_provider(world: int, tmp_path: Path, seed: int) -> None:
    run_gloo(world, _round_trip_worker, (seed,), tmp_path)
