"""The values a mod computes with while it is traced: :class:`Proxy` (one scalar, built into an IR node
by Python's operators) and :class:`PartialLoad` (a captured tensor indexed in some of its dimensions).

A proxy knows only its tracer (:class:`flexc.mods.tracing.tracer.Tracer`): torch functions and tensor
methods called on it go to the tracer's ``dispatch``, ``methods`` and ``call``
(:mod:`flexc.mods.tracing.torch_ops` holds the tables).
"""
from __future__ import annotations

from typing import Any

import torch

from .. import ir, reductions
from ..derived import leaves
from ..promotion import weak_pair

_NUMPY_FIX = ("use the torch function instead (torch.where, torch.logical_and, torch.exp, `&`, `|`, ...), and "
              "convert captured numpy arrays to tensors once, outside the mod: `table = torch.as_tensor(table)`")


def dtype_kind(dtype: torch.dtype) -> str:
    """The IR kind (bool, int or float) of values of ``dtype``."""
    if dtype == torch.bool:
        return ir.BOOL
    return ir.FLOAT if dtype.is_floating_point else ir.INT


def describe_tensor(t: torch.Tensor) -> str:
    """A captured tensor as errors name it: ``(shape [4, 8], float32)``."""
    return f"(shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')})"


class PartialLoad:
    """A captured tensor indexed in fewer dimensions than it has (``bias[h]`` before ``[q_idx]``).

    ``slots`` has one entry per dimension: its index node, or ``None`` while still free.
    """

    def __init__(self, tensor: torch.Tensor, slots: tuple, tracer):
        self.tensor, self.slots, self.tracer = tensor, slots, tracer

    @property
    def indexed(self) -> int:
        return sum(node is not None for node in self.slots)

    @property
    def ndim(self) -> int:
        return self.tensor.dim()

    def describe(self) -> str:
        return describe_tensor(self.tensor)

    def __getitem__(self, key):
        return self.tracer.index(self, key)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in leaves((args, kwargs)) if isinstance(a, (Proxy, PartialLoad)))
        return tracer.dispatch(func, args, kwargs or {})

    def vector(self) -> "Proxy":
        """The rest of the tensor as a vector proxy (fails unless exactly one dimension is left)."""
        return self.tracer.wrap(self.tracer.to_node(self))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.vector(), name)

    def _as_vector(name: str):
        def method(self, *args):
            return getattr(self.vector(), name)(*args)
        method.__name__ = name
        return method

    __add__, __radd__, __sub__, __rsub__ = _as_vector("__add__"), _as_vector("__radd__"), _as_vector("__sub__"), _as_vector("__rsub__")
    __mul__, __rmul__, __truediv__, __rtruediv__ = _as_vector("__mul__"), _as_vector("__rmul__"), _as_vector("__truediv__"), _as_vector("__rtruediv__")
    __pow__, __rpow__, __eq__, __ne__ = _as_vector("__pow__"), _as_vector("__rpow__"), _as_vector("__eq__"), _as_vector("__ne__")
    __lt__, __le__, __gt__, __ge__ = _as_vector("__lt__"), _as_vector("__le__"), _as_vector("__gt__"), _as_vector("__ge__")
    __and__, __rand__, __or__, __ror__ = _as_vector("__and__"), _as_vector("__rand__"), _as_vector("__or__"), _as_vector("__ror__")
    __xor__, __rxor__, __neg__, __abs__ = _as_vector("__xor__"), _as_vector("__rxor__"), _as_vector("__neg__"), _as_vector("__abs__")
    __invert__, __bool__, __floordiv__, __rfloordiv__ = _as_vector("__invert__"), _as_vector("__bool__"), _as_vector("__floordiv__"), _as_vector("__rfloordiv__")
    __mod__, __rmod__ = _as_vector("__mod__"), _as_vector("__rmod__")
    del _as_vector
    __hash__ = object.__hash__


def _binop(op: str, reverse: bool = False):
    def method(self: "Proxy", other: Any) -> "Proxy":
        t = self.tracer
        a, b = self.node, t.to_node(other)
        if reverse:
            a, b = b, a
        return t.wrap(binary(t, op, a, b))

    method.__name__ = f"__{'r' if reverse else ''}{op}__"
    return method


def binary(t, op: str, a: ir.Node, b: ir.Node) -> ir.Node:
    """``a op b`` as torch computes it on tensors, traced by ``t``: Python ints take a narrow operand's dtype;
    logic on floats and integer division by zero fail."""
    if op in ir.LOGIC_OPS and ir.FLOAT in (a.kind, b.kind):
        t.fail(f"`{ir.SYMBOLS[op]}` on a float value ({a} {ir.SYMBOLS[op]} {b})",
               "use `&`, `|`, `^` on comparisons (bools) or integer indices")
    if op != "pow":  # torch converts a Python int to a narrow integer operand's dtype (wrapping)
        a, b = weak_pair(a, b)
    if op in ("floordiv", "mod") and b.op == "const" and b.attr == 0 and ir.FLOAT not in (a.kind, b.kind):
        t.fail(f"integer division by zero (`{a} {ir.SYMBOLS[op]} 0`, after torch converts the divisor to "
               f"the dividend's dtype); torch raises ZeroDivisionError for it",
               "divide by a non-zero number, or use `/` (true division) on floats")
    node = ir.binary(op, a, b)
    return t.note_site(node) if op in ("floordiv", "mod") else node


class Proxy:
    """Stands in for one scalar of a mod (``score``, ``q_idx``, or anything computed from them)."""

    is_trace_proxy = True  # how flexc.mods.lifted_cells tells a proxy from another operand

    __slots__ = ("node", "tracer")

    def __init__(self, node: ir.Node, tracer):
        self.node, self.tracer = node, tracer

    def __repr__(self) -> str:
        return f"Proxy({self.node})"

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in leaves((args, kwargs)) if isinstance(a, (Proxy, PartialLoad)))
        return tracer.dispatch(func, args, kwargs or {})

    __add__, __radd__ = _binop("add"), _binop("add", True)
    __sub__, __rsub__ = _binop("sub"), _binop("sub", True)
    __mul__, __rmul__ = _binop("mul"), _binop("mul", True)
    __truediv__, __rtruediv__ = _binop("truediv"), _binop("truediv", True)
    __floordiv__, __rfloordiv__ = _binop("floordiv"), _binop("floordiv", True)
    __mod__, __rmod__ = _binop("mod"), _binop("mod", True)
    __pow__, __rpow__ = _binop("pow"), _binop("pow", True)
    __and__, __rand__ = _binop("and"), _binop("and", True)
    __or__, __ror__ = _binop("or"), _binop("or", True)
    __xor__, __rxor__ = _binop("xor"), _binop("xor", True)

    def __lshift__(self, other):
        return self.tracer.methods["__lshift__"](self.tracer, self, other)

    def __rlshift__(self, other):
        return self.tracer.methods["__rlshift__"](self.tracer, self, other)

    def __rshift__(self, other):
        return self.tracer.methods["__rshift__"](self.tracer, self, other)

    def __rrshift__(self, other):
        return self.tracer.methods["__rrshift__"](self.tracer, self, other)

    def __round__(self, ndigits=None):  # Python's round() on a tensor is torch.round
        return self.tracer.methods["round"](self.tracer, self, ndigits or 0)
    __eq__, __ne__ = _binop("eq"), _binop("ne")
    __lt__, __le__ = _binop("lt"), _binop("le")
    __gt__, __ge__ = _binop("gt"), _binop("ge")

    def __neg__(self):
        if self.node.kind == ir.BOOL:
            self.tracer.fail(f"unary minus on a bool value ({self.node})", "use `~` to negate a condition")
        return self.tracer.wrap(ir.unary("neg", self.node))

    def __pos__(self):
        return self

    def __abs__(self):
        return self.tracer.wrap(ir.unary("abs", self.node))

    def __invert__(self):
        if self.node.kind == ir.FLOAT:
            self.tracer.fail(f"`~` on a float value ({self.node})", "use `~` on a comparison, or `-` to negate a number")
        return self.tracer.wrap(ir.unary("not", self.node))

    # -- things that would need a concrete value --
    def _concrete(self, how: str, fix: str):
        self.tracer.fail(
            f"{how} needs a concrete value, but `{self.node}` is symbolic (it is traced once for "
            f"all positions)", fix)

    def __bool__(self):
        self._concrete(
            "Python control flow (`if`, `while`, `and`, `or`, `not`, `bool()`, a conditional expression, "
            "a chained comparison `a < b < c`, or builtin min/max) on a traced value",
            "use `&`, `|`, `~` instead of `and`, `or`, `not`, and `torch.where(cond, a, b)` instead of `if`; "
            "write `(a < b) & (b < c)` for a chained comparison; use torch.minimum/torch.maximum instead of min/max",
        )

    def __int__(self):
        self._concrete("int()", "keep the value symbolic: use `//` for integer division and `.long()` to convert")

    def __float__(self):
        self._concrete("float() or a `math` function", "use the torch function instead, e.g. torch.exp, torch.sqrt, or `.float()`")

    def __index__(self):
        self._concrete("using a traced value as a Python index or length",
                       "index captured tensors directly, e.g. `bias[q_idx]`, not Python lists or range()")

    def __iter__(self):
        self._concrete("iterating over a traced value", "a traced value is a scalar; there is nothing to iterate")

    def __len__(self):
        self._concrete("len()", "a traced value is a scalar")

    def __getitem__(self, key):
        sizes = reductions.free_axes(self.node)
        if sizes and isinstance(key, int) and not isinstance(key, bool):  # one element of a vector
            n = next(iter(sizes))
            if not -n <= key < n:
                self.tracer.fail(f"index {key} is out of range for a vector of {n} values", "use an index inside it")
            return self.tracer.wrap(reductions.substitute(self.node, n, ir.const(key % n)))
        self.tracer.fail(f"indexing the traced scalar `{self.node}`", "index captured tensors, not the mod's arguments")

    # -- numpy: it cannot build graph nodes, so every way a proxy reaches it is an error --
    def __array__(self, *args, **kwargs):
        self.tracer.fail(f"the traced value `{self.node}` was passed to numpy (a numpy function, or an index "
                         f"into a numpy array); numpy needs concrete values", _NUMPY_FIX)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        self.tracer.fail(f"numpy's `np.{ufunc.__name__}` was called on the traced value `{self.node}`; numpy "
                         f"cannot be traced", _NUMPY_FIX)

    def __array_function__(self, func, types, args, kwargs):
        self.tracer.fail(f"numpy's `np.{func.__name__}` was called on the traced value `{self.node}`; numpy "
                         f"cannot be traced", _NUMPY_FIX)

    def __setitem__(self, key, value):
        self.tracer.fail("assigning into a traced value", "compute a new value instead")

    def __getattr__(self, name: str):
        tracer = self.tracer
        method = tracer.methods.get(name)
        if method is None:
            if name.startswith("__"):
                raise AttributeError(name)
            if name.endswith("_"):
                self.tracer.fail(f"`.{name}()` mutates a value inside the mod",
                                 f"mods must be pure: use the out-of-place form `.{name[:-1]}()`")
            public = sorted(n for n in tracer.methods if not n.startswith("_"))
            self.tracer.fail(f"the tensor method `.{name}()` is not supported by flexc's tracer",
                             f"use one of: {', '.join(public)}")
        return lambda *args, **kwargs: tracer.call(name, method, (self, *args), kwargs)

    def _unsupported_operator(symbol: str, fix: str):
        def method(self, *args):
            self.tracer.fail(f"the operator `{symbol}` is not supported on traced values", fix)
        return method

    __matmul__ = __rmatmul__ = _unsupported_operator("@", "a traced value is a scalar: use `*`")
    __divmod__ = __rdivmod__ = _unsupported_operator("divmod", "use `//` and `%` separately")
    del _unsupported_operator

    @property
    def dtype(self) -> torch.dtype:
        return {ir.BOOL: torch.bool, ir.INT: torch.int64, ir.FLOAT: torch.float32}[self.node.kind]

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def ndim(self) -> int:
        return 0

    def dim(self) -> int:
        return 0
