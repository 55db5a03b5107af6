"""Differentiate a traced score_mod: the IR of d(score_mod)/d(score) and of d/d(each gathered element).

The fourth reader of the IR. Reverse-mode differentiation runs over the score_mod's graph once:
every float node receives an *adjoint* (an IR expression for d root / d node), built from its
users' adjoints with the local rules torch's autograd uses. The adjoint of the ``score`` input is
the score derivative the backward kernels multiply ``dS`` by; the adjoint of each ``load`` of a
captured float tensor is the derivative with respect to that gathered element, paired with the
load's index expressions (where the backward adds the gradient).

Because IR nodes are hash-consed, shared subexpressions of the derivative are shared for free
(``exp(x)``'s derivative *is* the node ``exp(x)``); small rewrites (``x * 1``, ``x + 0``, constant
operands) keep the result short. Integer and bool nodes carry no gradient, as in torch.

Local rules follow torch's autograd formulas, including its choices at kinks: ``abs`` has slope
``sign(x)`` (0 at 0); ``clamp`` (a min/max with a Python constant bound) passes the gradient where
the value is inside the closed range; ``torch.minimum``/``maximum`` of two tensors split it in
half on ties; ``where`` routes it to the branch taken; ``floor``/``ceil``/``sign``/``//`` give 0.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass

from . import ir
from .trace import SCORE_MOD, TracedMod

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Gather:
    """One read of a captured float tensor inside the score_mod, and the derivative there.

    ``load`` is the IR ``load`` node (its ``args[1:]`` are the index expressions, one per dim),
    ``slot`` the captured tensor's slot and ``grad`` the IR of d(score_mod)/d(that element).
    The same element read twice is one load node; different index expressions are separate gathers.
    """

    slot: int
    load: ir.Node
    grad: ir.Node

    @property
    def indices(self) -> tuple[ir.Node, ...]:
        return self.load.args[1:]


@dataclass(frozen=True)
class ScoreModDerivative:
    """The derivatives of one score_mod: ``d_score`` and one :class:`Gather` per captured-tensor read."""

    score_mod: TracedMod
    d_score: ir.Node
    gathers: tuple[Gather, ...]

    def as_mod(self, root: ir.Node, name: str) -> TracedMod:
        """``root`` wrapped as a score_mod with the original captured tensors (for printing/evaluating)."""
        return dataclasses.replace(self.score_mod, root=root, name=name)

    def __str__(self) -> str:
        names = self.score_mod.buffer_names
        lines = [f"d/d score = {ir.format_expr(self.d_score, names)}"]
        for g in self.gathers:
            lines.append(f"d/d {ir.format_expr(g.load, names)} = {ir.format_expr(g.grad, names)}")
        return "\n".join(lines)


# ---- building blocks with light simplification ---------------------------------------------

def _is_const(n: ir.Node, value: float | None = None) -> bool:
    if n.op != "const" or isinstance(n.attr, bool):
        return False
    return value is None or n.attr == value


def _c(value: float) -> ir.Node:
    return ir.const(float(value))


def _fold(op: str, *args: ir.Node) -> ir.Node | None:
    """The constant result of ``op`` on constant float/int operands, or None."""
    if not all(_is_const(a) for a in args):
        return None
    values = [a.attr for a in args]
    try:
        if op == "add":
            r = values[0] + values[1]
        elif op == "sub":
            r = values[0] - values[1]
        elif op == "mul":
            r = values[0] * values[1]
        elif op == "truediv":
            r = values[0] / values[1]
        elif op == "neg":
            r = -values[0]
        else:
            return None
    except (ZeroDivisionError, OverflowError):
        return None
    if isinstance(r, float) and math.isnan(r):
        return None
    return ir.const(float(r)) if any(isinstance(v, float) for v in values) or op == "truediv" else ir.const(r)


def add(a: ir.Node, b: ir.Node) -> ir.Node:
    if _is_const(a, 0):
        return b
    if _is_const(b, 0):
        return a
    if a.op == "where" and b.op == "where" and a.args[0] is b.args[0]:
        # the two branches of one select: `where(c, 0, 2) + where(c, 0.5, 0)` is `where(c, 0.5, 2)`
        return where(a.args[0], add(a.args[1], b.args[1]), add(a.args[2], b.args[2]))
    if b.op == "neg":
        return sub(a, b.args[0])
    return _fold("add", a, b) or ir.binary("add", a, b)


def sub(a: ir.Node, b: ir.Node) -> ir.Node:
    if _is_const(b, 0):
        return a
    if _is_const(a, 0):
        return neg(b)
    return _fold("sub", a, b) or ir.binary("sub", a, b)


# The float dtype integer operands of derivative products are widened to (None: left as they are).
# A float64 kernel needs it: `t * (q - kv) * 0.7` is float64 in torch because `t` is, but its
# derivative `0.7 * (q - kv)` alone would be computed in float32, torch's type for float * int.
_widen_ints: contextvars.ContextVar = contextvars.ContextVar("flexc_derivative_widen_ints", default=None)


def _widened(n: ir.Node) -> ir.Node:
    dtype = _widen_ints.get()
    if dtype is None or n.kind == ir.FLOAT or n.op == "const":
        return n
    return ir.cast(n, dtype, ir.FLOAT)


def mul(a: ir.Node, b: ir.Node) -> ir.Node:
    a, b = _widened(a), _widened(b)
    # only float zeros annihilate: 0 * inf is NaN, but the operands here are finite derivatives
    for x, y in ((a, b), (b, a)):
        if _is_const(x, 0):
            return _c(0.0)
        if _is_const(x, 1):
            return y
        if _is_const(x, -1):
            return neg(y)
    if a.op == "neg" and b.op == "neg":
        return mul(a.args[0], b.args[0])
    if a.op == "neg":
        return neg(mul(a.args[0], b))
    if b.op == "neg":
        return neg(mul(a, b.args[0]))
    if _is_const(b) and not _is_const(a):  # constants first: `2.0 * x` reads as a coefficient
        a, b = b, a
    if _is_const(a) and b.op == "where" and _is_const(b.args[1]) and _is_const(b.args[2]):
        return where(b.args[0], mul(a, b.args[1]), mul(a, b.args[2]))
    if _is_const(a) and b.op == "mul" and _is_const(b.args[0]):
        return mul(_fold("mul", a, b.args[0]) or ir.binary("mul", a, b.args[0]), b.args[1])
    return _fold("mul", a, b) or ir.binary("mul", a, b)


def div(a: ir.Node, b: ir.Node) -> ir.Node:
    a, b = _widened(a), _widened(b)
    if _is_const(a, 0):
        return _c(0.0)
    if _is_const(b, 1):
        return a
    if _is_const(b) and b.attr != 0 and a.op == "mul" and _is_const(a.args[0]):
        # (c1 * x) / c2 -> (c1 / c2) * x: the chain rule through `s / c` after `c * f(...)`
        return mul(_c(a.args[0].attr / b.attr), a.args[1])
    return _fold("truediv", a, b) or ir.binary("truediv", a, b)


def neg(a: ir.Node) -> ir.Node:
    if a.op == "neg":
        return a.args[0]
    return _fold("neg", a) or ir.unary("neg", a)


def where(cond: ir.Node, a: ir.Node, b: ir.Node) -> ir.Node:
    if cond.op == "const":
        return a if cond.attr else b
    if a is b:
        return a
    return ir.where(cond, a, b)


def _as_float(n: ir.Node) -> ir.Node:
    """``n`` usable as a float factor (bools and ints promote in arithmetic anyway)."""
    return n


# ---- local derivative rules ----------------------------------------------------------------

def _local(n: ir.Node, A: ir.Node) -> list[tuple[ir.Node, ir.Node]]:
    """``[(operand, contribution to its adjoint)]`` for node ``n`` whose adjoint is ``A``."""
    op, args = n.op, n.args
    if op == "add":
        return [(args[0], A), (args[1], A)]
    if op == "sub":
        return [(args[0], A), (args[1], neg(A))]
    if op == "mul":
        x, y = args
        return [(x, mul(A, y)), (y, mul(A, x))]
    if op == "truediv":
        x, y = args
        # torch: d/dx = g / y, d/dy = -g * x / (y * y)
        return [(x, div(A, y)), (y, neg(div(mul(A, x), mul(y, y))))]
    if op == "pow":
        x, y = args
        out = []
        if x.kind == ir.FLOAT:
            # torch: g * y * x ** (y - 1), and 0 where y == 0
            term = mul(A, mul(y, ir.binary("pow", x, sub(y, ir.const(1)) if y.kind != ir.FLOAT else sub(y, _c(1.0)))))
            if _is_const(y):
                out.append((x, _c(0.0) if y.attr == 0 else term))
            else:
                out.append((x, where(ir.binary("eq", y, _c(0.0)), _c(0.0), term)))
        if y.kind == ir.FLOAT:
            # torch: g * x ** y * log(x), and 0 where x == 0 and y >= 0
            term = mul(A, mul(n, ir.unary("log", x)))
            if _is_const(x):
                out.append((y, term if x.attr != 0 else _c(0.0)))
            else:
                out.append((y, where(ir.binary("and", ir.binary("eq", x, _c(0.0)), ir.binary("ge", y, _c(0.0))),
                                     _c(0.0), term)))
        return out
    if op in ("min", "max"):
        x, y = args
        pick = "lt" if op == "min" else "gt"  # the operand that wins strictly
        if _is_const(y) or _is_const(x):
            # clamp(x, bound): torch passes the gradient where x lies inside the closed range
            var, bound = (x, y) if _is_const(y) else (y, x)
            inside = ir.binary("le" if op == "min" else "ge", var, bound)
            return [(var, where(inside, A, _c(0.0)))]
        tie = ir.binary("eq", x, y)
        half = mul(_c(0.5), A)
        return [(x, where(tie, half, where(ir.binary(pick, x, y), A, _c(0.0)))),
                (y, where(tie, half, where(ir.binary(pick, y, x), A, _c(0.0))))]
    if op == "where":
        c, x, y = args
        return [(x, where(c, A, _c(0.0))), (y, where(c, _c(0.0), A))]
    if op == "neg":
        return [(args[0], neg(A))]
    if op == "abs":
        return [(args[0], mul(A, ir.unary("sign", args[0])))]
    if op in ("sign", "floor", "ceil", "floordiv", "trunc", "round"):
        return []  # piecewise constant: zero gradient (torch returns zeros)
    if op == "fmod":
        # torch.fmod: d/dx = g, d/dy = -g * trunc(x / y)
        x, y = args
        return [(x, A), (y, neg(mul(A, ir.unary("trunc", ir.binary("truediv", x, y)))))]
    if op == "atan2":
        # atan2(y, x): d/dy = g * x / (x^2 + y^2), d/dx = -g * y / (x^2 + y^2)
        # (0 at the origin, as torch gives)
        y, x = args
        r2 = add(mul(x, x), mul(y, y))
        origin = ir.binary("eq", r2, _c(0.0))
        return [(y, where(origin, _c(0.0), div(mul(A, x), r2))), (x, where(origin, _c(0.0), neg(div(mul(A, y), r2))))]
    if op == "mod":
        # torch.remainder: d/dx = g, d/dy = -g * floor(x / y)
        x, y = args
        return [(x, A), (y, neg(mul(A, ir.binary("floordiv", x, y))))]
    x = args[0] if args else None
    if op == "exp":
        return [(x, mul(A, n))]
    if op == "exp2":
        return [(x, mul(A, mul(_c(LN2), n)))]
    if op == "log":
        return [(x, div(A, x))]
    if op == "log2":
        return [(x, div(A, mul(x, _c(LN2))))]
    if op == "sqrt":
        return [(x, div(A, mul(_c(2.0), n)))]
    if op == "rsqrt":
        # torch: -0.5 * g * rsqrt(x) ** 3
        return [(x, mul(_c(-0.5), mul(A, mul(n, mul(n, n)))))]
    if op == "tanh":
        return [(x, mul(A, sub(_c(1.0), mul(n, n))))]
    if op == "sigmoid":
        return [(x, mul(A, mul(n, sub(_c(1.0), n))))]
    if op == "sin":
        return [(x, mul(A, ir.unary("cos", x)))]
    if op == "cos":
        return [(x, neg(mul(A, ir.unary("sin", x))))]
    if op == "tan":
        return [(x, mul(A, add(_c(1.0), mul(n, n))))]
    if op == "atan":
        return [(x, div(A, add(_c(1.0), mul(x, x))))]
    if op in ("asin", "acos"):
        # torch: +-g * rsqrt(1 - x^2)
        term = mul(A, ir.unary("rsqrt", sub(_c(1.0), mul(x, x))))
        return [(x, term if op == "asin" else neg(term))]
    if op == "sinh":
        return [(x, mul(A, ir.unary("cosh", x)))]
    if op == "cosh":
        return [(x, mul(A, ir.unary("sinh", x)))]
    if op in ("asinh", "acosh"):
        # torch: g * rsqrt(x^2 + 1) and g * rsqrt(x^2 - 1)
        return [(x, mul(A, ir.unary("rsqrt", (add if op == "asinh" else sub)(mul(x, x), _c(1.0)))))]
    if op == "atanh":
        return [(x, div(A, sub(_c(1.0), mul(x, x))))]
    if op in ("erf", "erfc"):
        # d erf / dx = 2 / sqrt(pi) * exp(-x^2); erfc is 1 - erf
        term = mul(_c(2.0 / math.sqrt(math.pi)), mul(A, ir.unary("exp", neg(mul(x, x)))))
        return [(x, term if op == "erf" else neg(term))]
    if op == "expm1":
        return [(x, mul(A, add(n, _c(1.0))))]
    if op == "log1p":
        return [(x, div(A, add(x, _c(1.0))))]
    if op == "log10":
        return [(x, div(A, mul(x, _c(math.log(10.0)))))]
    if op == "cast":
        return [(x, A)] if x.kind == ir.FLOAT and n.kind == ir.FLOAT else []
    if op in ("load", "input", "const", "buffer", "scalar"):
        return []
    if op in ir.COMPARE_OPS or op in ir.LOGIC_OPS or op in ("not", "lshift", "rshift"):
        return []
    raise NotImplementedError(f"flexc derivative: no rule for IR op {op!r}")


def adjoints(root: ir.Node) -> dict[int, ir.Node]:
    """``id(node) -> d root / d node`` for every float node that ``root`` depends on."""
    order = list(root.walk())
    adj: dict[int, ir.Node] = {id(root): _c(1.0)}
    for n in reversed(order):
        A = adj.get(id(n))
        if A is None or n.kind != ir.FLOAT or _is_const(A, 0):
            continue
        for operand, contribution in _local(n, A):
            if operand.kind != ir.FLOAT:
                continue  # ints and bools carry no gradient
            previous = adj.get(id(operand))
            adj[id(operand)] = contribution if previous is None else add(previous, contribution)
    return adj


def differentiate(score_mod: TracedMod, slots: tuple[int, ...] | None = None,
                  widen_ints: str | None = None) -> ScoreModDerivative:
    """The derivatives of ``score_mod`` with respect to its score and its captured float tensors.

    ``slots`` limits the gathers to those captured tensors (default: every float one).
    ``widen_ints="float64"`` casts integer factors of the derivative products to float64, so a
    float64 kernel computes them in float64 as torch does along the original expression.

    >>> from flexc import trace
    >>> print(differentiate(trace(lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0))).d_score)  # doctest: +SKIP
    1.0 - tanh(score / 20.0) * tanh(score / 20.0)
    """
    if score_mod.kind != SCORE_MOD:
        raise ValueError(f"differentiate: expected a traced score_mod, got a {score_mod.kind}. "
                         f"Fix: pass trace(score_mod).")
    root = score_mod.root
    if root.kind != ir.FLOAT:  # the tracer casts int roots to float32; be safe for hand-built IR
        root = ir.cast(root, "float32", ir.FLOAT)
    token = _widen_ints.set(widen_ints)
    try:
        adj = adjoints(root)
    finally:
        _widen_ints.reset(token)
    nodes = list(root.walk())
    score = next((n for n in nodes if n.op == "input" and n.attr == "score"), None)
    d_score = adj.get(id(score), _c(0.0)) if score is not None else _c(0.0)
    gathers = []
    for n in nodes:
        if n.op != "load" or n.kind != ir.FLOAT:
            continue
        slot = n.args[0].attr[0]
        if slots is not None and slot not in slots:
            continue
        grad = adj.get(id(n))
        if grad is not None and not _is_const(grad, 0):
            gathers.append(Gather(slot, n, grad))
    return ScoreModDerivative(score_mod, d_score, tuple(gathers))


__all__ = ["Gather", "ScoreModDerivative", "adjoints", "differentiate"]
