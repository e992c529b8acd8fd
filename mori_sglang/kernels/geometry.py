"""How the Triton kernels are launched: tiles, warps and programs per kernel, and how many programs a
device runs.

``KernelTuning`` is the one set of launch shapes the Triton provider reads; benchmarks and tuning sweeps
hand it one through ``EpDispatchCombineOp.set_kernel_tuning``. It needs neither Triton nor a GPU, so the
op and the commands can name it wherever the provider cannot be built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelTuning:
    """Tile sizes, warps and programs per kernel; the defaults measured fastest on an H200
    (docs/performance.md). Tiles are also work items, so small batches still fill the GPU."""

    # Batches of at most this many tokens route item by item inside the send, with no routing tasks to
    # wait for: each work item counts the earlier tokens' destinations itself, ``self_route_chunk``
    # tokens at a time, a cost that grows with the batch (worlds of at most SELF_ROUTING_MAX_WORLD ranks).
    self_routing_max_tokens: int = 128
    self_route_chunk: int = 64
    # Larger batches route in tasks of ``route_block`` tokens for one destination, run inside the send
    # by ``route_programs_per_sm`` programs per SM that move no rows (a task's registers stay out of the
    # programs that do: docs/performance.md).
    route_block: int = 16
    route_programs_per_sm: int = 4
    send_tile: int = 1024  # elements of the bf16 token quantized per work item of the dispatch send
    send_programs_per_sm: int = 48
    copy_block: int = 2048  # 32-bit words per copy step (unquantized send, receive)
    recv_warps: int = 4
    combine_send_tile: int = 8192  # elements per work item of the combine send
    combine_send_warps: int = 4
    combine_recv_tile: int = 2048  # elements per work item of the combine receive, bf16 rows
    combine_recv_warps: int = 4
    combine_recv_tile_fp8: int = 1024  # the same for fp8 rows: dequantizing needs more programs in flight
    combine_recv_warps_fp8: int = 2
    # Bytes of rows in flight per SM in the dispatch receive (a program moves one row at a time), close
    # to an SM's share of the device's bandwidth-delay product: more programs add DRAM contention, and
    # every program waits for the senders before it knows its rows (its grid covers the most rows a rank
    # can receive, so idle programs cost decode batches in buffers sized for prefill).
    dispatch_recv_bytes_per_sm: int = 32768
    combine_send_programs_per_sm: int = 32  # idle programs exit at once; one row or tile per item
    combine_recv_programs_per_sm: int = 16  # each item reads top-k rows: fewer programs, more loads each
    # Under programmatic dependent launch, a kernel of at most this many programs lets the kernel after
    # it launch as soon as its own wait for the kernel before is over (0: none does). Measured once on
    # an H200: faster small steps, slower 4096-token ones when every kernel did it (docs/performance.md).
    early_launch_max_programs: int = 0

    def dispatch_recv_programs_per_sm(self, row_bytes: int) -> int:
        """Programs per SM of the dispatch receive: the rows that fit in ``dispatch_recv_bytes_per_sm``,
        rounded to a power of two (2^round(log2)), within DISPATCH_RECV_PROGRAMS_PER_SM (measured on
        an H200: docs/performance.md)."""
        fewest, most = DISPATCH_RECV_PROGRAMS_PER_SM
        nearest = 1 << max(0, round(math.log2(self.dispatch_recv_bytes_per_sm / row_bytes)))
        return min(most, max(fewest, nearest))

    def __post_init__(self) -> None:
        for name in ("early_launch_max_programs", "self_routing_max_tokens"):
            if getattr(self, name) < 0:  # 0 turns the feature off; a negative value meant nothing
                raise ValueError(f"KernelTuning.{name}={getattr(self, name)}: must be >= 0")
        if self.dispatch_recv_bytes_per_sm <= 0:
            raise ValueError(f"KernelTuning.dispatch_recv_bytes_per_sm={self.dispatch_recv_bytes_per_sm}: must be > 0")
        for name in TILE_FIELDS:
            value, least = getattr(self, name), MIN_TILE_OF.get(name, MIN_TILE)
            if value < least or value & (value - 1):
                raise ValueError(f"KernelTuning.{name}={value}: tiles are powers of two of at least {least}")
        for name in WARP_FIELDS:
            value = getattr(self, name)
            if not 1 <= value <= MAX_WARPS or value & (value - 1):
                # Triton asserts this only when it compiles for a GPU (the interpreter ignores warps).
                raise ValueError(f"KernelTuning.{name}={value}: warps are powers of two in [1, {MAX_WARPS}]")
        for name in PROGRAM_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"KernelTuning.{name}={getattr(self, name)}: must be >= 1")


TILE_FIELDS = (
    "self_route_chunk",
    "route_block",
    "send_tile",
    "copy_block",
    "combine_send_tile",
    "combine_recv_tile",
    "combine_recv_tile_fp8",
)
WARP_FIELDS = (
    "recv_warps",
    "combine_send_warps",
    "combine_recv_warps",
    "combine_recv_warps_fp8",
)
PROGRAM_FIELDS = (
    "route_programs_per_sm",
    "send_programs_per_sm",
    "combine_send_programs_per_sm",
    "combine_recv_programs_per_sm",
)
# The most warps a program may have: 1024 threads of 32-lane NVIDIA warps (AMD's 64-lane ones reach it at 16).
MAX_WARPS = 32
# The smallest tile.
MIN_TILE = 64
# The fewest tokens of a routing task inside the dispatch send, and so the most tasks a batch can span.
MIN_ROUTE_TASK = 16
# The smallest value of the tiles counted in tokens; the others are at least MIN_TILE.
MIN_TILE_OF = {"route_block": MIN_ROUTE_TASK, "self_route_chunk": 1}
# The most ranks a batch can route item by item in: one bit per rank in a 64-bit word per token.
SELF_ROUTING_MAX_WORLD = 64
# The fewest and the most programs per SM of the dispatch receive, whatever its rows' size.
DISPATCH_RECV_PROGRAMS_PER_SM = (4, 16)
# Programs per kernel in Triton's CPU interpreter: two exercise the work-item loops, more only cost time.
INTERPRETER_PROGRAMS = 2


def multiprocessors(device: torch.device) -> int | None:
    """SMs (CUs) the programs spread over; None in the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


def program_count(per_sm: int, sms: int | None) -> int:
    """Programs of a kernel: ``per_sm`` per multiprocessor (``multiprocessors``), a fixed count in the interpreter."""
    return per_sm * sms if sms else INTERPRETER_PROGRAMS
