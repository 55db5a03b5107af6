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

Reductions over a captured vector (``torch.dot``, ``.sum(-1)``, ``.mean(-1)``, ``.norm()``,
``.prod(-1)``, ``.amax(-1)``...) are differentiated written out term by term
(:func:`flexc.mods.reductions.unroll`), each fold as one n-ary operation: a sum passes the gradient to
every term, a product to each term times the product of the others (exact at zeros, as torch's
``prod`` backward), a max or min to the terms equal to the result, shared evenly among ties (as
torch's ``amax``/``amin``, which evaluation and so the torch backward use); ``any``/``all`` and
integer sums carry none. A ``torch.autograd.Function`` is differentiated with its own ``backward``,
traced like a mod: its ``ctx`` holds what the forward (or ``setup_context``) saved, as traced values,
and the incoming gradient is the Function node's adjoint; what the backward returns for each input
is that input's contribution. A backward that cannot be traced, or that reads a captured tensor the
score_mod does not, raises ``NotImplementedError`` (the caller trains through the torch backward).
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass

import torch

from . import ir, reductions
from .lowering import AUTOGRAD_FUNCTION
from ..constants import LN2
from .traced_mod import SCORE_MOD, TracedMod
from .tracing.dispatch import TraceMode, hook_function_apply
from .tracing.proxies import Proxy
from .tracing.tracer import Tracer



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


# ---- reductions: unrolled, each fold differentiated as one n-ary operation ---------------------

_FOLD_OPS = ("sum", "prod", "max", "min")


def _expand(root: ir.Node) -> tuple[ir.Node, dict[int, tuple[str, tuple[ir.Node, ...]]]]:
    """``root`` with every reduction unrolled (as :func:`flexc.mods.reductions.unroll` writes it), and
    ``id(fold) -> (op, terms)`` for each unrolled float reduction of two or more terms."""
    folds: dict[int, tuple[str, tuple[ir.Node, ...]]] = {}
    if not reductions.has_reductions(root):
        return root, folds
    # (node, result) by the node's id: the node stays alive, so its id is not reused while memoised
    memo: dict[int, tuple[ir.Node, ir.Node]] = {}
    keep: list[ir.Node] = []  # the folds' nodes stay alive while their ids key `folds`

    def go(x: ir.Node) -> ir.Node:
        found = memo.get(id(x))
        if found is not None:
            return found[1]
        if x.op == reductions.REDUCE:
            op, count = x.attr
            terms = [reductions.term(op, go(reductions.substitute(x.args[0], count, ir.const(i))))
                     for i in range(count)]
            out = terms[0]
            for t in terms[1:]:
                fold = reductions.FOLD[op]
                if op in ("max", "min") and t.kind == ir.BOOL:
                    fold = "or" if op == "max" else "and"
                out = ir.binary(fold, out, t)
            if out.kind == ir.FLOAT and op in _FOLD_OPS and count > 1:
                folds[id(out)] = (op, tuple(terms))
                keep.append(out)
        elif not x.args:
            out = x
        else:
            args = tuple(go(a) for a in x.args)
            out = x if all(a is b for a, b in zip(args, x.args)) else ir.make(x.op, args, x.attr, x.kind)
        memo[id(x)] = (x, out)
        return out

    return go(root), folds


def _fold_rule(op: str, terms: tuple[ir.Node, ...], n: ir.Node, A: ir.Node) -> list[tuple[ir.Node, ir.Node]]:
    """The contributions of a reduction ``n`` of ``terms`` (unrolled) whose adjoint is ``A``."""
    if op == "sum":
        return [(t, A) for t in terms]
    if op == "prod":
        # each term times the product of the others (prefix and suffix products: no division, exact at 0)
        prefix, suffix = [_c(1.0)], [_c(1.0)]
        for t in terms[:-1]:
            prefix.append(mul(prefix[-1], t))
        for t in reversed(terms[1:]):
            suffix.append(mul(suffix[-1], t))
        suffix.reverse()
        return [(t, mul(A, mul(p, q))) for t, p, q in zip(terms, prefix, suffix)]
    # max / min: the terms equal to the result share the gradient evenly (torch's amax/amin)
    hits = [ir.binary("eq", t, n) for t in terms]
    count = None
    for hit in hits:
        one = where(hit, _c(1.0), _c(0.0))
        count = one if count is None else add(count, one)
    share = div(A, count)
    return [(t, where(hit, share, _c(0.0))) for t, hit in zip(terms, hits)]


# ---- torch.autograd.Function: its own backward, traced ------------------------------------------

# the captured tensors of the score_mod being differentiated (a Function's backward may read them)
_buffers: contextvars.ContextVar = contextvars.ContextVar("flexc_derivative_buffers", default=())


class _BackwardCtx:
    """The ``ctx`` a Function's forward (or ``setup_context``) and backward see while traced: what
    is saved is kept (traced values), attributes set on it stay."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value

    def mark_dirty(self, *tensors):
        raise NotImplementedError("marks an input dirty")


def _function_rule(n: ir.Node, A: ir.Node) -> list[tuple[ir.Node, ir.Node]]:
    """Contributions to the inputs of ``Function.apply(*inputs)`` (node ``n``, adjoint ``A``): the
    Function's ``backward`` traced on the incoming gradient and the values its forward saved."""
    fn_class, forward, inputs = n.attr, n.args[0], n.args[1:]
    name = f"{fn_class.__name__}.backward"
    buffers = _buffers.get()
    tracer = Tracer(fn_class.backward, SCORE_MOD)
    for t in buffers:  # the score_mod's captured tensors keep their slots
        tracer.buffer_node(t)
    for x in inputs:
        if reductions.free_axes(x):
            raise NotImplementedError(f"{fn_class.__name__}.apply takes a vector; its backward would return one")
    args = [x.attr if x.op == "const" else Proxy(x, tracer) for x in inputs]
    ctx = _BackwardCtx(tuple(x.kind == ir.FLOAT and x.op != "const" for x in inputs))
    try:
        with TraceMode(tracer), hook_function_apply(tracer):
            if torch.autograd.function._is_setup_context_defined(fn_class.setup_context):
                fn_class.setup_context(ctx, tuple(args), Proxy(forward, tracer))
            else:
                fn_class.forward(ctx, *args)  # again, for what it saves on ctx
            grads = fn_class.backward(ctx, Proxy(A, tracer))
        if not isinstance(grads, (tuple, list)):
            grads = (grads,)
        out = []
        for x, g in zip(inputs, grads):
            if g is None or x.kind != ir.FLOAT or x.op == "const":
                continue
            node = tracer.to_node(g, what=f"a gradient {name} returns")
            if node.kind != ir.FLOAT:
                node = ir.cast(node, "float32", ir.FLOAT)
            out.append((x, node))
    except NotImplementedError:
        raise
    except Exception as e:  # a TraceError, or the backward failing on traced values
        raise NotImplementedError(f"cannot trace {name}: {str(e).splitlines()[0]}") from e
    if len(tracer.buffers) > len(buffers):
        raise NotImplementedError(f"{name} reads a tensor the score_mod does not capture")
    if any(reductions.free_axes(g) for _, g in out):
        raise NotImplementedError(f"{name} returns a vector")
    return out


def adjoints(root: ir.Node) -> dict[int, ir.Node]:
    """``id(node) -> d root / d node`` for every float node that ``root`` depends on.

    A ``root`` with reductions is differentiated unrolled (see the module docstring): the ids are
    those of :func:`flexc.mods.reductions.unroll` ``(root)``'s nodes."""
    expanded, folds = _expand(root)
    return _adjoints(expanded, folds)


def _adjoints(root: ir.Node, folds: dict) -> dict[int, ir.Node]:
    order = list(root.walk())
    adj: dict[int, ir.Node] = {id(root): _c(1.0)}
    for n in reversed(order):
        A = adj.get(id(n))
        if A is None or n.kind != ir.FLOAT or _is_const(A, 0):
            continue
        fold = folds.get(id(n))
        if fold is not None:
            local = _fold_rule(fold[0], fold[1], n, A)
        elif n.op == AUTOGRAD_FUNCTION:
            local = _function_rule(n, A)
        else:
            local = _local(n, A)
        for operand, contribution in local:
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
    root, folds = _expand(root)
    token, buffers_token = _widen_ints.set(widen_ints), _buffers.set(tuple(score_mod.buffers))
    try:
        adj = _adjoints(root, folds)
    finally:
        _widen_ints.reset(token)
        _buffers.reset(buffers_token)
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
