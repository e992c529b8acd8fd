"""Triton kernels that move dispatch and combine rows between ranks' arenas.

Every rank owns one arena (symmetric memory on GPUs of a node, plain buffers in a loopback world):

    [dispatch rows: W * max_tokens x dispatch row] [combine rows: W * max_tokens x combine stride]
    [sync: dispatch arrivals[W] | combine arrivals[W] | dispatch counts[W]]   (int64)

A send kernel writes copy p of rank r into slot ``(r * max_tokens + p)`` of the destination's region.
Its programs count their finished work on a ticket counter (acquire-release, GPU scope); the one that
completes it adds 1 to each destination's arrival counter for r (release, system scope), so every row
precedes the signal without a kernel of its own, and advances the sender's own round for the receive
that follows it in the stream. Arrival counters only grow: a receive kernel waits until all senders'
counters reach its round (acquire), and the first of its programs to see that opens a local gate for
the others. So no buffer is ever reset, no wait kernel runs ahead of the copy, a receive ends without
any bookkeeping atomics, and a CUDA graph can replay everything. Per round kind (dispatch, combine)
three local words live on the device: the round, the gate, and whether a receive gave up on the
round. A receive gives up once it has waited ``timeout_ns`` nanoseconds of wall-clock time (the GPU's
global timer, or the host's clock in Triton's interpreter) and records ``1 + peer`` in ``status`` for
the host to raise.

On NVIDIA GPUs from Hopper on, every kernel is launched under programmatic dependent launch: it may
start while the kernel before it in the stream is still ending, and each of its programs waits for
that kernel (its end and its writes) before touching memory, so a kernel's end still implies the end
of everything before it. The launch and the programs' start overlap the kernel before instead of
following it. A kernel lets the one after it launch as soon as its own wait is over where the provider
launches it with PDL_EARLY (``KernelTuning.early_launch_max_programs``: grids of at most that many
programs).
``TRTLLM_ENABLE_PDL=0`` turns programmatic launch off, as it does for FlashInfer's kernels in SGLang.

The routing (each copy's destination slot) runs inside the dispatch send, so that a send is one
launch whatever the batch: the smallest batches route item by item, each counting the earlier tokens'
destinations itself (``SELF_ROUTING``, ``_self_route``), and larger ones in tasks that number a block
of tokens for one destination, run by programs of their own (``_route_tasks``; docs/performance.md).
"""

from __future__ import annotations

import os
import time

import triton
import triton.language as tl
from triton.language.extra import cuda as cuda_extra
from triton.language.extra import hip as hip_extra
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mori_sglang import wire_formats

# Every row in an arena starts on this many bytes (the host checks it): lets loads and stores through
# peer pointers read from memory be vectorized.
ROW_ALIGN = tl.constexpr(16)

# The formats' codes (wire_formats.py), as constexprs the kernels compare FORMAT and QUANT with.
COMBINE_BF16 = tl.constexpr(wire_formats.COMBINE_BF16)
COMBINE_FP8_DIRECT = tl.constexpr(wire_formats.COMBINE_FP8_DIRECT)
COMBINE_FP8_BLOCKWISE = tl.constexpr(wire_formats.COMBINE_FP8_BLOCKWISE)
COMBINE_FP8_BLOCKWISE_NATIVE = tl.constexpr(wire_formats.COMBINE_FP8_BLOCKWISE_NATIVE)
QUANT_NONE = tl.constexpr(wire_formats.QUANT_NONE)
QUANT_FP8 = tl.constexpr(wire_formats.QUANT_FP8)
QUANT_MXFP8 = tl.constexpr(wire_formats.QUANT_MXFP8)
QUANT_MXFP4 = tl.constexpr(wire_formats.QUANT_MXFP4)


@triton.jit
def _take_ticket(tickets_ptr, done, total):
    """Add this program's ``done`` work units to the kernel's counter; True in the program that brings
    it to ``total`` (program 0 when there is no work), which resets the counter for the next launch
    (the next kernel of the stream touches memory only after this one has ended). Programs without
    work leave the counter alone. The acquire-release (GPU scope: every program runs on this GPU)
    orders every store of the programs, peer rows included, before the last one's next operations; a
    release at system scope from that program then carries them all to the peer (causality is
    transitive across scopes, the chain DeepEP's low-latency dispatch uses between its sending warps
    and its signalling thread)."""
    tl.debug_barrier()  # all threads' stores of this program precede its ticket
    last = (total == 0) & (tl.program_id(0) == 0)
    if done > 0:
        before = tl.atomic_add(tickets_ptr, done, sem="acq_rel", scope="gpu")
        last = before + done == total
    if last:
        tl.store(tickets_ptr, 0)
    return last


# The PDL constexpr of every kernel: launched without programmatic dependent launch, under it, or under
# it and letting the kernel after it launch once this one's wait is over.
PDL_OFF = 0
PDL_WAIT = 1
PDL_EARLY = 2


@triton.jit
def _after_previous_kernel(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before this one in the stream has
    finished and its writes are visible. Every program calls it before its first memory access. With
    PDL_EARLY the kernel after it may then launch: it waits in turn for this one's end before touching
    memory, and releasing it only after this wait keeps at most two grids of the stream in flight."""
    if PDL:
        gdc_wait()
    if PDL == 2:  # PDL_EARLY (a plain int: the kernels read only constexpr globals)
        gdc_launch_dependents()


@triton.jit
def _in_arena(arena_ptr, offset, dtype: tl.constexpr):
    """A ``dtype`` pointer to byte ``offset`` of this rank's arena, whose address ``arena_ptr`` comes as
    an int argument: widened to 64 bits first, as Triton types an int that fits 32 bits as i32 (a host
    address can), and only a 64-bit int converts to a pointer."""
    return (arena_ptr.to(tl.int64) + offset).to(tl.pointer_type(dtype))


@triton.jit
def _peer_words(peer_bases, offset, rank, W: tl.constexpr, WP: tl.constexpr):
    """This rank's int64 word of the sync array at byte ``offset`` in every rank's arena, and which of
    the WP lanes are ranks."""
    w_offs = tl.arange(0, WP)
    bases = tl.load(peer_bases + w_offs, mask=w_offs < W, other=0)
    return (bases + offset).to(tl.pointer_type(tl.int64)) + rank, w_offs < W


@triton.jit
def _signal_arrival(peer_bases, arrivals_offset, rank, W: tl.constexpr, WP: tl.constexpr):
    """Add 1 to this rank's arrival counter on every destination (release, system scope), all
    destinations at once: called by the last program of a send, after every program's rows."""
    tl.debug_barrier()
    arrivals, ranks = _peer_words(peer_bases, arrivals_offset, rank, W, WP)
    tl.atomic_add(arrivals, 1, mask=ranks, sem="release", scope="sys")


@triton.jit
def _late_senders(arrivals, senders, target):
    """Poll every sender's arrival counter at once (acquire, system scope): which are behind ``target``."""
    seen = tl.atomic_add(arrivals, 0, mask=senders, sem="acquire", scope="sys")
    return senders & (seen < target)


@triton.jit
def _advance_round(round_ptr):
    """Called by the last program of a send: this kind's receive waits for the next round, and has not
    given up on it. Nothing else touches the words while a send runs (the receive before it has
    finished, the one after it touches memory only after this kernel has ended), and the end of the
    kernel publishes them; an atomic add needs no read of the round first."""
    tl.atomic_add(round_ptr, 1, sem="relaxed", scope="gpu")
    tl.store(round_ptr + 2, 0)


@triton.jit
def _publish_dispatch(
    round_ptr, peer_bases, send_counts_ptr, counts_offset, arrivals_offset, rank, W: tl.constexpr, WP: tl.constexpr
):
    """The end of a dispatch send, in the program that took its last ticket: the round advanced, this
    rank's counts stored into every destination's arena, then its arrival signalled (after every row)."""
    _advance_round(round_ptr)
    counts, ranks = _peer_words(peer_bases, counts_offset, rank, W, WP)
    tl.store(counts, tl.load(send_counts_ptr + tl.arange(0, WP), mask=ranks), mask=ranks)
    _signal_arrival(peer_bases, arrivals_offset, rank, W, WP)


# Which clock a receive's deadline reads (the CLOCK constexpr of the receive kernels).
CLOCK_HOST = 0  # Triton's interpreter: the host's monotonic clock, in ns
CLOCK_CUDA = 1  # NVIDIA: %globaltimer, in ns
CLOCK_HIP = 2  # AMD: s_memrealtime, a 100 MHz counter
HIP_NS_PER_TICK = tl.constexpr(10)


if os.environ.get("TRITON_INTERPRET", "0") == "1":

    @triton.jit
    def _host_clock_ns():
        """The host's clock, read by the interpreter as it runs the kernel's Python."""
        return tl.full((), time.monotonic_ns(), tl.int64)

else:

    @triton.jit
    def _host_clock_ns():
        """Compiled kernels read their GPU's clock (the provider picks CLOCK_HOST only when interpreting);
        a compiled kernel cannot call the host."""
        return tl.full((), 0, tl.int64)


@triton.jit
def _clock_ns(CLOCK: tl.constexpr):
    """Nanoseconds from a fixed origin, read by the program itself: the deadline is wall-clock time
    wherever the kernel runs, however fast or slow a poll is."""
    if CLOCK == 0:
        now = _host_clock_ns()
    elif CLOCK == 1:
        now = cuda_extra.globaltimer()
    else:
        now = hip_extra.memrealtime() * HIP_NS_PER_TICK
    return now


@triton.jit
def _await_round(
    arena_ptr,
    arrivals_offset,
    round_ptr,
    status_ptr,
    timeout_ns,
    W: tl.constexpr,
    WP: tl.constexpr,
    CLOCK: tl.constexpr,
):
    """Wait until every sender's arrival counter reaches this rank's round ``round_ptr[0]``.
    ``round_ptr[1]`` is a local gate: the round whose senders a program of this rank has already seen
    arrive (acquire, system scope), which it then publishes (release, GPU scope). A program that finds
    the gate open needs one atomic instead of one per sender, and the causality chain sender -> first
    program -> this program orders the rows before its reads. Otherwise it polls all senders at once and
    gives up after ``timeout_ns`` of wall-clock time, or at once when another program gave up on this
    round (``round_ptr[2]``), recording ``1 + the first late sender`` in ``status[0]`` for the host."""
    target = tl.load(round_ptr)
    gate = round_ptr + 1
    if tl.atomic_add(gate, 0, sem="acquire", scope="gpu") < target:
        w_offs = tl.arange(0, WP)
        senders = w_offs < W
        arrivals = _in_arena(arena_ptr, arrivals_offset, tl.int64) + w_offs
        late = _late_senders(arrivals, senders, target)
        deadline = _clock_ns(CLOCK) + timeout_ns  # SGLANG_MORI_PEER_TIMEOUT_S's cap keeps it from wrapping
        gave_up_ptr = round_ptr + 2
        # Every warp of the program leaves the loop in the same iteration, or they would meet different
        # barriers (those of ``_late_senders``' broadcast): the loop reads only values a scalar atomic
        # hands every warp alike. A clock is read by each thread on its own and may tick between two
        # warps' reads, so the deadline reaches the loop through the scalar word too, set from the one
        # thread that makes a scalar atomic (and set only while senders are late, as it tells the
        # rank's other programs to give up). One atomic per poll both sets and reads the word: it returns
        # the word before this poll's update, so a program that sets it leaves after one more poll.
        gave_up = tl.atomic_add(gave_up_ptr, 0, sem="relaxed", scope="gpu")
        while (tl.max(late.to(tl.int32), 0) > 0) & (gave_up == 0):
            late = _late_senders(arrivals, senders, target)
            expired = (_clock_ns(CLOCK) >= deadline) & (tl.max(late.to(tl.int32), 0) > 0)
            gave_up = tl.atomic_max(gave_up_ptr, expired.to(tl.int64), sem="relaxed", scope="gpu")
        if tl.max(late.to(tl.int32), 0) > 0:
            tl.atomic_max(status_ptr, tl.min(tl.where(late, w_offs, WP), 0) + 1)
            tl.atomic_xchg(gave_up_ptr, 1)
        else:
            tl.debug_barrier()  # every lane's acquire of the arrivals precedes the gate's release
            tl.atomic_max(gate, target, sem="release", scope="gpu")
    tl.debug_barrier()  # every thread of the program reads the rows after the acquire


@triton.jit
def _copy_words(dst, src, n_words, BLOCK: tl.constexpr):
    for start in range(0, n_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _row_start(row, ROW_ELEMENTS: tl.constexpr):
    """Where row ``row`` of a dense ``[rows, ROW_ELEMENTS]`` tensor starts, in elements, as int64: a
    batch's elements pass int32 (at hidden 7168 from 299,594 tokens) long before its rows do."""
    return row.to(tl.int64) * ROW_ELEMENTS


@triton.jit
def _source_of_row(counts, j, WP: tl.constexpr):
    """Row j of the compact receive order -> (source rank, position within that source)."""
    ends = tl.cumsum(counts, 0)
    src = tl.sum((ends <= j).to(tl.int64), 0)
    start = tl.sum(tl.where(tl.arange(0, WP) == src, ends - counts, 0), 0)
    return src, j - start


@triton.jit
def _e8m0(amax, EMAX: tl.constexpr):
    """OCP MX shared exponent floor(log2 amax) - EMAX, clamped to e8m0, and the inverse of its power of
    two. The exponent is at most 255 - 127 - EMAX <= 126 (so only e8m0's lower bound needs a clamp),
    and the inverse is a normal f32, exactly; f32 arithmetic keeps subnormals, so x * inverse rounds
    the same real number as the reference's x / 2^exponent: the same bits, for one multiplication
    instead of a division per element."""
    tl.static_assert(EMAX >= 2, "the inverse of 2^exponent is a normal f32 only for EMAX >= 2")
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.where(amax > 0, biased - 127 - EMAX, -127)
    exponent = tl.maximum(exponent, -127)
    return exponent, ((127 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(v):
    """f32 -> e2m1 code (0..15): round to nearest even among 0, .5, 1, 1.5, 2, 3, 4, 6; saturate at 6.
    From 1 on, e2m1 is a float with one mantissa bit: the f32 bits rounded to nearest even at that bit
    give its exponent and mantissa, and so its code, at once. Below 1 the values are 0, .5 and 1 (the
    ties .25 and .75 go to 0 and 1)."""
    mag = tl.minimum(tl.abs(v), 6.0)
    bits = mag.to(tl.int32, bitcast=True)
    # (2 * biased exponent + mantissa bit) after rounding; 1.0 (biased exponent 127) is code 2.
    rounded = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22
    below_one = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32)
    code = tl.where(mag >= 1.0, rounded - 252, below_one)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def _finite_amax(x, axis: tl.constexpr):
    """Largest magnitude along ``axis`` with NaN counted as 0, infinity kept (formats._finite_amax)."""
    return tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=axis)


@triton.jit
def _saturate_fp8(v, FP8_MAX: tl.constexpr, FP8: tl.constexpr):
    """Saturating cast to the fp8 flavour, every NaN made the canonical one (formats.saturating_fp8_cast)."""
    v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(v != v, float("nan"), v).to(FP8)


@triton.jit
def _row_pointers(addresses, dtype: tl.constexpr):
    """Byte addresses of arena rows -> typed pointers the compiler knows are ROW_ALIGN-aligned."""
    return tl.multiple_of(addresses.to(tl.pointer_type(dtype)), ROW_ALIGN)


@triton.jit
def _store_all(rows, start, offsets, values, mask, present, T: tl.constexpr, KP: tl.constexpr):
    """Store one tile into every present destination row: ``offsets`` count elements of the values'
    type from byte ``start`` of each row."""
    ptrs = _row_pointers(rows + start, values.dtype)[:, None] + offsets[None, :]
    tl.store(ptrs, tl.broadcast_to(values[None, :], (KP, T)), mask=present[:, None] & mask[None, :])


@triton.jit
def _destinations(ids, num_experts, num_local_experts):
    """Expert ids as loaded (int32 or int64, -1 in masked-off slots) -> which route somewhere, and the
    rank holding each (0 where an id routes nowhere). 32-bit from here on (an id that routes somewhere
    fits): the routing's registers are the send's too."""
    valid = (ids >= 0) & (ids < num_experts)
    return valid, tl.where(valid, ids, 0).to(tl.int32) // num_local_experts


@triton.jit
def _tokens_to(
    ids_ptr, d, n0, num_tokens, num_experts, num_local_experts, K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr
):
    """For the block of tokens from n0: which go to rank d, through which top-k slot (the first whose
    expert lives on d), and the masks and destinations of every slot."""
    k_offs = tl.arange(0, KP)
    rows = n0 + tl.arange(0, BLOCK_N)
    mask = (rows < num_tokens)[:, None] & (k_offs < K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * K + k_offs[None, :], mask=mask, other=-1)
    valid, dest = _destinations(ids, num_experts, num_local_experts)
    dest = tl.where(valid, dest, -1)
    here = (dest == d) & mask
    first = tl.min(tl.where(here, k_offs[None, :], KP), axis=1)
    goes = (first < KP).to(tl.int32)
    return rows, ids, mask, dest, here, first, goes


@triton.jit
def _block_count(
    ids_ptr, d, b, num_tokens, num_experts, num_local_experts, K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr
):
    """How many tokens of block b go to rank d."""
    _rows, _ids, _mask, _dest, _here, _first, goes = _tokens_to(
        ids_ptr, d, b * BLOCK_N, num_tokens, num_experts, num_local_experts, K, KP, BLOCK_N
    )
    return tl.sum(goes, 0)


@triton.jit
def _write_routes(
    ids_ptr,
    peer_bases,
    slot_of_pair_ptr,
    row_of_pair_ptr,
    send_counts_ptr,
    status_ptr,
    d,
    b,
    before,
    last_block,
    num_tokens,
    num_experts,
    num_local_experts,
    rank,
    max_tokens,
    ROW_BYTES: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Number the tokens of block b that go to rank d, in token order, after the ``before`` tokens of
    the earlier blocks.

    A token goes to d once, through its first top-k slot whose expert lives on d (the owner);
    ``slot_of_pair[n, k]`` gets ``d * max_tokens + position`` for the owner, -1 for the other slots
    that point at d; rank 0's routing also writes -1 for dropped slots (id < 0). Same result as
    routing.plan_dispatch. ``row_of_pair`` gets the byte address of the owner's row in rank d's arena
    (0 for the other slots), so that the send finds its destinations in one load. The last block
    writes ``send_counts[d]``.
       An id past the last expert is dropped too, and rank 0's routing records ``id - (num_experts - 1)``
    (at least 1, and no overflow for any int64 id) in ``status[1]`` so that the host raises without a
    synchronisation on the hot path. Ids are int32 or int64, read as they are: none is truncated."""
    k_offs = tl.arange(0, KP)
    rows, ids, mask, dest, here, first, goes = _tokens_to(
        ids_ptr, d, b * BLOCK_N, num_tokens, num_experts, num_local_experts, K, KP, BLOCK_N
    )
    position = before + tl.cumsum(goes, 0) - goes
    owner = here & (k_offs[None, :] == first[:, None])
    slot = tl.where(owner, d * max_tokens + position[:, None], -1)
    slot_in_arena = (rank * max_tokens + position[:, None]).to(tl.int64)
    row = tl.where(owner, tl.load(peer_bases + d) + slot_in_arena * ROW_BYTES, 0)
    pair = rows[:, None] * K + k_offs[None, :]
    tl.store(slot_of_pair_ptr + pair, slot, mask=here)
    tl.store(row_of_pair_ptr + pair, row, mask=here)
    if d == 0:
        dropped = mask & (dest < 0)
        tl.store(slot_of_pair_ptr + pair, tl.full(slot.shape, -1, tl.int64), mask=dropped)
        tl.store(row_of_pair_ptr + pair, tl.zeros(slot.shape, tl.int64), mask=dropped)
        too_big = tl.max(tl.where(mask & (ids >= num_experts), ids.to(tl.int64) - (num_experts - 1), 0))
        if too_big > 0:
            tl.atomic_max(status_ptr + 1, too_big)
    if last_block:
        tl.store(send_counts_ptr + d, before + tl.sum(goes, 0))


# The routing of a batch too large to route item by item is split into tasks: task ``b * W + d``
# numbers the tokens of block b that go to rank d. The first ``routers`` programs to start (in the order of
# a counter they take at their start, not of their program ids) run the tasks and move no rows; every
# later program moves rows and waits only for tasks of programs that started before it, which never
# wait without bound: the send makes progress however the GPU schedules its programs (in Triton's
# interpreter, one after another). Two int64 words per task hold the send's round (``target``), so
# none is ever reset: ``counts`` (``target << 21 | tokens of the block that go to d``, published before
# the task waits for anything) and ``routed`` (the round whose numbering the task has finished). Waits
# poll with plain loads, which many programs can make at once without serializing on the words as
# atomics would; one acquire per wait then orders the task's stores before the reads that follow it.
# A block's count is at most its tokens (a block spans at most 2**20, the most a rank dispatches), so
# it fits below bit 21, and the round above it stays positive for 2**42 rounds: over ten years of
# 10,000 dispatches a second.
# (At 32 bits the round reached the sign bit after 2**31 rounds, days of serving a deep model, and
# from then on no published count matched, so every task recounted every earlier block.)
TASK_TAG_BITS = 21
TASK_TAG_SHIFT = tl.constexpr(TASK_TAG_BITS)
TASK_COUNT_LIMIT = tl.constexpr(1 << TASK_TAG_BITS)  # a block's count stays below it


@triton.jit
def _count_before(
    ids_ptr,
    counts_ptr,
    d,
    b,
    target,
    num_tokens,
    num_experts,
    num_local_experts,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    COUNT_SPINS: tl.constexpr,
):
    """Tokens of the blocks before b that go to rank d: the counts their tasks published, LANES blocks
    at a time, each chunk polled at most COUNT_SPINS times; a count not published by then is made here
    (a count depends on nothing, so no task ever waits on another without bound)."""
    before = tl.zeros((), dtype=tl.int64)
    for e0 in range(0, b, LANES):
        earlier = e0 + tl.arange(0, LANES)
        lanes = earlier < b
        words = counts_ptr + earlier * W + d
        seen = tl.load(words, mask=lanes, other=0, volatile=True)
        missing = lanes & ((seen >> TASK_TAG_SHIFT) != target)
        spins = 0
        while (tl.max(missing.to(tl.int32), 0) > 0) & (spins < COUNT_SPINS):
            seen = tl.load(words, mask=lanes, other=0, volatile=True)
            missing = lanes & ((seen >> TASK_TAG_SHIFT) != target)
            spins += 1
        before += tl.sum(tl.where(lanes & ~missing, seen - (target << TASK_TAG_SHIFT), 0), 0)
        if tl.max(missing.to(tl.int32), 0) > 0:
            for e in range(e0, tl.minimum(e0 + LANES, b)):
                if tl.sum(tl.where(earlier == e, missing.to(tl.int32), 0), 0) > 0:
                    before += _block_count(ids_ptr, d, e, num_tokens, num_experts, num_local_experts, K, KP, BLOCK_N)
    return before.to(tl.int32)


@triton.jit
def _route_tasks(
    router,
    routers,
    target,
    ids_ptr,
    peer_bases,
    slot_of_pair_ptr,
    row_of_pair_ptr,
    counts_ptr,
    routed_ptr,
    send_counts_ptr,
    status_ptr,
    num_tokens,
    num_experts,
    num_local_experts,
    rank,
    max_tokens,
    ROW_BYTES: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    COUNT_SPINS: tl.constexpr,
):
    """Router ``router`` of ``routers``: tasks router, router + routers, ... First it publishes every
    one of its tasks' counts (so that other routers' tasks rarely wait for them), then numbers each
    task's tokens after the earlier blocks' counts (``_write_routes``) and marks it routed (release)."""
    tl.static_assert(BLOCK_N < TASK_COUNT_LIMIT, "a block's count must fit below the round's tag")
    blocks = tl.cdiv(num_tokens, BLOCK_N)
    tasks = tl.maximum(blocks, 1) * W  # an empty batch has one block, of no tokens: its task writes the counts
    for task in range(router, tasks, routers):
        count = _block_count(ids_ptr, task % W, task // W, num_tokens, num_experts, num_local_experts, K, KP, BLOCK_N)
        tl.atomic_xchg(counts_ptr + task, (target << TASK_TAG_SHIFT) | count, sem="relaxed", scope="gpu")
    for task in range(router, tasks, routers):
        d = task % W
        b = task // W
        before = _count_before(
            ids_ptr, counts_ptr, d, b, target, num_tokens, num_experts, num_local_experts, K, KP, W, BLOCK_N, LANES,
            COUNT_SPINS,
        )  # fmt: skip
        _write_routes(
            ids_ptr, peer_bases, slot_of_pair_ptr, row_of_pair_ptr, send_counts_ptr, status_ptr, d, b, before,
            b >= blocks - 1, num_tokens, num_experts, num_local_experts, rank, max_tokens, ROW_BYTES, K, KP, BLOCK_N,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's stores precede the mark
        tl.atomic_xchg(routed_ptr + task, target, sem="release", scope="gpu")


@triton.jit
def _late_tasks(routed_ptr, tasks, lanes, target):
    """How many of ``tasks`` have not yet finished routing round ``target`` (a plain poll)."""
    routed = tl.load(routed_ptr + tasks, mask=lanes, other=0, volatile=True)
    return tl.sum((lanes & (routed < target)).to(tl.int32), 0)


@triton.jit
def _await_block(b, target, routed_ptr, W: tl.constexpr, WP: tl.constexpr):
    """Return once every task of block b is routed. The tasks' routers started before this program and
    wait for nothing without bound. The send runs one warp per program, which reads each poll as one
    value."""
    w_offs = tl.arange(0, WP)
    lanes = w_offs < W
    tasks = b * W + w_offs
    # The loop carries a scalar: a loop-carried [WP] mask of 32 lanes or more in a one-warp program
    # crashes Triton's layout pass (3.6 and 3.7, sm_90).
    late = _late_tasks(routed_ptr, tasks, lanes, target)
    while late > 0:
        late = _late_tasks(routed_ptr, tasks, lanes, target)
    tl.atomic_add(routed_ptr + tasks, 0, mask=lanes, sem="acquire", scope="gpu")  # the tasks' stores first
    tl.debug_barrier()  # every thread of the program reads the routing after the acquire


# The routing made by each work item of a small batch for its own token (``SELF_ROUTING``): a token's
# position among the tokens that go to a rank is the number of earlier tokens that go there, which the
# item counts from the ids itself, so nothing in the send waits for anything (docs/performance.md). The
# earlier tokens' destinations are OR-ed into one word per token, a bit per rank.


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _tokens_before(
    ids_ptr,
    n,
    num_experts,
    num_local_experts,
    K: tl.constexpr,
    KP: tl.constexpr,
    WP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """How many of tokens 0..n-1 go to each rank ([WP], int32), CHUNK tokens at a time."""
    k_offs = tl.arange(0, KP)
    w_offs = tl.arange(0, WP)
    BITS: tl.constexpr = tl.int64 if WP > 32 else tl.int32
    counts = tl.zeros((WP,), dtype=tl.int32)
    for t0 in range(0, n, CHUNK):
        tokens = t0 + tl.arange(0, CHUNK)
        mask = (tokens < n)[:, None] & (k_offs < K)[None, :]
        ids = tl.load(ids_ptr + tokens[:, None] * K + k_offs[None, :], mask=mask, other=-1)
        valid, dest = _destinations(ids, num_experts, num_local_experts)
        bits = tl.reduce(tl.where(valid, tl.full((CHUNK, KP), 1, BITS) << dest.to(BITS), 0), 1, _bit_or)
        counts += tl.sum(((bits[:, None] >> w_offs[None, :].to(BITS)) & 1).to(tl.int32), 0)
    return counts


@triton.jit
def _self_route(
    ids_ptr,
    bases,
    slot_of_pair_ptr,
    send_counts_ptr,
    status_ptr,
    n,
    tile,
    num_tokens,
    num_experts,
    num_local_experts,
    rank,
    max_tokens,
    ROW_BYTES: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The byte address of token n's row in each destination's arena ([KP]; 0 for a slot that is not
    its destination's owner), as ``_write_routes`` numbers them; ``bases`` holds every rank's arena
    address ([WP], loaded once per program rather than once per item after its ids). Tile 0's item
    also writes the token's ``slot_of_pair`` row and records an id past the last expert in
    ``status[1]``, and the last token's writes ``send_counts``."""
    k_offs = tl.arange(0, KP)
    w_offs = tl.arange(0, WP)
    k_mask = k_offs < K
    ids = tl.load(ids_ptr + n * K + k_offs, mask=k_mask, other=-1)
    valid, dest = _destinations(ids, num_experts, num_local_experts)
    # A token goes to a rank once, through its first slot whose expert lives there (the owner).
    same_earlier = (dest[:, None] == dest[None, :]) & valid[None, :] & (k_offs[None, :] < k_offs[:, None])
    owner = valid & (tl.max(same_earlier.to(tl.int32), 1) == 0)
    before = _tokens_before(ids_ptr, n, num_experts, num_local_experts, K, KP, WP, CHUNK)
    position = tl.sum(tl.where(dest[:, None] == w_offs[None, :], before[None, :], 0), 1)
    base = tl.sum(tl.where(dest[:, None] == w_offs[None, :], bases[None, :], 0), 1)
    rows = tl.where(owner, base + (rank * max_tokens + position).to(tl.int64) * ROW_BYTES, 0)
    if tile == 0:
        slot = tl.where(owner, dest.to(tl.int64) * max_tokens + position, -1)
        tl.store(slot_of_pair_ptr + n * K + k_offs, slot, mask=k_mask)
        too_big = tl.max(tl.where(k_mask & (ids >= num_experts), ids.to(tl.int64) - (num_experts - 1), 0))
        if too_big > 0:
            tl.atomic_max(status_ptr + 1, too_big)
        if n == num_tokens - 1:
            goes = tl.max((owner[:, None] & (dest[:, None] == w_offs[None, :])).to(tl.int32), 0)
            tl.store(send_counts_ptr + w_offs, before + goes, mask=w_offs < W)
    return rows


@triton.jit
def _token_tile(
    x_ptr,
    item,
    total,
    TILES: tl.constexpr,
    QUANT: tl.constexpr,
    HIDDEN: tl.constexpr,
    TILE_ELEMS: tl.constexpr,
    TOKEN_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The input of a dispatch send work item as it is in memory (bf16 elements to quantize, or the
    words to copy, whatever the tokens' dtype); an item past the last loads nothing."""
    n = item // TILES
    tile = item % TILES
    if QUANT == QUANT_NONE:
        word = tile * BLOCK + tl.arange(0, BLOCK)
        words = x_ptr.to(tl.pointer_type(tl.int32))
        return tl.load(words + _row_start(n, TOKEN_WORDS) + word, mask=(word < TOKEN_WORDS) & (item < total))
    else:
        elem = tile * TILE_ELEMS + tl.arange(0, TILE_ELEMS)
        return tl.load(x_ptr + _row_start(n, HIDDEN) + elem, mask=(elem < HIDDEN) & (item < total), other=0.0)


@triton.jit
def dispatch_send_kernel(
    peer_bases,
    x_ptr,
    scales_ptr,
    weights_ptr,
    ids_ptr,
    slot_of_pair_ptr,
    row_of_pair_ptr,
    block_counts_ptr,
    routed_ptr,
    start_order_ptr,
    send_counts_ptr,
    status_ptr,
    tickets_ptr,
    round_ptr,
    num_tokens,
    num_experts,
    num_local_experts,
    rank,
    max_tokens,
    counts_offset,
    arrivals_offset,
    routers,
    ROW_BYTES: tl.constexpr,
    TOKEN_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    STRIDE_WORDS: tl.constexpr,
    SCALE_AT: tl.constexpr,
    WEIGHTS_AT: tl.constexpr,
    IDS_AT: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    QUANT: tl.constexpr,
    HIDDEN: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    EMAX: tl.constexpr,
    SELF_ROUTING: tl.constexpr,
    ROUTE_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    COUNT_SPINS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Read each token once and write its packed row (token | zero-padded scale row | weights | ids)
    into the slot of every distinct destination rank, all destinations in one store per tile. QUANT
    quantizes the bf16 token on the way, exactly as formats.quantize_dispatch: 1 = fp8 (f32 scale per
    128), 2 = mxfp8, 3 = mxfp4 (e8m0 per 32, EMAX the element type's largest exponent); with 0 the
    payload words are copied as they are. A partial last group holds the token's last elements (the
    rest load as zeros); MX scale rows end in zero bytes up to a whole dword, the scales of groups with
    no elements. Ids travel as int32, an id that routes nowhere (negative, or past the last expert) as -1.
       A work item is one tile (TILE_GROUPS scale groups, or BLOCK words when copying) of one token, so
    that a small batch still spreads over every program; TILES is the number of tiles of a token, and
    tile 0 also writes the pad, the weights and the ids. The inputs are read as the caller made them:
    the tokens' words and the scale rows' words whatever their dtype, f32 or 16-bit weights (sent as
    f32), int32 or int64 ids.
       With SELF_ROUTING each item numbers its own token's copies from the ids (``_self_route``) and
    nothing waits. Otherwise the routing runs as tasks: the first ``routers`` programs to start run
    them (``_route_tasks``) and the others move the rows, each quantizing an item before it waits for
    its block's routing (``_await_block``) and stores.
       A program loads its next item's input before it works on the current one, so that two items'
    loads are in flight: the send is bound by the bytes it keeps in flight, and the extra registers
    (99 instead of 80 per thread for fp8, 168 instead of 96 for a copy) cost less than that gains."""
    _after_previous_kernel(PDL)
    total = num_tokens * TILES
    TILE_ELEMS: tl.constexpr = TILE_GROUPS * GROUP
    first_item = tl.program_id(0)
    movers = tl.num_programs(0)  # the programs that move rows
    if not SELF_ROUTING:
        target = tl.load(round_ptr) + 1  # this send's round: the last program advances round_ptr to it
        started = tl.atomic_add(start_order_ptr, 1, sem="relaxed", scope="gpu")  # programs started before this one
        movers -= routers
        first_item = started - routers
        if started < routers:
            _route_tasks(
                started, routers, target, ids_ptr, peer_bases, slot_of_pair_ptr, row_of_pair_ptr, block_counts_ptr,
                routed_ptr, send_counts_ptr, status_ptr, num_tokens, num_experts, num_local_experts, rank, max_tokens,
                ROW_BYTES, K, KP, W, BLOCK_N, LANES, COUNT_SPINS,
            )  # fmt: skip
            first_item = total  # a router moves no rows
    x_next = _token_tile(x_ptr, first_item, total, TILES, QUANT, HIDDEN, TILE_ELEMS, TOKEN_WORDS, BLOCK)
    if SELF_ROUTING:  # every rank's arena address, once per program that has an item
        w_offs = tl.arange(0, WP)
        bases = tl.load(peer_bases + w_offs, mask=(w_offs < W) & (first_item < total), other=0)
    routed = -1  # the last block this program saw routed (its items' tokens only grow)
    offs = tl.arange(0, BLOCK)
    k_offs = tl.arange(0, KP)
    k_mask = k_offs < K
    for item in range(first_item, total, movers):
        x_now = x_next
        following = item + movers
        x_next = _token_tile(x_ptr, following, total, TILES, QUANT, HIDDEN, TILE_ELEMS, TOKEN_WORDS, BLOCK)
        n = item // TILES
        tile = item % TILES
        # Tile 0's other inputs, loaded before any store (the compiler cannot move a load past a store
        # that may alias it): their memory round trip overlaps the routing's instead of following the
        # token's stores.
        first_pad = SCALE_WORDS if QUANT else 0
        in_row = tl.arange(0, PAD_BLOCK)
        region = (in_row >= first_pad) & (in_row < STRIDE_WORDS)
        src = scales_ptr.to(tl.pointer_type(tl.int32)) + n * SCALE_WORDS + in_row
        scale_words = tl.load(src, mask=region & (in_row < SCALE_WORDS) & (tile == 0), other=0)
        weights = tl.load(weights_ptr + n * K + k_offs, mask=k_mask & (tile == 0)).to(tl.float32)
        wire_ids = tl.load(ids_ptr + n * K + k_offs, mask=k_mask & (tile == 0))
        wire_ids = tl.where((wire_ids >= 0) & (wire_ids < num_experts), wire_ids, -1).to(tl.int32)
        # The item's wire values first: they do not depend on the routing.
        if (QUANT == QUANT_FP8) or (QUANT == QUANT_MXFP8):  # noqa: SIM109  the kernel compares constexprs
            if QUANT == QUANT_FP8:
                NUM_GROUPS: tl.constexpr = (HIDDEN + GROUP - 1) // GROUP
            else:
                NUM_GROUPS: tl.constexpr = (HIDDEN + 4 * GROUP - 1) // (4 * GROUP) * 4
            groups = tile * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
            elem = tile * TILE_ELEMS + tl.arange(0, TILE_ELEMS)
            x = x_now.to(tl.float32)
            x2 = tl.reshape(x, (TILE_GROUPS, GROUP))
            if QUANT == QUANT_FP8:  # f32 scale amax / max; payload x * (max / amax)
                amax = tl.maximum(_finite_amax(x2, 1), 1e-10)
                scale_row = tl.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
                scaled = x2 * tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)[:, None]
            else:  # e8m0 byte; payload x / 2^exponent
                exponent, inverse = _e8m0(_finite_amax(x2, 1), EMAX)
                infinite = tl.max((tl.abs(x2) == float("inf")).to(tl.int32), axis=1) > 0
                scale_row = tl.where(infinite, 255, exponent + 127).to(tl.uint8)
                scaled = x2 * inverse[:, None]
            payload = tl.reshape(_saturate_fp8(scaled, FP8_MAX, FP8), (TILE_ELEMS,))
            payload_at = elem
            payload_in = elem < HIDDEN
        elif QUANT == QUANT_MXFP4:
            NUM_GROUPS: tl.constexpr = (HIDDEN + 4 * GROUP - 1) // (4 * GROUP) * 4
            PAIRS: tl.constexpr = GROUP // 2
            TILE: tl.constexpr = TILE_GROUPS * PAIRS  # packed bytes
            groups = tile * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
            x = x_now.to(tl.float32)
            even, odd = tl.split(tl.reshape(x, (TILE_GROUPS, PAIRS, 2)))
            amax = tl.maximum(_finite_amax(even, 1), _finite_amax(odd, 1))
            exponent, inverse = _e8m0(amax, EMAX)
            # e2m1 holds neither NaN nor infinity: such a group's scale is e8m0's NaN code, its NaNs code 0.
            bad = (even != even) | (odd != odd) | (tl.abs(even) == float("inf")) | (tl.abs(odd) == float("inf"))
            poisoned = tl.max(bad.to(tl.int32), axis=1) > 0
            even = tl.where(even != even, 0.0, even)
            odd = tl.where(odd != odd, 0.0, odd)
            packed = _e2m1(even * inverse[:, None]) | (_e2m1(odd * inverse[:, None]) << 4)
            payload = tl.reshape(packed.to(tl.uint8), (TILE,))
            payload_at = tile * TILE + tl.arange(0, TILE)
            payload_in = payload_at < HIDDEN // 2
            scale_row = tl.where(poisoned, 255, exponent + 127).to(tl.uint8)
        else:
            payload = x_now
            payload_at = tile * BLOCK + offs
            payload_in = payload_at < TOKEN_WORDS
        if SELF_ROUTING:
            rows = _self_route(
                ids_ptr, bases, slot_of_pair_ptr, send_counts_ptr, status_ptr, n, tile, num_tokens, num_experts,
                num_local_experts, rank, max_tokens, ROW_BYTES, K, KP, W, WP, ROUTE_CHUNK,
            )  # fmt: skip
        else:
            if n // BLOCK_N > routed:
                routed = n // BLOCK_N
                _await_block(routed, target, routed_ptr, W, WP)
            rows = tl.load(row_of_pair_ptr + n * K + k_offs, mask=k_mask, other=0)  # [KP] byte addresses
        present = rows != 0
        _store_all(rows, 0, payload_at, payload, payload_in, present, payload_at.shape[0], KP)
        if QUANT != QUANT_NONE:
            _store_all(rows, SCALE_AT * 4, groups, scale_row, groups < NUM_GROUPS, present, TILE_GROUPS, KP)
        if tile == 0:
            # The scale region (copied, or its zero pad after the quantized scales) in one step.
            _store_all(rows, SCALE_AT * 4, in_row, scale_words, region, present, PAD_BLOCK, KP)
            _store_all(rows, WEIGHTS_AT * 4, k_offs, weights, k_mask, present, KP, KP)
            _store_all(rows, IDS_AT * 4, k_offs, wire_ids, k_mask, present, KP, KP)
    if SELF_ROUTING:  # noqa: SIM102  a constexpr test around a runtime one
        if (num_tokens == 0) & (tl.program_id(0) == 0):  # no token's item counts: nothing goes anywhere
            tl.store(send_counts_ptr + tl.arange(0, WP), tl.zeros((WP,), tl.int64), mask=tl.arange(0, WP) < W)
    if _take_ticket(tickets_ptr, 1, tl.num_programs(0)):
        if not SELF_ROUTING:  # every program has taken its place in the start order
            tl.store(start_order_ptr, 0)
        _publish_dispatch(round_ptr, peer_bases, send_counts_ptr, counts_offset, arrivals_offset, rank, W, WP)


@triton.jit
def dispatch_recv_kernel(
    arena_ptr,
    tokens_out,
    scales_out,
    weights_out,
    ids_out,
    num_recv_out,
    recv_counts_out,
    round_ptr,
    status_ptr,
    timeout_ns,
    max_tokens,
    counts_offset,
    arrivals_offset,
    ROW_WORDS: tl.constexpr,
    TOKEN_WORDS: tl.constexpr,
    STRIDE_WORDS: tl.constexpr,
    SCALE_AT: tl.constexpr,
    WEIGHTS_AT: tl.constexpr,
    IDS_AT: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    CLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Wait for every sender, then copy the received rows out compact, ordered by source rank."""
    _after_previous_kernel(PDL)
    pid = tl.program_id(0)
    _await_round(arena_ptr, arrivals_offset, round_ptr, status_ptr, timeout_ns, W, WP, CLOCK)
    w_offs = tl.arange(0, WP)
    counts_ptr = _in_arena(arena_ptr, counts_offset, tl.int64)
    counts = tl.load(counts_ptr + w_offs, mask=w_offs < W, other=0, volatile=True)
    total = tl.sum(counts, 0)
    rows = _in_arena(arena_ptr, 0, tl.int32)
    k_offs = tl.arange(0, KP)
    k_mask = k_offs < K
    s_offs = tl.arange(0, SCALE_BLOCK)
    s_mask = s_offs < STRIDE_WORDS
    for j in range(pid, total, tl.num_programs(0)):
        src, pos = _source_of_row(counts, j, WP)
        row = tl.multiple_of(rows + (src * max_tokens + pos) * ROW_WORDS, ROW_ALIGN)
        # Every load of the row before any store: one memory round trip per row, not one per section.
        if TOKEN_WORDS <= BLOCK:
            t_offs = tl.arange(0, BLOCK)
            token = tl.load(row + t_offs, mask=t_offs < TOKEN_WORDS)
        scale_words = tl.load(row + SCALE_AT + s_offs, mask=s_mask)
        weights = tl.load(row + WEIGHTS_AT + k_offs, mask=k_mask)
        ids = tl.load(row + IDS_AT + k_offs, mask=k_mask)
        if TOKEN_WORDS <= BLOCK:
            tl.store(tokens_out + j * TOKEN_WORDS + t_offs, token, mask=t_offs < TOKEN_WORDS)
        else:
            _copy_words(tokens_out + j * TOKEN_WORDS, row, TOKEN_WORDS, BLOCK)
        tl.store(scales_out + j * STRIDE_WORDS + s_offs, scale_words, mask=s_mask)
        tl.store(weights_out + j * K + k_offs, weights, mask=k_mask)
        tl.store(ids_out + j * K + k_offs, ids, mask=k_mask)
    if pid == 0:
        tl.store(num_recv_out, total.to(tl.int32))
        tl.store(recv_counts_out + w_offs, counts, mask=w_offs < W)


@triton.jit
def _quantize_blocks(
    src,
    dst,
    first_block,
    has_row,
    HIDDEN: tl.constexpr,
    SCALE_AT: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    ITEM_BLOCKS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    FP8: tl.constexpr,
):
    """Blocks [first_block, first_block + ITEM_BLOCKS) of one expert output row -> its combine wire row
    (the torch reference in formats.py, bit for bit); the last block may be partial. The native
    format's sign flag depends on the whole row, so it is quantized as one item. Without ``has_row``
    (the expert outputs hold fewer rows than were received) nothing is read and the row is zeros."""
    NUM_BLOCKS: tl.constexpr = (HIDDEN + BLOCK - 1) // BLOCK
    cols = tl.arange(0, BLOCK_P2)
    any_scaled = tl.full((), 0, tl.int32)
    first_scale = tl.full((), 0.0, tl.float32)
    for b in tl.static_range(0, ITEM_BLOCKS, TILE_BLOCKS):
        blocks = first_block + b + tl.arange(0, TILE_BLOCKS)
        elem = blocks[:, None] * BLOCK + cols[None, :]
        mask = (blocks < NUM_BLOCKS)[:, None] & (cols < BLOCK)[None, :] & (elem < HIDDEN)
        x = tl.load(src + elem, mask=mask & has_row, other=0.0).to(tl.float32)
        if FORMAT == COMBINE_BF16:
            tl.store(dst.to(tl.pointer_type(tl.bfloat16)) + elem, x.to(tl.bfloat16), mask=mask)
        elif FORMAT == COMBINE_FP8_DIRECT:
            tl.store(dst.to(tl.pointer_type(FP8)) + elem, _saturate_fp8(x, FP8_MAX, FP8), mask=mask)
        else:
            amax = _finite_amax(x, 1)
            if FORMAT == COMBINE_FP8_BLOCKWISE:
                nonzero = amax > 0
                safe_amax = tl.where(nonzero, tl.maximum(amax, MIN_AMAX), 1.0)
                scale = tl.where(nonzero, tl.div_rn(safe_amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
                inv = tl.where(nonzero, tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), safe_amax), 1.0)
                q = x * inv[:, None]
            else:
                scaled = amax > FP8_MAX
                scale = tl.where(scaled, amax * (1.0 / FP8_MAX), 1.0)
                safe_amax = tl.where(scaled, amax, 1.0)
                inv = tl.where(scaled, tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), safe_amax), 1.0)
                q = tl.where(scaled[:, None], x * inv[:, None], x)
                any_scaled = tl.maximum(any_scaled, tl.max(scaled.to(tl.int32), axis=0))
                if b == 0:
                    first_scale = tl.sum(tl.where(blocks == 0, scale, 0.0), axis=0)
            tl.store(dst.to(tl.pointer_type(FP8)) + elem, _saturate_fp8(q, FP8_MAX, FP8), mask=mask)
            scales = (dst + SCALE_AT).to(tl.pointer_type(tl.float32))
            tl.store(scales + blocks, scale, mask=blocks < NUM_BLOCKS)
    if FORMAT == COMBINE_FP8_BLOCKWISE_NATIVE:
        tl.debug_barrier()
        if any_scaled > 0:
            tl.store((dst + SCALE_AT).to(tl.pointer_type(tl.float32)), -first_scale)


@triton.jit
def combine_send_kernel(
    peer_bases,
    y_ptr,
    y_rows,
    recv_counts_ptr,
    tickets_ptr,
    round_ptr,
    status_ptr,
    rank,
    max_tokens,
    combine_offset,
    arrivals_offset,
    HIDDEN: tl.constexpr,
    SCALE_AT: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    ITEM_BLOCKS: tl.constexpr,
    ITEMS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    FP8: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Quantize each received row's expert output straight into its source rank's combine slot; a work
    item is ITEM_BLOCKS blocks of one row (ITEMS per row). The last program to finish signals.
       Expert outputs of fewer rows (``y_rows``) than were received are never read past their end: the
    missing rows travel as zeros and program 0 records ``1 + received`` in ``status[2]``, which the
    host raises at its next status check, without a synchronisation here."""
    _after_previous_kernel(PDL)
    pid = tl.program_id(0)
    w_offs = tl.arange(0, WP)
    counts = tl.load(recv_counts_ptr + w_offs, mask=w_offs < W, other=0)
    # Every rank's arena address with the counts, not after them: a row's source is known only then.
    bases = tl.load(peer_bases + w_offs, mask=w_offs < W, other=0)
    total = tl.sum(counts, 0)
    programs = tl.num_programs(0)
    if (pid == 0) & (total > y_rows):
        tl.atomic_max(status_ptr + 2, total + 1)
    for item in range(pid, total * ITEMS, programs):
        j = item // ITEMS
        src, pos = _source_of_row(counts, j, WP)
        base = tl.sum(tl.where(w_offs == src, bases, 0), 0)
        dst = (base + combine_offset).to(tl.pointer_type(tl.uint8)) + (rank * max_tokens + pos) * ROW_STRIDE
        dst = tl.multiple_of(dst, ROW_ALIGN)
        first_block = (item % ITEMS) * ITEM_BLOCKS
        _quantize_blocks(
            y_ptr + _row_start(tl.minimum(j, y_rows - 1), HIDDEN),
            dst,
            first_block,
            j < y_rows,
            HIDDEN,
            SCALE_AT,
            FORMAT,
            BLOCK,
            BLOCK_P2,
            TILE_BLOCKS,
            ITEM_BLOCKS,
            FP8_MAX,
            MIN_AMAX,
            FP8,
        )
    # The grid covers the most rows a rank can receive: only programs with items take a ticket.
    mine = tl.maximum(total * ITEMS - pid + programs - 1, 0) // programs
    if _take_ticket(tickets_ptr, mine, total * ITEMS):
        _advance_round(round_ptr)
        _signal_arrival(peer_bases, arrivals_offset, rank, W, WP)


@triton.jit
def combine_recv_kernel(
    arena_ptr,
    slot_of_pair_ptr,
    out_ptr,
    round_ptr,
    status_ptr,
    timeout_ns,
    num_tokens,
    combine_offset,
    arrivals_offset,
    HIDDEN: tl.constexpr,
    SCALE_AT: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    FP8: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    CLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Wait for every sender, then per token: dequantize its returned rows and add them in f32 in top-k
    order, cast once to bf16. A work item is one tile of TILE_BLOCKS blocks of one token; the last
    block may be partial."""
    _after_previous_kernel(PDL)
    pid = tl.program_id(0)
    _await_round(arena_ptr, arrivals_offset, round_ptr, status_ptr, timeout_ns, W, WP, CLOCK)
    NUM_BLOCKS: tl.constexpr = (HIDDEN + BLOCK - 1) // BLOCK
    TILES: tl.constexpr = (NUM_BLOCKS + TILE_BLOCKS - 1) // TILE_BLOCKS
    rows = _in_arena(arena_ptr, combine_offset, tl.uint8)
    cols = tl.arange(0, BLOCK_P2)
    for item in range(pid, num_tokens * TILES, tl.num_programs(0)):
        n = item // TILES
        blocks = (item % TILES) * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
        elem = blocks[:, None] * BLOCK + cols[None, :]
        mask = (blocks < NUM_BLOCKS)[:, None] & (cols < BLOCK)[None, :] & (elem < HIDDEN)
        acc = tl.zeros((TILE_BLOCKS, BLOCK_P2), dtype=tl.float32)
        for k in tl.static_range(K):
            slot = tl.load(slot_of_pair_ptr + n * K + k)
            present = slot >= 0
            row = tl.multiple_of(rows + tl.maximum(slot, 0) * ROW_STRIDE, ROW_ALIGN)
            m = mask & present
            if FORMAT == COMBINE_BF16:
                v = tl.load(row.to(tl.pointer_type(tl.bfloat16)) + elem, mask=m, other=0.0).to(tl.float32)
            else:
                v = tl.load(row.to(tl.pointer_type(FP8)) + elem, mask=m, other=0.0).to(tl.float32)
                if FORMAT >= 2:
                    scales = (row + SCALE_AT).to(tl.pointer_type(tl.float32))
                    s = tl.load(scales + blocks, mask=(blocks < NUM_BLOCKS) & present, other=1.0)
                    if FORMAT == COMBINE_FP8_BLOCKWISE_NATIVE:
                        flagged = tl.load(scales, mask=present, other=1.0) < 0
                        s = tl.where(flagged, tl.abs(s), 1.0)
                    v = v * s[:, None]
            acc = acc + v  # masked lanes hold 0 (or are never stored)
        tl.store(out_ptr + _row_start(n, HIDDEN) + elem, acc.to(tl.bfloat16), mask=mask)
