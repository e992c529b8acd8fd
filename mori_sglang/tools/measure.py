"""What every benchmark command measures with: synchronisation, phase timing, the copy roofline the
benchmarks divide by, and the identity expert whose output a combine carries back. (The device a
command runs on is chosen by ``mori_sglang.cli.resolve_device``.)"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from mori_sglang import formats, wire_formats
from mori_sglang.config import DispatchDtype
from mori_sglang.types import DispatchOutput


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks around it time the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Time of a region on a device: CUDA events on a GPU (the device's time), the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn``'s device work captured once in a CUDA graph: the call that replays it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_phases(phases: list[Callable[[], object]], device: torch.device, iters: int) -> list[list[float]]:
    """Seconds of each phase per iteration (phases run in order every iteration)."""
    out: list[list[float]] = [[] for _ in phases]
    for _ in range(iters):
        for i, phase in enumerate(phases):
            with Stopwatch(device) as watch:
                phase()
            out[i].append(watch.seconds)
    return out


# The four calls of a step, in order (the benchmarks time each as a phase over every rank).
PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def time_eager(
    phases: list[Callable[[], object]], device: torch.device, iters: int
) -> tuple[list[list[float]], list[list[float]] | None, bool | None]:
    """Host seconds of each phase's calls and, on a GPU, device seconds of the work they queued, per
    iteration. On a GPU a sleep kernel runs ahead of each phase, longer than its calls take, so the host
    time holds no wait for the device (a synchronisation in a call would show as the whole sleep) and the
    device time no gap for the host. The third value: whether the sleep outlasted the calls every time
    (None on a CPU, where no device runs ahead of the calls)."""
    host: list[list[float]] = [[] for _ in phases]
    if device.type != "cuda":
        for _ in range(iters):
            for i, phase in enumerate(phases):
                t0 = time.perf_counter()
                phase()
                host[i].append(time.perf_counter() - t0)
        return host, None, None
    dev: list[list[float]] = [[] for _ in phases]
    cycles_per_s = _sleep_rate(device)
    sleeps = []
    for phase in phases:  # each phase's sleep: three times its calls' time, with at most 30 ms
        t0 = time.perf_counter()
        phase()
        sleeps.append(int(cycles_per_s * min(3 * (time.perf_counter() - t0) + 1e-3, 30e-3)))
        sync(device)
    busy = True
    for _ in range(iters):
        for i, phase in enumerate(phases):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleeps[i])
            start.record()
            t0 = time.perf_counter()
            phase()
            t1 = time.perf_counter()
            end.record()
            busy = busy and not start.query()
            end.synchronize()
            host[i].append(t1 - t0)
            dev[i].append(start.elapsed_time(end) / 1e3)
    return host, dev, busy


def kept_busy_text(flag: bool | None) -> str:
    """A table's cell for whether the device was kept busy (``time_eager``'s third value): a CPU has no
    device to keep busy, which is neither yes nor no."""
    return "no device" if flag is None else "yes" if flag else "no"


def host_us_per_call(
    call: Callable[[], object], device: torch.device, iters: int, repeats: int
) -> tuple[float, bool | None]:
    """Median over ``repeats`` of the mean host µs of ``iters`` calls, timed as the eager benchmark times a
    phase (``time_eager``: on a GPU a sleep kernel ahead outlasts them; the second value says whether it
    did every time, None on a CPU)."""
    call()  # compile outside the timing

    def calls() -> None:
        for _ in range(iters):
            call()

    host, _device, busy = time_eager([calls], device, repeats)
    return statistics.median(host[0]) * 1e6 / iters, busy


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on this device."""
    cycles = 10_000_000
    sync(device)
    with Stopwatch(device) as watch:
        torch.cuda._sleep(cycles)
    return cycles / watch.seconds


def count_launches(phase: Callable[[], object], device: torch.device) -> tuple[int, int] | None:
    """(device operations, of which device-to-host copies) one run of ``phase`` queues, from torch's
    profiler; None on CPU, where nothing launches."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        phase()
        sync(device)
    ops = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(ops), sum("DtoH" in name for name in ops)


def roofline_bytes(device: torch.device) -> int:
    """Buffer size of a bandwidth measurement: 1 GiB on a GPU (far past its caches), 64 MiB on CPU."""
    return (1 << 30) if device.type == "cuda" else (1 << 26)


def copy_bandwidth(device: torch.device, iters: int = 10) -> float:
    """Device-to-device copy GB/s over ``roofline_bytes``, counting bytes read plus bytes written."""
    nbytes = roofline_bytes(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_phases([lambda: dst.copy_(src)], device, iters)[0]
    return 2 * nbytes / statistics.median(times) / 1e9


# The 32-bit words a copy-floor kernel's program copies, per variant timed (4 and 16 KiB): the smaller
# block runs more programs on a small copy, the larger fewer on a large one; a floor is the faster.
COPY_FLOOR_BLOCKS = (1024, 4096)


class CopyFloorStep:
    """A step that only copies: per phase of ``phase_bytes`` (bytes each phase reads plus writes, summed
    over the ranks) one copy kernel per rank of that rank's share (whole 32-bit words), in the step's
    order, each between regions of its own so that no copy reads what another left in the cache, each
    program copying ``block`` words. Replayed from a graph it is the floor of a step that launches a
    kernel per rank and phase and moves the same bytes: each kernel's launch, ramp-up and bytes,
    launched as the transport's kernels are (programmatic launch where they use it), with no routing,
    quantization or synchronisation. A kernel, not ``Tensor.copy_``: in a graph that becomes a memcpy
    node, which the copy engines run slower than the SMs copy."""

    def __init__(self, phase_bytes: Sequence[int], world: int, device: torch.device, block: int) -> None:
        from mori_sglang.kernels.probes import copy_probe_kernel
        from mori_sglang.kernels.transport import PDL_OFF, PDL_WAIT
        from mori_sglang.providers.triton_provider import programmatic_launch

        words = [max(1, total // (2 * world) // 4) for total in phase_bytes for _ in range(world)]
        starts = [0]
        for n in words:  # each region starts on a whole block, so every program's words are aligned alike
            starts.append(starts[-1] + -(-n // block) * block)
        src = torch.empty(starts[-1], dtype=torch.int32, device=device)
        dst = torch.empty_like(src)
        # (source, destination) per rank and phase, in launch order.
        self.regions = [(src[at : at + n], dst[at : at + n]) for at, n in zip(starts, words, strict=False)]
        pdl = programmatic_launch(device)
        self._kernel = copy_probe_kernel
        self._options = {"BLOCK": block, "PDL": PDL_WAIT if pdl else PDL_OFF}
        if pdl:
            self._options["launch_pdl"] = True

    def __call__(self) -> None:
        block = self._options["BLOCK"]
        for source, to in self.regions:
            n = source.numel()
            self._kernel[(-(-n // block),)](source, to, n, **self._options)


def identity_expert(out: DispatchOutput, dispatch: DispatchDtype, hidden: int, rows: int | None = None) -> torch.Tensor:
    """What an expert that returns its input would produce: the dequantized received tokens, as bf16.

    ``rows``: dequantize only the first rows (the received count); by default the whole receive buffer,
    which needs no host sync and so can precede a CUDA graph capture.
    """
    tokens = out.tokens if rows is None else out.tokens[:rows]
    scales = None
    scale_bytes = wire_formats.DISPATCH_BY_NAME[dispatch.value].scale_bytes
    if scale_bytes:  # f32 block scales, or e8m0 bytes, as the reference reads them
        scales = out.recv_scales(torch.float32 if scale_bytes == 4 else torch.uint8)
    if scales is not None and rows is not None:
        scales = scales[:rows]
    return formats.dequantize_dispatch(tokens, scales, dispatch, hidden).to(torch.bfloat16)


def write_rows(path: str | None, rows: Sequence[object]) -> None:
    """A command's ``--json``: its rows (dataclasses) as a JSON list; nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
