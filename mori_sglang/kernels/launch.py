"""Kernel launches bound once and re-run with the least Python.

Launching through a ``@triton.jit`` function binds every argument, computes its specialization key and
looks the compiled kernel up on every call: tens of µs for the kernels here, more than a decode step's
data movement. A ``BoundLaunch`` fixes a kernel's grid, constexprs, launch options and the arguments
that do not change from step to step (the op's own buffers, as addresses) when it is made. Its first
launch of each specialization goes through Triton's JIT, which compiles (or finds) the kernel; later
launches call the compiled kernel's C launcher directly (``DirectLaunch``) with the arguments that
change per call (the caller's tensors) put in their places, through a launcher generated for the
specialization that only checks the values keep it. Where a launch hook is set (a profiler's),
a launch goes through Triton's own launcher with the hooks and their metadata, as the JIT does. In
Triton's interpreter every launch goes through the JIT.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from triton import knobs
from triton.runtime import driver

# Triton specializes pointer arguments on this alignment (bytes); a compiled kernel is reused only for
# tensors that share the first launch's dtype and alignment.
POINTER_ALIGN = 16


class DirectLaunch(NamedTuple):
    """A compiled kernel's C launcher with everything its Python wrapper would pass it, but the stream
    and the kernel's arguments: ``c_launch(*head, stream, *middle, *arguments)``, or with the arguments
    as one tuple where ``packs_arguments`` (the wrapper's layout differs by Triton version and backend)."""

    c_launch: Callable[..., object]
    head: tuple
    middle: tuple
    packs_arguments: bool


class _Marker:
    """A stand-in the wrapper passes on to its C launcher, found again by identity."""


def direct_launch(
    run: object, grid: tuple[int, int, int], function: object, packed_metadata: object
) -> DirectLaunch | None:
    """How the compiled kernel's launcher ``run`` (Triton's ``CudaLauncher`` or ``HIPLauncher``) calls
    its C launcher for ``grid`` with no launch hooks, read from one call of the wrapper on a copy whose C
    launcher only records its arguments. The wrapper does nothing else per launch where the kernel needs
    no scratch memory, which it would allocate per launch; None there, or for a launcher laid out
    otherwise (the caller then calls ``run``)."""
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0) or not hasattr(run, "launch"):
        return None
    stream, arguments = _Marker(), (_Marker(), _Marker())
    seen: list[tuple] = []

    probe = copy.copy(run)
    probe.launch = lambda *passed: seen.append(passed)
    type(run).__call__(probe, *grid, stream, function, packed_metadata, None, None, None, *arguments)
    if len(seen) != 1:
        return None
    passed = seen[0]
    at = [i for i, value in enumerate(passed) if value is stream]
    if len(at) != 1 or any(isinstance(value, _Marker) for value in passed[: at[0]]):
        return None
    head, rest = passed[: at[0]], passed[at[0] + 1 :]
    if rest[-len(arguments) :] == arguments:
        return DirectLaunch(run.launch, head, rest[: -len(arguments)], packs_arguments=False)
    if rest and rest[-1] == arguments:
        return DirectLaunch(run.launch, head, rest[:-1], packs_arguments=True)
    return None


class _Compiled(NamedTuple):
    """One specialization's compiled kernel and its direct launch (None: through Triton's launcher)."""

    kernel: object
    direct: DirectLaunch | None


class BoundLaunch:
    """One kernel with a fixed grid, fixed constexprs and options, and fixed arguments; the arguments
    named in ``variable`` (tensors or ints) are given per launch, in that order. ``launches`` counts
    the launches. After the first launch of a specialization, Triton's pre-run hooks are not called
    (the provider's kernels have none).

    A launch calls ``_launch``: the checked path (``_launch_checked``), which works the specialization
    out from the values, until a specialization has been launched directly; from then on that
    specialization's direct launcher (``_direct_launcher``), which only confirms that the values keep
    it and hands them to the C launcher, and takes the checked path for anything else."""

    # False: every launch goes through Triton's launcher (``through_tritons_launcher``).
    direct_launches = True

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
        # addresses, constexprs as their values (the launcher ignores them); each launch writes its
        # per-launch values in place.
        self._arguments = [_raw(args[name]) if name in args else options.get(name) for name in names]
        self._compiled: dict[tuple, _Compiled] = {}  # per specialization
        self._direct_launchers: dict[tuple, Callable[..., None]] = {}  # per specialization launched directly
        self._launch: Callable[..., None] = self._launch_checked
        # Straight to the compiled kernel on a GPU; through the JIT in the interpreter (CPU tensors).
        self._stream = driver.active.get_current_stream if device.type == "cuda" else None
        self._device_index = (
            device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        )

    def __call__(self, *values: torch.Tensor | int) -> None:
        """Launch with the per-launch arguments (tensors or ints), in the order ``variable`` named them."""
        self._launch(*values)

    def _launch_checked(self, *values: torch.Tensor | int) -> None:
        """A launch that works its specialization out from the values: the first of each specialization
        (which compiles it), every launch while a hook is set or through Triton's launcher, and in the
        interpreter every launch. A direct launch makes its specialization's direct launcher the one
        the next launch tries."""
        self.launches += 1
        if self._stream is None:
            self.kernel[self.grid](**self._jit_kwargs, **dict(zip(self._variable, values, strict=True)))
            return
        if len(values) != len(self._positions):
            raise TypeError(f"{len(values)} per-launch arguments for {self._variable}")
        arguments = self._arguments
        # The specialization, flat: per tensor its dtype and alignment, per int Triton's three tests.
        specialization: list = []
        for position, value in zip(self._positions, values, strict=False):  # lengths checked above
            if isinstance(value, int):
                arguments[position] = value
                specialization.append(_int_specialization(value))
            else:  # a tensor, by address: Triton specializes on its dtype and alignment
                address = arguments[position] = value.data_ptr()
                specialization.append(value.dtype)
                specialization.append(address % POINTER_ALIGN == 0)
        key = tuple(specialization)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compile(key, values)
            return
        kernel, direct = compiled
        stream = self._stream(self._device_index)
        hooks = launch_hooks()
        if hooks is not None or direct is None or not self.direct_launches:
            enter_hook, exit_hook = hooks or (None, None)
            metadata = None if hooks is None else kernel.launch_metadata(self.grid, stream, *arguments)
            kernel.run(
                *self.grid, stream, kernel.function, kernel.packed_metadata, metadata, enter_hook, exit_hook, *arguments
            )
            return
        if direct.packs_arguments:
            direct.c_launch(*direct.head, stream, *direct.middle, tuple(arguments))
        else:
            direct.c_launch(*direct.head, stream, *direct.middle, *arguments)
        launcher = self._direct_launchers.get(key)
        if launcher is None:
            launcher = self._direct_launchers[key] = self._direct_launcher(key, values, direct)
        self._launch = launcher

    def _direct_launcher(self, key: tuple, values: tuple, direct: DirectLaunch) -> Callable[..., None]:
        """The launch of specialization ``key`` (as ``_launch_checked`` reads it from ``values``) as
        straight-line code, made once per specialization (as Triton makes its own argument binder): it
        reads each tensor's address, and where every value keeps the specialization and no hook is
        set, writes the values and the current stream into the C launcher's arguments, made once here,
        and calls it; otherwise it takes the checked path. A loop over the values, as the checked path
        runs, costs about twice as much per launch."""
        parameters = [f"v{index}" for index in range(len(values))]
        call = [*direct.head, None, *direct.middle]
        stream_at = len(direct.head)
        if direct.packs_arguments:  # the kernel's arguments as one tuple after the rest
            arguments, first = list(self._arguments), 0
        else:  # spread at the end of the call
            call += self._arguments
            arguments, first = call, len(call) - len(self._arguments)
        reads, holds, stores, dtypes = [], [], [], {}
        specialization = iter(key)  # per int its three tests, per tensor its dtype and alignment
        for index, (value, position) in enumerate(zip(values, self._positions, strict=True)):
            name, at = parameters[index], first + position
            if isinstance(value, int):
                tests = zip(_INT_TESTS, next(specialization), strict=True)
                holds += [f"{name}.__class__ is int", *(_holds(test.format(name), outcome) for test, outcome in tests)]
                stores.append(f"arguments[{at}] = {name}")
            else:
                dtypes[f"dtype_{index}"], aligned = next(specialization), next(specialization)
                reads.append(f"a{index} = {name}.data_ptr()")
                holds += [f"{name}.dtype is dtype_{index}", _holds(f"a{index} % {POINTER_ALIGN} == 0", aligned)]
                stores.append(f"arguments[{at}] = a{index}")
        holds += [_no_hooks_test(), "BoundLaunch.direct_launches"]
        signature = ", ".join(parameters)
        lines = [f"def launch({signature}):", "    try:", *(f"        {read}" for read in reads)]
        lines += [f"        same = {' and '.join(holds)}", "    except AttributeError:", "        same = False"]
        lines += ["    if not same:", f"        return checked({signature})", "    bound.launches += 1"]
        lines += [f"    {store}" for store in stores]
        lines += [f"    call[{stream_at}] = stream(device_index)"]
        lines += ["    c_launch(*call, tuple(arguments))" if direct.packs_arguments else "    c_launch(*call)"]
        namespace = {
            "BoundLaunch": BoundLaunch,
            "runtime": knobs.runtime,
            "checked": self._launch_checked,
            "bound": self,
            "call": call,
            "arguments": arguments,
            "stream": self._stream,
            "device_index": self._device_index,
            "c_launch": direct.c_launch,
            **dtypes,
        }
        exec(compile("\n".join(lines), f"<direct launch of {self.kernel.__name__}>", "exec"), namespace)
        return namespace["launch"]

    def _compile(self, key: tuple, values: tuple) -> None:
        """The first launch of a specialization: through the JIT, which compiles or finds the kernel."""
        kernel = self.kernel[self.grid](**self._jit_kwargs, **dict(zip(self._variable, values, strict=True)))
        self._compiled[key] = _Compiled(
            kernel, direct_launch(kernel.run, self.grid, kernel.function, kernel.packed_metadata)
        )


# What Triton specializes an int argument on, as Python tests of the value ``{0}``: whether it fits 32
# bits, is 1, is a multiple of 16. A direct launcher inlines them; the checked path runs them through
# ``_int_specialization``, made from the same tests.
_INT_TESTS = (f"{-(2**31)} <= {{0}} < {2**31}", "{0} == 1", f"{{0}} % {POINTER_ALIGN} == 0")
_int_specialization: Callable[[int], tuple[bool, bool, bool]] = eval(
    f"lambda value: ({', '.join(test.format('value') for test in _INT_TESTS)})"
)


def _no_hooks_test() -> str:
    """Python that is true where no launch hook would run, as ``launch_hooks`` finds, for the kind of
    hook this Triton keeps (a ``HookChain`` from 3.5, a callable or None before); a hook of another
    kind set later makes it false or raise AttributeError, and the launch takes the checked path."""
    if hasattr(knobs.runtime.launch_enter_hook, "calls"):
        return "not runtime.launch_enter_hook.calls and not runtime.launch_exit_hook.calls"
    return "runtime.launch_enter_hook is None and runtime.launch_exit_hook is None"


def _holds(test: str, outcome: bool) -> str:
    """Python that is true where ``test`` comes out as ``outcome``."""
    return test if outcome else f"not ({test})"


@contextmanager
def through_tritons_launcher() -> Iterator[None]:
    """Every ``BoundLaunch`` goes through the compiled kernel's Triton launcher while this is active, as
    before direct launches: the baseline a benchmark measures them against in the same run."""
    BoundLaunch.direct_launches = False
    try:
        yield
    finally:
        BoundLaunch.direct_launches = True


def active_hook(hook: Callable | None) -> Callable | None:
    """A launch hook as the compiled kernel's launcher takes it: None where nothing would run. Triton
    3.6 and 3.7 keep each hook as a ``HookChain``, empty unless a profiler adds to it; handed one, the
    launcher calls it around every launch, and the launch metadata it is given is built on the host
    first, all for nothing (µs per launch). With None the launcher skips both; an older Triton's hook
    (a plain callable or None) passes as it is."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def launch_hooks() -> tuple[Callable | None, Callable | None] | None:
    """Triton's launch enter and exit hooks as the launcher takes them (``active_hook``), or None where
    neither would run: the one test a direct launch needs."""
    runtime = knobs.runtime
    enter_hook, exit_hook = active_hook(runtime.launch_enter_hook), active_hook(runtime.launch_exit_hook)
    if enter_hook is None and exit_hook is None:
        return None
    return enter_hook, exit_hook


def _raw(value: object) -> object:
    """A fixed argument as the launcher takes it: a tensor by its address."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value
