"""A mask_mod's verdicts along one query row as runs of allowed ``kv_idx``, found without evaluating elements.

For one query row (a fixed ``q_idx``), a mask built from comparisons of affine integer expressions
(``q_idx + offset >= kv_idx``, ``q_idx - kv_idx < window``, combined with ``&``, ``|``, ``^``,
``~`` and boolean ``where``) allows a union of ``kv_idx`` intervals: a comparison of
``a * kv_idx + c`` with 0 holds on a half-line, and the logic operations combine half-lines.
Decoding asks for the verdicts of a few partial key blocks on every step; the intervals answer
with a few integer operations where evaluating the elements costs several array operations.

:func:`allowed_intervals` returns None for anything else (``b``/``h``, lookups or divisions that
depend on ``kv_idx``, products of two ``kv_idx`` terms, ``abs``/``min``/``max``, casts, floats,
small integer dtypes, values that could overflow int32), and the caller evaluates the elements.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from ..mods import ir
from ..mods.lifted_cells import structure
from .spans import ALL, INF, NONE, complement, intersect, union
from ..mods.trace import TracedMod

# |value| below this for every integer node over the key range: no wraparound in int32 or int64,
# so exact Python arithmetic equals torch's
SAFE = 1 << 31
_BUFFER_DTYPES = frozenset((torch.int32, torch.int64, torch.bool))


class NotAffine(Exception):
    """This call's values leave what intervals describe exactly."""


def allowed_intervals(mod: TracedMod, q_idx: int, kv_len: int) -> tuple | None:
    """The ``kv_idx`` values where ``mod`` allows query row ``q_idx`` (``kv_idx`` in ``[0, kv_len)``
    bounds the arithmetic), as sorted disjoint half-open ``(lo, hi)`` pairs, ``-inf``/``inf`` at
    open ends; None when the mod is not of the supported form (see the module docstring)."""
    root, scalars = structure(mod)  # a new decoding offset reuses its template's program
    run = _program(root)
    if run is None:
        return None
    try:
        return run(_Operands(mod.buffers, scalars), q_idx, kv_len)
    except (NotAffine, IndexError):
        return None


class _Operands(NamedTuple):
    """What a program reads besides the row: captured tensors, and the values of ``scalar`` nodes."""

    buffers: tuple
    scalars: tuple


@functools.lru_cache(maxsize=256)
def _program(root: ir.Node) -> Callable | None:
    """The graph as one generated function ``(mod, q_idx, kv_len) -> intervals``: integer nodes as
    two locals ``a``, ``c`` (the value ``a * kv_idx + c``), boolean nodes as interval tuples.
    None when some node is not of the supported form whatever the values."""
    if root.kind != ir.BOOL:
        return None
    order = list(root.walk())
    slot = {id(node): i for i, node in enumerate(order)}
    lines = ["def run(mod, q_idx, S):"]
    for node in order:
        line = _line(node, slot[id(node)], [slot[id(a)] for a in node.args])
        if line is None:
            return None
        lines.append("    " + line)
    lines.append(f"    return v{slot[id(root)]}")
    namespace = {"NotAffine": NotAffine, "SAFE": SAFE, "ALL": ALL, "NONE": NONE, "INF": INF, "_read": _read,
                 "_number": _number, "_at_least": _at_least, "intersect": intersect, "complement": complement,
                 "union": union, "_equal": _equal}
    exec("\n".join(lines), namespace)  # (source made here from the graph's own ops, slots and ints)
    return namespace["run"]


_ARITH = {"add": "{x} + {y}", "sub": "{x} - {y}"}
_CHECK = "\n    if abs(a{i}) * S + abs(c{i}) >= SAFE: raise NotAffine"


def _line(node: ir.Node, i: int, args: list) -> str | None:
    """Python statements computing node ``i`` from its operands' locals, or None (unsupported)."""
    op, kind = node.op, node.kind
    if kind == ir.FLOAT:
        return None
    if op == "input":
        return {"q_idx": f"a{i}, c{i} = 0, q_idx", "kv_idx": f"a{i}, c{i} = 1, 0"}.get(node.attr)
    if op in ("const", "scalar"):
        value = repr(node.attr) if op == "const" else f"mod.scalars[{int(node.attr[0])}]"
        if kind == ir.BOOL:
            return f"v{i} = ALL if _number({value}, bool) else NONE"
        return f"a{i}, c{i} = 0, _number({value}, int)" + _CHECK.format(i=i)
    if op == "buffer":
        return f"v{i} = mod.buffers[{int(node.attr[0])}]"
    if any(a.op == "buffer" for a in node.args[op == "load":]):
        return None  # a captured tensor read other than by a lookup
    if op == "load":
        if any(a.kind != ir.INT for a in node.args[1:]):
            return None  # a boolean index
        value = f"_read(v{args[0]}, ({''.join(f'a{j}, c{j}, ' for j in args[1:])}))"
        if kind == ir.BOOL:
            return f"v{i} = ALL if _number({value}, bool) else NONE"
        return f"a{i}, c{i} = 0, _number({value}, int)" + _CHECK.format(i=i)
    if kind == ir.INT:
        if any(a.kind != ir.INT for a in node.args):
            return None  # a boolean used as a number
        if op in _ARITH:
            x, y = args
            return (f"a{i} = {_ARITH[op].format(x=f'a{x}', y=f'a{y}')}; c{i} = {_ARITH[op].format(x=f'c{x}', y=f'c{y}')}"
                    + _CHECK.format(i=i))
        if op == "neg":
            return f"a{i}, c{i} = -a{args[0]}, -c{args[0]}"
        if op == "mul":  # by a number fixed along the row (a product of two kv_idx terms is not affine)
            x, y = args
            return (f"if a{x} and a{y}: raise NotAffine\n    a{i} = a{x} * c{y} + a{y} * c{x}; c{i} = c{x} * c{y}"
                    + _CHECK.format(i=i))
        if op in ("floordiv", "mod"):  # of numbers fixed along the row; floor semantics in both libraries
            x, y = args
            symbol = "//" if op == "floordiv" else "%"
            return f"if a{x} or a{y} or c{y} == 0: raise NotAffine\n    a{i}, c{i} = 0, c{x} {symbol} c{y}"
        return None
    if op in ("ge", "gt", "le", "lt", "eq", "ne"):
        if any(a.kind != ir.INT for a in node.args):
            return None
        x, y = args
        a, c = f"a{x} - a{y}", f"c{x} - c{y}"  # lhs - rhs, exact (torch compares without forming it)
        return {"ge": f"v{i} = _at_least({a}, {c})", "gt": f"v{i} = _at_least({a}, {c} - 1)",
                "le": f"v{i} = _at_least(a{y} - a{x}, c{y} - c{x})",
                "lt": f"v{i} = _at_least(a{y} - a{x}, c{y} - c{x} - 1)",
                "eq": f"v{i} = _equal({a}, {c})", "ne": f"v{i} = complement(_equal({a}, {c}))"}[op]
    if op == "and":
        return f"v{i} = intersect(v{args[0]}, v{args[1]})"
    if op == "or":
        return f"v{i} = union(v{args[0]}, v{args[1]})"
    if op == "xor":
        x, y = args
        return f"v{i} = union(intersect(v{x}, complement(v{y})), intersect(v{y}, complement(v{x})))"
    if op == "not":
        return f"v{i} = complement(v{args[0]})"
    if op == "where":
        cond, x, y = args
        return f"v{i} = union(intersect(v{cond}, v{x}), intersect(complement(v{cond}), v{y}))"
    return None


def _number(value: Any, kind: type) -> Any:
    """A captured number or 0-d value of the expected Python type (else not describable here)."""
    if type(value) is not kind:
        raise NotAffine
    return value


def _read(t: torch.Tensor, index: tuple) -> Any:
    """``t[index]`` as a Python number, ``index`` the operands' ``(a, c)`` pairs: each must be
    fixed along the row (a lookup by ``kv_idx`` varies) and in range."""
    if not t.is_cpu or t.dtype not in _BUFFER_DTYPES:
        raise NotAffine
    if not index:
        return t.item()
    at = index[1::2]
    if any(index[0::2]) or any(not 0 <= c < n for c, n in zip(at, t.shape)):
        raise NotAffine
    return t[at].item()


def _at_least(a: int, c: int) -> tuple:
    """Where ``a * kv + c >= 0``."""
    if a == 0:
        return ALL if c >= 0 else NONE
    if a > 0:
        return ((-(c // a), INF),)  # kv >= ceil(-c / a)
    return ((-INF, c // -a + 1),)  # kv <= floor(c / -a)


def _equal(a: int, c: int) -> tuple:
    """Where ``a * kv + c == 0``."""
    return intersect(_at_least(a, c), _at_least(-a, -c))
