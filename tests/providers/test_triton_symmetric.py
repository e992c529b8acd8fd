"""The triton provider over real PyTorch symmetric memory and an NCCL group, against the torch
provider over the same group: identical received rows and combined outputs.

Every GPU in the machine takes part (one process each); with one GPU the group has one rank, which
still exercises the symmetric allocation, the peer-pointer table and the signal/wait protocol.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("symmetric memory needs CUDA GPUs", allow_module_level=True)

import torch.distributed as dist
import torch.multiprocessing as mp

from mori_sglang.config import CombineDtype, DispatchDtype, EpConfig, Mode
from mori_sglang.op import EpDispatchCombineOp

HIDDEN, EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 7168, 32, 8, 96


def _round(op: EpDispatchCombineOp, x, weights, ids, low_latency: bool):
    if low_latency:
        op.dispatch_send(x, weights, None, ids)
        out = op.dispatch_recv()
    else:
        out = op.dispatch(x, weights, None, ids)
    n = out.num_recv_host()
    y = (out.tokens[:n].float() * 0.5).to(torch.bfloat16)
    y = torch.cat([y, torch.zeros(op.config.max_recv_tokens - n, HIDDEN, dtype=y.dtype, device=y.device)])
    if op.config.combine_mode is Mode.LOW_LATENCY:
        op.combine_send(y, out.handle)
        combined = op.combine_recv()
    else:
        combined = op.combine(y, out.handle)
    return out, n, combined


def _worker(rank: int, world: int, init_file: str, seed: int, errors) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        gen = torch.Generator().manual_seed(seed + rank)
        experts = world * EXPERTS_PER_RANK
        for mode in (Mode.INTRANODE, Mode.LOW_LATENCY, Mode.SPLIT):
            for combine in (CombineDtype.BF16, CombineDtype.FP8_BLOCKWISE, CombineDtype.FP8_DIRECT_CAST):
                ops = {
                    p: EpDispatchCombineOp(
                        EpConfig(
                            world,
                            rank,
                            HIDDEN,
                            experts,
                            TOPK,
                            max_tokens_per_rank=MAX_TOKENS,
                            dispatch_dtype=DispatchDtype.BF16,
                            combine_dtype=combine,
                            mode=mode,
                            provider=p,
                        )
                    )
                    for p in ("torch", "triton")
                }
                for _ in range(3):
                    n = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=gen))
                    x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
                    ids = torch.rand(n, experts, generator=gen).topk(TOPK, dim=1).indices.int().cuda()
                    weights = torch.rand(n, TOPK, generator=gen).cuda()
                    ref = _round(ops["torch"], x, weights, ids, mode is Mode.LOW_LATENCY)
                    got = _round(ops["triton"], x, weights, ids, mode is Mode.LOW_LATENCY)
                    assert ref[1] == got[1], (mode, combine, ref[1], got[1])
                    m = got[1]
                    assert torch.equal(ref[0].tokens[:m], got[0].tokens[:m]), (mode, combine)
                    assert torch.equal(ref[0].topk_ids[:m], got[0].topk_ids[:m]), (mode, combine)
                    assert torch.equal(ref[2].view(torch.int16), got[2].view(torch.int16)), (mode, combine)
                ops["triton"].synchronize()
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}: {exc!r}")
        raise


def test_symmetric_memory_matches_nccl_reference(tmp_path, seed: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world = torch.cuda.device_count()
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), seed, errors), nprocs=world)
    assert errors.empty()
