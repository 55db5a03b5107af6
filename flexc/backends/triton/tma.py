"""Whether a forward launch loads its key/value tiles through tensor descriptors (torch's ``USE_TMA``).

The variant (:mod:`flexc.codegen.tma`) is chosen per call by :func:`choose`:

* ``kernel_options["USE_TMA"]`` (or ``fwd_USE_TMA``) forces it on or off, as in torch;
* otherwise it is off, torch's default on CUDA, unless :data:`flexc.backends.triton.config.DEPARTURES`
  lists a hardware row that shows it faster. The offline instruction count once turned it on (1-5 %
  fewer SASS instructions per key tile); on an H200 a sliding-window forward then ran 2.5x slower
  (0.543 ms against 0.213 ms without, docs/hardware.md): descriptors and fences add code outside the
  loops that every program pays, which short loops do not win back;
* either way only where the key and value tensors meet TMA's layout rules (:func:`tensors_allow`:
  16-byte aligned heads and rows, contiguous head dim), and on CUDA only from sm_90 (TMA's first
  GPU); elsewhere the plain loads run, as torch drops USE_TMA where ``can_use_tma`` fails.

CPU tensors run the variant in Triton's interpreter when it is forced on (the interpreter reads a
descriptor as masked loads), which is how its numerics are tested without a GPU. A CUDA launch of
the variant needs a global-memory allocator for the device-side descriptors (:func:`ensure_allocator`).
"""
from __future__ import annotations

import dataclasses

import torch

from ... import device as gpu
from ...codegen.forward import ForwardSpec
from . import config

OPTION = "USE_TMA"
# TMA's element types among flexc's inputs (float64 tiles keep the plain loads, as in torch)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def requested(kernel_options: dict | None) -> bool | None:
    """The user's ``USE_TMA`` (``fwd_USE_TMA`` overrides it), or None when neither is given."""
    options = kernel_options or {}
    name = f"fwd_{OPTION}" if f"fwd_{OPTION}" in options else OPTION
    if name not in options:
        return None
    value = options[name]
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"flexc: kernel_options[{name!r}] must be a bool, got {type(value).__name__} {value!r}. "
                        f"Fix: pass {OPTION}=True or False.")
    return bool(value)


def by_default(spec: ForwardSpec) -> bool:
    """Whether ``spec``'s kernel takes descriptors when the user does not say: only where
    :data:`~flexc.backends.triton.config.DEPARTURES` lists a hardware row for it (none does: off)."""
    found = config.departure("forward", OPTION, spec.dtype, spec.head_dim)
    return bool(found.value) if found is not None else False


def tensors_allow(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``key`` and ``value`` meet TMA's layout rules: a TMA dtype, the head dim contiguous and
    16 bytes' worth (a whole number of 16-byte units), the base and every other stride 16-byte aligned
    (so each program's head and each key row start 16-byte aligned)."""
    for t in (key, value):
        size = t.element_size()
        if t.dtype not in DTYPES or t.stride(-1) != 1 or t.shape[-1] * size % 16 or t.data_ptr() % 16:
            return False
        if any(stride * size % 16 for stride, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            return False
    return True


def choose(spec: ForwardSpec, key: torch.Tensor, value: torch.Tensor, kernel_options: dict | None) -> ForwardSpec:
    """``spec`` with ``tma`` set where this call loads its key/value tiles through descriptors."""
    asked = requested(kernel_options)
    hopper = spec.target == "cuda" and gpu.facts(key.device).capability >= 90
    if asked is None:
        on = hopper and by_default(spec)
    else:  # forced: on CUDA (or a simulated GPU) only where TMA exists; the interpreter target runs them anyway
        on = asked and (hopper or spec.target == "interpreter")
    if on and tensors_allow(key, value):
        return dataclasses.replace(spec, tma=True)
    return spec


def _allocate(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # the device-side descriptors' scratch: torch's caching allocator on the current device
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton a global-memory allocator for the descriptors a TMA kernel makes on the device
    (torch.empty on the current CUDA device), unless one is set already (the user's, or Inductor's)."""
    import triton
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is not None and not isinstance(current.get(), _allocation.NullAllocator):
        return
    triton.set_allocator(_allocate)


__all__ = ["DTYPES", "OPTION", "by_default", "choose", "ensure_allocator", "requested", "tensors_allow"]
