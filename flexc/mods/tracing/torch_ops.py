"""The tracer's tables: what each torch function and tensor method a mod may call builds in the IR.

Every handler takes the tracer first (``t``, a :class:`flexc.mods.tracing.tracer.Tracer`), then the
call's arguments; :data:`METHODS` holds the tensor methods, :data:`TORCH_FUNCS` the ``torch.*``
functions, both by name.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .. import elementwise, ir, reductions
from ..promotion import weak_pair
from .proxies import PartialLoad, Proxy, binary, dtype_kind

# ---- torch functions and tensor methods ---------------------------------------------------

_UNARY_FUNCS = {n: n for n in ("abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh",
                               "sigmoid", "sin", "cos", "floor", "ceil", "sign")}
_UNARY_FUNCS.update(neg="neg", negative="neg", logical_not="not", bitwise_not="not", absolute="abs",
                    expit="sigmoid")
_BINARY_FUNCS = {
    "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
    "true_divide": "truediv", "floor_divide": "floordiv", "remainder": "mod", "pow": "pow",
    "minimum": "min", "maximum": "max", "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "greater_equal": "ge", "greater": "gt", "less_equal": "le", "less": "lt", "not_equal": "ne",
    "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "truediv", "__div__": "truediv",
    "__floordiv__": "floordiv", "__mod__": "mod", "__pow__": "pow", "__and__": "and", "__or__": "or",
    "__xor__": "xor", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
    "__ge__": "ge",
}
_REVERSED_FUNCS = {"__radd__": "add", "__rsub__": "sub", "rsub": "sub", "__rmul__": "mul",
                   "__rtruediv__": "truediv", "__rdiv__": "truediv", "__rfloordiv__": "floordiv",
                   "__rmod__": "mod", "__rpow__": "pow", "__rand__": "and", "__ror__": "or", "__rxor__": "xor"}
_LOGICAL_FUNCS = {"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}
_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
          "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64, "bool": torch.bool}


def _cast(t, x: Any, dtype: torch.dtype) -> "Proxy":
    node = t.to_node(x)
    kind = dtype_kind(dtype)
    name = str(dtype).removeprefix("torch.")
    # Constants with a default dtype stay Python constants (`b.new_ones((), dtype=torch.bool)` is
    # True, `torch.full_like(q_idx, 7)` is 7): a Python number mixes with tensors as a 0-d tensor of
    # the default dtype does (a float32 score rounds it the same way; `like=` a float64 score, the
    # unrounded number is what torch would have used).
    if node.op == "const" and dtype in (torch.bool, torch.int64, torch.float32):
        value = node.attr
        if dtype == torch.bool:
            return t.wrap(ir.const(bool(value)))
        if dtype == torch.int64 and not (isinstance(value, float) and not math.isfinite(value)):
            return t.wrap(ir.const(int(value)))
        if dtype == torch.float32:
            return t.wrap(ir.const(float(value)))
    if kind == ir.BOOL and node.kind != ir.BOOL:
        return t.wrap(ir.binary("ne", node, ir.const(0)))
    return t.wrap(ir.cast(node, name, kind))


def _to(t, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.to(dtype)``, ``x.to(other)``, ``x.to(device, dtype)``; device moves are no-ops here."""
    for a in (*args, kwargs.get("dtype"), kwargs.get("other")):
        if isinstance(a, torch.dtype):
            return _cast(t, x, a)
        if isinstance(a, (Proxy, torch.Tensor)):
            return _cast(t, x, a.dtype)
    return x


def _masked_fill(t, x: Any, mask: Any, value: Any) -> "Proxy":
    m = t.to_node(mask)
    if m.kind != ir.BOOL:
        t.fail(f"masked_fill's mask `{m}` is {'an' if m.kind == ir.INT else 'a'} {m.kind}, not a bool",
               "pass a comparison such as `q_idx < kv_idx`")
    return t.wrap(ir.where(m, *weak_pair(t.to_node(value), t.to_node(x))))


def _as_bool(t, x: Any) -> ir.Node:
    node = t.to_node(x)
    return node if node.kind == ir.BOOL else ir.binary("ne", node, ir.const(0))


def _clamp(t, x: Any, min: Any = None, max: Any = None) -> "Proxy":
    node = t.to_node(x)
    if min is not None:
        node = binary(t, "max", node, t.to_node(min))
    if max is not None:
        node = binary(t, "min", node, t.to_node(max))
    return t.wrap(node)


def _where(t, cond: Any, x: Any, y: Any) -> "Proxy":
    c = t.to_node(cond)
    if c.kind != ir.BOOL:
        t.fail(f"torch.where's condition `{c}` is {'an' if c.kind == ir.INT else 'a'} {c.kind}, not a bool", "pass a comparison such as `q_idx >= kv_idx`")
    return t.wrap(ir.where(c, *weak_pair(t.to_node(x), t.to_node(y))))


def _div(t, x: Any, y: Any, rounding_mode: str | None = None) -> "Proxy":
    a, b = t.to_node(x), t.to_node(y)
    if rounding_mode is None:
        return t.wrap(binary(t, "truediv", a, b))
    if rounding_mode == "floor":
        return t.wrap(binary(t, "floordiv", a, b))
    t.fail(f"torch.div with rounding_mode={rounding_mode!r}", "use rounding_mode='floor' (or `//`), or plain `/`")


def _full(t, value: Any, dtype: torch.dtype | None = None, like: Any = None) -> "Proxy":
    node = t.to_node(value)
    if dtype is None and like is not None:
        dtype = like.dtype if isinstance(like, (Proxy, torch.Tensor)) else None
    return _cast(t, t.wrap(node), dtype) if dtype is not None else t.wrap(node)


def _min_max(op: str):
    """``torch.min(a, b)`` / ``a.max(b)``: the elementwise two-operand form (as in HF's T5 buckets)."""
    def handler(t, x: Any, other: Any = None, *rest: Any, **kwargs: Any) -> "Proxy":
        if other is None or rest or kwargs or isinstance(other, bool):
            t.fail(f"`{op}` with one operand is a reduction, which a scalar mod cannot do",
                   f"compare two values with `torch.{op}imum(a, b)`")
        return t.wrap(binary(t, op, t.to_node(x), t.to_node(other)))
    return handler


def _method_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for name, op in _UNARY_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x: t.wrap(ir.unary(op, t.to_node(x))), op)
    for name, op in _BINARY_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(binary(t, op, t.to_node(x), t.to_node(y))), op)
    for name, op in _REVERSED_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(binary(t, op, t.to_node(y), t.to_node(x))), op)
    for name, op in _LOGICAL_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(ir.binary(op, _as_bool(t, x), _as_bool(t, y))), op)
    table["logical_not"] = lambda t, x: t.wrap(ir.unary("not", _as_bool(t, x)))
    for name, dtype in _CASTS.items():
        table[name] = functools.partial(lambda dtype, t, x: _cast(t, x, dtype), dtype)
    table["to"] = _to
    table["min"], table["max"] = _min_max("min"), _min_max("max")
    table["masked_fill"] = _masked_fill
    table["type_as"] = lambda t, x, other: _cast(t, x, other.dtype)
    table["clamp"] = table["clip"] = _clamp
    table["clamp_min"] = lambda t, x, min: _clamp(t, x, min=min)
    table["clamp_max"] = lambda t, x, max: _clamp(t, x, max=max)
    table["where"] = lambda t, x, cond, y: _where(t, cond, x, y)  # tensor method order: x.where(cond, y)
    table["div"] = table["divide"] = table["__truediv__"] = _div
    table["square"] = lambda t, x: t.wrap(ir.binary("mul", t.to_node(x), t.to_node(x)))
    table["reciprocal"] = lambda t, x: t.wrap(ir.binary("truediv", ir.const(1.0), t.to_node(x)))
    table["new_ones"] = lambda t, x, size=(), dtype=None, **k: _full(t, 1, dtype, x)
    table["new_zeros"] = lambda t, x, size=(), dtype=None, **k: _full(t, 0, dtype, x)
    table["new_full"] = lambda t, x, size, value, dtype=None, **k: _full(t, value, dtype, x)
    table["new_tensor"] = lambda t, x, value, dtype=None, **k: _full(t, value, dtype)
    table["detach"] = table["clone"] = table["contiguous"] = lambda t, x, *a, **k: x
    for name in ("item", "tolist", "numpy", "cpu", "cuda"):
        table[name] = functools.partial(lambda name, t, x, *a, **k: t.fail(
            f"`.{name}()` on a traced value needs a concrete value",
            "keep the value symbolic: index captured tensors with it or compare it directly"), name)
    return table


METHODS = _method_table()
# torch.* functions that take a proxy; looked up by name and mapped to the method table above.
TORCH_FUNCS = dict(METHODS)
TORCH_FUNCS["where"] = _where
TORCH_FUNCS.update(
    ones_like=lambda t, x, dtype=None, **k: _full(t, 1, dtype, x),
    zeros_like=lambda t, x, dtype=None, **k: _full(t, 0, dtype, x),
    full_like=lambda t, x, value, dtype=None, **k: _full(t, value, dtype, x),
)


# ---- shifts and the rest of torch's elementwise math ------------------------------------------

def _shift(t, op: str, x: Any, y: Any) -> "Proxy":
    """``x << y`` / ``x >> y`` on integers. A shift by a constant is the multiplication or floor
    division by a power of two it equals (also for negative x: >> is arithmetic, as in torch), which
    the range analysis decides exactly; other shifts become shift nodes."""
    a, b = t.to_node(x), t.to_node(y)
    if ir.FLOAT in (a.kind, b.kind):
        t.fail(f"`{'<<' if op == 'lshift' else '>>'}` on a float value ({a}, {b})",
               "shift integers only, e.g. convert with `.long()` first")
    if b.op == "const" and not isinstance(b.attr, bool) and 0 <= b.attr < 63 and a.kind == ir.INT:
        return t.wrap(binary(t, "mul" if op == "lshift" else "floordiv", a, ir.const(1 << b.attr)))
    return t.wrap(binary(t, op, a, b))


def _options(t, name: str, values: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An activation's options as Python values; ``inplace=True`` would mutate a traced value."""
    kwargs = dict(kwargs)
    if kwargs.pop("inplace", False):
        t.fail(f"`{name}(..., inplace=True)` mutates its input inside the mod", "pass inplace=False (the default)")
    for v in (*values, *kwargs.values()):
        if isinstance(v, (Proxy, PartialLoad, torch.Tensor)):
            t.fail(f"an option of `{name}` is a tensor or traced value ({v!r})",
                   f"pass {name}'s options as Python numbers; compute a tensor-dependent variant from arithmetic")
    return values, kwargs


def _activation(name: str, builder: Callable) -> Callable:
    def handler(t, x: Any, *options: Any, **kwargs: Any) -> "Proxy":
        options, kwargs = _options(t, name, options, kwargs)
        try:
            return t.wrap(builder(t.to_node(x), *options, **kwargs))
        except ValueError as e:
            t.fail(f"`{name}`: {e}", f"call {name} with the options torch documents")
    return handler


def _unary_math(op: str) -> Callable:
    def handler(t, x: Any, decimals: int = 0) -> "Proxy":
        node = t.to_node(x)
        if op in ("trunc", "round") and node.kind != ir.FLOAT:
            return t.wrap(node)  # an integer is its own trunc and round
        if decimals:  # torch.round(x, decimals=d): round(x * 10**d) / 10**d
            scaled = ir.unary(op, ir.binary("mul", node, ir.const(10.0 ** decimals)))
            return t.wrap(ir.binary("truediv", scaled, ir.const(10.0 ** decimals)))
        return t.wrap(ir.unary(op, node))
    return handler


def _logit(t, x: Any, eps: float | None = None) -> "Proxy":
    node = t.to_node(x)
    if eps is not None:
        node = ir.binary("min", ir.binary("max", node, ir.const(float(eps))), ir.const(1.0 - eps))
    return t.wrap(elementwise.logit(node))


def _elementwise_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for name, op in elementwise.UNARY_ALIASES.items():
        table[name] = _unary_math(op)
    for name, op in elementwise.BINARY_ALIASES.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(binary(t, op, t.to_node(x), t.to_node(y))), op)
    for name, builder in elementwise.ACTIVATIONS.items():
        table[name] = _activation(name, builder)
    table["_threshold"] = table["threshold"]  # torch.nn.functional.threshold's own name
    for name, builder in elementwise.OPERAND_FUNCS.items():
        table[name] = functools.partial(
            lambda builder, t, *xs: t.wrap(builder(*(t.to_node(x) for x in xs))), builder)
    table["logit"] = _logit
    table["positive"] = lambda t, x: x
    table["__lshift__"] = table["bitwise_left_shift"] = lambda t, x, y: _shift(t, "lshift", x, y)
    table["__rshift__"] = table["bitwise_right_shift"] = lambda t, x, y: _shift(t, "rshift", x, y)
    table["__rlshift__"] = lambda t, x, y: _shift(t, "lshift", y, x)
    table["__rrshift__"] = lambda t, x, y: _shift(t, "rshift", y, x)
    # torch.special.* arrive as special_<name>
    for name in ("erf", "erfc", "expm1", "log1p", "logit", "sinc", "xlogy", "round", "exp2", "expit"):
        table[f"special_{name}"] = table.get(name) or TORCH_FUNCS[name]
    return table


# ---- vectors over a small captured axis and their reductions (flexc.mods.reductions) ---------------

def _vector_size(t, node: ir.Node, what: str) -> int | None:
    """The length of the vector ``node`` holds, or None for a scalar."""
    sizes = reductions.free_axes(node)
    if len(sizes) > 1:
        t.fail(f"{what} combines vectors of different lengths {sorted(sizes)}", "combine vectors of one length")
    return next(iter(sizes)) if sizes else None


def _check_dim(t, name: str, dim: Any) -> None:
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if any(isinstance(d, bool) or not isinstance(d, int) or d not in (-1, 0) for d in dims):
        t.fail(f"`{name}` over dim={dim!r}; a captured vector has one dimension",
               f"reduce over its only dimension: `.{name}(-1)`")


def _reduction(op: str, name: str) -> Callable:
    """``x.sum(dim)``, ``x.any(dim)``... over a vector's axis; on a scalar (one value) the value itself."""
    def handler(t, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> "Proxy":
        node = t.to_node(x)
        if dim is not None:
            _check_dim(t, name, dim)
        n = _vector_size(t, node, f"`{name}`")
        if n is None:  # reducing a single value (a scalar, possibly unsqueezed)
            out = _as_bool(t, node) if op in ("any", "all") else node
            if op in ("sum", "prod") and out.kind == ir.BOOL:
                out = ir.cast(out, "int64", ir.INT)
        else:
            out = reductions.reduce(op, node, n)
        if name == "mean":
            out = ir.binary("truediv", out, ir.const(n or 1))
        result = t.wrap(out)
        return _cast(t, result, dtype) if dtype is not None else result
    return handler


def _dot(t, x: Any, y: Any) -> "Proxy":
    a, b = t.to_node(x), t.to_node(y)
    n = _vector_size(t, ir.binary("mul", a, b), "`dot`")
    if n is None or _vector_size(t, a, "`dot`") is None or _vector_size(t, b, "`dot`") is None:
        t.fail("`dot` of values that are not both vectors", "index a captured tensor in all but one dimension, "
               "e.g. `torch.dot(q_rope[b, h, q_idx], k_rope[b, h, kv_idx])`")
    return t.wrap(reductions.reduce("sum", binary(t, "mul", a, b), n))


def _norm(t, x: Any, p: Any = 2, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> "Proxy":
    node = t.to_node(x)
    p = kwargs.pop("ord", p)
    if dim is not None:
        _check_dim(t, "norm", dim)
    if kwargs or p not in (1, 2, "fro"):
        t.fail(f"`norm` with p={p!r}", "use p=1 or p=2, or write the reduction out, e.g. `x.abs().amax(-1)`")
    n = _vector_size(t, node, "`norm`")
    magnitude = ir.unary("abs", node) if p == 1 else binary(t, "mul", node, node)
    total = reductions.reduce("sum", magnitude, n) if n is not None else magnitude
    return t.wrap(total if p == 1 else ir.unary("sqrt", total))


class _ValuesIndices(tuple):
    """``torch.max(x, dim)``'s result: ``.values``; the indices are not traced."""

    @property
    def values(self):
        return self[0]

    @property
    def indices(self):
        self[1].fail("the indices of a max/min reduction", "use `.amax(-1)`/`.amin(-1)` (the values) instead")


def _min_max_or_reduction(op: str) -> Callable:
    """``a.max(b)`` elementwise as before; ``v.max()`` / ``v.max(dim)`` reduce a vector."""
    elementwise_form = _min_max(op)
    reduce = _reduction(op, op)

    def handler(t, x: Any, other: Any = None, *rest: Any, **kwargs: Any) -> Any:
        vector = isinstance(x, PartialLoad) or (isinstance(x, Proxy) and reductions.free_axes(x.node))
        dim = kwargs.pop("dim", other)
        if vector and not rest and set(kwargs) <= {"keepdim"} and (dim is None or isinstance(dim, int)):
            values = reduce(t, x, dim, **kwargs)
            return values if dim is None else _ValuesIndices((values, t))
        return elementwise_form(t, x, other, *rest, **kwargs)
    return handler


def _unsqueeze(t, x: Any, dim: int = 0) -> Any:
    node = t.to_node(x)
    if reductions.free_axes(node):
        t.fail("`unsqueeze` of a vector (it would make a second dimension, which flexc does not trace)",
               "compare the scalar against the vector directly; broadcasting does the rest")
    return t.wrap(node)  # a scalar with a size-1 dimension: the same single value


def _vector_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for op, names in (("sum", ("sum", "nansum")), ("prod", ("prod",)), ("max", ("amax",)), ("min", ("amin",)),
                      ("any", ("any",)), ("all", ("all",)), ("sum", ("mean",))):
        for name in names:
            table[name] = _reduction(op, name)
    table["max"], table["min"] = _min_max_or_reduction("max"), _min_max_or_reduction("min")
    table["dot"] = table["inner"] = table["vdot"] = _dot
    table["norm"] = table["linalg_vector_norm"] = _norm
    table["count_nonzero"] = lambda t, x, dim=None: _reduction("sum", "count_nonzero")(t, t.wrap(_as_bool(t, x)), dim)
    table["unsqueeze"] = _unsqueeze
    table["squeeze"] = lambda t, x, *dims: x
    return table


_ELEMENTWISE = _elementwise_table()
_ELEMENTWISE.update(_vector_table())
METHODS.update({k: v for k, v in _ELEMENTWISE.items() if not k.startswith("special_")})
TORCH_FUNCS.update(_ELEMENTWISE)
