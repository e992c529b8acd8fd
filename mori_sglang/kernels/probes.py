"""Kernels with the memory traffic of a transport phase and none of its arithmetic: they measure what a
phase's access pattern allows on a device, the ceiling its "% of the copy roofline" is read against,
and what a step of plain copies of its phases' bytes costs;
kernels that move (almost) nothing, for the cost of a launch on the host and on the device; and a
dispatch send without rows, for what its synchronization adds to a kernel."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mori_sglang.kernels.transport import _after_previous_kernel, _publish_dispatch, _take_ticket


@triton.jit
def fan_out_kernel(x_ptr, out_ptr, out_stride, num_tokens, D: tl.constexpr, HIDDEN: tl.constexpr, TILE: tl.constexpr):
    """The dispatch send's traffic: read each 16-bit element once and write one byte of it (its high
    byte, as an fp8 cast writes one byte per bf16 element) into D destination rows. A work item is one
    tile of one token, as in the send."""
    TILES: tl.constexpr = HIDDEN // TILE
    dests = tl.arange(0, D)
    for item in range(tl.program_id(0), num_tokens * TILES, tl.num_programs(0)):
        n = item // TILES
        cols = (item % TILES) * TILE + tl.arange(0, TILE)
        high = (tl.load(x_ptr + n * HIDDEN + cols) >> 8).to(tl.uint8)
        rows = out_ptr + dests[:, None] * out_stride + n * HIDDEN + cols[None, :]
        tl.store(rows, tl.broadcast_to(high[None, :], (D, TILE)))


@triton.jit
def copy_probe_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A phase's bytes and nothing else: each program copies one block of 32-bit words, after the kernel
    before it where launched under programmatic launch, as the transport's kernels start."""
    _after_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_words
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def launch_probe_kernel(out_ptr):
    """Nothing to move: one program stores one word, so a launch costs its launcher and nothing else."""
    tl.store(out_ptr, 1)


@triton.jit
def launch_probe_wide_kernel(
    out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19
):
    """The launch probe with the dispatch send's count of runtime arguments (21): a launcher's cost per
    argument shows against ``launch_probe_kernel``."""
    low = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9
    high = a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17 + a18 + a19
    tl.store(out_ptr, low + high)


@triton.jit
def idle_probe_kernel(out_ptr, store_in: int, PDL: tl.constexpr):
    """A kernel's fixed device cost: under programmatic dependent launch each program waits for the
    kernel before it, as the transport's do, and no program moves anything (``store_in`` names no
    program, a runtime value that keeps the compiler from dropping the store)."""
    if PDL:
        gdc_wait()
    if tl.program_id(0) == store_in:
        tl.store(out_ptr, 1)


@triton.jit
def send_end_probe_kernel(
    tickets_ptr,
    round_ptr,
    peer_bases,
    send_counts_ptr,
    counts_offset,
    arrivals_offset,
    rank,
    W: tl.constexpr,
    WP: tl.constexpr,
    PDL: tl.constexpr,
):
    """A dispatch send without rows: each program takes its ticket and the last one publishes the
    counts and the arrival, with the send's own code. Its device time less an idle kernel's is what
    a send's synchronization adds to the kernel, whatever it moves."""
    _after_previous_kernel(PDL)
    if _take_ticket(tickets_ptr, 1, tl.num_programs(0)):
        _publish_dispatch(round_ptr, peer_bases, send_counts_ptr, counts_offset, arrivals_offset, rank, W, WP)
