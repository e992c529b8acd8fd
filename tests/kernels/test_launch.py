"""``BoundLaunch``: what it hands the compiled kernel's launcher. Launch hooks are passed only when one
is set (an empty ``HookChain`` would cost the launcher a call around every launch and the host the
launch metadata it is given), and a hook that is set, a profiler's, still sees every launch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from triton import knobs
from triton.knobs import HookChain

from mori_sglang.kernels.launch import BoundLaunch, active_hook
from mori_sglang.kernels.probes import launch_probe_kernel


def _hook(metadata: object) -> None:
    """A launch hook that does nothing."""


def test_an_empty_hook_chain_is_no_hook() -> None:
    assert active_hook(HookChain()) is None
    assert active_hook(None) is None


def test_a_hook_that_is_set_passes_as_it_is() -> None:
    chain = HookChain()
    chain.add(_hook)
    assert active_hook(chain) is chain
    assert active_hook(_hook) is _hook  # an older Triton's single hook


@pytest.fixture
def enter_hook_calls() -> Iterator[list[object]]:
    """Launch metadata seen by a launch enter hook added to Triton's knobs while the test runs."""
    seen: list[object] = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    yield seen
    knobs.runtime.launch_enter_hook.remove(seen.append)


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
    assert enter_hook_calls[0]["name"] == compiled.name

    knobs.runtime.launch_enter_hook.remove(enter_hook_calls.append)
    built = []
    monkeypatch.setattr(type(compiled), "launch_metadata", lambda *args: built.append(args))
    out.fill_(-7)
    bound(out)
    torch.cuda.synchronize()
    assert out.item() == 1
    assert built == []
    knobs.runtime.launch_enter_hook.add(enter_hook_calls.append)  # the fixture removes it
