"""Launch a compiled Triton kernel through its launcher, as torch's inductor does: no binding per launch.

``fn[grid](*args, **constexprs)`` (``JITFunction.run``) binds every argument to the kernel's
signature, specializes each one (tensor pointers by dtype and 16-byte alignment, integers by
``== 1``, ``% 16`` and width), turns that into the compile cache's string key, checks the kernel's
globals and only then calls the compiled kernel's launcher: about 10 µs of Python per launch of
a forward kernel (its binding and key alone, timed on this project's CPU machines). A flexc call
launches one to four kernels with arguments its plan fixed, so that is host time on every call.

:class:`CompiledLaunches`, kept on each ``JITFunction``, launches the first time through
``JITFunction.run`` and keeps the ``CompiledKernel`` it returns, keyed by what that specialization
depended on (:func:`arguments_key`: each argument's type, a tensor's dtype and alignment, an
integer's specialization classes, the constexprs, warps, stages, device and Triton's debug
switches). A later launch with an equal key calls ``CompiledKernel.run`` with exactly the
arguments ``JITFunction.run`` passes it (every parameter in signature order, constexprs and
defaults included), on the current stream, with Triton's launch hooks. Any argument this cannot
classify, a kernel with pre-run hooks, or Triton's stage-inspection hook sends the launch through
``JITFunction.run`` every time. Triton 3.6 and 3.9 make the same ``CompiledKernel.run`` call.

``FLEXC_COMPILED_LAUNCH=0`` (read at import; :data:`ENABLED` at run time) launches every kernel
through ``JITFunction.run``: what ``bench/gpu.py`` compares against, and a way around this module
should a Triton release change the launcher's call.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

ENABLED = os.environ.get("FLEXC_COMPILED_LAUNCH", "1") != "0"  # (see the module docstring)
MAX_KERNELS = 16  # specializations kept per kernel function (the oldest dropped past that)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = {float: float, bool: bool, type(None): None}  # (Triton does not specialize these by value)


def arguments_key(args: list) -> tuple | None:
    """What Triton specializes ``args`` (the non-constexpr arguments) by, as a hashable key that
    tells apart at least every pair of argument lists it compiles apart: a tensor's dtype and
    16-byte alignment; an integer's ``== 1``, ``% 16 == 0``, 32-bit range and ``>= 2**63``; the
    type of a float, bool or None. None for an argument of another kind."""
    try:  # (one comprehension: this runs at every launch)
        return tuple([(a.dtype, a.data_ptr() & 15 == 0) if type(a) in _TENSORS else
                      (a == 1, a & 15 == 0, (a + 0x80000000) >> 32 == 0, a >> 63 > 0) if type(a) is int else
                      _SCALARS[type(a)] for a in args])
    except KeyError:
        return None


class CompiledLaunches:
    """The compiled kernels of one ``JITFunction``, each with the constexprs and defaults it is
    launched with, kept by :meth:`key` (see the module docstring)."""

    def __init__(self, fn: Any):
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.kernels: dict = {}

    def rest(self, count: int, constants: dict) -> list:
        """The values of the parameters after the first ``count`` (the positional arguments), in
        signature order: from ``constants`` by name, else their defaults."""
        defaults = self.defaults
        return [constants[n] if n in constants else defaults[n] for n in self.names[count:]]

    def bound(self, args: list, constants: dict) -> list:
        """Every parameter's value in signature order (``JITFunction.run``'s ``bound_args.values()``)."""
        return [*args, *self.rest(len(args), constants)]

    def key(self, fn: Any, args: list, constants: dict, options: dict, device_index: int, fixed: int = 0
            ) -> tuple | None:
        """What the compiled kernel for this launch is kept under; None: launch through ``JITFunction.run``.
        The last ``fixed`` arguments (a plan's scalars, the same at each of its launches) are keyed by
        their values and types, which is faster than by :func:`arguments_key` and as safe (equal
        values and types specialize alike)."""
        knobs = _knobs()
        if fn.pre_run_hooks or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
            return None
        split = len(args) - fixed
        facts = arguments_key(args[:split] if fixed else args)
        if facts is None:
            return None
        tail = tuple(args[split:]) if fixed else ()
        return (facts, tail, tuple(map(type, tail)), tuple(constants.items()), tuple(options.items()), device_index,
                knobs.runtime.debug, knobs.compilation.instrumentation_mode)

    def launch(self, fn: Any, grid: tuple, args: list, constants: dict, options: dict, device_index: int,
               fixed: int = 0) -> None:
        """``fn[grid](*args, **constants, **options)`` on the current CUDA device (``device_index``);
        ``fixed`` as :meth:`key` takes it."""
        key = self.key(fn, args, constants, options, device_index, fixed) if ENABLED else None
        try:
            kept = self.kernels.get(key) if key is not None else None
        except TypeError:  # (an unhashable constexpr or fixed scalar: launched as Triton launches it)
            key = kept = None
        if kept is None:
            kernel = fn[grid](*args, **constants, **options)
            if key is not None and hasattr(kernel, "packed_metadata"):
                if len(self.kernels) >= MAX_KERNELS:  # (plans come and go: the oldest are dropped)
                    del self.kernels[next(iter(self.kernels))]
                self.kernels[key] = (kernel, self.rest(len(args), constants))
            return
        kernel, rest = kept
        bound = [*args, *rest]
        stream = current_stream(device_index)
        runtime = _knobs().runtime
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *bound), runtime.launch_enter_hook, runtime.launch_exit_hook,
                   *bound)


@functools.lru_cache(maxsize=None)
def _knobs() -> Any:
    from triton import knobs  # (imported once a kernel is launched: triton is loaded by then)

    return knobs


@functools.lru_cache(maxsize=None)
def _driver() -> Any:
    from triton.runtime.driver import driver

    return driver


def current_stream(device_index: int) -> int:
    """The raw current CUDA stream of the device, as ``JITFunction.run`` asks Triton's driver for it."""
    return _driver().active.get_current_stream(device_index)


def launches_of(fn: Any) -> CompiledLaunches:
    """The :class:`CompiledLaunches` of ``fn`` (kept on it: freed with the kernel's module)."""
    launches = getattr(fn, "_flexc_launches", None)
    if launches is None:
        launches = fn._flexc_launches = CompiledLaunches(fn)
    return launches


__all__ = ["CompiledLaunches", "ENABLED", "MAX_KERNELS", "arguments_key", "current_stream", "launches_of"]
