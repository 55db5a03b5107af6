"""Vector work inside a mod: values over a small captured axis, and their reductions.

A mod may read a captured row as a vector (``q_rope[b, h, q_idx]`` of a ``[B, H, L, D]`` tensor),
combine vectors elementwise, and reduce them (``torch.dot``, ``.sum(-1)``, ``.any(-1)``...). In the
IR, the free dimension is an ``axis`` node (an integer ``0 <= r < n``, ``attr = n``) inside a
``reduce`` node (``attr = (op, n)``) that binds it: a bounded loop. Readers that work on one value
at a time call :func:`unroll`, which rewrites every reduction as the fold of its ``n`` terms (the
axis replaced by ``0 .. n-1``), so range analysis, code generation and differentiation need no
special case; evaluation (:mod:`flexc.mods.evaluate`) keeps the loop vectorised instead.
"""
from __future__ import annotations

import functools
import weakref

from . import ir

AXIS, REDUCE = "axis", "reduce"
REDUCE_OPS = ("sum", "prod", "max", "min", "any", "all")


def axis(n: int) -> ir.Node:
    """The loop variable of a reduction over ``n`` values (an int in ``[0, n)``)."""
    return ir.make(AXIS, (), n, ir.INT)


def reduce(op: str, body: ir.Node, n: int) -> ir.Node:
    """``op`` over the ``n`` values of ``body`` (an expression of :func:`axis` ``(n)``).

    The kind follows torch: ``any``/``all`` give bools, ``sum``/``prod`` of bools or integers give
    integers (int64), ``max``/``min`` keep the body's kind.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; expected one of {REDUCE_OPS}")
    if op in ("any", "all"):
        kind = ir.BOOL
    elif op in ("sum", "prod"):
        kind = ir.FLOAT if body.kind == ir.FLOAT else ir.INT
    else:
        kind = body.kind
    return ir.make(REDUCE, (body,), (op, n), kind)


# weak keys: every trace asks, and a strong cache would keep discarded traces' nodes alive
_free_axes: "weakref.WeakKeyDictionary[ir.Node, frozenset]" = weakref.WeakKeyDictionary()


def free_axes(node: ir.Node) -> frozenset:
    """Sizes of the axes ``node`` reads that no enclosing reduction inside it binds."""
    found = _free_axes.get(node)
    if found is not None:
        return found
    if node.op == AXIS:
        out = frozenset((node.attr,))
    elif node.op == REDUCE:
        out = free_axes(node.args[0]) - {node.attr[1]}
    else:
        out = frozenset()
        for a in node.args:
            out |= free_axes(a)
    _free_axes[node] = out
    return out


def has_reductions(root: ir.Node) -> bool:
    return any(n.op == REDUCE for n in root.walk())


def substitute(node: ir.Node, n: int, value: ir.Node) -> ir.Node:
    """``node`` with :func:`axis` ``(n)`` replaced by ``value`` (reductions over ``n`` inside keep theirs)."""
    memo: dict[int, ir.Node] = {}

    def go(x: ir.Node) -> ir.Node:
        found = memo.get(id(x))
        if found is not None:
            return found
        if x.op == AXIS and x.attr == n:
            out = value
        elif (x.op == REDUCE and x.attr[1] == n) or not x.args or n not in free_axes(x):
            out = x
        else:
            args = tuple(go(a) for a in x.args)
            out = ir.make(x.op, args, x.attr, x.kind)
        memo[id(x)] = out
        return out

    return go(node)


def term(op: str, node: ir.Node) -> ir.Node:
    if op in ("any", "all"):
        return node if node.kind == ir.BOOL else ir.binary("ne", node, ir.const(0))
    if op in ("sum", "prod") and node.kind != ir.FLOAT:
        return ir.cast(node, "int64", ir.INT)  # torch sums bools and integers in int64
    return node


FOLD = {"sum": "add", "prod": "mul", "max": "max", "min": "min", "any": "or", "all": "and"}


@functools.lru_cache(maxsize=1024)
def unroll(root: ir.Node) -> ir.Node:
    """``root`` with every reduction written out as the fold of its terms (no axis nodes left)."""
    if not has_reductions(root):
        return root
    memo: dict[int, ir.Node] = {}

    def go(x: ir.Node) -> ir.Node:
        found = memo.get(id(x))
        if found is not None:
            return found
        if x.op == REDUCE:
            op, n = x.attr
            terms = [term(op, go(substitute(x.args[0], n, ir.const(i)))) for i in range(n)]
            out = terms[0]
            for t in terms[1:]:
                out = ir.binary(FOLD[op] if not (op in ("max", "min") and t.kind == ir.BOOL)
                                else ("or" if op == "max" else "and"), out, t)
        elif not x.args:
            out = x
        else:
            args = tuple(go(a) for a in x.args)
            out = x if all(a is b for a, b in zip(args, x.args)) else ir.make(x.op, args, x.attr, x.kind)
        memo[id(x)] = out
        return out

    return go(root)
