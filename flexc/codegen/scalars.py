"""Captured Python numbers become kernel arguments, so new values reuse one compiled kernel.

A mod such as ``lambda score, b, h, q_idx, kv_idx: score / temperature`` is traced with the number
``temperature`` holds, as a constant. Baked into the kernel source, every new temperature would
compile (and keep) another kernel. :func:`lift_scalars` replaces such constants by ``scalar``
placeholder nodes named after the variable; the cache key then holds the placeholder, the
generated function takes ``score_mod_temperature`` as a parameter, and the launcher passes
:attr:`TracedMod.scalars`.

Only numbers the mod captures by name (closures, defaults, ``functools.partial`` arguments,
globals) are lifted, and only where the value is not structural: an operand of ``+ - * /``,
``min``/``max``, a comparison or a ``where`` branch, next to an int64 value (ints) or a value that
is not float64 (floats, which travel as fp32 kernel arguments, as torch computes them for fp32
scores). Indices, divisors of ``//`` and ``%``, exponents, casts and infinities stay literals: they
shape the code, and a narrow integer operand must keep torch's wraparound. Numbers computed inside
the mod from captured ones (``2 * temperature``) are new constants and stay literals too.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from ..mods import ir
from ..device import is_gpu
from ..mods.promotion import node_dtype
from ..mods.traced_mod import TracedMod
from ..mods.tracing.captures import captured_numbers

_LIFT_OPS = {"add", "sub", "mul", "truediv", "min", "max"} | ir.COMPARE_OPS
_memo: "weakref.WeakKeyDictionary[TracedMod, dict]" = weakref.WeakKeyDictionary()  # -> {lift floats: lifted}


def lift_scalars(traced: TracedMod | None, floats: bool = True) -> TracedMod | None:
    """``traced`` with its captured, non-structural numbers replaced by ``scalar`` nodes whose
    values are in ``.scalars`` (``traced`` itself when there are none). ``floats=False`` keeps
    captured floats literals (see :func:`floats_travel_exactly`)."""
    if traced is None:
        return None
    lifted = _memo.get(traced, {}).get(floats)
    if lifted is None:
        lifted = _lift(traced, floats)
        _memo.setdefault(traced, {})[floats] = lifted
    return lifted


def lift_for_call(query: torch.Tensor, *mods: TracedMod | None) -> tuple:
    """:func:`lift_scalars` of each mod, for a kernel call on ``query``."""
    floats = floats_travel_exactly(query)
    return tuple(lift_scalars(mod, floats) for mod in mods)


def floats_travel_exactly(query: torch.Tensor) -> bool:
    """Whether a captured float can be a kernel argument for this call without rounding: a compiled
    kernel receives a Python float as fp32, which a float64 call on a GPU would feel (torch
    computes its mod in float64); Triton's interpreter keeps float64."""
    return query.dtype != torch.float64 or not is_gpu(query.device)


def _liftable(const: ir.Node, other: ir.Node, names: dict, floats: bool) -> bool:
    if const.op != "const" or type(const.attr) not in ((int, float) if floats else (int,)) \
            or (type(const.attr), const.attr) not in names:
        return False
    if isinstance(const.attr, float) and not math.isfinite(const.attr):
        return False
    dtype = node_dtype(other)
    if dtype is None:  # arithmetic of constants: folded into a literal by the printer
        return False
    return dtype == torch.int64 if type(const.attr) is int else dtype != torch.float64


def _lift(traced: TracedMod, floats: bool) -> TracedMod:
    names: dict[tuple, str] = {}
    for name, value in captured_numbers(traced.fn).items():
        names.setdefault((type(value), value), name)
    if not names:
        return traced
    placeholders: dict[tuple, ir.Node] = {}
    values: list = []
    used: set[str] = set()

    def placeholder(const: ir.Node) -> ir.Node:
        key = (type(const.attr), const.attr)
        if key not in placeholders:
            name = names[key]
            if name in used:
                name = f"{name}_{len(values)}"
            used.add(name)
            placeholders[key] = ir.scalar(len(values), const.kind, name)
            values.append(const.attr)
        return placeholders[key]

    rebuilt: dict[int, ir.Node] = {}
    for node in traced.root.walk():
        args = [rebuilt[id(a)] for a in node.args]
        if node.op in _LIFT_OPS or node.op == "where":
            pair = (0, 1) if node.op != "where" else (1, 2)
            for i, j in (pair, pair[::-1]):
                if _liftable(node.args[i], node.args[j], names, floats):
                    args[i] = placeholder(node.args[i])
        same = all(a is b for a, b in zip(args, node.args))
        rebuilt[id(node)] = node if same else ir.make(node.op, tuple(args), node.attr, node.kind)
    if not values:
        return traced
    return dataclasses.replace(traced, root=rebuilt[id(traced.root)], scalars=tuple(values))


__all__ = ["floats_travel_exactly", "lift_for_call", "lift_scalars"]
