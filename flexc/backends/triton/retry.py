"""Launching again when a GPU cannot run a kernel's configuration: the one loop every Triton launch uses.

The forward, backward and decode launches each hand :func:`launch_with_fallbacks` one attempt (get
the kernel for a spec, build its arguments, launch it). It runs the attempt with the spec that last
worked on this GPU (:func:`flexc.backends.triton.cache.resolve_fallback`, kept per compute
capability) and handles exactly two failures:

* Triton's ``OutOfResources`` (a configuration needing more shared memory, tensor memory or
  threads than this GPU has, raised when the compiled kernel is loaded, before it runs): the
  attempt runs again with :func:`flexc.backends.triton.config.smaller_config`'s spec;
* a TMA variant that does not compile (Triton's ``CompilationError`` or ``PTXASError``, or MLIR's
  "PassManager::run failed" ``RuntimeError``): it runs again with plain loads (the same results).

What replaced the spec is remembered for it on GPUs of this compute capability and warned once,
when it has run, with a :class:`flexc.errors.FallbackWarning` saying what failed and what runs now.
Every other exception propagates unchanged.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, TypeVar

import torch

from ... import device as gpu
from ...errors import FallbackWarning
from . import cache, config

T = TypeVar("T")

# the RuntimeError Triton's MLIR pipeline raises when a pass fails (triton 3.6 and 3.9 alike)
PASS_FAILURE = "PassManager::run failed"


def triton_errors() -> tuple[type, tuple[type, ...]]:
    """``(OutOfResources, the errors a TMA variant's compile may raise)`` of the installed Triton (imported
    only once a kernel runs; the same modules in Triton 3.6 and 3.9). A ``RuntimeError`` among the
    latter is one only with :data:`PASS_FAILURE` in its message."""
    cache.require_triton()  # (without Triton: an ImportError saying how to install it)
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return OutOfResources, (CompilationError, PTXASError, RuntimeError)


def launch_with_fallbacks(spec: Any, device: torch.device, attempt: Callable[[Any], T], kernel: str) -> T:
    """``attempt(spec)``, or ``attempt`` of the spec that replaces ``spec`` on this GPU after it runs out
    of resources or its TMA variant fails to compile (see the module docstring). ``attempt`` must leave
    nothing half done when it raises (the retry starts it over); ``kernel`` names the kernel in the
    warning ("forward", "backward", "decode"), one warning once the replacement runs."""
    spec = cache.resolve_fallback(spec, device)
    out_of_resources, compile_errors = triton_errors()
    first, why = spec, {}  # what failed: the first failure of each kind, in order
    while True:
        try:
            result = attempt(spec)
        except out_of_resources as e:
            # e.g. a score_mod that loads whole [BLOCK_M, BLOCK_N] tiles of a captured tensor:
            # pipelining them needs more shared memory than the default tiles leave
            replacement = config.smaller_config(spec)
            if replacement is None:
                raise
            why.setdefault("resources", f"with {config.tiles_text(spec)} it needs more GPU resources than "
                                        f"{_gpu_name(device)} has ({e})")
        except compile_errors as e:
            if not getattr(spec, "tma", False) or (isinstance(e, RuntimeError) and PASS_FAILURE not in str(e)):
                raise  # not a descriptor variant's compile failure: the caller's error
            # TMA's device-side descriptors depend on the Triton version and the driver: where they
            # fail to compile, the plain loads (the same results) run
            replacement = dataclasses.replace(spec, tma=False)
            why.setdefault("tma", f"its TMA key/value loads (USE_TMA) failed to compile for {_gpu_name(device)} "
                                  f"({type(e).__name__}: {e})")
        else:
            if why:
                _warn(first, spec, kernel, list(why.values()))
            return result
        cache.remember_fallback(spec, replacement, device)
        spec = replacement


def _warn(first: Any, final: Any, kernel: str, why: list[str]) -> None:
    plain = " with plain loads" if getattr(first, "tma", False) and not final.tma else ""
    fix = ("pass kernel_options={'USE_TMA': False}" if plain and config.tiles_text(first) == config.tiles_text(final)
           else f"pass these tiles in kernel_options{' and USE_TMA=False' if plain else ''}")
    warnings.warn(f"flexc: the {kernel} kernel cannot run as configured: {'; '.join(why)}. It runs with "
                  f"{config.tiles_text(final)}{plain} from now on, on GPUs of this capability. Fix: {fix} to skip "
                  f"the attempt.", FallbackWarning, stacklevel=4)


def _gpu_name(device: torch.device) -> str:
    return f"{device} ({gpu.facts(device).name})" if gpu.is_gpu(device) else str(device)


__all__ = ["PASS_FAILURE", "launch_with_fallbacks", "triton_errors"]
