"""Reuse a mod's trace while nothing the mod can read has changed.

Decoding calls attention once per token with the same mods, so tracing them on every call would
cost more than the attention itself. :func:`lookup` returns the trace of an earlier call when the
mod's *snapshot* is unchanged. The snapshot covers everything a trace can depend on:

- the code object, ``__defaults__``, ``__kwdefaults__`` and ``__name__`` of the function;
- the contents of its closure cells and the globals its code names (missing ones included, so a
  global defined later is noticed); functions reached that way are snapshotted the same way
  (``and_masks`` over user mods, helpers a mod calls), ``functools.partial`` arguments too;
- attributes, named in the reading code, of objects, classes and user modules it reaches
  (``cfg.window``, ``self.bias``); lists, tuples, dicts and sets by content.

Python numbers, strings and dtypes are compared by value (``1``, ``1.0`` and ``True`` differ, as
their traces do); tensors by identity plus dtype, shape and device, so new values written into a
captured tensor reuse the trace (its buffers are the same tensors) while a rebound name re-traces.
A tensor that does not require grad also matches an earlier one viewing the same memory (same
address, shape, strides, dtype): ``input_pos[0]`` makes a new view each decoding step, and the old
view, kept alive by the cache, holds the same values while it still views that memory. A trace is
served only while every tensor it was keyed by memory still views what it viewed then: after
``old.data = new`` the old view reads other elements, and a new tensor at the old address (the
allocator reuses freed memory) must not find the trace that reads it. torch's own functions and
modules, builtins and other C objects are compared by identity.

The cache is keyed by the code object, so a closure re-created each step with the same captured
state (``get_mask_mod(mask_mod, offset)`` in a decoding loop) finds the trace of its predecessor.
Each code object keeps at most :data:`_MAX_ENTRIES` traces, oldest dropped first (an entry keeps
the objects of its snapshot alive). A mod whose snapshot cannot be taken (an object of unknown kind,
very deep or very long data) is traced every time, as is a trace that read a captured tensor's
value (``int(t)``): never stale.

A closure's cells that its code uses only as operator operands (``q_idx + offset``) are *lifted*
(:mod:`flexc.mods.lifted_cells`): the key holds their kind (a Python int or float, or a tensor's dtype,
shape, device and grad flag) instead of their value, and a template traced once per key gives each
new value its trace by substitution, so gpt-fast's new ``offset`` each decoding step traces once.
"""
from __future__ import annotations

import functools
import os
import sys
import types
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from . import lifted_cells

_MAX_ENTRIES = 16  # per code object: a mod re-created with new captured numbers evicts the oldest
_MAX_CODES = 1024  # code objects with cached traces, least recently used dropped first
_MAX_DEPTH = 12
_MAX_ITEMS = 256  # longer Python containers are not snapshotted (the mod is traced each call)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_LIBRARY_MODULES = ("torch", "math", "numpy", "functools", "operator", "builtins", "triton", "flexc", "sympy")
_VALUE_TYPES = frozenset((type(None), bool, int, str, bytes, complex, type(Ellipsis), torch.dtype, torch.device,
                          torch.Size, torch.memory_format, torch.layout))
_MISSING = ("missing",)
_CPU = "cpu"  # a CPU tensor's device in a snapshot (reading x.device builds an object)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_NO_DEFAULTS = (type(None), None)  # what value() makes of None


class _Unknown(Exception):
    """Some reachable object cannot be snapshotted: do not cache."""


def _names_of(code: types.CodeType) -> frozenset:
    """The names ``code`` and the code objects nested in it read as globals or attributes."""
    return _code_facts(code)[0]


def _code_facts(code: types.CodeType, _memo: dict = {}) -> tuple[frozenset, tuple, bool]:
    """``(names, the names sorted, whether the code is torch's)`` of a code object, worked out once."""
    entry = _memo.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_of(const)
    result = (frozenset(names), tuple(sorted(names)), code.co_filename.startswith(_TORCH_DIR))
    _memo[id(code)] = (code, result)  # the code object is kept so its id is never reused
    return result


def _is_library_module(module: types.ModuleType) -> bool:
    return module.__name__.split(".")[0] in _LIBRARY_MODULES or module.__name__ in sys.builtin_module_names


class _Snapshot:
    """Builds the hashable snapshot of one mod; ``keep`` holds every object whose id it contains."""

    def __init__(self, lift: tuple[int, ...] = ()):
        self.keep: list = []
        self.active: set[int] = set()  # functions being snapshotted (recursion guard)
        self.lift = lift  # the top function's cells snapshotted by kind (their values go to ``values``)
        self.values: list = []
        self.tensors: set[int] = set()  # ids of the tensors met outside lifted cells
        self.lifted_tensors: list[int] = []
        self.located: list = []  # (tensor, its memory) of the tensors keyed by memory
        self.lifted_located: list = []  # the same, of the lifted cells' tensors

    def ident(self, tag: str, obj: Any) -> tuple:
        self.keep.append(obj)
        return (tag, id(obj))

    def value(self, x: Any, names: frozenset, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unknown
        t = type(x)
        # the kinds a mod's closure and globals usually hold come first: this runs every call
        if t in _VALUE_TYPES:
            return (t, x)
        if t is types.FunctionType:
            return self.function(x, depth)
        if t is torch.Tensor or isinstance(x, torch.Tensor):
            return self.tensor(x)
        if t is float:
            return (float, x.hex())  # keeps -0.0 apart from 0.0
        if isinstance(x, np.generic):
            return (t, x.tobytes())
        if t in (tuple, list):
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (t, tuple(self.value(v, names, depth + 1) for v in x))
        if t is dict:
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (dict, tuple((self.value(k, names, depth + 1), self.value(v, names, depth + 1))
                                for k, v in x.items()))
        if t in (set, frozenset):
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (t, frozenset(self.value(v, names, depth + 1) for v in x))
        if t is functools.partial:
            return ("partial", self.value(x.func, names, depth + 1), self.value(x.args, names, depth + 1),
                    self.value(x.keywords, names, depth + 1))
        if t is types.MethodType:
            func = x.__func__
            inner = _names_of(func.__code__) if hasattr(func, "__code__") else names
            return ("method", self.value(func, names, depth + 1), self.value(x.__self__, inner, depth + 1))
        if t is types.ModuleType:
            if _is_library_module(x):
                return self.ident("module", x)
            return (*self.ident("module", x), self.attributes(x, names, depth))
        if isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                          types.MethodWrapperType, types.MethodDescriptorType, types.GetSetDescriptorType,
                          torch._C._TensorMeta)) or t.__module__.split(".")[0] == "torch" and not hasattr(x, "__dict__"):
            return self.ident("c", x)  # C functions and torch's own objects do not change
        if isinstance(x, type):
            if x.__module__.split(".")[0] in _LIBRARY_MODULES:
                return self.ident("type", x)
            return (*self.ident("type", x), self.attributes(x, names, depth))
        if hasattr(x, "__dict__"):
            # a user object (or callable object): its identity and the attributes the reading code
            # can name, plus those its own __call__ reads
            if id(x) in self.active:
                return self.ident("recursive", x)
            call = type(x).__call__ if callable(x) else None
            code = getattr(call, "__code__", None)
            if code is not None and not code.co_filename.startswith(_TORCH_DIR):
                names = names | _names_of(code)
            self.active.add(id(x))
            out = (*self.ident("object", x), self.value(call, names, depth + 1) if call is not None else None,
                   self.attributes(x, names, depth))
            self.active.discard(id(x))
            return out
        raise _Unknown

    def tensor(self, x: torch.Tensor) -> tuple:
        self.tensors.add(id(x))
        if not x.requires_grad and type(x) in _PLAIN_TENSORS and x.layout is torch.strided:
            try:
                address = x.data_ptr()
            except (RuntimeError, NotImplementedError):  # fake or meta tensors: identity only
                address = 0
            if address:
                # the same memory: a view made anew each call reads what the kept one reads, while
                # the kept one still views it (:func:`still_located`)
                self.keep.append(x)
                where = ("memory", address, x.shape, x.stride(), x.dtype, _CPU if x.is_cpu else x.device)
                self.located.append((x, where))
                return where
        return (*self.ident("tensor", x), x.dtype, x.shape, x.device)

    def lifted(self, x: Any) -> tuple:
        """A lifted cell's kind for the key; its value's snapshot goes to ``values``."""
        if type(x) is torch.Tensor:
            tensors = self.tensors
            self.tensors = set()
            where = self.tensor(x)
            self.values.append(where)
            self.tensors = tensors
            self.lifted_tensors.append(id(x))
            if where[0] == "memory":  # ("memory", address, shape, strides, dtype, device): read once
                self.lifted_located.append(self.located.pop())
                return ("lifted tensor", where[4], where[2], where[5], False)  # (keyed by memory: no grad)
            return ("lifted tensor", x.dtype, x.shape, _CPU if x.is_cpu else x.device, x.requires_grad)
        self.values.append(self.value(x, frozenset(), 0))
        return ("lifted", type(x))

    def attributes(self, obj: Any, names: frozenset, depth: int) -> tuple:
        out = []
        for name in sorted(names):
            try:
                value = getattr(obj, name)
            except Exception:  # absent (or a property that fails): recorded as missing
                value = _MISSING
            out.append(_MISSING if value is _MISSING else self.value(value, names, depth + 1))
        return tuple(out)

    def function(self, fn: types.FunctionType, depth: int) -> tuple:
        code = fn.__code__
        names, sorted_names, is_library = _code_facts(code)
        if is_library:  # torch's Python functions are treated like its C ones: they do not change
            return self.ident("library", fn)
        if id(fn) in self.active:  # recursion through a global or a cell
            return self.ident("recursive", fn)
        self.active.add(id(fn))
        inner = depth + 1
        cells = []
        lift, self.lift = self.lift, ()  # (the top function's cells only)
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet assigned
                cells.append(_MISSING)
                continue
            if i in lift:
                cells.append(self.lifted(contents))
            else:
                cells.append(self.value(contents, names, inner))
        reads = ()
        if sorted_names:
            globs = fn.__globals__
            reads = tuple([self.value(globs[name], names, inner) if name in globs else _MISSING
                           for name in sorted_names])
        self.active.discard(id(fn))
        defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__  # usually None: no call for those
        # (the code object's id needs no keeping: _code_facts keeps every code object it has seen)
        return ("code", id(code), fn.__name__,
                _NO_DEFAULTS if defaults is None else self.value(defaults, names, inner),
                _NO_DEFAULTS if kwdefaults is None else self.value(kwdefaults, names, inner), tuple(cells), reads)


def snapshot(fn: Callable, lift: tuple[int, ...] = ()) -> tuple[Any, tuple | None, list, tuple] | None:
    """``(key, values of the lifted cells or None, kept objects, located, the key's located)`` describing
    everything ``fn``'s trace can depend on, or None if unknown; ``located``: each tensor keyed by its
    memory with that memory (:func:`still_located`), the key's (outside lifted cells) first. ``lift``:
    cells of ``fn`` keyed by kind (a tensor in one of them that is also reached another way is not
    lifted: the template would share its slot)."""
    snap = _Snapshot(lift)
    try:
        key = snap.value(fn, frozenset(), 0)
    except (_Unknown, RecursionError):
        return None
    located = tuple(snap.located)
    if not lift:
        return key, None, snap.keep, located, located
    ids = snap.lifted_tensors
    if len(set(ids)) != len(ids) or not snap.tensors.isdisjoint(ids):
        return snapshot(fn)
    return key, tuple(snap.values), snap.keep, located + tuple(snap.lifted_located), located


def still_located(located: tuple) -> bool:
    """Whether each tensor a trace was keyed by memory still views that memory (no ``.data = new``
    or ``set_`` since): then a tensor that views it now reads, through the trace, its own elements."""
    for x, where in located:
        if (x.data_ptr() != where[1] or x.shape != where[2] or x.stride() != where[3] or x.dtype != where[4]
                or (_CPU if x.is_cpu else x.device) != where[5]):
            return False
    return True


def _lift_cells(fn: Callable) -> tuple[int, ...]:
    """The cells of a plain function that :mod:`flexc.mods.lifted_cells` can lift now."""
    if type(fn) is not types.FunctionType or not fn.__closure__:
        return ()
    cells = lifted_cells.liftable_cells(fn.__code__)
    if not cells:
        return ()
    closure = fn.__closure__
    try:
        return tuple([i for i in cells if lifted_cells.liftable_value(closure[i].cell_contents)])
    except ValueError:  # a cell not yet assigned
        return ()


# id(code) -> (code, OrderedDict(snapshot key -> (trace, kept objects))); the code object is kept
# so that its id is never reused while the entry lives
_STORES: OrderedDict = OrderedDict()


def _code_of(fn: Callable) -> types.CodeType | None:
    while type(fn) is functools.partial:
        fn = fn.func
    return fn.__code__ if type(fn) is types.FunctionType else None


def _store(fn: Callable, create: bool = True) -> OrderedDict | None:
    """The cache of ``fn``'s code object; None for callables that are not (partials of) functions."""
    code = _code_of(fn)
    if code is None:
        return None
    entry = _STORES.get(id(code))
    if entry is not None and entry[0] is code:
        _STORES.move_to_end(id(code))
        return entry[1]
    if not create:
        return None
    store: OrderedDict = OrderedDict()
    _STORES[id(code)] = (code, store)
    while len(_STORES) > _MAX_CODES:
        _STORES.popitem(last=False)
    return store


_NO_TEMPLATE = ("no template",)  # a generic key whose template attempt failed: trace each value


class _Token(NamedTuple):
    """Where to remember a trace made after a miss; ``cells`` set: try a template first."""

    store: OrderedDict
    key: Any
    keep: list
    located: tuple  # the snapshot's tensors keyed by memory, checked before the trace is served
    generic: Any = None  # the key by cell kinds, for the template
    cells: tuple = ()
    generic_located: tuple = ()  # those of the key by cell kinds (a template's instances check their own)


def lookup(fn: Callable, kind: str | None) -> tuple[Any, Any]:
    """``(cached trace or None, token)``; pass the token to :func:`remember` after tracing on a miss
    (to :func:`remember_template` first when :func:`wants_template` says so)."""
    store = _store(fn)
    if store is None:
        return None, None
    cells = _lift_cells(fn)
    snap = snapshot(fn, cells)
    if snap is None:
        return None, None
    key, values, keep, located, key_located = snap
    if values is None:
        entry = store.get(key)
        if entry is not None and (kind is None or entry[0].kind == kind) and still_located(entry[2]):
            if len(store) > 1:  # (a decoding loop's closure has one entry: no second hashing of its key)
                store.move_to_end(key)
            return entry[0], None
        return None, _Token(store, key, keep, located)
    # lifted cells: the template for these kinds gives the trace for these values
    generic = store.get(key)
    if generic is None or not still_located(generic[2]):
        return None, _Token(store, (key, values), keep, located, key, cells, key_located)
    if len(store) > 1:
        store.move_to_end(key)
    template = generic[0]
    if template is _NO_TEMPLATE:  # traces per value, as for cells that are not lifted
        exact = (key, values)
        entry = store.get(exact)
        if entry is not None and (kind is None or entry[0].kind == kind) and still_located(entry[2]):
            store.move_to_end(exact)
            return entry[0], None
        return None, _Token(store, exact, keep, located)
    if kind is not None and template.traced.kind != kind:
        return None, _Token(store, (key, values), keep, located)  # (the tracer raises the kind's error)
    latest = template.latest
    if latest is not None and latest[0] == values and still_located(latest[3]):
        return latest[1], None  # the same values again (a tensor advanced in place)
    return instance(template, fn, values, keep, located), None


def wants_template(token: Any) -> bool:
    """Whether the trace for ``token`` should first try a template (:func:`flexc.mods.trace.trace`)."""
    return token is not None and bool(token.cells)


def template_cells(token: Any) -> tuple[int, ...]:
    return token.cells


def remember_template(token: Any, template: Any) -> None:
    """Store the template for ``token``'s key, or that there is none (None)."""
    # (keep: the key's ids stay valid while the entry lives)
    token.store[token.generic] = (_NO_TEMPLATE if template is None else template, token.keep, token.generic_located)
    _trim(token.store)


def instance(template: Any, fn: Callable, values: tuple, keep: list, located: tuple) -> Any:
    """``fn``'s trace from ``template`` (None if not exact), kept as the template's latest for
    ``values`` (the snapshot of the lifted cells; ``keep`` holds what its ids name, ``located``
    the snapshot's tensors keyed by memory)."""
    traced = lifted_cells.instantiate(template, fn)  # (a template has no derived buffers)
    if traced is not None:
        template.latest = (values, traced, keep, located)
    return traced


def remember(token: Any, traced: Any) -> None:
    """Store ``traced`` under the snapshot taken by :func:`lookup` (a no-op for a None token)."""
    if token is None:
        return
    store, key = token.store, token.key
    store[key] = (traced, token.keep, token.located)  # keep: the snapshot's ids stay valid while the entry lives
    store.move_to_end(key)
    _trim(store)


def _trim(store: OrderedDict) -> None:
    while len(store) > _MAX_ENTRIES:
        store.popitem(last=False)


def clear() -> None:
    """Forget every cached trace."""
    _STORES.clear()
