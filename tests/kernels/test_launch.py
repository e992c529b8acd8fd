"""``BoundLaunch``: what it hands the compiled kernel's launcher. Launch hooks are passed only when one
is set (an empty ``HookChain`` would cost the launcher a call around every launch and the host the
launch metadata it is given), and a hook that is set, a profiler's, still sees every launch. Without
hooks it calls the C launcher directly, with what Triton's own launcher (this Triton's, NVIDIA's and
AMD's) would pass it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
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


STREAM = 0x5EA
FIXED = tuple(range(1, 20))  # the wide probe's a1..a19


class _RecordingKernel:
    """A compiled kernel's stand-in whose Triton launcher records ``(key, "Triton's launcher", stream,
    hooks given, arguments)``."""

    function, packed_metadata = 0xF00, (4, 1, 0)

    def __init__(self, key: tuple, launched: list[tuple]) -> None:
        self.key, self.launched = key, launched

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *arguments) -> None:
        self.launched.append((self.key, "Triton's launcher", stream, enter is not None, arguments))

    def launch_metadata(self, grid: tuple, stream: int, *arguments: object) -> dict:
        return {"name": "launch_probe_wide_kernel"}


class _BoundWithoutAGpu(BoundLaunch):
    """A wide probe's ``BoundLaunch`` (its tensor ``out_ptr`` and int ``a0`` given per launch) on a GPU's
    path without a GPU: a stream that is a number, and a first launch per specialization that stands in
    for the JIT, recording ``(key, "compiled", values)``. A direct launch records ``(key, "direct",
    stream, arguments)``, from a C launcher that takes them spread or, with ``packs``, as one tuple,
    each after a head and a middle. ``checked`` counts the launches that took the checked path."""

    def __init__(self, launched: list[tuple], packs: bool = False) -> None:
        fixed = {f"a{i}": value for i, value in enumerate(FIXED, start=1)}
        super().__init__(
            launch_probe_wide_kernel, torch.device("cpu"), (1,), fixed, {"num_warps": 1}, ("out_ptr", "a0")
        )
        self._stream = lambda index: STREAM
        self.launched, self.packs, self.checked = launched, packs, 0

    def _launch_checked(self, *values: torch.Tensor | int) -> None:
        self.checked += 1
        super()._launch_checked(*values)

    def _compile(self, key: tuple, values: tuple) -> None:
        def record(head: str, stream: int, middle: str, *arguments: object) -> None:
            assert (head, middle) == ("head", "middle")
            self.launched.append((key, "direct", stream, arguments[0] if self.packs else arguments))

        direct = DirectLaunch(record, ("head",), ("middle",), packs_arguments=self.packs)
        self._compiled[key] = (_RecordingKernel(key, self.launched), direct)
        self.launched.append((key, "compiled", values))


def _key(out: torch.Tensor, a0: int) -> tuple:
    """The specialization Triton gives the wide probe's per-launch ``out_ptr`` and ``a0``."""
    return (out.dtype, out.data_ptr() % 16 == 0, (-(2**31) <= a0 < 2**31, a0 == 1, a0 % 16 == 0))


_WORDS = torch.zeros(16, dtype=torch.int64)
# Per-launch tensors: aligned, unaligned, another dtype, and another aligned address of the first's kind.
_OUTS = (_WORDS[:2], _WORDS[1:3], torch.zeros(2, dtype=torch.int32), _WORDS[2:4])
# Per-launch ints of every specialization: 32 bits or not, 1 or not, a multiple of 16 or not.
_A0S = (3, 5, 1, 16, 0, -7, 2**40, 2**40 + 16, -(2**31) - 1, 2**31 - 1)


@settings(max_examples=60, deadline=None)
# Aligned int64 with an int32 a0 (3, 5 and 7 share it), the unaligned view, int32, a0 == 1, a 64-bit a0,
# in turn and again.
@example(calls=[(0, 3), (0, 5), (1, 5), (0, 7), (2, 7), (0, 1), (0, 2**40)] * 2, packs=False)
@given(
    calls=st.lists(st.tuples(st.sampled_from(range(len(_OUTS))), st.sampled_from(_A0S)), min_size=1, max_size=24),
    packs=st.booleans(),
)
def test_each_launch_reaches_its_own_specialization_with_its_own_values(
    calls: list[tuple[int, int]], packs: bool
) -> None:
    launched: list[tuple] = []
    bound = _BoundWithoutAGpu(launched, packs)
    compiled: set[tuple] = set()
    direct_key = None  # the specialization whose direct launcher a launch tries first
    checked = 0
    expected: list[tuple] = []
    for index, a0 in calls:
        out = _OUTS[index]
        bound(out, a0)
        key = _key(out, a0)
        if key != direct_key:
            checked += 1  # a launch of another specialization goes through the checked path
        if key in compiled:
            expected.append((key, "direct", STREAM, (out.data_ptr(), a0, *FIXED)))
            direct_key = key
        else:
            expected.append((key, "compiled", (out, a0)))
            compiled.add(key)
    assert launched == expected
    assert bound.launches == len(calls) and bound.checked == checked
    assert len(bound._compiled) == len(compiled)


def test_a_value_of_another_kind_takes_the_checked_path() -> None:
    launched: list[tuple] = []
    bound = _BoundWithoutAGpu(launched)
    out = _OUTS[0]
    for _ in range(3):
        bound(out, 3)
    assert bound.checked == 2  # the compile, then the direct launch that makes the direct launcher
    bound(out, out)  # a tensor where the specialization has an int
    bound(7, 3)  # an int where it has a tensor
    assert bound.checked == 4 and bound.launches == 5
    assert [entry[1] for entry in launched] == ["compiled", "direct", "direct", "compiled", "compiled"]


@needs_hook_chains
def test_a_hook_set_after_the_direct_launcher_is_made_still_sees_every_launch(enter_hook_calls: list[object]) -> None:
    knobs.runtime.launch_enter_hook.remove(enter_hook_calls.append)
    launched: list[tuple] = []
    bound = _BoundWithoutAGpu(launched)
    out = _OUTS[0]
    for _ in range(3):
        bound(out, 3)
    key, arguments = _key(out, 3), (out.data_ptr(), 3, *FIXED)
    knobs.runtime.launch_enter_hook.add(enter_hook_calls.append)  # the fixture removes it
    bound(out, 3)
    assert launched[-1] == (key, "Triton's launcher", STREAM, True, arguments)
    knobs.runtime.launch_enter_hook.remove(enter_hook_calls.append)
    bound(out, 3)
    assert launched[-1] == (key, "direct", STREAM, arguments)
    with through_tritons_launcher():
        bound(out, 3)
    assert launched[-1] == (key, "Triton's launcher", STREAM, False, arguments)
    bound(out, 3)
    assert launched[-1] == (key, "direct", STREAM, arguments)
    assert bound.launches == 7 and len(launched) == 7
    knobs.runtime.launch_enter_hook.add(enter_hook_calls.append)


def test_an_older_tritons_hook_set_after_the_direct_launcher_is_made_still_sees_every_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)  # a Triton before 3.5: None where unset
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    launched: list[tuple] = []
    bound = _BoundWithoutAGpu(launched)
    out = _OUTS[0]
    for _ in range(3):
        bound(out, 3)
    assert bound.checked == 2
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _hook)
    bound(out, 3)
    assert launched[-1][1:4] == ("Triton's launcher", STREAM, True) and bound.checked == 3


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
    fresh = [torch.full((4,), -7, dtype=torch.int64, device=device) for _ in range(3)]
    for out in fresh:  # one specialization at new addresses: the direct launcher made for it launches them
        bound(out)
    torch.cuda.synchronize()
    assert [out[0].item() for out in fresh] == [sum(values.values())] * 3 and (fresh[0][1:] == -7).all()
    assert bound._launch in bound._direct_launchers.values() and bound.launches == 10


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
