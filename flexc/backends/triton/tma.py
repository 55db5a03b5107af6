"""Whether a forward launch loads its key/value tiles through tensor descriptors (torch's ``USE_TMA``).

The variant (:mod:`flexc.codegen.tma`) is chosen per call by :func:`choose`:

* ``kernel_options["USE_TMA"]`` (or ``fwd_USE_TMA``) forces it on or off, as in torch;
* otherwise the static rule :func:`by_default` picks it on sm_90 and newer only for the kernels
  whose offline compile for sm_90 (``python bench/kernel_metrics.py --forward --tma``) shows it no
  worse than plain loads: no more SASS instructions per (query, key) pair in any key-tile loop, no
  lost ring slots, no spills, no C7511;
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
    """The static rule: whether the sm_90 kernel for ``spec`` takes descriptors when the user does not say.

    Measured with ``python bench/kernel_metrics.py --forward --tma`` (bf16, sm_90, B=2, H=16,
    L=S=4096, the catalogue's causal, sliding-window 256, document, ALiBi + causal and soft-cap +
    causal at D=64 and D=128, each at its default tiles: 128x128 w8 s3 at D=64, 128x64 w8 s3 at
    D=128). In nine of the ten, TMA issues 1-5% fewer SASS instructions per key tile in both loops
    (e.g. causal D=128: partial 461 -> 447, full 384 -> 365), keeps 3 ring slots, spills nothing, no
    C7511, one more KiB of shared memory (the TMA barriers). The tenth is document at D=64: its
    partial loop is 870 instructions with TMA against 866 plain (+0.5%; full 474 against 485). Its
    mask_mod gathers a captured tensor at the key index (``document_id[kv_idx]``), a per-key-tile
    load that no descriptor carries: it stays a cp.async copy, so that loop pays the TMA barriers'
    bookkeeping (waits, arrivals, elected threads) and the cp.async groups' too, which at D=64's
    128x128 tile outweighs the address arithmetic TMA saves (document at D=128: 579 -> 571).
    So the rule is exactly what was measured: bf16, key and value head dims both 64 or both 128,
    the default tiles, no dropout and no sinks, and at D=64 no mod lookup indexed by ``kv_idx``
    (:func:`gathers_per_key`). Other cases (fp16, fp32, other head dims, the user's tiles) keep the
    plain loads until measured.
    """
    if spec.dtype != torch.bfloat16 or spec.head_dim != spec.v_head_dim or spec.head_dim not in (64, 128):
        return False
    if spec.dropout or spec.sinks:
        return False
    if spec.head_dim == 64 and gathers_per_key(spec):
        return False
    default = config.default_config(spec.dtype, spec.head_dim, spec.v_head_dim, spec.target)
    return (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == default


def gathers_per_key(spec: ForwardSpec) -> bool:
    """Whether a mod of ``spec`` reads a captured tensor at an index that depends on ``kv_idx`` (a
    load per key tile besides the key and value tiles, e.g. ``document_id[kv_idx]``)."""
    for traced in (spec.score_mod, spec.mask_mod):
        if traced is None:
            continue
        for node in traced.root.walk():
            if node.op == "load" and any(leaf.op == "input" and leaf.attr == "kv_idx"
                                         for index in node.args[1:] for leaf in index.walk()):
                return True
    return False


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


__all__ = ["DTYPES", "OPTION", "by_default", "choose", "ensure_allocator", "gathers_per_key", "requested",
           "tensors_allow"]
