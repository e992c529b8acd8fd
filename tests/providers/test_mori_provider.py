"""The native MoRI provider against a stand-in with MoRI's Python API and behaviour (tests/fake_mori):
SGLang's configuration and choice of API, the ids MoRI's kernels are handed, and dispatch/combine
round trips on 2 and 4 gloo ranks that equal the torch provider (received rows, bf16 and direct-cast
combines) and MoRI's blockwise numerics (the stand-in's, held to a transliteration of MoRI's kernels
in test_mori_numerics.py)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mori_sglang import formats, providers
from mori_sglang.config import CombineDtype, ConfigError, DispatchDtype, EpConfig, Mode, Provider
from mori_sglang.loopback import LoopbackWorld
from mori_sglang.op import EpDispatchCombineOp
from mori_sglang.providers import mori_ids, mori_provider
from mori_sglang.providers.device_status import DeviceStatus
from mori_sglang.providers.mori_provider import MoriProvider, finalize_shmem, uses_ep_v2
from mori_sglang.providers.mori_v1 import (
    check_combine_quantization,
    check_receive_cap,
    check_token_index_range,
    kernel_type_name,
    mori_config_kwargs,
)
from mori_sglang.providers.mori_v2 import MoriV2Provider, scale_row
from mori_sglang.types import InputError
from tests.helpers import generator, make_topk_ids, run_gloo

FAKE_MORI = str(Path(__file__).parents[1] / "fake_mori")
EXPERTS, TOPK, MAX_TOKENS = 8, 3, 6


@pytest.fixture
def fake_mori(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in importable as ``mori`` for one test, and forgotten afterwards."""
    monkeypatch.syspath_prepend(FAKE_MORI)
    yield
    for name in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
        del sys.modules[name]


def test_auto_picks_native_mori_on_a_gpu_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert providers.resolve_provider(Provider.AUTO, torch.device("cuda", 0)) is Provider.MORI
    assert providers.resolve_provider(Provider.AUTO, torch.device("cpu")) is Provider.TORCH
    monkeypatch.setattr(providers, "mori_available", lambda: False)
    assert providers.resolve_provider(Provider.AUTO, torch.device("cpu")) is Provider.TORCH
    with pytest.raises(ConfigError, match="SGLANG_MORI_BACKEND=mori but the native MoRI package does not import"):
        providers.resolve_provider(Provider.MORI, torch.device("cpu"))


@pytest.mark.parametrize(
    ("mode", "world", "per_host", "max_tokens", "environ", "kernel"),
    [
        (Mode.INTRANODE, 8, 8, 4096, {}, "IntraNode"),
        (Mode.INTRANODE, 4, 4, 4096, {}, "IntraNode"),
        (Mode.INTRANODE, 8, 4, 4096, {}, "InterNodeV1"),  # two hosts of four GPUs
        (Mode.INTRANODE, 2, 1, 4096, {}, "InterNodeV1"),
        (Mode.INTRANODE, 16, 16, 4096, {}, "InterNodeV1"),  # more ranks than the intranode kernels take
        (Mode.INTRANODE, 16, 8, 4096, {}, "InterNodeV1"),
        (Mode.INTRANODE, 16, 8, 256, {}, "InterNodeV1"),  # SGLang: InterNodeV1LL, which misroutes dropped ids
        (Mode.INTRANODE, 16, 8, 257, {}, "InterNodeV1"),
        (Mode.INTRANODE, 16, 8, 512, {"SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD": "512"}, "InterNodeV1"),
        (Mode.INTRANODE, 8, 8, 4096, {"MORI_ENABLE_SDMA": "1"}, "AsyncLL"),
        (Mode.LOW_LATENCY, 8, 8, 4096, {}, "AsyncLL"),
        (Mode.LOW_LATENCY, 8, 4, 4096, {}, "AsyncLL"),
        (Mode.SPLIT, 8, 8, 4096, {}, "AsyncLL"),
    ],
)
def test_v1_kernel_type_as_sglang_picks_it_but_never_the_ll_internode_kernel(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, world: int, per_host: int, max_tokens: int, environ: dict, kernel: str
) -> None:
    """By the ranks' hosts, not by the world's size: eight ranks on two hosts take the inter-node kernel."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cfg = EpConfig(world, 0, 7168, 256, 8, max_tokens_per_rank=max_tokens, mode=mode)
    assert kernel_type_name(cfg, per_host) == kernel


@pytest.mark.parametrize(
    ("world", "per_host", "gpu_per_node"),
    [(8, 8, 8), (4, 4, 4), (6, 6, 6), (8, 4, 4), (16, 4, 4), (16, 8, 8), (16, 16, 8), (12, 12, 4), (12, 6, 2)],
)
@pytest.mark.parametrize("mode", [Mode.INTRANODE, Mode.LOW_LATENCY])
def test_mori_numbers_the_hosts_as_they_are(mode: Mode, world: int, per_host: int, gpu_per_node: int) -> None:
    """MoRI's ``gpu_per_node`` (a rank's node is ``rank // gpu_per_node``; AsyncLL's SDMA copies stay
    within one) is the ranks of one host; across hosts, or past eight ranks, the largest power of two
    up to eight that divides them (MoRI asserts a power of two that divides the world)."""
    cfg = EpConfig(world, 0, 7168, 48 * world, 8, mode=mode)
    layout = formats.DispatchRowLayout(formats.dispatch_token_bytes(DispatchDtype.BF16, 7168), 0, 8)
    got = mori_config_kwargs(cfg, layout, torch.bfloat16, torch.bfloat16, per_host)["gpu_per_node"]
    assert got == gpu_per_node and world % got == 0
    assert (got & (got - 1)) == 0 or (per_host == world <= 8)  # a power of two across hosts


@pytest.mark.parametrize(
    ("names", "per_host"),
    [(["a"], 1), (["a"] * 8, 8), (["a"] * 4 + ["b"] * 4, 4), (["a", "b", "c", "d"], 1), (["b"] * 2 + ["a"] * 2, 2)],
)
def test_the_ranks_per_host_come_from_the_host_names(names: list[str], per_host: int) -> None:
    assert providers.host_blocks(names) == per_host


@pytest.mark.parametrize(
    "names", [["a", "b"] * 4, ["a"] * 5 + ["b"] * 3, ["a"] * 2 + ["b"] * 2 + ["a"] * 2, ["a", "a", "b"]]
)
def test_a_host_layout_mori_cannot_number_is_refused(names: list[str]) -> None:
    """Ranks interleaved over the hosts, or unequal counts: MoRI would reach the wrong peers over the
    GPU links, so the op refuses to build, naming the knob that picks another provider."""
    with pytest.raises(ConfigError, match=r"consecutive ranks.*SGLANG_MORI_BACKEND=torch"):
        providers.host_blocks(names)


@pytest.mark.parametrize(
    ("mode", "world", "combine", "environ", "v2"),
    [
        (Mode.INTRANODE, 8, CombineDtype.BF16, {}, True),
        (Mode.INTRANODE, 8, CombineDtype.BF16, {"SGLANG_MORI_EP_V2": "1"}, True),
        (Mode.INTRANODE, 8, CombineDtype.BF16, {"SGLANG_MORI_EP_V2": "0"}, False),
        (Mode.INTRANODE, 16, CombineDtype.BF16, {}, False),  # across hosts
        (Mode.INTRANODE, 4, CombineDtype.BF16, {}, True),
        (Mode.LOW_LATENCY, 8, CombineDtype.BF16, {}, False),  # AsyncLL
        (Mode.SPLIT, 8, CombineDtype.BF16, {}, False),  # AsyncLL's split combine
        (Mode.INTRANODE, 8, CombineDtype.FP8_BLOCKWISE, {}, False),  # v1's blockwise format
        (Mode.INTRANODE, 8, CombineDtype.FP8_DIRECT_CAST, {}, False),
        (Mode.INTRANODE, 8, CombineDtype.BF16, {"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "32768"}, True),
        (Mode.INTRANODE, 8, CombineDtype.BF16, {"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS": "8192"}, False),  # a cap
    ],
)
def test_ep_v2_where_sglang_takes_it_and_v1_elsewhere(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, world: int, combine: CombineDtype, environ: dict, v2: bool
) -> None:
    monkeypatch.delenv("SGLANG_MORI_EP_V2", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cfg = EpConfig(world, 0, 7168, 256, 8, mode=mode, combine_dtype=combine)
    assert uses_ep_v2(cfg, min(world, 8)) is v2
    if v2:
        assert not uses_ep_v2(cfg, world // 2)  # the same ranks over two hosts


ROW_CASES = [
    (DispatchDtype.FP8, 2880, True),
    (DispatchDtype.FP8, 200, False),  # 200 B tokens
    (DispatchDtype.MXFP4, 2880, True),
    (DispatchDtype.BF16, 196, False),
]


@pytest.mark.parametrize(("dispatch", "hidden", "v2"), ROW_CASES)
def test_ep_v2_only_for_rows_of_whole_16_byte_pieces(dispatch: DispatchDtype, hidden: int, v2: bool) -> None:
    assert uses_ep_v2(EpConfig(8, 0, hidden, 256, 8, dispatch_dtype=dispatch), 8) is v2


@pytest.mark.parametrize(
    ("dispatch", "combine", "max_tokens", "scale_dim", "quant_type", "grid"),
    [
        (DispatchDtype.BF16, CombineDtype.BF16, 4096, 0, "none", (16, 80)),
        (DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE, 4096, 256, "fp8_blockwise", (16, 80)),  # 224 B, padded
        (DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST, 4096, 256, "fp8_direct_cast", (16, 80)),
        (DispatchDtype.MXFP4, CombineDtype.FP4_BLOCKWISE, 4096, 256, "fp4_blockwise", (16, 256)),
        (DispatchDtype.MXFP4, CombineDtype.BF16, 64, 256, "none", (5, 225)),  # SGLang's small-batch fp4 grid
    ],
)
def test_v1_config_carries_padded_scale_rows_the_combine_quantization_and_sglang_geometry(
    monkeypatch: pytest.MonkeyPatch,
    dispatch: DispatchDtype,
    combine: CombineDtype,
    max_tokens: int,
    scale_dim: int,
    quant_type: str,
    grid: tuple[int, int],
) -> None:
    monkeypatch.setenv("SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS", "12288")
    cfg = EpConfig(8, 3, 7168, 256, 8, max_tokens_per_rank=max_tokens, dispatch_dtype=dispatch, combine_dtype=combine)
    layout = formats.DispatchRowLayout(
        formats.dispatch_token_bytes(dispatch, 7168), formats.dispatch_scale_bytes(dispatch, 7168), 8
    )
    payload = formats.dispatch_payload_dtype(dispatch, torch.float8_e4m3fnuz)
    token = torch.float4_e2m1fn_x2 if dispatch is DispatchDtype.MXFP4 else payload
    kwargs = mori_config_kwargs(cfg, layout, token, payload, 8)
    assert kwargs["scale_dim"] == scale_dim and kwargs["scale_type_size"] == (1 if scale_dim else 0)
    assert kwargs["quant_type"] == quant_type and kwargs["kernel_type"] == "IntraNode"
    assert (kwargs["rank"], kwargs["world_size"], kwargs["hidden_dim"]) == (3, 8, 7168)
    assert (kwargs["num_experts_per_rank"], kwargs["num_experts_per_token"]) == (32, 8)
    assert kwargs["max_num_inp_token_per_rank"] == max_tokens and kwargs["max_total_recv_tokens"] == 12288
    assert kwargs["data_type"] is token
    assert (kwargs["warp_num_per_block"], kwargs["block_num"], kwargs["rdma_block_num"]) == (*grid, 0)
    assert kwargs["gpu_per_node"] == 8 and kwargs["max_token_type_size"] == 2
    # IntraNode's grid never exceeds the compute units: its combine ends in a grid-wide barrier.
    assert mori_config_kwargs(cfg, layout, token, payload, 8, compute_units=80)["block_num"] == min(grid[1], 80)


@pytest.mark.parametrize(
    ("dispatch", "hidden", "row"),
    [
        (DispatchDtype.BF16, 7168, (0, 0)),
        (DispatchDtype.FP8, 7168, (56, 4)),  # f32 per 128 elements, as SGLang states them
        (DispatchDtype.MXFP8, 7168, (224, 1)),  # e8m0 per 32
        (DispatchDtype.MXFP4, 2048, (64, 1)),
    ],
)
def test_v2_takes_the_callers_scale_row_as_sglang_states_it(
    dispatch: DispatchDtype, hidden: int, row: tuple[int, int]
) -> None:
    cfg = EpConfig(8, 0, hidden, 256, 8, dispatch_dtype=dispatch)
    layout = formats.DispatchRowLayout(
        formats.dispatch_token_bytes(dispatch, hidden), formats.dispatch_scale_bytes(dispatch, hidden), 8
    )
    assert scale_row(cfg, layout) == row
    custom = formats.DispatchRowLayout(formats.dispatch_token_bytes(dispatch, hidden), 36, 8)
    assert scale_row(replace(cfg, scale_bytes=36), custom) in ((9, 4), (36, 1))


def test_native_mori_is_never_picked_beside_a_cuda_build_of_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An amd-mori package that imports on an NVIDIA machine cannot run its kernels: auto passes it by,
    and asking for it names the build."""
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    monkeypatch.setattr(providers, "triton_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert providers.resolve_provider(Provider.AUTO, torch.device("cuda", 0)) is Provider.TRITON
    with pytest.raises(ConfigError, match=r"SGLANG_MORI_BACKEND=mori needs an AMD GPU.*CUDA build"):
        providers.resolve_provider(Provider.MORI, torch.device("cuda", 0))


def test_a_loopback_world_refuses_native_mori(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    with pytest.raises(ConfigError, match="native MoRI provider runs on real ranks"):
        LoopbackWorld(EpConfig(2, 0, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, provider="mori"))
    assert providers.resolve_provider(Provider.AUTO, torch.device("cuda", 0), real_ranks=False) is not Provider.MORI


@pytest.mark.parametrize(("hidden", "scale_dim"), [(2048, None), (256, None), (7168, 55), (256, 7)])
def test_fp4_combine_in_blocks_of_odd_length_is_refused(
    hidden: int, scale_dim: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MoRI packs fp4 pairs from each block's start: odd blocks (hidden 2048 under MoRI's default 56
    scales: 37) would quantize pairs across a block edge with the wrong scale. MoRI reads
    MORI_FP8_COMBINE_SCALE_DIM from the process environment, and so does the check."""
    if scale_dim is None:
        monkeypatch.delenv("MORI_FP8_COMBINE_SCALE_DIM", raising=False)
    else:
        monkeypatch.setenv("MORI_FP8_COMBINE_SCALE_DIM", str(scale_dim))
    cfg = EpConfig(8, 0, hidden, 256, 8, dispatch_dtype=DispatchDtype.MXFP4, combine_dtype=CombineDtype.FP4_BLOCKWISE)
    block = math.ceil(hidden / (scale_dim or 56))
    assert block % 2 == 1
    refusal = f"COMBINE_DTYPE=fp4 .*blocks of {block} elements.*MORI_FP8_COMBINE_SCALE_DIM"
    with pytest.raises(ConfigError, match=refusal):
        check_combine_quantization(cfg, "IntraNode")
    monkeypatch.setenv("MORI_FP8_COMBINE_SCALE_DIM", str(hidden // 8))  # blocks of 8
    check_combine_quantization(cfg, "IntraNode")


@pytest.mark.parametrize(
    ("mode", "world", "combine"),
    [
        (Mode.LOW_LATENCY, 8, CombineDtype.FP4_BLOCKWISE),
        (Mode.SPLIT, 8, CombineDtype.FP4_BLOCKWISE),
        (Mode.INTRANODE, 16, CombineDtype.FP4_BLOCKWISE),
        (Mode.INTRANODE, 16, CombineDtype.FP8_BLOCKWISE),
        (Mode.INTRANODE, 16, CombineDtype.FP8_BLOCKWISE_NATIVE),
    ],
)
def test_combine_quantization_a_mori_kernel_lacks_is_refused(mode: Mode, world: int, combine: CombineDtype) -> None:
    cfg = EpConfig(world, 0, 7168, 256, 8, mode=mode, dispatch_dtype=DispatchDtype.MXFP4, combine_dtype=combine)
    with pytest.raises(ConfigError, match=f"SGLANG_MORI_COMBINE_DTYPE={combine.value} is not offered by MoRI"):
        check_combine_quantization(cfg, kernel_type_name(cfg, 8))


@pytest.mark.parametrize(
    ("mode", "world", "cap", "refused"),
    [
        (Mode.INTRANODE, 8, 8192, True),  # 1024 per source, below 4096
        (Mode.INTRANODE, 8, 32761, False),  # rounds up to 4096 per source
        (Mode.INTRANODE, 8, 0, False),  # no cap
        (Mode.LOW_LATENCY, 8, 8192, False),  # AsyncLL asserts on the cap itself
        (Mode.INTRANODE, 16, 8192, False),  # InterNodeV1 too
    ],
)
def test_a_receive_cap_intranode_does_not_check_is_refused(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, world: int, cap: int, refused: bool
) -> None:
    monkeypatch.setenv("SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS", str(cap))
    monkeypatch.delenv("MORI_ENABLE_SDMA", raising=False)
    cfg = EpConfig(world, 0, 7168, 256, 8, max_tokens_per_rank=4096, mode=mode)
    if refused:
        with pytest.raises(ConfigError, match=f"SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS={cap} caps MoRI's IntraNode"):
            check_receive_cap(cfg, kernel_type_name(cfg, 8))
    else:
        check_receive_cap(cfg, kernel_type_name(cfg, 8))


@pytest.mark.parametrize(
    ("world", "tokens", "kernel", "refused"),
    [
        (8, 1 << 20, "IntraNode", False),  # the largest buffer EpConfig takes, on one host
        (64, 524_287, "AsyncLL", False),
        (64, 524_288, "AsyncLL", True),  # 64 x 64 x 2^19 = 2^31: MoRI's "no token" index wraps
        (64, 524_224, "InterNodeV1", False),
        (64, 524_225, "InterNodeV1", True),  # MoRI's buffer, rounded up to whole chunks of 64, is 2^19
        (128, 131_071, "AsyncLL", False),
        (128, 131_072, "AsyncLL", True),
    ],
)
def test_a_buffer_past_moris_int32_token_index_is_refused(world: int, tokens: int, kernel: str, refused: bool) -> None:
    cfg = EpConfig(world, 0, 7168, 256, 8, max_tokens_per_rank=tokens)
    if refused:
        chunk = 64 if kernel == "InterNodeV1" else 1
        largest = (2**31 - 1) // (world * world) // chunk * chunk
        refusal = rf"SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK={tokens} .*{kernel}.* at most {largest} here"
        with pytest.raises(ConfigError, match=refusal):
            check_token_index_range(cfg, kernel)
    else:
        check_token_index_range(cfg, kernel)


@pytest.mark.parametrize(("tokens", "mori_tokens"), [(100, 128), (128, 128), (4096, 4096), (1, 64)])
def test_internode_v1_gets_a_buffer_of_whole_64_token_chunks(
    monkeypatch: pytest.MonkeyPatch, tokens: int, mori_tokens: int
) -> None:
    """InterNodeV1 takes send slots in whole chunks of 64 in arrival order: a buffer of 100 tokens per
    rank would let a full chunk land in the next node's rows, so MoRI gets 128 and the op's receive
    capacity is MoRI's; IntraNode keeps the op's size."""
    cfg = EpConfig(16, 0, 7168, 256, 8, max_tokens_per_rank=tokens)
    layout = formats.DispatchRowLayout(formats.dispatch_token_bytes(DispatchDtype.BF16, 7168), 0, 8)
    assert kernel_type_name(cfg, 8) == "InterNodeV1"
    kwargs = mori_config_kwargs(cfg, layout, torch.bfloat16, torch.bfloat16, 8)
    assert kwargs["max_num_inp_token_per_rank"] == mori_tokens
    one_host = EpConfig(8, 0, 7168, 256, 8, max_tokens_per_rank=tokens)
    assert kernel_type_name(one_host, 8) == "IntraNode"
    kwargs = mori_config_kwargs(one_host, layout, torch.bfloat16, torch.bfloat16, 8)
    assert kwargs["max_num_inp_token_per_rank"] == tokens


class _Bootstrapped(Exception):
    """Stops building the op once MoRI's shmem bootstrap has been handed its group."""


def test_mori_shmem_bootstraps_over_the_callers_cpu_group(fake_mori: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang and vLLM hand the op their gloo CPU group: MoRI's shmem bootstraps over it, not over a
    gloo group made from the device group (a collective over the default group, which hangs where
    only one pipeline stage's ranks make it). Without one the device group is handed on."""
    from mori_sglang.providers import mori_v1

    handed: list[object] = []

    def init_shmem(group: object) -> None:
        handed.append(group)
        raise _Bootstrapped

    from mori_sglang import op

    asked: list[object] = []
    monkeypatch.setattr(providers, "mori_available", lambda: True)
    monkeypatch.setattr(op, "ranks_per_host", lambda group, device: asked.append(group) or 2)  # the hosts' collective
    monkeypatch.setattr(mori_v1, "init_shmem", init_shmem)
    cfg = EpConfig(2, 0, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, mode=Mode.LOW_LATENCY, provider="mori")
    device_group, cpu_group = object(), object()
    for kwargs, want in (({"cpu_group": cpu_group}, cpu_group), ({}, device_group)):
        with pytest.raises(_Bootstrapped):
            EpDispatchCombineOp(cfg, device_group, device="cpu", **kwargs)
        assert handed.pop() is want and asked.pop() is want


def _bootstrap_one_stage(rank: int, world: int) -> None:
    """Two pipeline stages of one rank each: stage 1's group lacks global rank 0, from which MoRI's own
    torch bootstrap broadcasts; the provider's bootstrap sends the id from the group's first rank."""
    sys.path.insert(0, FAKE_MORI)
    import mori

    stages = [dist.new_group([r], backend="gloo") for r in range(world)]
    mine = stages[rank]
    if rank == 1:
        torch._C._distributed_c10d._register_process_group(mori_provider.SHMEM_GROUP_NAME, mine)
        with pytest.raises(ValueError, match=r"Global rank 0 is not part of group"):
            mori.shmem.shmem_torch_process_group_init(mori_provider.SHMEM_GROUP_NAME)
        torch._C._distributed_c10d._unregister_process_group(mori_provider.SHMEM_GROUP_NAME)
    mori_provider.init_shmem(mine)
    try:
        assert dist.get_process_group_ranks(mori.shmem.group) == [rank]
    finally:
        finalize_shmem()


def test_mori_shmem_bootstraps_over_a_later_pipeline_stages_group(tmp_path: Path) -> None:
    run_gloo(2, _bootstrap_one_stage, (), tmp_path, timeout_s=120)


def test_closing_ep_v2_meets_every_rank_before_freeing_the_window() -> None:
    """MoRI releases the window without a synchronisation: a peer's combine may still gather from it,
    so the provider waits for its kernels and meets every rank before the op and communicator go."""
    calls: list[str] = []
    provider = object.__new__(MoriV2Provider)
    provider.device = torch.device("cpu")
    provider.comm = SimpleNamespace(barrier=lambda: calls.append("barrier"), destroy=lambda: calls.append("destroy"))
    provider.op = SimpleNamespace(close=lambda: calls.append("close"))
    provider.close()
    assert calls == ["barrier", "close", "destroy"]


@pytest.mark.parametrize("gpu_fp8", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
@pytest.mark.parametrize("op_fp8", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_fp8_tokens_go_to_mori_in_the_flavour_it_builds_for_the_gpu(
    monkeypatch: pytest.MonkeyPatch, op_fp8: torch.dtype, gpu_fp8: torch.dtype
) -> None:
    """MoRI builds its kernels for one fp8 flavour per GPU (gfx942: e4m3fnuz, gfx950: e4m3fn): tokens in
    the op's flavour (SGLANG_MORI_FP8_TYPE) travel as that one's bytes; other payloads as they are."""
    monkeypatch.setattr(mori_provider.formats, "fp8_dtype_for_device", lambda device: gpu_fp8)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for dispatch in (DispatchDtype.FP8, DispatchDtype.MXFP8):
        cfg = EpConfig(8, 0, 7168, EXPERTS, TOPK, dispatch_dtype=dispatch, fp8_dtype=op_fp8)
        assert mori_provider.mori_token_dtype(cfg, op_fp8, gpu) is gpu_fp8
        assert mori_provider.mori_token_dtype(cfg, op_fp8, cpu) is op_fp8  # the stand-in takes either
    cfg = EpConfig(8, 0, 7168, EXPERTS, TOPK, dispatch_dtype=DispatchDtype.MXFP4)
    assert mori_provider.mori_token_dtype(cfg, torch.uint8, gpu) is torch.float4_e2m1fn_x2
    assert mori_provider.mori_token_dtype(EpConfig(8, 0, 7168, EXPERTS, TOPK), torch.bfloat16, gpu) is torch.bfloat16


def test_ids_past_the_last_expert_are_dropped_and_flagged_on_the_device() -> None:
    status = DeviceStatus(2, torch.device("cpu"))
    ids = torch.tensor([[0, 7, -1], [8, 3, 12]])
    dropped = mori_ids.flag_past_last(ids, EXPERTS, status)
    checked = mori_ids.negative_for_dropped(ids, dropped)
    assert checked.dtype == torch.int32 and checked.tolist() == [[0, 7, -1], [-1, 3, -1]]
    provider = SimpleNamespace(config=EpConfig(2, 0, 256, EXPERTS, TOPK), _status=status)
    with pytest.raises(InputError, match="topk_ids held expert 12"):
        MoriProvider.check_status(provider)
    MoriProvider.check_status(provider)  # cleared once raised


def _asyncll_destinations(ids: torch.Tensor, num_local: int, world: int) -> list[list[int]]:
    """The ranks AsyncLL sends each token to, as its kernel computes them (C++ division, range check,
    one copy per rank)."""
    ranks = []
    for row in ids.tolist():
        seen: list[int] = []
        for expert in row:
            pe = int(expert / num_local)  # truncates towards zero, like C++
            if 0 <= pe < world and pe not in seen:
                seen.append(pe)
        ranks.append(seen)
    return ranks


def test_asyncll_routing_sends_dropped_slots_nowhere_and_the_receiver_restores_them() -> None:
    world, num_local = 4, 2  # 8 experts
    ids = torch.tensor(
        [
            [-1, 3, 5],  # the old -1 went to rank 0
            [6, -1, 9],  # 9 is past the last expert
            [-1, -1, -1],  # nothing kept: nothing sent
            [1, 0, 7],  # two on rank 0
            [12, -1, 2],
        ]
    )
    weights = torch.rand(ids.shape)
    dropped = mori_ids.flag_past_last(ids, world * num_local, DeviceStatus(1, torch.device("cpu")))
    sent, sent_weights = mori_ids.asyncll_routing(ids, weights, dropped, world * num_local)
    kept = [[e for e in row if 0 <= e < world * num_local] for row in ids.tolist()]
    expected = [sorted({e // num_local for e in row}) for row in kept]
    assert [sorted(r) for r in _asyncll_destinations(sent, num_local, world)] == expected
    assert _asyncll_destinations(ids.int(), num_local, world)[0] == [0, 1, 2]  # the bug: -1 reached rank 0
    for row in sent.tolist():  # AsyncLL's receiver asserts every id of a row it gets names a rank
        assert all(0 <= int(e / num_local) < world for e in row) or all(e == world * num_local for e in row)
    restored = mori_ids.asyncll_received(sent)
    for t in range(ids.shape[0]):
        if not kept[t]:
            continue
        pairs = sorted(zip(restored[t].tolist(), sent_weights[t].tolist(), strict=True))
        original = zip(ids[t].tolist(), weights[t].tolist(), strict=True)
        want = sorted((e if 0 <= e < world * num_local else -1, w) for e, w in original)
        assert pairs == want, t


# ---------------------------------------------------------------------------------------------
# round trips on gloo ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    mode: Mode
    dispatch: DispatchDtype
    combine: CombineDtype
    hidden: int
    kernel: str  # which MoRI API and kernel the provider must pick
    ep_v2: bool = True  # SGLANG_MORI_EP_V2
    scale_dim: int | None = None  # MORI_FP8_COMBINE_SCALE_DIM
    one_gpu_hosts: bool = False  # every rank a host of its own: the inter-node kernels


CASES = (
    Case(Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 256, "v2"),
    Case(Mode.INTRANODE, DispatchDtype.FP8, CombineDtype.BF16, 512, "v2"),
    Case(Mode.INTRANODE, DispatchDtype.MXFP4, CombineDtype.BF16, 256, "v2"),
    Case(Mode.INTRANODE, DispatchDtype.MXFP8, CombineDtype.BF16, 256, "v2"),
    Case(Mode.INTRANODE, DispatchDtype.MXFP8, CombineDtype.BF16, 256, "IntraNode", ep_v2=False),
    Case(Mode.INTRANODE, DispatchDtype.FP8, CombineDtype.FP8_DIRECT_CAST, 256, "InterNodeV1", one_gpu_hosts=True),
    Case(Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 512, "InterNodeV1", one_gpu_hosts=True),
    Case(Mode.INTRANODE, DispatchDtype.FP8, CombineDtype.FP8_BLOCKWISE, 256, "IntraNode"),  # 56 blocks of 5
    Case(Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE_NATIVE, 7168, "IntraNode"),  # of 128
    Case(Mode.INTRANODE, DispatchDtype.MXFP8, CombineDtype.FP8_DIRECT_CAST, 256, "IntraNode"),
    Case(Mode.INTRANODE, DispatchDtype.MXFP4, CombineDtype.FP4_BLOCKWISE, 256, "IntraNode", scale_dim=32),  # gfx950
    Case(Mode.LOW_LATENCY, DispatchDtype.FP8, CombineDtype.FP8_DIRECT_CAST, 256, "AsyncLL"),
    Case(Mode.LOW_LATENCY, DispatchDtype.MXFP4, CombineDtype.BF16, 256, "AsyncLL"),
    Case(Mode.LOW_LATENCY, DispatchDtype.BF16, CombineDtype.FP8_BLOCKWISE, 384, "AsyncLL", scale_dim=3),
    Case(Mode.SPLIT, DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE_NATIVE, 256, "AsyncLL"),
    Case(Mode.INTRANODE, DispatchDtype.FP8, CombineDtype.BF16, 2880, "v2"),  # a partial last fp8 group
    Case(Mode.LOW_LATENCY, DispatchDtype.MXFP8, CombineDtype.FP8_BLOCKWISE, 2880, "AsyncLL"),  # blocks of 52
)
ARCHES = ("gfx942", "gfx950")


def _rows(out, n: int) -> list[tuple]:
    """Received rows as sortable tuples: token and scale bytes, then the (id, weight) pairs (AsyncLL
    may move a token's first kept slot to the front)."""
    scales = out.recv_scales()
    rows = []
    for j in range(n):
        scale = bytes(scales[j].contiguous().numpy()) if scales is not None else b""
        pairs = sorted(zip(out.topk_ids[j].tolist(), out.topk_weights[j].float().tolist(), strict=True))
        rows.append((bytes(out.tokens[j].contiguous().view(torch.uint8).numpy()), scale, tuple(pairs)))
    return sorted(rows)


def _expected_mori_blockwise(
    y: torch.Tensor, ids: torch.Tensor, num_local: int, fp8: torch.dtype, scale_dim: int, fp4: bool
) -> torch.Tensor:
    """MoRI's blockwise combine of expert outputs ``y`` (one row per source token, the same on every
    rank it went to): each distinct destination sends back MoRI's quantized row, added in order."""
    from mori import _numerics

    if fp4:
        q, scales = _numerics.quantize_fp4_blockwise(y, scale_dim)
    else:
        q, scales = _numerics.quantize_blockwise(y, fp8, scale_dim)
    acc = torch.zeros(y.shape)
    copies = torch.tensor([len({int(e) // num_local for e in row if e >= 0}) for row in ids.tolist()])
    for step in range(int(copies.max()) if copies.numel() else 0):
        stepped = _numerics.accumulate(acc, q, scales, y.shape[1])
        acc = torch.where((copies > step)[:, None], stepped, acc)
    return acc.to(torch.bfloat16)


def _round_trip_worker(rank: int, world: int, seed: int, arch: str) -> None:
    sys.path.insert(0, FAKE_MORI)
    os.environ["FAKE_MORI_ARCH"] = arch
    try:
        for i, case in enumerate(CASES):
            _round_trip(rank, world, seed + 1000 * i, arch, case)
        _ids_past_the_last_expert(rank, world)
        _a_dispatch_before_the_last_combine(rank, world)
        _expert_outputs_shorter_than_the_received_rows(rank, world)
        _a_capped_receive(rank, world)
    finally:
        finalize_shmem()


def _case_env(case: Case) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    providers.host_name = lambda: f"host{rank}" if case.one_gpu_hosts else "host"
    # Buffers SGLang would run on InterNodeV1LL: the provider still runs InterNodeV1.
    os.environ["SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD"] = str(MAX_TOKENS)
    os.environ["SGLANG_MORI_EP_V2"] = "1" if case.ep_v2 else "0"
    if case.scale_dim is None:
        os.environ.pop("MORI_FP8_COMBINE_SCALE_DIM", None)
    else:
        os.environ["MORI_FP8_COMBINE_SCALE_DIM"] = str(case.scale_dim)


def _round_trip(rank: int, world: int, seed: int, arch: str, case: Case) -> None:
    import mori
    from mori import _numerics

    _case_env(case)
    fp8 = _numerics.FP8_BY_ARCH[arch]
    cfg = EpConfig(
        world,
        rank,
        case.hidden,
        EXPERTS,
        TOPK,
        max_tokens_per_rank=MAX_TOKENS,
        mode=case.mode,
        dispatch_dtype=case.dispatch,
        combine_dtype=case.combine,
        fp8_dtype=fp8,
    )
    if case.combine is CombineDtype.FP4_BLOCKWISE and arch != "gfx950":
        with pytest.raises(ValueError, match="requires a gfx950 GPU"):  # MoRI's own check
            EpDispatchCombineOp(replace(cfg, provider="mori"), device="cpu")
        return
    reference_combine = CombineDtype.BF16 if case.combine is not CombineDtype.FP8_DIRECT_CAST else case.combine
    ops = {
        "torch": EpDispatchCombineOp(replace(cfg, provider="torch", combine_dtype=reference_combine), device="cpu"),
        "mori": EpDispatchCombineOp(replace(cfg, provider="mori"), device="cpu"),
    }
    provider = ops["mori"].provider
    api = mori.ops.dispatch_combine_v2.EpDispatchCombineOp if case.kernel == "v2" else mori.ops.EpDispatchCombineOp
    assert isinstance(provider.op, api) and provider.kernel == case.kernel, (case, provider.kernel)
    gen = generator(seed, rank)
    results = {}
    first_tokens = None
    for step in range(2):  # the second step overwrites the first's buffers
        n = (MAX_TOKENS, 2, 0)[(rank + step) % 3]
        x = (torch.randn(n, case.hidden, generator=gen) * 3).to(torch.bfloat16)
        ids = make_topk_ids("dropped" if step else "random", n, EXPERTS, TOPK, world, gen)
        weights = torch.rand(n, TOPK, generator=gen)
        for name, op in ops.items():
            op.dispatch_send(x, weights, None, ids)
            out = op.dispatch_recv()
            received = out.num_recv_host()
            scales = None
            if out.scales is not None:
                padded = out.scales.as_strided((received, out.scale_stride), (out.scale_stride, 1))
                assert out.scale_stride % 128 == 0 and not padded[:, op.scale_bytes :].any(), name
                scales = out.recv_scales(torch.float32 if case.dispatch is DispatchDtype.FP8 else torch.uint8)
                scales = scales[:received]
            y = formats.dequantize_dispatch(out.tokens[:received], scales, case.dispatch, case.hidden) * 1.5
            rows = _rows(out, received)
            if name == "mori":  # MoRI hands out its own buffers again: the same memory every step
                first_tokens = out.tokens.data_ptr() if first_tokens is None else first_tokens
                assert out.tokens.data_ptr() == first_tokens
            op.combine_send(y.to(torch.bfloat16), out.handle)
            results[name] = (rows, op.combine_recv().clone())
        assert results["mori"][0] == results["torch"][0], f"{case} step {step}: received rows differ"
        got, ref = results["mori"][1], results["torch"][1]
        assert got.shape == (n, case.hidden) and got.dtype == torch.bfloat16
        if case.combine in (CombineDtype.BF16, CombineDtype.FP8_DIRECT_CAST):
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"{case} step {step}: combine differs"
        else:
            y_src = formats.dequantize_dispatch(
                *formats.quantize_dispatch(x, case.dispatch, fp8), case.dispatch, case.hidden
            )
            y_src = (y_src * 1.5).to(torch.bfloat16)
            dim = case.scale_dim or _numerics.DEFAULT_SCALE_DIM
            fp4 = case.combine is CombineDtype.FP4_BLOCKWISE
            want = _expected_mori_blockwise(y_src, ids, EXPERTS // world, fp8, dim, fp4)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{case} step {step}: combine differs"
    split = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]
    assert provider.op.calls == (split if case.kernel == "AsyncLL" else ["dispatch", "combine"]) * 2


def _op_checking_ids_on_device(cfg: EpConfig) -> EpDispatchCombineOp:
    """A CPU op whose MoRI provider declares, as on a GPU, that it range-checks expert ids itself (the
    op decides when it is built whether to check them on the host)."""
    declared = MoriProvider.capabilities
    MoriProvider.capabilities = replace(declared, id_checks_on_device=frozenset({"cpu", "cuda"}))
    try:
        op = EpDispatchCombineOp(cfg, device="cpu")
    finally:
        MoriProvider.capabilities = declared
    assert isinstance(op.provider, MoriProvider)
    return op


def _ids_past_the_last_expert(rank: int, world: int) -> None:
    """On a GPU the op leaves ids to the provider: ids past the last expert reach no rank (AsyncLL's
    receiver would assert on them), -1 reaches none either, and the step raises."""
    _case_env(Case(Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 256, "v2"))
    local = EXPERTS // world
    for mode in (Mode.LOW_LATENCY, Mode.INTRANODE):
        cfg = EpConfig(world, rank, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, mode=mode, provider="mori")
        op = _op_checking_ids_on_device(cfg)
        own = rank * local
        ids = torch.tensor([[EXPERTS + rank, 1, -1], [EXPERTS + 5, -1, -1], [own, own + 1, EXPERTS]])
        op.dispatch_send(torch.randn(3, 256).to(torch.bfloat16), torch.rand(3, TOPK), None, ids)
        with pytest.raises(InputError, match=f"topk_ids held expert {EXPERTS + 5}"):
            op.dispatch_recv()  # on CPU the flags are read at once
        received_ids = op.provider._dispatched[3][: int(op.provider._dispatched[4][0])]
        if mode is Mode.LOW_LATENCY:
            received_ids = mori_ids.asyncll_received(received_ids)
        got = sorted(tuple(sorted(row)) for row in received_ids.tolist())
        # Token 0 of every rank reaches rank 0 (expert 1), token 2 its own rank, token 1 no rank.
        want = [(-1, -1, 1)] * world if rank == 0 else []
        want.append((-1, own, own + 1))
        assert got == sorted(want), (mode, got)


def _a_dispatch_before_the_last_combine(rank: int, world: int) -> None:
    """IntraNode and InterNodeV1 add each dispatch's rows to a receive count that only their combine
    clears: a second dispatch before the combine is refused by name, and the first still combines
    right. AsyncLL clears its count at each dispatch, so the op takes the sequence there."""
    bf16 = (Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 256)
    for case in (Case(*bf16, "IntraNode", ep_v2=False), Case(*bf16, "InterNodeV1", one_gpu_hosts=True)):
        _case_env(case)
        cfg = EpConfig(world, rank, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS)
        ops = [EpDispatchCombineOp(replace(cfg, provider=p), device="cpu") for p in ("mori", "torch")]
        assert ops[0].provider.kernel == case.kernel
        gen = generator(rank)
        x, weights = torch.randn(2, 256, generator=gen).to(torch.bfloat16), torch.rand(2, TOPK, generator=gen)
        ids = make_topk_ids("random", 2, EXPERTS, TOPK, world, gen)
        combined = []
        for op in ops:
            out = op.dispatch(x, weights, None, ids)
            if op is ops[0]:
                with pytest.raises(RuntimeError, match=f"MoRI's {case.kernel} kernel adds each dispatch's rows"):
                    op.dispatch_send(x, weights, None, ids)
            combined.append(op.combine(out.tokens[: out.num_recv_host()].clone(), out.handle))
        assert torch.equal(combined[0].view(torch.int16), combined[1].view(torch.int16)), case


def _a_capped_receive(rank: int, world: int) -> None:
    """Under SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS, AsyncLL and InterNodeV1 receive into fewer rows than
    every rank may send: the op reports MoRI's own count (each rank's share rounded up) as its
    receive capacity, and a batch within it round-trips as the torch provider's does."""
    bf16 = (Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 256)
    for mode, case in (
        (Mode.LOW_LATENCY, Case(Mode.LOW_LATENCY, *bf16[1:], "AsyncLL")),
        (Mode.INTRANODE, Case(*bf16, "InterNodeV1", one_gpu_hosts=True)),
    ):
        _case_env(case)
        # InterNodeV1's buffer holds whole chunks of 64 tokens per rank: a share past MAX_TOKENS stays.
        whole = 64 if case.kernel == "InterNodeV1" else MAX_TOKENS
        for cap, per_rank in (
            (world * 2 - 1, 2),
            (world * 2, 2),
            (world * MAX_TOKENS + 5, min(-(-5 // world) + MAX_TOKENS, whole)),
        ):
            os.environ["SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS"] = str(cap)
            cfg = EpConfig(world, rank, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, mode=mode)
            ops = [EpDispatchCombineOp(replace(cfg, provider=p), device="cpu") for p in ("mori", "torch")]
            assert ops[0].provider.kernel == case.kernel
            assert ops[0].max_recv_tokens == ops[0].provider.op.max_num_tokens_to_recv() == world * per_rank
            assert ops[1].max_recv_tokens == world * MAX_TOKENS
            gen = generator(rank, cap)
            x, weights = torch.randn(2, 256, generator=gen).to(torch.bfloat16), torch.rand(2, TOPK, generator=gen)
            ids = make_topk_ids("random", 2, EXPERTS, TOPK, world, gen)
            combined = []
            for op in ops:
                op.dispatch_send(x, weights, None, ids)
                out = op.dispatch_recv()
                assert out.num_recv_host() <= op.max_recv_tokens
                if op is ops[0]:
                    assert out.tokens.shape[0] == op.max_recv_tokens
                op.combine_send(out.tokens[: out.num_recv_host()].clone() * 2, out.handle)
                combined.append(op.combine_recv())
            assert torch.equal(combined[0].view(torch.int16), combined[1].view(torch.int16)), (case, cap)
    del os.environ["SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS"]


def _expert_outputs_shorter_than_the_received_rows(rank: int, world: int) -> None:
    """MoRI's combine takes no row count and reads every received row, past the end of short expert
    outputs: the provider compares the rows on the device and raises after the combine (at once on
    CPU), on v1 and v2 alike; the next step runs clean."""
    bf16 = (Mode.INTRANODE, DispatchDtype.BF16, CombineDtype.BF16, 256)
    for case in (Case(*bf16, "v2"), Case(*bf16, "IntraNode", ep_v2=False)):
        _case_env(case)
        cfg = EpConfig(world, rank, 256, EXPERTS, TOPK, max_tokens_per_rank=MAX_TOKENS, provider="mori")
        op = EpDispatchCombineOp(cfg, device="cpu")
        assert op.provider.kernel == case.kernel
        ids = torch.full((2, TOPK), -1, dtype=torch.int64)
        ids[:, 0] = torch.arange(world).repeat(2)[rank : rank + 2] * (EXPERTS // world)  # two ranks, one row each
        x, weights = torch.randn(2, 256).to(torch.bfloat16), torch.rand(2, TOPK)
        for short in (True, False):
            out = op.dispatch(x, weights, None, ids)
            received = out.num_recv_host()
            assert received >= 1
            y = out.tokens[: received - 1 if short else received].clone()
            if short:
                with pytest.raises(
                    InputError, match=f"expert outputs had fewer rows, the dispatch received {received}"
                ):
                    op.combine(y, out.handle)
            else:
                assert op.combine(y, out.handle).shape == (2, 256)
                assert out.num_recv_host() == 0  # MoRI's combine clears its count (v1 and EP v2)


@pytest.mark.parametrize(("world", "arch"), [(2, "gfx942"), (4, "gfx950")])
def test_round_trips_through_mori_equal_the_reference(world: int, arch: str, tmp_path: Path, seed: int) -> None:
    run_gloo(world, _round_trip_worker, (seed, arch), tmp_path, timeout_s=480)
