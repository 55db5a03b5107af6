"""Evaluate an integer/boolean mask_mod with numpy on a few hundred index pairs.

Decoding asks a mask_mod for its verdict on the partial blocks of one query row: a few hundred
``(q_idx, kv_idx)`` pairs, where each torch operation costs more in dispatch (~3 us) than in
arithmetic, and a numpy one about a third of that. Only graphs that numpy computes exactly as
torch does are accepted: integer and boolean arithmetic, comparisons, logic, ``where``/``min``/
``max``, casts to integer or boolean dtypes, floor division and remainder by a nonzero constant,
and lookups into captured integer or boolean tensors. Captured 0-d tensors enter as Python
numbers, which numpy (like torch for 0-d tensors) lets the array operand's dtype win.
:func:`evaluate_small` returns None for anything else (floats, reductions, shifts, other dtypes),
and the caller uses :func:`flexc.mods.evaluate.evaluate`.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import numpy as np
import torch

from . import ir
from .trace import TracedMod


def _invert(x: Any) -> Any:
    """Logical/bitwise not as torch's ``~``: a Python bool (two scalar operands compared) is
    negated, where Python's ``~True`` would give -2."""
    return (not x) if type(x) is bool else ~x


# binary operations written inline in the compiled program, as Python operators
_INFIX = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^", "eq": "==", "ne": "!=",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_BINARY: dict[str, Callable] = {"min": np.minimum, "max": np.maximum}
_UNARY: dict[str, Callable] = {"neg": operator.neg, "not": _invert, "abs": np.abs}
_BY_CONSTANT = {"floordiv": np.floor_divide, "mod": np.remainder}  # floor semantics in both libraries
_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
           "int64": np.int64}
# numpy 2 lets a Python number take the array operand's dtype (NEP 50), as torch does for numbers
# and 0-d tensors; numpy 1 decides by value, so it is not used
_SAME_PROMOTION = int(np.__version__.split(".")[0]) >= 2
_BUFFER_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))


def _step(node: ir.Node) -> str | Callable | None:
    """How the program computes ``node``: a Python operator written inline, a function to call,
    or None when numpy would not compute it exactly as torch does."""
    op = node.op
    if op in _INFIX:
        return _INFIX[op]
    if op in _BINARY:
        return _BINARY[op]
    if op in _UNARY:
        return _UNARY[op]
    if op in _BY_CONSTANT:
        divisor = node.args[1]
        if divisor.op != "const" or type(divisor.attr) is not int or divisor.attr == 0:
            return None  # torch raises on an integer division by zero, numpy warns
        return _BY_CONSTANT[op]
    if op == "where":
        return np.where
    if op == "cast" and node.attr in _DTYPES:
        dtype = _DTYPES[node.attr]
        return lambda x: np.asarray(x).astype(dtype)
    if op == "load":
        if any(index.kind == ir.BOOL for index in node.args[1:]):
            return None  # a bool index selects in numpy, converts to 0/1 in torch
        return lambda table, *index: table[index] if index else table
    return None


@functools.lru_cache(maxsize=1024)
def _program(root: ir.Node) -> Callable | None:
    """The graph as one function ``(inputs, buffers, scalars) -> the root's value`` (see
    :func:`_compile`), or None when some node is not computed exactly as in torch."""
    slots: dict[int, int] = {}
    leaves = []  # (slot, kind, what): kind "input" (a name), "const" (a value), "buffer"/"scalar" (an index)
    steps = []  # (slot, operator or function, argument slots), operands first
    for node in root.walk():
        if node.kind not in (ir.INT, ir.BOOL):
            return None
        slot = slots[id(node)] = len(slots)
        if node.op == "input":
            leaves.append((slot, "input", node.attr))
        elif node.op == "const":
            if type(node.attr) not in (int, bool):
                return None
            leaves.append((slot, "const", node.attr))
        elif node.op == "buffer":
            leaves.append((slot, "buffer", node.attr[0]))
        elif node.op == "scalar":
            leaves.append((slot, "scalar", node.attr[0]))
        else:
            run = _step(node)
            if run is None:
                return None
            steps.append((slot, run, tuple(slots[id(a)] for a in node.args)))
    return _compile(leaves, steps, slots[id(root)])


def _compile(leaves: list, steps: list, root: int) -> Callable:
    """The program as the body of one function: a decoding step evaluates it every call, and a
    loop over the steps would cost more than the few numpy operations it runs."""
    lines = ["def run(inputs, buffers, scalars):"]
    namespace: dict[str, Any] = {"_buffer": _buffer, "_scalar": _scalar}
    for slot, kind, what in leaves:
        if kind == "input":
            lines.append(f"    v{slot} = inputs[{what!r}]")
        elif kind == "const":
            lines.append(f"    v{slot} = {what!r}")
        elif kind == "buffer":
            lines.append(f"    v{slot} = _buffer(buffers[{int(what)}])")
        else:
            lines.append(f"    v{slot} = _scalar(scalars[{int(what)}])")
    for slot, run, args in steps:
        names = [f"v{a}" for a in args]
        if isinstance(run, str):  # a binary Python operator
            lines.append(f"    v{slot} = {names[0]} {run} {names[1]}")
        else:
            namespace[f"f{slot}"] = run
            lines.append(f"    v{slot} = f{slot}({', '.join(names)})")
    lines.append(f"    return v{root}")
    exec("\n".join(lines), namespace)  # (source made here from the graph's own ops, names and ints)
    return namespace["run"]


def _scalar(value: Any) -> Any:
    if type(value) not in (int, bool):
        raise _NotHere
    return value


def _buffer(t: torch.Tensor) -> Any:
    if not t.is_cpu or t.dtype not in _BUFFER_DTYPES:
        raise _NotHere
    return t.item() if t.dim() == 0 else t.detach().numpy()


class _NotHere(Exception):
    pass


def evaluate_small(mod: TracedMod, inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """The mask_mod's verdicts on ``inputs`` (numpy int64 index arrays, broadcastable, 4-D, or an
    int64 scalar for an index with one value) as a 4-D numpy array that broadcasts to their shape
    (size 1 along what the mod does not read), or None when this graph or its captured tensors
    need :func:`flexc.mods.evaluate.evaluate`."""
    run = _program(mod.root) if _SAME_PROMOTION else None
    if run is None:
        return None
    try:  # (arrays wrap around on overflow, as torch's tensors)
        out = run(inputs, mod.buffers, mod.scalars)
    except (_NotHere, KeyError, IndexError, OverflowError):  # torch's evaluation decides (and raises)
        return None
    return out if type(out) is np.ndarray and out.ndim == 4 else np.asarray(out).reshape(
        (1,) * (4 - np.ndim(out)) + np.shape(out))
