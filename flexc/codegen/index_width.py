"""Whether a mod's integer index arithmetic fits int32 inside a kernel, for given extents.

torch evaluates mods with int64 indices; the kernels pass ``b``, ``h``, ``q_idx`` and ``kv_idx`` as
int32, which is faster but wraps where torch does not (``q_idx * kv_idx`` once L >= 46341). An
interval pass over the IR (:func:`flexc.analysis.ranges.int_range`, the tile classifier's rules)
bounds every integer node for indices in ``[0, extent)``; when a node that
torch computes in int64 is computed in int32 by the kernel and its bound leaves int32, the kernel
must widen the indices to int64 (:func:`index_dtype`). Values read from captured tensors are bounded
by their dtype (their contents may change without a recompile), so the answer depends only on the
mod's structure and the extents, and is cached.
"""
from __future__ import annotations

import math
import threading

import torch

from ..analysis.ranges import TOP_BOOL, IntRange, int_range, where_range
from ..mods import ir
from ..mods.trace import TracedMod

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_UNKNOWN = IntRange(-float(2 ** 63), float(2 ** 63 - 1))  # any int64
_cache: dict[tuple, bool] = {}
_cache_lock = threading.Lock()
_CACHE_LIMIT = 4096


def index_dtype(mods: tuple[TracedMod | None, ...], B: int, H: int, L: int, S: int) -> str:
    """``"int32"`` when every mod's index arithmetic provably fits int32 for these extents, else ``"int64"``."""
    for traced in mods:
        if traced is not None and _overflows(traced, B, H, L, S):
            return "int64"
    return "int32"


def float_indices(B: int, H: int, L: int, S: int) -> bool:
    """Whether every index (``b``, ``h``, ``q_idx``, ``kv_idx``) is below 2**23 for these extents: then
    an index offset by 2**23, and the difference of two, is exact in float32, and the kernels may
    subtract indices in float where the mods read the difference as a float (flexc.codegen.printer)."""
    return max(B, H, L, S) <= 2 ** 23


def _overflows(traced: TracedMod, B: int, H: int, L: int, S: int) -> bool:
    key = (traced.key, B, H, L, S)
    with _cache_lock:
        found = _cache.get(key)
    if found is None:
        found = may_overflow_int32(traced.root, {"b": B, "h": H, "q_idx": L, "kv_idx": S})
        with _cache_lock:
            if len(_cache) >= _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = found
    return found


def may_overflow_int32(root: ir.Node, extents: dict[str, int]) -> bool:
    """Whether some integer node that torch computes in int64 could leave int32 for indices in
    ``[0, extents[name])`` when the index inputs are int32 (as in the kernels). The bounds are
    :mod:`flexc.analysis.ranges`' interval rules over the whole index domain."""
    bounds: dict[int, IntRange] = {}
    wide_in_torch: dict[int, bool] = {}  # computed in int64 by torch
    wide_in_kernel: dict[int, bool] = {}  # computed in int64 by the kernel with int32 indices
    for n in root.walk():
        if n.kind == ir.FLOAT:
            continue
        args = n.args
        if n.op == "input":
            bounds[id(n)] = IntRange(0.0, float(max(0, extents.get(n.attr, 1) - 1)))
            wide_in_torch[id(n)], wide_in_kernel[id(n)] = True, False
            continue
        if n.op == "const":
            value = float(int(n.attr))
            bounds[id(n)] = IntRange(value, value)
            wide_in_torch[id(n)] = wide_in_kernel[id(n)] = False
            continue
        if n.op == "buffer":
            continue
        if n.op in ("load", "cast"):
            dtype = getattr(torch, n.args[0].attr[1] if n.op == "load" else n.attr)
            bounds[id(n)] = _dtype_bounds(dtype)
            wide = dtype == torch.int64
            wide_in_torch[id(n)] = wide_in_kernel[id(n)] = wide
            continue
        if n.kind == ir.BOOL:
            bounds[id(n)] = IntRange(0.0, 1.0)
            wide_in_torch[id(n)] = wide_in_kernel[id(n)] = False
            continue
        operands = args[1:] if n.op == "where" else args
        known = [a for a in operands if id(a) in bounds]
        wide_in_torch[id(n)] = any(wide_in_torch.get(id(a), False) for a in known)
        wide_in_kernel[id(n)] = any(wide_in_kernel.get(id(a), False) for a in known)
        r = _bound(n, [bounds.get(id(a), _UNKNOWN) for a in args])
        if wide_in_torch[id(n)] and not wide_in_kernel[id(n)] and (r.lo < INT32_MIN or r.hi > INT32_MAX):
            return True
        # whatever the rules say, a machine integer stays in int64's range (it wraps, in torch too)
        bounds[id(n)] = IntRange(max(r.lo, _UNKNOWN.lo), min(r.hi, _UNKNOWN.hi))
    return False


def _dtype_bounds(dtype: torch.dtype) -> IntRange:
    if dtype == torch.bool:
        return IntRange(0.0, 1.0)
    info = torch.iinfo(dtype)
    return IntRange(float(info.min), float(info.max))


def _bound(n: ir.Node, args: list[IntRange]) -> IntRange:
    """Bounds of one integer node from its operands' bounds."""
    if n.op == "where":  # either branch: the condition's own bounds are not tracked here
        return where_range(TOP_BOOL, args[1], args[2], ir.INT)
    second = args[1].lo if len(args) == 2 and args[1].lo == args[1].hi and math.isfinite(args[1].lo) else None
    return int_range(n.op, args, None if second is None else int(second))


__all__ = ["index_dtype", "may_overflow_int32"]
