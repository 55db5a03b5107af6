"""The tracer: runs a mod once on proxies and builds its :class:`~flexc.mods.traced_mod.TracedMod`.

It turns operands into IR nodes, indexes captured tensors, traces ``torch.autograd.Function`` calls and
raises :class:`~flexc.mods.traced_mod.TraceError` naming the mod's line and the fix. Proxies reach
the torch-call tables through it (``dispatch``, ``methods``, ``call``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .. import derived, ir, lifted_cells, lowering, reductions
from ..traced_mod import MASK_MOD, MASK_MOD_ARGS, SCORE_MOD, SCORE_MOD_ARGS, TraceError, TracedMod, mod_name
from . import torch_ops
from .captures import buffer_names
from .dispatch import TraceMode, call_handler, dispatch_call, hook_function_apply
from .proxies import PartialLoad, Proxy, describe_tensor, dtype_kind
from .source_lines import return_site, user_site


class Tracer:
    """One trace of ``fn`` (a ``kind`` mod): its captured tensors, where its lookups were written, and
    whether it read a tensor's value."""

    methods = torch_ops.METHODS  # the tensor methods a proxy has, by name

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
            self.sites[node] = self._site if self._site is not None else user_site()
        return node

    def run(self) -> TracedMod:
        names = SCORE_MOD_ARGS if self.kind == SCORE_MOD else MASK_MOD_ARGS
        proxies = [Proxy(ir.input_(n), self) for n in names]
        with TraceMode(self), hook_function_apply(self):
            out = self.fn(*proxies)
        # the mod has returned: problems with its result point at its return statement
        self._site = return_site(self.fn)
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
        return TracedMod(self.kind, root, tuple(self.buffers), buffer_names(self.fn, self.buffers),
                         mod_name(self.fn), self.fn, self.sites,
                         derivations=self.recorder.derivations(self.buffers))

    # -- errors --
    def fail(self, what: str, fix: str) -> None:
        """Raise a TraceError naming the mod, the offending ``file:line`` and its source, and the fix."""
        where, source = self._site if self._site is not None else user_site()
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
        return ir.buffer(slot, str(t.dtype).removeprefix("torch."), t.dim(), dtype_kind(t.dtype))

    def to_node(self, x: Any, what: str = "an operand") -> ir.Node:
        if isinstance(x, PartialLoad) and x.indexed == x.ndim - 1:
            # one dimension left: a vector over it, to be reduced (flexc.mods.reductions)
            free = x.slots.index(None)
            slots = tuple(reductions.axis(x.tensor.shape[free]) if n is None else n for n in x.slots)
            return ir.load(self.buffer_node(x.tensor), slots)
        if isinstance(x, PartialLoad):
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

    # -- torch calls on proxies (flexc.mods.tracing.dispatch) --
    def dispatch(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A torch function or tensor method called on a proxy, as the graph node it builds."""
        return dispatch_call(self, func, args, kwargs)

    def call(self, name: str, handler: Callable, args: tuple, kwargs: dict) -> Any:
        """``handler`` (from :attr:`methods`) called for the method ``name``; a signature mismatch is the mod's error."""
        return call_handler(self, name, handler, args, kwargs)

    # -- indexing a captured tensor --
    def index(self, base: Any, key: Any) -> Any:
        """``tensor[key]`` or ``partial[key]``; a load once every dimension has an index.

        ``slots`` holds one index node per dimension of the captured tensor, ``None`` for a dimension
        still free. As in torch, a full slice ``:`` (or ``...``) leaves its dimension free and the
        next indexing fills the free dimensions in order: ``bias[:, q_idx][h]`` is ``bias[h, q_idx]``.
        """
        tensor = base.tensor if isinstance(base, PartialLoad) else base
        slots = list(base.slots) if isinstance(base, PartialLoad) else [None] * tensor.dim()
        free = [d for d, node in enumerate(slots) if node is None]
        keys = list(key) if isinstance(key, tuple) else [key]
        ellipses = [i for i, k in enumerate(keys) if k is Ellipsis]  # not .index(): Proxy == builds a node
        if ellipses:
            pos = ellipses[0]
            keys[pos:pos + 1] = [slice(None)] * max(len(free) - (len(keys) - 1), 0)
        if len(keys) > len(free):
            self.fail(
                f"captured tensor {describe_tensor(tensor)} is indexed with more indices than its "
                f"{tensor.dim()} dimension{'s' if tensor.dim() != 1 else ''}",
                f"index it with exactly {tensor.dim()} "
                f"{'index' if tensor.dim() == 1 else 'indices'}, one per dimension",
            )
        for k, dim in zip(keys, free):
            slots[dim] = self._index_node(tensor, dim, k)
        if any(node is None for node in slots):
            return PartialLoad(tensor, tuple(slots), self)
        return self.wrap(self.note_site(ir.load(self.buffer_node(tensor), tuple(slots))))

    def _index_node(self, tensor: torch.Tensor, dim: int, k: Any) -> ir.Node | None:
        """The index node for ``k`` on dimension ``dim``; ``None`` when a full slice leaves it free."""
        if isinstance(k, Proxy):
            if k.node.kind == ir.FLOAT:
                self.fail(f"captured tensor {describe_tensor(tensor)} is indexed with a float value {k.node}",
                          "convert the index with `.long()` or use `//` instead of `/`")
            if k.node.kind == ir.BOOL:
                self.fail(f"captured tensor {describe_tensor(tensor)} is indexed with a bool value {k.node}",
                          "use torch.where(cond, a, b) to choose between values")
            return k.node
        if isinstance(k, bool) or k is None:
            self.fail(f"captured tensor {describe_tensor(tensor)} is indexed with {k!r}", "index with integers or the mod's arguments")
        size = tensor.shape[dim]
        if isinstance(k, int) or (isinstance(k, torch.Tensor) and k.dim() == 0 and not k.is_floating_point()):
            self.reads_values |= isinstance(k, torch.Tensor)
            i = int(k)
            if not -size <= i < size:
                self.fail(f"index {i} is out of range for dimension {dim} of captured tensor {describe_tensor(tensor)}",
                          "use an index inside the tensor")
            return ir.const(i % size)
        if isinstance(k, slice):
            picked = range(size)[k]
            if len(picked) == 1:  # a one-element slice picks that element
                return ir.const(picked[0])
            if picked == range(size):
                return None
            self.fail(
                f"the slice {_slice_text(k)} on dimension {dim} of captured tensor {describe_tensor(tensor)} "
                f"selects {len(picked)} elements; the result must be a scalar",
                "slice the tensor outside the mod, or index that dimension with an integer",
            )
        self.fail(f"captured tensor {describe_tensor(tensor)} is indexed with a {type(k).__name__}",
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


def _slice_text(s: slice) -> str:
    parts = ["" if v is None else str(v) for v in (s.start, s.stop, s.step)]
    return ":".join(parts[:2] if s.step is None else parts)


def _is_numpy_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"
