"""Trace a ``score_mod`` or ``mask_mod`` into an :mod:`flexc.mods.ir` graph.

The mod is called once with proxy objects standing in for ``score``, ``b``, ``h``, ``q_idx`` and
``kv_idx``. Python operators on proxies build graph nodes; torch functions and tensor methods are
intercepted by a :class:`~torch.overrides.TorchFunctionMode` while the mod runs. Tensors the mod
captures (closures, globals, defaults, ``functools.partial`` arguments) become buffer parameters
the moment a proxy indexes them or meets them in arithmetic. Anything that would make the graph
depend on a concrete value (``if``, ``bool()``, ``int()``, ``.item()``) raises :class:`TraceError`
with the offending line and a fix.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import linecache
import math
import os
import sys
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from . import derived, elementwise, ir, lifted_cells, lowering, reductions, trace_cache
from .derived import leaves
from .promotion import weak_pair
from .traced_mod import (MASK_MOD, MASK_MOD_ARGS, SCORE_MOD, SCORE_MOD_ARGS, ArityError, TraceError,  # noqa: F401
                         TracedMod, code_of, def_site, mod_kind, mod_name)

_FLEXC_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def trace(fn: Callable, kind: str | None = None) -> TracedMod:
    """Trace ``fn`` once with proxies and return its :class:`TracedMod`.

    ``kind`` (``"score_mod"``/``"mask_mod"``) is inferred from the arity when omitted. Raises
    :class:`TraceError` for code that cannot become a graph. The trace is cached on the function and
    reused while nothing the mod can read has changed (see :mod:`flexc.mods.trace_cache`).

    >>> print(trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))
    q_idx >= kv_idx
    """
    token = None
    if not isinstance(fn, TracedMod):
        cached, token = trace_cache.lookup(fn, kind)
        if cached is not None:
            return cached if cached.derivations is None else derived.current(cached)
    actual = fn.kind if isinstance(fn, TracedMod) else mod_kind(fn)
    if kind is not None and kind != actual:
        source = fn.fn if isinstance(fn, TracedMod) else fn
        raise TraceError(
            f"cannot trace {mod_name(source)}{def_site(source)}: expected a {kind} but it is a {actual} "
            f"({len(SCORE_MOD_ARGS if actual == SCORE_MOD else MASK_MOD_ARGS)} positional parameters). "
            f"Fix: pass a {kind} taking ({', '.join(SCORE_MOD_ARGS if kind == SCORE_MOD else MASK_MOD_ARGS)})."
        )
    if isinstance(fn, TracedMod):
        return fn if fn.derivations is None else derived.current(fn)
    if trace_cache.wants_template(token):
        traced = _from_template(fn, actual, token)
        if traced is not None:
            return traced
    tracer = Tracer(fn, actual)
    traced = tracer.run()
    if not tracer.reads_values:  # a trace that baked in a tensor's value must be redone each call
        trace_cache.remember(token, traced)
    return traced


def _from_template(fn: Callable, kind: str, token: Any) -> TracedMod | None:
    """Trace ``fn`` once with its liftable cells as placeholders (flexc.mods.lifted_cells), remember the
    template (or that there is none) and return ``fn``'s trace from it; None: trace with the values."""
    cells = trace_cache.template_cells(token)
    clone, numbers = lifted_cells.clone_with_markers(fn, cells)
    template = None
    try:
        tracer = Tracer(clone, kind)
        traced = tracer.run()
        if not tracer.reads_values:
            template = lifted_cells.template_of(traced, fn, cells, numbers)
    except Exception:  # any failure: the trace with the values decides (and raises its own error)
        template = None
    trace_cache.remember_template(token, template)
    return (trace_cache.instance(template, fn, token.key[1], token.keep, token.located) if template is not None
            else None)


# ---- the tracer ---------------------------------------------------------------------------

class Tracer:
    def __init__(self, fn: Callable, kind: str):
        self.fn, self.kind = fn, kind
        self.buffers: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}
        self._site: tuple[str, str] | None = None  # overrides the error location once the mod returned
        self.reads_values = False  # the mod read a concrete tensor value: the trace is not cached
        self.sites: dict = {}  # lookup / division node -> where the mod wrote it
        self.recorder = derived.Recorder()  # torch operations on captured tensors, for replay

    def note_site(self, node: ir.Node) -> ir.Node:
        """Remember where ``node`` (a lookup or an integer division) was written; the first place wins."""
        if node not in self.sites:
            self.sites[node] = self._site if self._site is not None else _user_site()
        return node

    def run(self) -> TracedMod:
        names = SCORE_MOD_ARGS if self.kind == SCORE_MOD else MASK_MOD_ARGS
        proxies = [Proxy(ir.input_(n), self) for n in names]
        with TraceMode(self), hook_function_apply(self):
            out = self.fn(*proxies)
        # the mod has returned: problems with its result point at its return statement
        self._site = _return_site(self.fn)
        if out is None:
            self.fail("it returned None", "add a `return` statement with the mask or score")
        root = self.to_node(out, what="the return value")
        if reductions.free_axes(root):
            self.fail(f"the mod returns a vector of {sorted(reductions.free_axes(root))[0]} values "
                      f"(`{ir.format_expr(root)}`), not one value per position",
                      "reduce it to a scalar, e.g. with `.sum(-1)`, `.any(-1)`, `.all(-1)` or `torch.dot(a, b)`, or "
                      "index every dimension of the captured tensors it reads")
        if self.kind == MASK_MOD and root.kind != ir.BOOL:
            self.fail(
                f"a mask_mod must return a bool, but {mod_name(self.fn)} returns "
                f"{'an' if root.kind == ir.INT else 'a'} {root.kind} value: {ir.format_expr(root)}",
                "return a comparison such as `q_idx >= kv_idx`; to change scores write a score_mod",
            )
        if self.kind == SCORE_MOD and root.kind == ir.BOOL:
            self.fail(
                f"a score_mod must return a number, but {mod_name(self.fn)} returns a bool: "
                f"{ir.format_expr(root)}",
                "to mask, return `torch.where(cond, score, -float('inf'))` or write a mask_mod",
            )
        if self.kind == SCORE_MOD and root.kind == ir.INT:
            root = ir.cast(root, "float32", ir.FLOAT)
        return TracedMod(self.kind, root, tuple(self.buffers), _buffer_names(self.fn, self.buffers),
                         mod_name(self.fn), self.fn, self.sites,
                         derivations=self.recorder.derivations(self.buffers))

    # -- errors --
    def fail(self, what: str, fix: str) -> None:
        """Raise a TraceError naming the mod, the offending ``file:line`` and its source, and the fix."""
        where, source = self._site if self._site is not None else _user_site()
        text = f"cannot trace {self.kind} {mod_name(self.fn)}{where}: {what}."
        if source:
            text += f"\n    {source}"
        raise TraceError(f"{text}\nFix: {fix}.")

    # -- operands --
    def buffer_node(self, t: torch.Tensor) -> ir.Node:
        slot = self._slots.get(id(t))
        if slot is None:
            slot = len(self.buffers)
            self._slots[id(t)] = slot
            self.buffers.append(t)
        return ir.buffer(slot, str(t.dtype).removeprefix("torch."), t.dim(), _dtype_kind(t.dtype))

    def to_node(self, x: Any, what: str = "an operand") -> ir.Node:
        if isinstance(x, _PartialLoad) and x.indexed == x.ndim - 1:
            # one dimension left: a vector over it, to be reduced (flexc.mods.reductions)
            free = x.slots.index(None)
            slots = tuple(reductions.axis(x.tensor.shape[free]) if n is None else n for n in x.slots)
            return ir.load(self.buffer_node(x.tensor), slots)
        if isinstance(x, _PartialLoad):
            self.fail(
                f"captured tensor {x.describe()} is indexed with {x.indexed} of its {x.ndim} "
                f"dimensions, which leaves a tensor, not a scalar",
                "index every dimension, e.g. `bias[h, q_idx, kv_idx]` for a 3-D bias",
            )
        if isinstance(x, Proxy):
            return x.node
        if type(x) is lifted_cells.Marker:  # a captured number traced as a placeholder
            return x.node
        if isinstance(x, (bool, int, float)):
            if isinstance(x, float) and math.isnan(x):
                self.fail("a NaN constant", "use a finite number or -inf")
            return ir.const(x)
        if _is_numpy_array(x):
            self.fail(f"{what} is a numpy array (shape {list(x.shape)}, {x.dtype}); flexc captures torch "
                      f"tensors only", "convert it once, outside the mod: `table = torch.as_tensor(table)`, "
                      "then index it with the mod's arguments")
        if hasattr(x, "dtype") and hasattr(x, "item") and not isinstance(x, torch.Tensor):  # numpy scalar
            return ir.const(x.item())
        if isinstance(x, torch.Tensor):
            if x.dim() == 1:  # a captured vector, to be reduced (flexc.mods.reductions)
                return ir.load(self.buffer_node(x), (reductions.axis(x.shape[0]),))
            if x.dim() != 0:
                self.fail(
                    f"{what} is a captured tensor of shape {list(x.shape)} used whole; a mod works "
                    f"on one (b, h, q_idx, kv_idx) element at a time",
                    "index it with the mod's arguments, e.g. `bias[h, q_idx]`",
                )
            return ir.load(self.buffer_node(x), ())
        self.fail(f"{what} has unsupported type {type(x).__name__}", "use tensors, Python numbers or the mod's arguments")

    def function_apply(self, fn_class: type, args: tuple, kwargs: dict) -> "Proxy":
        """``fn_class.apply(*args)`` for a torch.autograd.Function: its forward is traced into the
        graph, and the node keeps the class, so evaluation calls ``apply`` and autograd runs the
        Function's own backward."""
        name = f"{fn_class.__name__}.apply"
        if kwargs:
            self.fail(f"`{name}` with keyword arguments", "pass the Function's inputs positionally")
        inputs = tuple(self.to_node(a, what=f"an input of {name}") for a in args)
        call_args = [a if isinstance(a, (bool, int, float)) else self.wrap(n) for a, n in zip(args, inputs)]
        if torch.autograd.function._is_setup_context_defined(fn_class.setup_context):
            out = fn_class.forward(*call_args)
        else:
            out = fn_class.forward(_TracingCtx(self, name), *call_args)
        if isinstance(out, (tuple, list)):
            self.fail(f"`{name}` returns {len(out)} outputs; a score_mod can use one", "return a single tensor from forward")
        return self.wrap(lowering.autograd_function(fn_class, self.to_node(out, what=f"the output of {name}"), inputs))

    def wrap(self, node: ir.Node) -> "Proxy":
        return Proxy(node, self)

    # -- indexing a captured tensor --
    def index(self, base: Any, key: Any) -> Any:
        """``tensor[key]`` or ``partial[key]``; a load once every dimension has an index.

        ``slots`` holds one index node per dimension of the captured tensor, ``None`` for a dimension
        still free. As in torch, a full slice ``:`` (or ``...``) leaves its dimension free and the
        next indexing fills the free dimensions in order: ``bias[:, q_idx][h]`` is ``bias[h, q_idx]``.
        """
        tensor = base.tensor if isinstance(base, _PartialLoad) else base
        slots = list(base.slots) if isinstance(base, _PartialLoad) else [None] * tensor.dim()
        free = [d for d, node in enumerate(slots) if node is None]
        keys = list(key) if isinstance(key, tuple) else [key]
        ellipses = [i for i, k in enumerate(keys) if k is Ellipsis]  # not .index(): Proxy == builds a node
        if ellipses:
            pos = ellipses[0]
            keys[pos:pos + 1] = [slice(None)] * max(len(free) - (len(keys) - 1), 0)
        if len(keys) > len(free):
            self.fail(
                f"captured tensor {_describe(tensor)} is indexed with more indices than its "
                f"{tensor.dim()} dimension{'s' if tensor.dim() != 1 else ''}",
                f"index it with exactly {tensor.dim()} "
                f"{'index' if tensor.dim() == 1 else 'indices'}, one per dimension",
            )
        for k, dim in zip(keys, free):
            slots[dim] = self._index_node(tensor, dim, k)
        if any(node is None for node in slots):
            return _PartialLoad(tensor, tuple(slots), self)
        return self.wrap(self.note_site(ir.load(self.buffer_node(tensor), tuple(slots))))

    def _index_node(self, tensor: torch.Tensor, dim: int, k: Any) -> ir.Node | None:
        """The index node for ``k`` on dimension ``dim``; ``None`` when a full slice leaves it free."""
        if isinstance(k, Proxy):
            if k.node.kind == ir.FLOAT:
                self.fail(f"captured tensor {_describe(tensor)} is indexed with a float value {k.node}",
                          "convert the index with `.long()` or use `//` instead of `/`")
            if k.node.kind == ir.BOOL:
                self.fail(f"captured tensor {_describe(tensor)} is indexed with a bool value {k.node}",
                          "use torch.where(cond, a, b) to choose between values")
            return k.node
        if isinstance(k, bool) or k is None:
            self.fail(f"captured tensor {_describe(tensor)} is indexed with {k!r}", "index with integers or the mod's arguments")
        size = tensor.shape[dim]
        if isinstance(k, int) or (isinstance(k, torch.Tensor) and k.dim() == 0 and not k.is_floating_point()):
            self.reads_values |= isinstance(k, torch.Tensor)
            i = int(k)
            if not -size <= i < size:
                self.fail(f"index {i} is out of range for dimension {dim} of captured tensor {_describe(tensor)}",
                          "use an index inside the tensor")
            return ir.const(i % size)
        if isinstance(k, slice):
            picked = range(size)[k]
            if len(picked) == 1:  # a one-element slice picks that element
                return ir.const(picked[0])
            if picked == range(size):
                return None
            self.fail(
                f"the slice {_slice_text(k)} on dimension {dim} of captured tensor {_describe(tensor)} "
                f"selects {len(picked)} elements; the result must be a scalar",
                "slice the tensor outside the mod, or index that dimension with an integer",
            )
        self.fail(f"captured tensor {_describe(tensor)} is indexed with a {type(k).__name__}",
                  "index with integers, slices of one element, or the mod's arguments")


class _TracingCtx:
    """The ``ctx`` a Function's forward sees while it is traced: what it saves is not needed, since
    its backward runs later on real tensors (through ``apply`` in evaluation)."""

    def __init__(self, tracer: Tracer, name: str):
        self._tracer, self._name = tracer, name
        self.needs_input_grad = ()

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        self._tracer.fail(f"`{self._name}` marks an input dirty (it mutates it)", "return a new tensor instead")


# torch.autograd.Function.apply is routed to the tracer while a mod is traced (a Function's
# apply does not reach __torch_function__). The hook is installed only while some thread traces,
# and calls without a traced value go to torch's own apply unchanged.
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_apply_lock = threading.Lock()
_apply_users = 0
_active = threading.local()


def _traced_apply(cls, *args, **kwargs):
    tracer = getattr(_active, "tracer", None)
    if tracer is None or not any(isinstance(a, (Proxy, _PartialLoad)) for a in leaves((args, kwargs))):
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    return tracer.function_apply(cls, args, kwargs)


@contextlib.contextmanager
def hook_function_apply(tracer: Tracer):
    global _apply_users
    with _apply_lock:
        if _apply_users == 0:
            torch.autograd.Function.apply = classmethod(_traced_apply)
        _apply_users += 1
    previous, _active.tracer = getattr(_active, "tracer", None), tracer
    try:
        yield
    finally:
        _active.tracer = previous
        with _apply_lock:
            _apply_users -= 1
            if _apply_users == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return ir.BOOL
    return ir.FLOAT if dtype.is_floating_point else ir.INT


def _describe(t: torch.Tensor) -> str:
    return f"(shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')})"


def _slice_text(s: slice) -> str:
    parts = ["" if v is None else str(v) for v in (s.start, s.stop, s.step)]
    return ":".join(parts[:2] if s.step is None else parts)


class _PartialLoad:
    """A captured tensor indexed in fewer dimensions than it has (``bias[h]`` before ``[q_idx]``).

    ``slots`` has one entry per dimension: its index node, or ``None`` while still free.
    """

    def __init__(self, tensor: torch.Tensor, slots: tuple, tracer: Tracer):
        self.tensor, self.slots, self.tracer = tensor, slots, tracer

    @property
    def indexed(self) -> int:
        return sum(node is not None for node in self.slots)

    @property
    def ndim(self) -> int:
        return self.tensor.dim()

    def describe(self) -> str:
        return _describe(self.tensor)

    def __getitem__(self, key):
        return self.tracer.index(self, key)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in leaves((args, kwargs)) if isinstance(a, (Proxy, _PartialLoad)))
        return _dispatch(tracer, func, args, kwargs or {})

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


# ---- proxies ------------------------------------------------------------------------------

def _binop(op: str, reverse: bool = False):
    def method(self: "Proxy", other: Any) -> "Proxy":
        t = self.tracer
        a, b = self.node, t.to_node(other)
        if reverse:
            a, b = b, a
        return t.wrap(_binary(t, op, a, b))

    method.__name__ = f"__{'r' if reverse else ''}{op}__"
    return method


def _binary(t: Tracer, op: str, a: ir.Node, b: ir.Node) -> ir.Node:
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

    def __init__(self, node: ir.Node, tracer: Tracer):
        self.node, self.tracer = node, tracer

    def __repr__(self) -> str:
        return f"Proxy({self.node})"

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in leaves((args, kwargs)) if isinstance(a, (Proxy, _PartialLoad)))
        return _dispatch(tracer, func, args, kwargs or {})

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
        return _shift(self.tracer, "lshift", self, other)

    def __rlshift__(self, other):
        return _shift(self.tracer, "lshift", other, self)

    def __rshift__(self, other):
        return _shift(self.tracer, "rshift", self, other)

    def __rrshift__(self, other):
        return _shift(self.tracer, "rshift", other, self)

    def __round__(self, ndigits=None):  # Python's round() on a tensor is torch.round
        return _unary_math("round")(self.tracer, self, ndigits or 0)
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
        method = _METHODS.get(name)
        if method is None:
            if name.startswith("__"):
                raise AttributeError(name)
            if name.endswith("_"):
                self.tracer.fail(f"`.{name}()` mutates a value inside the mod",
                                 f"mods must be pure: use the out-of-place form `.{name[:-1]}()`")
            public = sorted(n for n in _METHODS if not n.startswith("_"))
            self.tracer.fail(f"the tensor method `.{name}()` is not supported by flexc's tracer",
                             f"use one of: {', '.join(public)}")
        tracer = self.tracer
        return lambda *args, **kwargs: _call_handler(tracer, name, method, (self, *args), kwargs)

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


def _cast(t: Tracer, x: Any, dtype: torch.dtype) -> "Proxy":
    node = t.to_node(x)
    kind = _dtype_kind(dtype)
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


def _to(t: Tracer, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.to(dtype)``, ``x.to(other)``, ``x.to(device, dtype)``; device moves are no-ops here."""
    for a in (*args, kwargs.get("dtype"), kwargs.get("other")):
        if isinstance(a, torch.dtype):
            return _cast(t, x, a)
        if isinstance(a, (Proxy, torch.Tensor)):
            return _cast(t, x, a.dtype)
    return x


def _masked_fill(t: Tracer, x: Any, mask: Any, value: Any) -> "Proxy":
    m = t.to_node(mask)
    if m.kind != ir.BOOL:
        t.fail(f"masked_fill's mask `{m}` is {'an' if m.kind == ir.INT else 'a'} {m.kind}, not a bool",
               "pass a comparison such as `q_idx < kv_idx`")
    return t.wrap(ir.where(m, *weak_pair(t.to_node(value), t.to_node(x))))


def _as_bool(t: Tracer, x: Any) -> ir.Node:
    node = t.to_node(x)
    return node if node.kind == ir.BOOL else ir.binary("ne", node, ir.const(0))


def _clamp(t: Tracer, x: Any, min: Any = None, max: Any = None) -> "Proxy":
    node = t.to_node(x)
    if min is not None:
        node = _binary(t, "max", node, t.to_node(min))
    if max is not None:
        node = _binary(t, "min", node, t.to_node(max))
    return t.wrap(node)


def _where(t: Tracer, cond: Any, x: Any, y: Any) -> "Proxy":
    c = t.to_node(cond)
    if c.kind != ir.BOOL:
        t.fail(f"torch.where's condition `{c}` is {'an' if c.kind == ir.INT else 'a'} {c.kind}, not a bool", "pass a comparison such as `q_idx >= kv_idx`")
    return t.wrap(ir.where(c, *weak_pair(t.to_node(x), t.to_node(y))))


def _div(t: Tracer, x: Any, y: Any, rounding_mode: str | None = None) -> "Proxy":
    a, b = t.to_node(x), t.to_node(y)
    if rounding_mode is None:
        return t.wrap(_binary(t, "truediv", a, b))
    if rounding_mode == "floor":
        return t.wrap(_binary(t, "floordiv", a, b))
    t.fail(f"torch.div with rounding_mode={rounding_mode!r}", "use rounding_mode='floor' (or `//`), or plain `/`")


def _full(t: Tracer, value: Any, dtype: torch.dtype | None = None, like: Any = None) -> "Proxy":
    node = t.to_node(value)
    if dtype is None and like is not None:
        dtype = like.dtype if isinstance(like, (Proxy, torch.Tensor)) else None
    return _cast(t, t.wrap(node), dtype) if dtype is not None else t.wrap(node)


def _min_max(op: str):
    """``torch.min(a, b)`` / ``a.max(b)``: the elementwise two-operand form (as in HF's T5 buckets)."""
    def handler(t: Tracer, x: Any, other: Any = None, *rest: Any, **kwargs: Any) -> "Proxy":
        if other is None or rest or kwargs or isinstance(other, bool):
            t.fail(f"`{op}` with one operand is a reduction, which a scalar mod cannot do",
                   f"compare two values with `torch.{op}imum(a, b)`")
        return t.wrap(_binary(t, op, t.to_node(x), t.to_node(other)))
    return handler


def _method_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for name, op in _UNARY_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x: t.wrap(ir.unary(op, t.to_node(x))), op)
    for name, op in _BINARY_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(_binary(t, op, t.to_node(x), t.to_node(y))), op)
    for name, op in _REVERSED_FUNCS.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(_binary(t, op, t.to_node(y), t.to_node(x))), op)
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


_METHODS = _method_table()
# torch.* functions that take a proxy; looked up by name and mapped to the method table above.
_TORCH_FUNCS = dict(_METHODS)
_TORCH_FUNCS["where"] = _where
_TORCH_FUNCS.update(
    ones_like=lambda t, x, dtype=None, **k: _full(t, 1, dtype, x),
    zeros_like=lambda t, x, dtype=None, **k: _full(t, 0, dtype, x),
    full_like=lambda t, x, value, dtype=None, **k: _full(t, value, dtype, x),
)


# ---- shifts and the rest of torch's elementwise math ------------------------------------------

def _shift(t: Tracer, op: str, x: Any, y: Any) -> "Proxy":
    """``x << y`` / ``x >> y`` on integers. A shift by a constant is the multiplication or floor
    division by a power of two it equals (also for negative x: >> is arithmetic, as in torch), which
    the range analysis decides exactly; other shifts become shift nodes."""
    a, b = t.to_node(x), t.to_node(y)
    if ir.FLOAT in (a.kind, b.kind):
        t.fail(f"`{'<<' if op == 'lshift' else '>>'}` on a float value ({a}, {b})",
               "shift integers only, e.g. convert with `.long()` first")
    if b.op == "const" and not isinstance(b.attr, bool) and 0 <= b.attr < 63 and a.kind == ir.INT:
        return t.wrap(_binary(t, "mul" if op == "lshift" else "floordiv", a, ir.const(1 << b.attr)))
    return t.wrap(_binary(t, op, a, b))


def _options(t: Tracer, name: str, values: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An activation's options as Python values; ``inplace=True`` would mutate a traced value."""
    kwargs = dict(kwargs)
    if kwargs.pop("inplace", False):
        t.fail(f"`{name}(..., inplace=True)` mutates its input inside the mod", "pass inplace=False (the default)")
    for v in (*values, *kwargs.values()):
        if isinstance(v, (Proxy, _PartialLoad, torch.Tensor)):
            t.fail(f"an option of `{name}` is a tensor or traced value ({v!r})",
                   f"pass {name}'s options as Python numbers; compute a tensor-dependent variant from arithmetic")
    return values, kwargs


def _activation(name: str, builder: Callable) -> Callable:
    def handler(t: Tracer, x: Any, *options: Any, **kwargs: Any) -> "Proxy":
        options, kwargs = _options(t, name, options, kwargs)
        try:
            return t.wrap(builder(t.to_node(x), *options, **kwargs))
        except ValueError as e:
            t.fail(f"`{name}`: {e}", f"call {name} with the options torch documents")
    return handler


def _unary_math(op: str) -> Callable:
    def handler(t: Tracer, x: Any, decimals: int = 0) -> "Proxy":
        node = t.to_node(x)
        if op in ("trunc", "round") and node.kind != ir.FLOAT:
            return t.wrap(node)  # an integer is its own trunc and round
        if decimals:  # torch.round(x, decimals=d): round(x * 10**d) / 10**d
            scaled = ir.unary(op, ir.binary("mul", node, ir.const(10.0 ** decimals)))
            return t.wrap(ir.binary("truediv", scaled, ir.const(10.0 ** decimals)))
        return t.wrap(ir.unary(op, node))
    return handler


def _logit(t: Tracer, x: Any, eps: float | None = None) -> "Proxy":
    node = t.to_node(x)
    if eps is not None:
        node = ir.binary("min", ir.binary("max", node, ir.const(float(eps))), ir.const(1.0 - eps))
    return t.wrap(elementwise.logit(node))


def _elementwise_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for name, op in elementwise.UNARY_ALIASES.items():
        table[name] = _unary_math(op)
    for name, op in elementwise.BINARY_ALIASES.items():
        table[name] = functools.partial(lambda op, t, x, y: t.wrap(_binary(t, op, t.to_node(x), t.to_node(y))), op)
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
        table[f"special_{name}"] = table.get(name) or _TORCH_FUNCS[name]
    return table


# ---- vectors over a small captured axis and their reductions (flexc.mods.reductions) ---------------

def _vector_size(t: Tracer, node: ir.Node, what: str) -> int | None:
    """The length of the vector ``node`` holds, or None for a scalar."""
    sizes = reductions.free_axes(node)
    if len(sizes) > 1:
        t.fail(f"{what} combines vectors of different lengths {sorted(sizes)}", "combine vectors of one length")
    return next(iter(sizes)) if sizes else None


def _check_dim(t: Tracer, name: str, dim: Any) -> None:
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if any(isinstance(d, bool) or not isinstance(d, int) or d not in (-1, 0) for d in dims):
        t.fail(f"`{name}` over dim={dim!r}; a captured vector has one dimension",
               f"reduce over its only dimension: `.{name}(-1)`")


def _reduction(op: str, name: str) -> Callable:
    """``x.sum(dim)``, ``x.any(dim)``... over a vector's axis; on a scalar (one value) the value itself."""
    def handler(t: Tracer, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> "Proxy":
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


def _dot(t: Tracer, x: Any, y: Any) -> "Proxy":
    a, b = t.to_node(x), t.to_node(y)
    n = _vector_size(t, ir.binary("mul", a, b), "`dot`")
    if n is None or _vector_size(t, a, "`dot`") is None or _vector_size(t, b, "`dot`") is None:
        t.fail("`dot` of values that are not both vectors", "index a captured tensor in all but one dimension, "
               "e.g. `torch.dot(q_rope[b, h, q_idx], k_rope[b, h, kv_idx])`")
    return t.wrap(reductions.reduce("sum", _binary(t, "mul", a, b), n))


def _norm(t: Tracer, x: Any, p: Any = 2, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> "Proxy":
    node = t.to_node(x)
    p = kwargs.pop("ord", p)
    if dim is not None:
        _check_dim(t, "norm", dim)
    if kwargs or p not in (1, 2, "fro"):
        t.fail(f"`norm` with p={p!r}", "use p=1 or p=2, or write the reduction out, e.g. `x.abs().amax(-1)`")
    n = _vector_size(t, node, "`norm`")
    magnitude = ir.unary("abs", node) if p == 1 else _binary(t, "mul", node, node)
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

    def handler(t: Tracer, x: Any, other: Any = None, *rest: Any, **kwargs: Any) -> Any:
        vector = isinstance(x, _PartialLoad) or (isinstance(x, Proxy) and reductions.free_axes(x.node))
        dim = kwargs.pop("dim", other)
        if vector and not rest and set(kwargs) <= {"keepdim"} and (dim is None or isinstance(dim, int)):
            values = reduce(t, x, dim, **kwargs)
            return values if dim is None else _ValuesIndices((values, t))
        return elementwise_form(t, x, other, *rest, **kwargs)
    return handler


def _unsqueeze(t: Tracer, x: Any, dim: int = 0) -> Any:
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
_METHODS.update({k: v for k, v in _ELEMENTWISE.items() if not k.startswith("special_")})
_TORCH_FUNCS.update(_ELEMENTWISE)


_INPLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                              "and", "or", "xor", "lshift", "rshift", "matmul")}


def _mutates(name: str) -> bool:
    """``add_``, ``index_put_``, ``__setitem__``, ``__iadd__``...: torch's in-place naming."""
    return (name in ("__setitem__", "index_put") or name in _INPLACE_DUNDERS
            or (name.endswith("_") and not name.endswith("__")))


# torch functions that draw random numbers: traced once, their values would be frozen into the
# graph, so they are rejected as torch's vmap rejects randomness.
_RANDOM_FUNCS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "binomial", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "rrelu", "native_dropout",
})


def _reject_random(tracer: Tracer, name: str) -> None:
    if name in _RANDOM_FUNCS:
        tracer.fail(f"`torch.{name}` draws random numbers inside the mod; flexc traces a mod once, so the values would "
                    f"be frozen into one constant for every position (torch's vmap rejects this too)",
                    "draw the tensor once outside the mod and capture it, e.g. `noise = torch.randn(L, S)` "
                    "and return `score + noise[q_idx, kv_idx]`")


def _is_numpy_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"


_NUMPY_FIX = ("use the torch function instead (torch.where, torch.logical_and, torch.exp, `&`, `|`, ...), and "
              "convert captured numpy arrays to tensors once, outside the mod: `table = torch.as_tensor(table)`")


def _dispatch(tracer: Tracer, func: Callable, args: tuple, kwargs: dict) -> Any:
    name = getattr(func, "__name__", repr(func))
    _reject_random(tracer, name)
    if name == "__getitem__" and isinstance(args[0], torch.Tensor):
        return tracer.index(args[0], args[1])
    if _mutates(name):
        tracer.fail(f"`{name}` mutates a tensor inside the mod", "mods must be pure: compute new values instead of writing into captured tensors")
    handler = _TORCH_FUNCS.get(name)
    if handler is None:
        tracer.fail(f"torch function `{name}` is not supported by flexc's tracer",
                    "rewrite the mod with supported operations: arithmetic, comparisons, &, |, ~, torch.where, "
                    "abs/exp/exp2/log/log2/sqrt/rsqrt/tanh/sigmoid/sin/cos/floor/ceil/sign/clamp/minimum/maximum")
    return _call_handler(tracer, name, handler, args, kwargs)


def _call_handler(tracer: Tracer, name: str, handler: Callable, args: tuple, kwargs: dict) -> Any:
    try:
        return handler(tracer, *args, **kwargs)
    except TraceError:
        raise
    except TypeError as e:  # a signature mismatch: report it as the user's call, not flexc's internals
        tracer.fail(f"`{name}` was called with arguments flexc does not support ({e})",
                    f"call it as in the torch documentation with one value per operand, e.g. `torch.{name}(x, y)`")


# tensor methods that turn a captured tensor's values into Python values the trace may bake in
_VALUE_READS = frozenset({"__int__", "__float__", "__bool__", "__complex__", "__index__", "item", "tolist",
                          "numpy", "__array__", "__format__", "__len__", "__iter__"})


class TraceMode(TorchFunctionMode):
    """Routes torch calls that touch a proxy into the graph; forbids mutating captured tensors."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, (Proxy, _PartialLoad)) for a in leaves((args, kwargs))):
            return _dispatch(self.tracer, func, args, kwargs)
        name = getattr(func, "__name__", "")
        _reject_random(self.tracer, name)
        if name in _VALUE_READS:
            self.tracer.reads_values = True
        if _mutates(name) and args and isinstance(args[0], torch.Tensor):
            self.tracer.fail(f"`{name}` mutates a tensor inside the mod",
                             "mods must be pure: compute new values instead of writing into captured tensors")
        result = func(*args, **kwargs)
        # an operation on captured tensors is replayed when they change (flexc.mods.derived)
        tensors = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.tracer.recorder.note(func, args, kwargs, tensors, result)
        return result


# ---- names and places ---------------------------------------------------------------------

def _site_of(filename: str, lineno: int) -> tuple[str, str]:
    return f" ({filename}:{lineno})", linecache.getline(filename, lineno).strip()


def _user_site() -> tuple[str, str]:
    """`` (file:line)`` and source text of the innermost frame outside flexc and torch: the mod's line."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_FLEXC_DIR + os.sep) and not path.startswith(_TORCH_DIR + os.sep) \
                and os.path.basename(path) != "functools.py":
            return _site_of(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return "", ""


def _return_site(fn: Callable) -> tuple[str, str]:
    """The mod's return statement when it has exactly one, else its ``def`` line."""
    code = code_of(fn)
    if code is None:
        return "", ""
    lines = {
        ins.positions.lineno for ins in dis.get_instructions(code)
        if ins.opname in ("RETURN_VALUE", "RETURN_CONST") and getattr(ins, "positions", None)
        and ins.positions.lineno
    }
    return _site_of(code.co_filename, lines.pop() if len(lines) == 1 else code.co_firstlineno)


def _captures(fn: Callable) -> list[tuple[str, Any]]:
    """``(name, value)`` of every tensor and Python number the mod can reach by name: its closures,
    defaults, ``functools.partial`` arguments and globals, and those of the functions it calls."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int = 0) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            for i, a in enumerate(obj.args):
                note(f"arg{i}", a, depth)
            for k, a in (obj.keywords or {}).items():
                note(k, a, depth)
            visit(obj.func, depth + 1)
            return
        code = getattr(obj, "__code__", None)
        if code is None:
            return
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                note(name, cell.cell_contents, depth)
            except ValueError:  # empty cell
                pass
        params = list(inspect.signature(obj).parameters.values()) if callable(obj) else []
        for p in params:
            if p.default is not p.empty:
                note(p.name, p.default, depth)
        globs = getattr(obj, "__globals__", {})
        for name in code.co_names:
            if name in globs:
                note(name, globs[name], depth)

    def note(name: str, value: Any, depth: int) -> None:
        if isinstance(value, (torch.Tensor, int, float)):
            found.append((name, value))
        elif callable(value) and not isinstance(value, type) and not inspect.ismodule(value):
            visit(value, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if callable(v):
                    visit(v, depth + 1)

    visit(fn)
    return found


def captured_numbers(fn: Callable) -> dict[str, int | float]:
    """The Python ints and floats (not bools) a mod captures, by name (the first place wins)."""
    numbers: dict[str, int | float] = {}
    for name, value in _captures(fn):
        if type(value) in (int, float) and name.isidentifier():
            numbers.setdefault(name, value)
    return numbers


def _buffer_names(fn: Callable, buffers: list) -> tuple:
    """Names for captured tensors, found in the mod's closures, defaults, partial args and globals."""
    found: dict[int, str] = {}
    for name, value in _captures(fn):
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), name)
    names, used = [], set()
    for slot, t in enumerate(buffers):
        name = found.get(id(t), f"buf{slot}")
        if name in used:
            name = f"{name}_{slot}"
        used.add(name)
        names.append(name)
    return tuple(names)
