"""Kernel launches bound once and re-run with the least Python.

Launching through a ``@triton.jit`` function binds every argument, computes its specialization key and
looks the compiled kernel up on every call: tens of µs for the kernels here, more than a decode step's
data movement. A ``BoundLaunch`` fixes a kernel's grid, constexprs, launch options and the arguments
that do not change from step to step (the op's own buffers, as addresses) when it is made. Its first
launch of each specialization goes through Triton's JIT, which compiles (or finds) the kernel; later
launches call that compiled kernel's launcher directly, as the JIT itself does, with the arguments
that change per call (the caller's tensors) put in their places, and without the launch hooks and their
metadata where no hook is set (the JIT passes them always). In Triton's interpreter every launch
goes through the JIT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from triton import knobs
from triton.runtime import driver

# Triton specializes pointer arguments on this alignment (bytes); a compiled kernel is reused only for
# tensors that share the first launch's dtype and alignment.
POINTER_ALIGN = 16


class BoundLaunch:
    """One kernel with a fixed grid, fixed constexprs and options, and fixed arguments; the arguments
    named in ``variable`` (tensors or ints) are given per launch, in that order. ``launches`` counts
    the launches. After the first launch of a specialization, Triton's pre-run hooks are not called
    (the provider's kernels have none)."""

    def __init__(
        self,
        kernel,
        device: torch.device,
        grid: Sequence[int],
        args: Mapping[str, object],
        options: Mapping[str, object],
        variable: Sequence[str] = (),
    ) -> None:
        names = list(kernel.arg_names)
        unknown = set(args) | set(variable)
        unknown -= set(names)
        missing = set(names) - set(args) - set(options) - set(variable)
        if unknown or missing:
            raise TypeError(f"{kernel.__name__}: unknown arguments {sorted(unknown)}, missing {sorted(missing)}")
        self.kernel = kernel
        self.grid = (*grid, *(1,) * (3 - len(grid)))
        self.launches = 0
        self._variable = tuple(variable)
        self._positions = tuple(names.index(name) for name in variable)
        self._jit_kwargs = {**args, **options}
        # Every parameter in order, as the compiled kernel's launcher takes them: fixed tensors as
        # addresses, constexprs as their values (the launcher ignores them), per-launch ones filled in.
        self._arguments = [_raw(args[name]) if name in args else options.get(name) for name in names]
        # Per specialization: the compiled kernel, its launcher, function handle and packed metadata.
        self._compiled: dict[tuple, tuple] = {}
        # Straight to the compiled kernel on a GPU; through the JIT in the interpreter (CPU tensors).
        self._stream = driver.active.get_current_stream if device.type == "cuda" else None
        self._device_index = device.index

    def __call__(self, *values: torch.Tensor | int) -> None:
        """Launch with the per-launch arguments (tensors or ints), in the order ``variable`` named them."""
        self.launches += 1
        if self._stream is None:
            self.kernel[self.grid](**self._jit_kwargs, **dict(zip(self._variable, values, strict=True)))
            return
        arguments = self._arguments
        key = ()
        if values:
            arguments = arguments.copy()
            specialization = []
            for position, value in zip(self._positions, values):  # noqa: B905 (lengths checked below)
                if isinstance(value, int):
                    arguments[position] = value
                    specialization.append((-(2**31) <= value < 2**31, value == 1, value % POINTER_ALIGN == 0))
                else:  # a tensor, by address: Triton specializes on its dtype and alignment
                    address = arguments[position] = value.data_ptr()
                    specialization.append((value.dtype, address % POINTER_ALIGN == 0))
            if len(values) != len(self._positions):
                raise TypeError(f"{len(values)} per-launch arguments for {self._variable}")
            key = tuple(specialization)
        compiled = self._compiled.get(key)
        if compiled is None:
            kwargs = dict(zip(self._variable, values, strict=True))
            compiled = self.kernel[self.grid](**self._jit_kwargs, **kwargs)
            self._compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
            return
        compiled, run, function, packed_metadata = compiled
        stream = self._stream(self._device_index)
        enter_hook = active_hook(knobs.runtime.launch_enter_hook)
        exit_hook = active_hook(knobs.runtime.launch_exit_hook)
        metadata = None
        if enter_hook is not None or exit_hook is not None:
            metadata = compiled.launch_metadata(self.grid, stream, *arguments)
        run(*self.grid, stream, function, packed_metadata, metadata, enter_hook, exit_hook, *arguments)


def active_hook(hook: Callable | None) -> Callable | None:
    """A launch hook as the compiled kernel's launcher takes it: None where nothing would run. Triton
    3.6 and 3.7 keep each hook as a ``HookChain``, empty unless a profiler adds to it; handed one, the
    launcher calls it around every launch, and the launch metadata it is given is built on the host
    first, all for nothing (µs per launch). With None the launcher skips both; an older Triton's hook
    (a plain callable or None) passes as it is."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def _raw(value: object) -> object:
    """A fixed argument as the launcher takes it: a tensor by its address."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value
