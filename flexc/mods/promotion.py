"""torch's type promotion on the IR: the dtype each node is computed in, and the weak-scalar rule.

A Python number in a mod is a *weak* scalar, as in torch: it takes the dtype of the tensor it meets
when both are integers. For a narrow integer tensor that means the number is first converted to the
tensor's dtype, with two's-complement wraparound: ``uint8_tensor <= -16`` is ``<= 240`` and
``int8_tensor < 128`` is ``< -128`` (always False). The tracer applies :func:`weak_operand` when it
builds a node, so every reader of the graph (evaluation, interval analysis, generated kernels) sees
the number torch actually uses.
"""
from __future__ import annotations

import weakref

import torch

from . import ir

# Index inputs are int64 tensors and the score is float32, as torch's FlexAttention passes them.
_INPUT_DTYPES = {"score": torch.float32, "b": torch.int64, "h": torch.int64, "q_idx": torch.int64,
                 "kv_idx": torch.int64}
# Unary ops whose result has the operand's dtype; the others (exp, log, ...) compute in float.
_SAME_DTYPE = {op for op, rule in ir.UNARY_OPS.items() if rule == "same"}
_memo: "weakref.WeakKeyDictionary[ir.Node, torch.dtype | None]" = weakref.WeakKeyDictionary()


def node_dtype(node: ir.Node) -> torch.dtype | None:
    """The torch dtype ``node`` is computed in; ``None`` for a weak Python scalar (a constant, or
    arithmetic on constants only)."""
    found = _memo.get(node, _memo)
    if found is not _memo:
        return found
    for n in node.walk():  # operands first, so each lookup below is a hit
        if n not in _memo:
            _memo[n] = _dtype_of(n)
    return _memo[node]


def _dtype_of(node: ir.Node) -> torch.dtype | None:
    op = node.op
    if op == "input":
        return _INPUT_DTYPES[node.attr]
    if op == "const":
        return None
    if op in ("buffer", "cast"):
        return getattr(torch, node.attr[1] if op == "buffer" else node.attr)
    if op == "load":
        return _memo[node.args[0]]
    if op in ir.COMPARE_OPS:
        return torch.bool
    operands = node.args[1:] if op == "where" else node.args
    dtypes = [_memo[a] for a in operands]
    if op in ir.UNARY_OPS and op not in _SAME_DTYPE:
        return torch.float64 if dtypes[0] == torch.float64 else torch.float32
    if op == "truediv" and not any(d is not None and d.is_floating_point for d in dtypes):
        return None if all(d is None for d in dtypes) else torch.float32
    strong = [d for d in dtypes if d is not None]
    if not strong:
        return None
    result = strong[0]
    for d in strong[1:]:
        result = torch.promote_types(result, d)
    # a weak operand of a higher category lifts the result to that category's default dtype
    if node.kind == ir.FLOAT and not result.is_floating_point:
        return torch.float32
    if node.kind == ir.INT and result == torch.bool:
        return torch.int64
    return result


def wrap_to_dtype(value: int, dtype: torch.dtype) -> int:
    """``value`` converted to the integer ``dtype`` as torch converts a scalar: modulo ``2**bits``."""
    info = torch.iinfo(dtype)
    span = info.max - info.min + 1
    return (value - info.min) % span + info.min


def weak_operand(const: ir.Node, other: ir.Node) -> ir.Node:
    """``const`` as torch uses it next to ``other``: a Python int meeting a narrow integer tensor
    (uint8, int8, int16, int32) is wrapped into that dtype's range; anything else is unchanged."""
    if const.op != "const" or type(const.attr) is not int:
        return const
    dtype = node_dtype(other)
    if dtype is None or dtype in (torch.bool, torch.int64) or dtype.is_floating_point or dtype.is_complex:
        return const
    wrapped = wrap_to_dtype(const.attr, dtype)
    return const if wrapped == const.attr else ir.const(wrapped)


def weak_pair(a: ir.Node, b: ir.Node) -> tuple[ir.Node, ir.Node]:
    """Both operands of a binary op or of ``where``'s branches after :func:`weak_operand`."""
    return weak_operand(a, b), weak_operand(b, a)


__all__ = ["node_dtype", "weak_operand", "weak_pair", "wrap_to_dtype"]
