"""Evaluate a traced mod with vectorised torch operations.

Each IR node becomes the torch operation the user wrote, applied to whole index grids at once, so
the result equals calling the mod on broadcast index tensors: same values, same dtypes. Autograd
flows through captured tensors that require grad, which is how the CPU path differentiates
score_mods.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Sequence

import torch

from . import ir
from .trace import SCORE_MOD, TracedMod, trace

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


@functools.lru_cache(maxsize=1024)
def _order(root: ir.Node) -> tuple:
    """``root.walk()`` once per graph: traces are reused across calls (the trace cache), so is this."""
    return tuple(root.walk())


def evaluate(
    mod: TracedMod | ir.Node,
    *,
    score: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    q_idx: torch.Tensor | None = None,
    kv_idx: torch.Tensor | None = None,
    buffers: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Evaluate a traced mod on broadcastable tensors; the result has their broadcast shape.

    ``buffers`` replaces the captured tensors (same slots); by default the traced ones are used.
    """
    root = mod.root if isinstance(mod, TracedMod) else mod
    bufs = buffers if buffers is not None else (mod.buffers if isinstance(mod, TracedMod) else ())
    inputs = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    given = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    device = given[0].device if given else torch.device("cpu")
    # a reduction's axis runs along one extra leading dimension, in front of the inputs' broadcast dims
    ndim = max((t.dim() for t in given), default=0)
    values: dict[int, Any] = {}
    for node in _order(root):
        op, args = node.op, [values[id(a)] for a in node.args]
        if op == "input":
            v = inputs[node.attr]
            if v is None:
                raise ValueError(f"evaluate: the mod reads `{node.attr}` but no value was given for it")
        elif op == "const":
            v = node.attr
        elif op == "scalar":  # a captured number lifted out of the graph (flexc.codegen.scalars)
            v = mod.scalars[node.attr[0]]
        elif op == "buffer":
            v = bufs[node.attr[0]]
        elif op == "load":
            v = args[0][tuple(args[1:])] if len(args) > 1 else args[0]
        elif op == "cast":
            v = _tensor(args[0], device).to(getattr(torch, node.attr))
        elif op == "where":
            cond = _tensor(args[0], device)
            v = torch.where(cond, args[1], args[2])
        elif op in ("min", "max"):
            v = _min_max(op, args[0], args[1], device)
        elif op == "autograd_function":  # through apply: autograd then uses the Function's own backward
            v = node.attr.apply(*args[1:])
        elif op == "axis":
            v = torch.arange(node.attr, device=device).view(node.attr, *([1] * ndim))
        elif op == "reduce":
            v = _reduce(node.attr[0], node.attr[1], _tensor(args[0], device), ndim)
        elif op in _BINARY:
            x, y = args
            if op in ("fmod", "atan2"):  # torch functions: a tensor first (and second, for atan2)
                x = _tensor(x, device)
                y = _tensor(y, device) if op == "atan2" else y
            elif not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
                x = _tensor(x, device)
            v = _BINARY[op](x, y)
        elif op in _UNARY:
            v = _UNARY[op](_tensor(args[0], device))
        else:
            raise NotImplementedError(f"evaluate: unknown IR op {op!r}")
        values[id(node)] = v
    out = _tensor(values[id(root)], device)
    if given:
        # broadcast_tensors (views only), not torch.broadcast_shapes: the latter imports sympy,
        # which costs 0.3-1.5 s on the first call
        shape = torch.broadcast_tensors(*given)[0].shape
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


def evaluate_grid(mod: Any, B: int, H: int, Q_LEN: int, KV_LEN: int, device: Any = None,
                  score: torch.Tensor | None = None, max_elements: int = 1 << 24) -> torch.Tensor:
    """The mod over the full ``[B, H, Q_LEN, KV_LEN]`` grid, computed in query chunks.

    For a score_mod, ``score`` defaults to zeros (float32). Intermediates never exceed about
    ``max_elements`` elements per chunk; the output itself is dense.
    """
    traced = trace(mod)
    rows = max(1, min(Q_LEN, max_elements // max(1, B * H * KV_LEN)))
    chunks = []
    for q0 in range(0, Q_LEN, rows):
        n = min(rows, Q_LEN - q0)
        grid = index_grid(B, H, n, KV_LEN, device, q_start=q0)
        if traced.kind == SCORE_MOD:
            if score is None:
                s = torch.zeros((), device=device)
            elif score.dim() >= 2 and score.shape[-2] == Q_LEN and Q_LEN > 1:
                s = score[..., q0:q0 + n, :]
            else:  # broadcast along queries (e.g. a 0-d or [.., 1, S] score)
                s = score
            grid["score"] = s
        chunks.append(evaluate(traced, **grid).expand(B, H, n, KV_LEN))
    return torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0].contiguous()
