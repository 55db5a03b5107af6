"""Evaluate a traced mod with vectorised torch operations.

Each IR node becomes the torch operation the user wrote, applied to whole index grids at once, so
the result equals calling the mod on broadcast index tensors: same values, same dtypes. Autograd
flows through captured tensors that require grad, which is how the CPU path differentiates
score_mods.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch

from . import ir

_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge,
    "lshift": operator.lshift, "rshift": operator.rshift, "fmod": torch.fmod, "atan2": torch.atan2,
}
_UNARY = {
    "neg": operator.neg, "not": operator.invert, "abs": torch.abs, "sign": torch.sign,
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin,
    "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil,
    "tan": torch.tan, "atan": torch.atan, "asin": torch.asin, "acos": torch.acos, "sinh": torch.sinh,
    "cosh": torch.cosh, "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh, "erf": torch.erf,
    "erfc": torch.erfc, "expm1": torch.expm1, "log1p": torch.log1p, "log10": torch.log10,
    "trunc": torch.trunc, "round": torch.round,
}


def _tensor(x: Any, device: torch.device) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, device=device)


def _min_max(op: str, x: Any, y: Any, device: torch.device) -> torch.Tensor:
    # torch.clamp keeps a Python bound a scalar (as `torch.clamp(x, max=3)` does in the mod);
    # torch.minimum/maximum needs two tensors.
    if not isinstance(y, torch.Tensor):
        return torch.clamp(_tensor(x, device), max=y) if op == "min" else torch.clamp(_tensor(x, device), min=y)
    if not isinstance(x, torch.Tensor):
        return torch.clamp(y, max=x) if op == "min" else torch.clamp(y, min=x)
    return torch.minimum(x, y) if op == "min" else torch.maximum(x, y)


def _reduce(op: str, n: int, body: torch.Tensor, ndim: int) -> torch.Tensor:
    """``op`` over the leading axis dimension of ``body`` (present only if the body reads the axis)."""
    if body.dim() <= ndim:  # the body does not vary along the axis
        body = body.reshape((1,) * (ndim + 1 - body.dim()) + tuple(body.shape))
    body = body.expand(n, *body.shape[1:])
    if op in ("any", "all"):
        body = body if body.dtype == torch.bool else body != 0
        return body.any(0) if op == "any" else body.all(0)
    if op == "sum":
        return body.sum(0)
    if op == "prod":
        return body.prod(0)
    return body.amax(0) if op == "max" else body.amin(0)


_INPUTS = ("score", "b", "h", "q_idx", "kv_idx")


def _binary(op: str) -> Callable:
    f = _BINARY[op]
    if op in ("fmod", "atan2"):  # torch functions: a tensor first (and second, for atan2)
        second = op == "atan2"
        return lambda device, ndim, x, y: f(_tensor(x, device), _tensor(y, device) if second else y)

    def run(device, ndim, x, y):
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            x = _tensor(x, device)
        return f(x, y)
    return run


def _unary(op: str) -> Callable:
    f = _UNARY[op]
    return lambda device, ndim, x: f(_tensor(x, device))


def _load(device, ndim, t, *index):
    return t[index] if index else t


def _clamped_load(device, ndim, t, *index):
    """``t[index]``, each integer index clamped into ``[-size, size)``: for a call whose bounds check
    proved its lookups in range over the tiles its BlockMask lists (:mod:`flexc.analysis.bounds`),
    where a CPU path evaluates a whole row of keys at once; tiles it then masks out read an in-range
    element instead of raising. (A no-op wherever the check proved the index in range.)"""
    if not index:
        return t
    return t[tuple(i.clamp(-size, size - 1) if isinstance(i, torch.Tensor) and i.dtype != torch.bool else i
                   for i, size in zip(index, t.shape))]


def _step(node: ir.Node, clamp_lookups: bool = False) -> Callable:
    """``run(device, ndim, *argument values)`` computing ``node`` (an interior node of the graph)."""
    op, attr = node.op, node.attr
    if op == "load":
        return _clamped_load if clamp_lookups else _load
    if op == "cast":
        dtype = getattr(torch, attr)
        return lambda device, ndim, x: _tensor(x, device).to(dtype)
    if op == "where":
        return lambda device, ndim, cond, x, y: torch.where(_tensor(cond, device), x, y)
    if op in ("min", "max"):
        return lambda device, ndim, x, y: _min_max(op, x, y, device)
    if op == "autograd_function":  # through apply: autograd then uses the Function's own backward
        return lambda device, ndim, _fn, *args: attr.apply(*args)
    if op == "axis":
        return lambda device, ndim: torch.arange(attr, device=device).view(attr, *([1] * ndim))
    if op == "reduce":
        return lambda device, ndim, body: _reduce(attr[0], attr[1], _tensor(body, device), ndim)
    if op in _BINARY:
        return _binary(op)
    if op in _UNARY:
        return _unary(op)
    raise NotImplementedError(f"evaluate: unknown IR op {op!r}")


class _Program(NamedTuple):
    """A graph in evaluation order: leaves filled in per call, then one step per interior node."""

    size: int
    consts: tuple  # (slot, value)
    inputs: tuple  # (slot, input name)
    scalars: tuple  # (slot, index into the mod's captured numbers)
    buffers: tuple  # (slot, index into the captured tensors)
    steps: tuple  # (slot, run, argument slots)
    root: int
    # per step: (the torch function with ``out=``, position of the argument it may overwrite) or None
    # (see _in_place_plan); used only when the caller lets the score be overwritten
    in_place: tuple


# Elementwise ops that may write their result into an argument (``torch.f(..., out=arg)`` computes
# exactly what ``f`` returns): the arithmetic ops and the unary math functions. Comparisons, casts,
# gathers, where, min/max and reductions never do.
_IN_PLACE_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div}
_IN_PLACE_UNARY = {op: f for op, f in _UNARY.items() if op not in ("not",)} | {"neg": torch.neg}


def _in_place_plan(root: ir.Node, slots: dict[int, int], steps: list) -> tuple:
    """For each step, ``(f, i)`` when it may compute into its argument ``i``: the argument is the
    ``score`` input or the result of an earlier in-place-capable step (a tensor the evaluation owns,
    never a captured tensor or a view of one), and this step is its last use. Whether its shape and
    dtype are the result's is checked when it runs."""
    nodes = {slots[id(n)]: n for n in root.walk()}
    last_use: dict[int, int] = {}
    for i, (_, _, args) in enumerate(steps):
        for a in args:
            last_use[a] = i
    owned = {slot for slot, n in nodes.items() if n.op == "input" and n.attr == "score"}
    plan = []
    for i, (slot, _, args) in enumerate(steps):
        op = nodes[slot].op
        f = _IN_PLACE_BINARY.get(op) if len(args) == 2 else _IN_PLACE_UNARY.get(op) if len(args) == 1 else None
        choice = None
        if f is not None:
            # the first argument, or for add/mul either (same result); an argument read twice is not
            # overwritten (x * x reads it while writing)
            positions = (0, 1) if op in ("add", "mul") else (0,)
            for pos in positions:
                a = args[pos]
                if a in owned and last_use.get(a) == i and args.count(a) == 1:
                    choice = (f, pos)
                    break
            owned.add(slot)  # its result is a fresh tensor, or the argument it overwrote
        plan.append(choice)
    return tuple(plan)


def _run_in_place(f: Callable, pos: int, args: list) -> torch.Tensor | None:
    """``f(*args, out=args[pos])`` when that is what ``f(*args)`` returns (a float tensor whose shape
    and dtype the result keeps, outside autograd), else None."""
    target = args[pos]
    if not isinstance(target, torch.Tensor) or not target.is_floating_point() or target.requires_grad:
        return None
    others = [a for j, a in enumerate(args) if j != pos]
    if any(isinstance(a, torch.Tensor) and (a.requires_grad or a.dim() > target.dim()
                                            or any(n not in (1, m) for n, m in zip(a.shape[::-1], target.shape[::-1])))
           for a in others):
        return None
    if any(torch.result_type(target, a) != target.dtype for a in others):
        return None
    # the target first: a Python number may only come second, and add/mul (the only ops that may
    # overwrite their second argument) are commutative, bit for bit
    return f(target, *others, out=target)


@functools.lru_cache(maxsize=1024)
def _program(root: ir.Node, clamp_lookups: bool = False) -> _Program:
    """The graph compiled once into slots and steps: traces are reused across calls (the trace
    cache), so a graph is evaluated many times and its per-node dispatch is decided here."""
    slots: dict[int, int] = {}
    consts, inputs, scalars, buffers, steps = [], [], [], [], []
    for node in root.walk():
        slot = slots[id(node)] = len(slots)
        if node.op == "input":
            inputs.append((slot, node.attr))
        elif node.op == "const":
            consts.append((slot, node.attr))
        elif node.op == "scalar":  # a captured number lifted out of the graph (flexc.codegen.scalars)
            scalars.append((slot, node.attr[0]))
        elif node.op == "buffer":
            buffers.append((slot, node.attr[0]))
        else:
            steps.append((slot, _step(node, clamp_lookups), tuple(slots[id(a)] for a in node.args)))
    return _Program(len(slots), tuple(consts), tuple(inputs), tuple(scalars), tuple(buffers), tuple(steps),
                    slots[id(root)], _in_place_plan(root, slots, steps))


def _broadcast_shape(tensors: list) -> tuple:
    """The broadcast shape of ``tensors`` (plain Python on their sizes; raises as torch would)."""
    shapes = [t.shape for t in tensors]
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, ndim - len(shape)):
            if n != 1:
                if out[i] not in (1, n):
                    return torch.broadcast_tensors(*tensors)[0].shape  # torch's error message
                out[i] = n
    return tuple(out)


def evaluate(
    mod: Any,
    *,
    score: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    q_idx: torch.Tensor | None = None,
    kv_idx: torch.Tensor | None = None,
    buffers: Sequence[torch.Tensor] | None = None,
    overwrite_score: bool = False,
    clamp_lookups: bool = False,
) -> torch.Tensor:
    """Evaluate a traced mod (a :class:`flexc.TracedMod` or a graph root) on broadcastable tensors; the
    result has their broadcast shape.

    ``buffers`` replaces the captured tensors (same slots); by default the traced ones are used.
    ``overwrite_score``: the caller owns ``score`` and lets elementwise steps compute into it and
    into their own intermediates (``20 * tanh(score / 20)`` then allocates nothing and returns
    ``score``); the values are the same. A step whose operands require grad allocates as usual, so
    autograd sees what it would without. ``clamp_lookups``: a backend evaluating a call's mod after
    its bounds check, beyond the tiles the check covered (see :func:`_clamped_load`).
    """
    root = mod if isinstance(mod, ir.Node) else mod.root
    bufs = buffers if buffers is not None else (() if isinstance(mod, ir.Node) else mod.buffers)
    given_by_name = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    given = [v for v in given_by_name.values() if isinstance(v, torch.Tensor)]
    device = given[0].device if given else torch.device("cpu")
    # a reduction's axis runs along one extra leading dimension, in front of the inputs' broadcast dims
    ndim = max((t.dim() for t in given), default=0)
    program = _program(root, clamp_lookups)
    values: list[Any] = [None] * program.size
    for slot, value in program.consts:
        values[slot] = value
    for slot, name in program.inputs:
        value = given_by_name[name]
        if value is None:
            raise ValueError(f"evaluate: the mod reads `{name}` but no value was given for it")
        values[slot] = value
    for slot, i in program.scalars:
        values[slot] = mod.scalars[i]
    for slot, i in program.buffers:
        values[slot] = bufs[i]
    if overwrite_score and score is not None:
        for (slot, run, args), in_place in zip(program.steps, program.in_place):
            operands = [values[a] for a in args]
            result = _run_in_place(in_place[0], in_place[1], operands) if in_place is not None else None
            values[slot] = result if result is not None else run(device, ndim, *operands)
    else:
        for slot, run, args in program.steps:
            values[slot] = run(device, ndim, *[values[a] for a in args])
    out = _tensor(values[program.root], device)
    if given:
        shape = _broadcast_shape(given)
        if out.shape != shape:
            out = out.expand(shape)
    return out


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int, device: Any = None, q_start: int = 0,
               kv_start: int = 0, dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    """Broadcastable ``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,L,1]``, ``kv_idx [1,1,1,S]``."""
    ar = lambda n, start=0: torch.arange(start, start + n, device=device, dtype=dtype)
    return {
        "b": ar(B).view(B, 1, 1, 1),
        "h": ar(H).view(1, H, 1, 1),
        "q_idx": ar(Q_LEN, q_start).view(1, 1, Q_LEN, 1),
        "kv_idx": ar(KV_LEN, kv_start).view(1, 1, 1, KV_LEN),
    }
