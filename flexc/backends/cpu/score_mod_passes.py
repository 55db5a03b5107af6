"""A general score_mod rewritten for the plain-torch CPU forward's passes over a score tile.

The row loop (:mod:`flexc.backends.cpu.torch_cpu`) softmaxes in base 2 and applies a score_mod
elementwise to each tile of scores; each elementwise step is a pass over the tile. Two rewrites
on the traced IR save passes: :func:`log2_form` moves a constant factor on every read of
``score`` into the query's scale and folds ``log2(e)`` into a trailing constant product, and
:func:`value_bounds` proves a mod's values bounded (tanh, sigmoid), so its bound can be the
softmax's fixed offset instead of a running row max.
"""
from __future__ import annotations

import functools
import math

from ...constants import LOG2E
from ...mods import ir


def _number(node: ir.Node) -> float | None:
    """The value of a finite, nonzero numeric constant node, else None."""
    if node.op != "const" or isinstance(node.attr, bool) or not isinstance(node.attr, (int, float)):
        return None
    value = float(node.attr)
    return value if value != 0 and math.isfinite(value) else None


@functools.lru_cache(maxsize=256)
def log2_form(root: ir.Node) -> tuple[ir.Node, float, bool]:
    """``(root', pre, folded)`` with ``root'(score * pre) == root(score)``, times ``log2(e)`` if
    ``folded``: the forward's general score_mods in as few passes over a score tile as their graph allows.

    * every read of ``score`` is ``score / K`` or ``score * K`` with one constant factor: the
      factor moves into the query's scale (soft-capping's ``score / cap``), a pass saved;
    * the mod ends in a product with a constant: ``log2(e)``, which the base-2 softmax needs, joins
      that constant (soft-capping's ``cap * ...``), another pass saved.

    Values agree up to rounding (one product of constants instead of two products of tensors).
    """
    score = ir.input_("score")
    users = [n for n in root.walk() if any(a is score for a in n.args)]
    factors = set()
    for n in users:
        x, y = (n.args + (None,))[:2]
        if n.op == "truediv" and x is score and _number(y) is not None:
            factors.add(1.0 / _number(y))
        elif n.op == "mul" and x is score and _number(y) is not None:
            factors.add(_number(y))
        elif n.op == "mul" and y is score and _number(x) is not None:
            factors.add(_number(x))
        else:
            factors.add(None)
    pre, mapping = 1.0, {}
    if len(factors) == 1 and None not in factors and root is not score:
        pre = factors.pop()
        mapping = {id(n): score for n in users}
    folded = False
    if root.op == "mul" and root.kind == ir.FLOAT and id(root) not in mapping:
        x, y = root.args
        if _number(x) is not None:
            mapping[id(root)] = ir.binary("mul", ir.const(_number(x) * LOG2E), _substitute(y, mapping))
            folded = True
        elif _number(y) is not None:
            mapping[id(root)] = ir.binary("mul", _substitute(x, mapping), ir.const(_number(y) * LOG2E))
            folded = True
    return _substitute(root, mapping), pre, folded


@functools.lru_cache(maxsize=256)
def tanh_cap(root: ir.Node) -> tuple[float, float] | None:
    """``(pre, cap)`` when the mod is ``cap * tanh(score * pre)`` (soft-capping, written with ``/`` or
    ``*`` by constants, ``cap`` on either side or absent), else None. Its slope is then
    ``cap * pre * (1 - tanh^2)``: the backward forms it in place from the tanh it keeps, instead
    of recording the mod's three tensor ops for autograd."""
    cap = 1.0
    if root.op == "mul" and root.kind == ir.FLOAT:
        x, y = root.args
        cap, root = (_number(x), y) if _number(x) is not None else (_number(y), x)
        if cap is None:
            return None
    if root.op != "tanh":
        return None
    inner, score = root.args[0], ir.input_("score")
    if inner is score:
        return 1.0, cap
    x, y = (inner.args + (None,))[:2]
    if inner.op == "truediv" and x is score and _number(y) is not None:
        return 1.0 / _number(y), cap
    if inner.op == "mul" and x is score and _number(y) is not None:
        return _number(y), cap
    if inner.op == "mul" and y is score and _number(x) is not None:
        return _number(x), cap
    return None


# A score_mod whose values provably lie within this many natural-log units takes a fixed softmax
# offset instead of a running row max: exp(s - hi) stays above e^-64 (a normal float32 or float64)
FIXED_MAX_SPAN = 64.0


@functools.lru_cache(maxsize=256)
def value_bounds(node: ir.Node) -> tuple[float, float] | None:
    """``(lo, hi)`` enclosing every non-NaN value of a float ``node`` whatever its inputs (tanh and
    sigmoid bound anything; constants, negation, sums, differences, products, division by a constant
    and ``where`` combine bounds), or None."""
    op, args = node.op, node.args
    if op == "const":
        value = node.attr
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value), float(value)
    if op == "tanh":
        return -1.0, 1.0
    if op == "sigmoid":
        return 0.0, 1.0
    if op == "neg":
        b = value_bounds(args[0])
        return None if b is None else (-b[1], -b[0])
    if op == "where":
        x, y = value_bounds(args[1]), value_bounds(args[2])
        return None if x is None or y is None else (min(x[0], y[0]), max(x[1], y[1]))
    if op not in ("add", "sub", "mul", "truediv"):
        return None
    x, y = value_bounds(args[0]), value_bounds(args[1])
    if x is None or y is None:
        return None
    if op == "add":
        return x[0] + y[0], x[1] + y[1]
    if op == "sub":
        return x[0] - y[1], x[1] - y[0]
    if op == "truediv":
        if y[0] != y[1] or y[0] == 0:
            return None  # only by a constant
        y = (1.0 / y[0], 1.0 / y[0])
    products = [a * b for a in x for b in y]
    return min(products), max(products)


def _substitute(root: ir.Node, mapping: dict) -> ir.Node:
    """``root`` with the nodes whose ids ``mapping`` holds replaced by their values."""
    new: dict[int, ir.Node] = {}
    for n in root.walk():
        if id(n) in mapping:
            new[id(n)] = mapping[id(n)]
        elif n.args:
            args = tuple(new[id(a)] for a in n.args)
            same = all(a is b for a, b in zip(args, n.args))
            new[id(n)] = n if same else ir.make(n.op, args, n.attr, n.kind)
        else:
            new[id(n)] = n
    return new[id(root)]
