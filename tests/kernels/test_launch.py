"""``BoundLaunch``: what it hands the compiled kernel's launcher. Launch hooks are passed only when one
is set (an empty ``HookChain`` would cost the launcher a call around every launch and the host the
launch metadata it is given), and a hook that is set, a profiler's, still sees every launch. Without
hooks it calls the C launcher directly, with what Triton's own launcher (this Triton's, NVIDIA's and
AMD's) would pass it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from triton import knobs

from mori_sglang.kernels.launch import BoundLaunch, DirectLaunch, active_hook, direct_launch, through_tritons_launcher
from mori_sglang.kernels.probes import launch_probe_kernel, launch_probe_wide_kernel

HookChain = getattr(knobs, "HookChain", None)  # Triton 3.5 on; 3.4 keeps each hook as one callable
needs_hook_chains = pytest.mark.skipif(HookChain is None, reason="this Triton (before 3.5) has no HookChain")


def _hook(metadata: object) -> None:
    """A launch hook that does nothing."""


def test_an_older_tritons_hook_passes_as_it_is() -> None:
    assert active_hook(None) is None
    assert active_hook(_hook) is _hook


@needs_hook_chains
def test_an_empty_hook_chain_is_no_hook() -> None:
    assert active_hook(HookChain()) is None


@needs_hook_chains
def test_a_hook_chain_that_is_set_passes_as_it_is() -> None:
    chain = HookChain()
    chain.add(_hook)
    assert active_hook(chain) is chain


@pytest.fixture
def enter_hook_calls() -> Iterator[list[object]]:
    """Launch metadata seen by a launch enter hook added to Triton's knobs while the test runs."""
    seen: list[object] = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    yield seen
    knobs.runtime.launch_enter_hook.remove(seen.append)


@needs_hook_chains
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launcher runs on a GPU (CPU: the JIT)")
def test_a_profilers_hook_sees_bound_launches_and_none_is_built_without_one(
    enter_hook_calls: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    out = torch.full((1,), -7, dtype=torch.int64, device=device)  # poison
    bound = BoundLaunch(launch_probe_kernel, device, (1,), {}, {"num_warps": 1}, variable=("out_ptr",))
    bound(out)  # the first launch compiles through the JIT
    compiled = next(iter(bound._compiled.values()))[0]
    enter_hook_calls.clear()
    out.fill_(-7)
    bound(out)
    torch.cuda.synchronize()
    assert out.item() == 1
    assert len(enter_hook_calls) == 1
    metadata = enter_hook_calls[0]
    assert (metadata if isinstance(metadata, dict) else metadata.get())["name"] == compiled.name  # LazyDict

    knobs.runtime.launch_enter_hook.remove(enter_hook_calls.append)
    built = []
    monkeypatch.setattr(type(compiled), "launch_metadata", lambda *args: built.append(args))
    out.fill_(-7)
    bound(out)
    torch.cuda.synchronize()
    assert out.item() == 1
    assert built == []
    knobs.runtime.launch_enter_hook.add(enter_hook_calls.append)  # the fixture removes it


def _launchers() -> list[type]:
    """This Triton's launcher classes: NVIDIA's and AMD's."""
    from triton.backends.amd.driver import HIPLauncher
    from triton.backends.nvidia.driver import CudaLauncher

    return [CudaLauncher, HIPLauncher]


def _recording_launcher(cls: type, calls: list[tuple], scratch: int = 0) -> object:
    """A launcher of class ``cls`` as Triton builds it for a kernel, but whose C launcher records the
    arguments it is given. Attributes of every Triton version's launchers are set (unused ones are
    harmless); ``scratch``: bytes of global scratch memory per program the kernel needs."""
    launcher = object.__new__(cls)
    for name, value in {
        "num_ctas": 1,
        "warp_size": 64,
        "global_scratch_size": scratch,
        "global_scratch_align": 128,
        "profile_scratch_size": 0,
        "profile_scratch_align": 1,
        "launch_cooperative_grid": False,
        "launch_pdl": True,
        "arg_annotations": ("annotations",),
        "kernel_signature": b"signature",
    }.items():
        setattr(launcher, name, value)
    launcher.launch = lambda *passed: calls.append(passed)
    return launcher


@pytest.mark.parametrize("cls", _launchers(), ids=lambda cls: cls.__name__)
def test_a_direct_launch_passes_what_tritons_launcher_passes(cls: type) -> None:
    calls: list[tuple] = []
    launcher = _recording_launcher(cls, calls)
    grid, function, packed_metadata, stream = (7, 2, 1), 0xF00, (4, 1, 0), 0x5EA
    direct = direct_launch(launcher, grid, function, packed_metadata)
    assert isinstance(direct, DirectLaunch)
    calls.clear()
    for arguments in ([11, 2**40, 1.5], [3]):
        cls.__call__(launcher, *grid, stream, function, packed_metadata, None, None, None, *arguments)
        if direct.packs_arguments:
            direct.c_launch(*direct.head, stream, *direct.middle, tuple(arguments))
        else:
            direct.c_launch(*direct.head, stream, *direct.middle, *arguments)
        assert len(calls) == 2
        assert calls[0] == calls[1]
        calls.clear()


@pytest.mark.parametrize("cls", _launchers(), ids=lambda cls: cls.__name__)
def test_a_kernel_that_needs_scratch_memory_goes_through_tritons_launcher(cls: type) -> None:
    launcher = _recording_launcher(cls, [], scratch=256)
    assert direct_launch(launcher, (1, 1, 1), 0xF00, (4, 1, 0)) is None  # allocated per launch
    launcher.global_scratch_size, launcher.profile_scratch_size = 0, 64
    assert direct_launch(launcher, (1, 1, 1), 0xF00, (4, 1, 0)) is None
    launcher.profile_scratch_size = 0
    assert direct_launch(launcher, (1, 1, 1), 0xF00, (4, 1, 0)) is not None


def test_a_launcher_laid_out_otherwise_goes_through_tritons_launcher() -> None:
    class Unknown:
        global_scratch_size = profile_scratch_size = 0

        def launch(self, *passed: object) -> None: ...

        def __call__(self, grid_x, grid_y, grid_z, stream, function, *rest) -> None:
            self.launch(str(stream), function, *rest)  # the stream converted: not recognisable

    assert direct_launch(Unknown(), (1, 1, 1), 0xF00, (4, 1, 0)) is None


def _bound_without_a_gpu(monkeypatch: pytest.MonkeyPatch, launched: list[tuple]) -> BoundLaunch:
    """A wide probe's ``BoundLaunch`` (its tensor ``out_ptr`` and int ``a0`` given per launch) on a GPU's
    path without a GPU: a stream that is a number, and a first launch per specialization that stands in
    for the JIT with a direct launch recording ``(specialization, stream, arguments)``."""
    fixed = {f"a{i}": i for i in range(1, 20)}
    bound = BoundLaunch(launch_probe_wide_kernel, torch.device("cpu"), (1,), fixed, {"num_warps": 1}, ("out_ptr", "a0"))
    bound._stream = lambda index: 0x5EA

    def compile_without_jit(self: BoundLaunch, key: tuple, values: tuple) -> None:
        def record(stream: int, *arguments: object) -> None:
            launched.append((key, stream, arguments))

        self._compiled[key] = (None, DirectLaunch(record, (), (), packs_arguments=False))
        launched.append((key, "compiled", values))

    monkeypatch.setattr(BoundLaunch, "_compile", compile_without_jit)
    return bound


def test_each_launch_reaches_its_own_specialization_as_they_alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[tuple] = []
    bound = _bound_without_a_gpu(monkeypatch, launched)
    words = torch.zeros(8, dtype=torch.int64)
    aligned, unaligned, other_dtype = words[:2], words[1:3], torch.zeros(2, dtype=torch.int32)
    calls = [(aligned, 3), (aligned, 5), (unaligned, 5), (aligned, 7), (other_dtype, 7), (aligned, 1), (aligned, 2**40)]
    for out, a0 in calls * 2:
        bound(out, a0)
    compiled = [entry for entry in launched if entry[1] == "compiled"]
    # aligned int64 with an int32 a0 (3 and 5 and 7 share it), the unaligned view, int32, a0 == 1, a 64-bit a0
    assert len(compiled) == 5 == len(bound._compiled)
    direct = [entry for entry in launched if entry[1] != "compiled"]
    assert len(direct) == 2 * len(calls) - len(compiled) and bound.launches == 2 * len(calls)
    first_time = set()
    for out, a0 in calls * 2:
        key = (out.dtype, out.data_ptr() % 16 == 0, (-(2**31) <= a0 < 2**31, a0 == 1, a0 % 16 == 0))
        if key in first_time:
            specialization, stream, arguments = direct.pop(0)
            assert specialization == key and stream == 0x5EA
            assert arguments[:2] == (out.data_ptr(), a0) and arguments[2:] == tuple(range(1, 20))
        first_time.add(key)
    assert direct == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launcher runs on a GPU (CPU: the JIT)")
def test_a_bound_launch_on_a_gpu_launches_directly_and_right() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    values = {f"a{i}": int(v) for i, v in enumerate(torch.randint(-1000, 1000, (20,)))}
    from mori_sglang.kernels.probes import launch_probe_wide_kernel

    out = torch.full((1,), -7, dtype=torch.int64, device=device)
    bound = BoundLaunch(launch_probe_wide_kernel, device, (1,), values, {"num_warps": 1}, variable=("out_ptr",))
    bound(out)
    assert all(direct is not None for _, direct in bound._compiled.values())
    for _ in range(3):
        other = torch.full((2,), -7, dtype=torch.int64, device=device)[1:]  # another address, alignment
        bound(other)
        out.fill_(-7)
        bound(out)
        torch.cuda.synchronize()
        assert out.item() == sum(values.values()) and other.item() == sum(values.values())
    assert len(bound._compiled) == 2 and bound.launches == 7


def test_through_tritons_launcher_switches_every_bound_launch_and_back() -> None:
    assert BoundLaunch.direct_launches
    with pytest.raises(RuntimeError), through_tritons_launcher():
        assert not BoundLaunch.direct_launches
        raise RuntimeError("a failing measurement")
    assert BoundLaunch.direct_launches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launcher runs on a GPU (CPU: the JIT)")
def test_a_bound_launch_through_tritons_launcher_makes_no_direct_launch() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    out = torch.full((1,), -7, dtype=torch.int64, device=device)
    bound = BoundLaunch(launch_probe_kernel, device, (1,), {}, {"num_warps": 1}, variable=("out_ptr",))
    bound(out)
    [(key, (kernel, direct))] = bound._compiled.items()

    def refuse(*passed: object) -> None:
        raise AssertionError("a direct launch")

    bound._compiled[key] = (kernel, direct._replace(c_launch=refuse))
    with through_tritons_launcher():
        out.fill_(-7)
        bound(out)
        torch.cuda.synchronize()
    assert out.item() == 1
    with pytest.raises(AssertionError, match="a direct launch"):
        bound(out)
