"""Whether a mod's integer index arithmetic fits int32 inside a kernel, for given extents.

torch evaluates mods with int64 indices; the kernels pass ``b``, ``h``, ``q_idx`` and ``kv_idx`` as
int32, which is faster but wraps where torch does not (``q_idx * kv_idx`` once L >= 46341). An
interval pass over the IR bounds every integer node for indices in ``[0, extent)``; when a node that
torch computes in int64 is computed in int32 by the kernel and its bound leaves int32, the kernel
must widen the indices to int64 (:func:`index_dtype`). Values read from captured tensors are bounded
by their dtype (their contents may change without a recompile), so the answer depends only on the
mod's structure and the extents, and is cached.
"""
from __future__ import annotations

import threading

import torch

from ..mods import ir
from ..mods.trace import TracedMod

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_UNKNOWN = (-(2 ** 63), 2 ** 63 - 1)
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
    ``[0, extents[name])`` when the index inputs are int32 (as in the kernels)."""
    bounds: dict[int, tuple[int, int]] = {}
    wide_in_torch: dict[int, bool] = {}  # computed in int64 by torch
    wide_in_kernel: dict[int, bool] = {}  # computed in int64 by the kernel with int32 indices
    for n in root.walk():
        if n.kind == ir.FLOAT:
            continue
        args = n.args
        if n.op == "input":
            bounds[id(n)] = (0, max(0, extents.get(n.attr, 1) - 1))
            wide_in_torch[id(n)], wide_in_kernel[id(n)] = True, False
            continue
        if n.op == "const":
            value = int(n.attr)
            bounds[id(n)] = (value, value)
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
            bounds[id(n)] = (0, 1)
            wide_in_torch[id(n)] = wide_in_kernel[id(n)] = False
            continue
        operands = args[1:] if n.op == "where" else args
        known = [a for a in operands if id(a) in bounds]
        wide_in_torch[id(n)] = any(wide_in_torch.get(id(a), False) for a in known)
        wide_in_kernel[id(n)] = any(wide_in_kernel.get(id(a), False) for a in known)
        lo, hi = _bound(n, [bounds.get(id(a), _UNKNOWN) for a in args])
        bounds[id(n)] = (lo, hi)
        if wide_in_torch[id(n)] and not wide_in_kernel[id(n)] and (lo < INT32_MIN or hi > INT32_MAX):
            return True
    return False


def _dtype_bounds(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _bound(n: ir.Node, args: list[tuple[int, int]]) -> tuple[int, int]:
    """Bounds of one integer node from its operands' bounds (exact Python integers)."""
    op = n.op
    if op == "add":
        return args[0][0] + args[1][0], args[0][1] + args[1][1]
    if op == "sub":
        return args[0][0] - args[1][1], args[0][1] - args[1][0]
    if op == "neg":
        return -args[0][1], -args[0][0]
    if op == "mul":
        corners = [a * b for a in args[0] for b in args[1]]
        return min(corners), max(corners)
    if op == "abs":
        lo, hi = args[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if op in ("min", "max"):
        pick = min if op == "min" else max
        return pick(args[0][0], args[1][0]), pick(args[0][1], args[1][1])
    if op == "where":
        return min(args[1][0], args[2][0]), max(args[1][1], args[2][1])
    if op in ("floordiv", "mod") and args[1][0] == args[1][1] and args[1][0] > 0:
        divisor = args[1][0]
        if op == "mod":
            return 0, divisor - 1
        return args[0][0] // divisor, args[0][1] // divisor
    if op == "pow" and args[1][0] == args[1][1] and 0 <= args[1][0] <= 8:
        e = args[1][0]
        corners = [args[0][0] ** e, args[0][1] ** e] + ([0] if args[0][0] <= 0 <= args[0][1] else [])
        return min(corners), max(corners)
    return _UNKNOWN


__all__ = ["index_dtype", "may_overflow_int32"]
