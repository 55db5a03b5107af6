"""Canonical affine forms of integer mask expressions, found once per expression.

``(q_idx + 5) - (kv_idx + 5) >= 0`` and ``q_idx >= kv_idx`` are the same comparison; interval
arithmetic on the first loses exactness (each ``+ 5`` is bounded separately only by luck, and
``x - x`` is not 0 in interval arithmetic). Rewriting ``lhs - rhs`` as ``sum(c_i * atom_i) + d``
with like terms collected removes that dependency: over a box, the exact minimum and maximum of an
affine form in independent variables is a corner computation.

Like terms are collected directly when the expression is linear; expressions with products of
non-constants are expanded with sympy, which cancels what cancels. Atoms are the mod inputs
(``b``, ``h``, ``q_idx``, ``kv_idx``) and every sub-expression that is not ``+``, ``-``, unary
minus or multiplication (``//``, ``%``, lookups, ``where``, min/max, casts, bools used as numbers). Atoms are bounded by the interval analysis in :mod:`flexc.analysis.ranges`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..mods import ir

_LINEAR_OPS = {"add", "sub", "neg", "mul"}


@dataclass(frozen=True)
class AffineForm:
    """``sum(coefficient * atom for atom, coefficient in terms) + const`` with integer coefficients."""

    terms: tuple  # ((atom Node, nonzero int coefficient), ...), in a stable order
    const: int

    def atoms(self) -> tuple:
        return tuple(atom for atom, _ in self.terms)


_cache: dict[tuple, AffineForm | None] = {}


def affine_difference(lhs: ir.Node, rhs: ir.Node, opaque: Iterable[ir.Node] = ()) -> AffineForm | None:
    """The affine form of ``lhs - rhs``, or None when it is not affine (a product of two
    non-constant terms, or a float operand).

    Nodes in ``opaque`` are kept as atoms even when they are sums or products; the range analysis
    passes the nodes whose machine value may have wrapped around, so that the form never claims
    exact arithmetic the evaluation does not do. Results are cached per ``(lhs, rhs, opaque)``:
    nodes are hash-consed, so this is once per expression, not once per call.
    """
    opaque_ids = frozenset(id(n) for n in opaque)
    key = (lhs, rhs, opaque_ids)
    if key in _cache:
        return _cache[key]
    form = _compute(lhs, rhs, opaque_ids)
    if len(_cache) > 4096:  # a bound, not an LRU: mods are few and their forms are small
        _cache.clear()
    _cache[key] = form
    return form


def _compute(lhs: ir.Node, rhs: ir.Node, opaque_ids: frozenset) -> AffineForm | None:
    if ir.FLOAT in (lhs.kind, rhs.kind):
        return None
    linear = _collect_linear(lhs, rhs, opaque_ids)
    if linear is not None:
        return linear
    return _expand_with_sympy(lhs, rhs, opaque_ids)


def _collect_linear(lhs: ir.Node, rhs: ir.Node, opaque_ids: frozenset) -> AffineForm | None:
    """The fast path: collect like terms directly when no product of two non-constants occurs.

    Exact, and it keeps sympy (0.3-0.9 s to import) off the first call for most masks."""
    coefficients: dict[int, int] = {}
    atoms: dict[int, ir.Node] = {}
    const = 0
    budget = [10_000]  # shared sub-expressions are revisited; a pathological DAG goes to sympy

    def add(node: ir.Node, scale: int) -> bool:
        nonlocal const
        budget[0] -= 1
        if node.kind == ir.FLOAT or budget[0] < 0:
            return False
        if node.op == "const":
            const += scale * int(node.attr)
            return True
        if node.kind == ir.INT and node.op in _LINEAR_OPS and id(node) not in opaque_ids:
            if node.op == "add":
                return add(node.args[0], scale) and add(node.args[1], scale)
            if node.op == "sub":
                return add(node.args[0], scale) and add(node.args[1], -scale)
            if node.op == "neg":
                return add(node.args[0], -scale)
            x, y = node.args
            if y.op == "const":
                return add(x, scale * int(y.attr))
            if x.op == "const":
                return add(y, scale * int(x.attr))
            return False  # a product of two non-constants: sympy may still find it affine
        atoms[id(node)] = node
        coefficients[id(node)] = coefficients.get(id(node), 0) + scale
        return True

    if not (add(lhs, 1) and add(rhs, -1)):
        return None
    terms = sorted(((atoms[i], c) for i, c in coefficients.items() if c != 0), key=lambda t: _order(t[0]))
    return AffineForm(tuple(terms), const)


def _expand_with_sympy(lhs: ir.Node, rhs: ir.Node, opaque_ids: frozenset) -> AffineForm | None:
    """Polynomial expressions: sympy expands them and cancels, e.g. ``(q+1)*(q+1) - q*q`` is
    ``2*q + 1``; a form with a remaining product is not affine."""
    import sympy  # imported on first use only

    atoms: dict[str, ir.Node] = {}  # sympy symbol name -> atom node
    symbols: dict[int, Any] = {}

    def atom(node: ir.Node):
        sym = symbols.get(id(node))
        if sym is None:
            name = node.attr if node.op == "input" else f"_atom{len(atoms)}"
            sym = sympy.Symbol(name, integer=True)
            symbols[id(node)] = sym
            atoms[name] = node
        return sym

    converted: dict[int, Any] = {}

    def convert(node: ir.Node):
        if id(node) not in converted:
            converted[id(node)] = convert_once(node)
        return converted[id(node)]

    def convert_once(node: ir.Node):
        if node.kind == ir.FLOAT:
            raise _NotAffine
        if node.op == "const":
            return sympy.Integer(int(node.attr))
        if node.kind == ir.INT and node.op in _LINEAR_OPS and id(node) not in opaque_ids:
            args = [convert(a) for a in node.args]
            if node.op == "add":
                return args[0] + args[1]
            if node.op == "sub":
                return args[0] - args[1]
            if node.op == "neg":
                return -args[0]
            return args[0] * args[1]
        return atom(node)

    try:
        expr = sympy.expand(convert(lhs) - convert(rhs))
    except _NotAffine:
        return None
    const = 0
    terms = []
    for monomial, coefficient in expr.as_coefficients_dict().items():
        if monomial == 1:
            const = int(coefficient)
        elif isinstance(monomial, sympy.Symbol) and coefficient.is_integer:
            if int(coefficient) != 0:
                terms.append((atoms[monomial.name], int(coefficient)))
        else:  # a product of atoms, a power, or a fractional coefficient
            return None
    terms.sort(key=lambda t: _order(t[0]))
    return AffineForm(tuple(terms), const)


class _NotAffine(Exception):
    pass


def _order(node: ir.Node) -> tuple:
    # inputs first in a fixed order, then other atoms by their printed form: a stable order makes
    # the summation order (and so the work) the same on every call
    inputs = ("b", "h", "q_idx", "kv_idx")
    if node.op == "input":
        return (0, inputs.index(node.attr), "")
    return (1, 0, ir.format_expr(node))
