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
A template keeps the traces of its latest few values (:data:`_MAX_INSTANCES`): two windows of one
factory used in alternate layers are substituted once each.

A hit also keeps a *guard* of its function (:func:`_guard`): the objects its snapshot read, where
each is immutable or compared by identity anyway (or, for a tensor or a container, checked as the
snapshot keys it). The next lookup of that code object checks that it finds the very same objects
(a few identity checks) and, lifted cells aside, skips the snapshot. A code object keeps the guards
of its latest few hits (:data:`_MAX_GUARDS`), the most recently hit tried first, so closures of one
code object called in turn (a model's sliding-window and full attention layers through one
``and_masks``) each keep theirs. It gives up guards for good where one cannot be made (defaults, a
set, a bound method) or where as many as it keeps were dropped in a row without a hit (a cell holding
a new object each call): its lookups take the snapshot, as before guards.
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
# C functions and torch's own classes: snapshotted by identity (they do not change)
_C_KINDS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType, types.MethodWrapperType,
            types.MethodDescriptorType, types.GetSetDescriptorType, torch._C._TensorMeta)


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


def _is_library_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in _LIBRARY_MODULES


def _unchanging(x: Any) -> bool:
    """C functions and torch's own objects without a ``__dict__``: read by identity alone."""
    return isinstance(x, _C_KINDS) or type(x).__module__.split(".")[0] == "torch" and not hasattr(x, "__dict__")


def _has_own_attributes(container: Any) -> bool:
    """Whether a tuple, list, dict or set is of a subclass with a ``__dict__`` (attributes of its own)."""
    return type(container) not in (tuple, list, dict, set, frozenset) and hasattr(container, "__dict__")


def _call_and_names(x: Any, names: frozenset) -> tuple[Any, frozenset]:
    """``(type(x).__call__ or None, names)`` of a user object, ``names`` with those its ``__call__``
    names (unless torch's): what reading the object reads."""
    call = type(x).__call__ if callable(x) else None
    code = getattr(call, "__code__", None)
    if code is not None and not code.co_filename.startswith(_TORCH_DIR):
        names = names | _names_of(code)
    return call, names


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
        # containers by their items, subclasses too (an OrderedDict, a namedtuple, a user's dict type),
        # with a subclass's own attributes the reading code names
        if isinstance(x, (tuple, list)):
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (t, tuple(self.value(v, names, depth + 1) for v in x), *self.own_attributes(x, names, depth))
        if isinstance(x, dict):
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (t, tuple((self.value(k, names, depth + 1), self.value(v, names, depth + 1))
                             for k, v in x.items()), *self.own_attributes(x, names, depth))
        if isinstance(x, (set, frozenset)):
            if len(x) > _MAX_ITEMS:
                raise _Unknown
            return (t, frozenset(self.value(v, names, depth + 1) for v in x), *self.own_attributes(x, names, depth))
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
        if _unchanging(x):
            return self.ident("c", x)  # C functions and torch's own objects do not change
        if isinstance(x, type):
            if _is_library_class(x):
                return self.ident("type", x)
            return (*self.ident("type", x), self.attributes(x, names, depth))
        if hasattr(x, "__dict__"):
            # a user object (or callable object): its identity and the attributes the reading code
            # can name, plus those its own __call__ reads
            if id(x) in self.active:
                return self.ident("recursive", x)
            call, names = _call_and_names(x, names)
            self.active.add(id(x))
            out = (*self.ident("object", x), self.value(call, names, depth + 1) if call is not None else None,
                   self.attributes(x, names, depth))
            self.active.discard(id(x))
            return out
        raise _Unknown

    def tensor(self, x: torch.Tensor) -> tuple:
        self.tensors.add(id(x))
        where = _tensor_key(x)
        if where[0] == "memory":
            # the same memory: a view made anew each call reads what the kept one reads, while
            # the kept one still views it (:func:`still_located`)
            self.keep.append(x)
            self.located.append((x, where))
            return where
        return (*self.ident("tensor", x), *where)

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
                return _memory_kind(where)
            return ("lifted tensor", x.dtype, x.shape, _CPU if x.is_cpu else x.device, x.requires_grad)
        self.values.append(self.value(x, frozenset(), 0))
        return ("lifted", type(x))

    def own_attributes(self, x: Any, names: frozenset, depth: int) -> tuple:
        """``(attributes,)`` of a container of a subclass with a ``__dict__``, else ``()``."""
        return (self.attributes(x, names, depth),) if _has_own_attributes(x) else ()

    def attributes(self, obj: Any, names: frozenset, depth: int) -> tuple:
        out = []
        for name in sorted(names):
            value = _attribute(obj, name)  # (absent, or a property that fails: recorded as missing)
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


def _memory(x: torch.Tensor) -> tuple | None:
    """``("memory", address, shape, strides, dtype, device)`` of a tensor keyed by the memory it views (one
    that does not require grad, plain and strided, with an address), else None (keyed by identity)."""
    if not x.requires_grad and type(x) in _PLAIN_TENSORS and x.layout is torch.strided:
        try:
            address = x.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake or meta tensors: identity only
            return None
        if address:
            return ("memory", address, x.shape, x.stride(), x.dtype, _CPU if x.is_cpu else x.device)
    return None


def _tensor_key(x: torch.Tensor) -> tuple:
    """What a snapshot keys a tensor by besides its identity: :func:`_memory`, or for a tensor keyed by
    identity alone its dtype, shape and device."""
    where = _memory(x)
    return where if where is not None else (x.dtype, x.shape, x.device)


def _memory_kind(where: tuple) -> tuple:
    """A lifted cell's kind in the key, for a tensor keyed by memory (so one that does not require grad)."""
    return ("lifted tensor", where[4], where[2], where[5], False)


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


class _Store(OrderedDict):
    """One code object's traces: ``snapshot key -> (trace, kept objects, located)``; ``fast``, the
    :class:`_Fast` path of its latest hit (None before one, :data:`_UNGUARDED` where it cannot be had),
    and ``older``, the fast paths of earlier hits, most recent first (:data:`_MAX_GUARDS` in all)."""

    def __init__(self):
        super().__init__()
        self.fast: Any = None
        self.older: tuple = ()
        self.unused = 0  # fast paths dropped in a row without a hit (see _MAX_UNUSED)


# id(code) -> (code, its _Store); the code object is kept so that its id is never reused while the entry lives
_STORES: OrderedDict = OrderedDict()
# [(code, its _Store)] of the latest lookup, the most recent in _STORES already (a decoding loop looks up one
# code object every step: no dict lookup, no reordering); one tuple, read and replaced whole (threads)
_latest: list = [(None, None)]


def _code_of(fn: Callable) -> types.CodeType | None:
    while type(fn) is functools.partial:
        fn = fn.func
    return fn.__code__ if type(fn) is types.FunctionType else None


def _store(fn: Callable, create: bool = True) -> OrderedDict | None:
    """The cache of ``fn``'s code object; None for callables that are not (partials of) functions."""
    code = fn.__code__ if type(fn) is types.FunctionType else _code_of(fn)
    if code is None:
        return None
    latest = _latest[0]
    if latest[0] is code:
        return latest[1]
    entry = _STORES.get(id(code))
    if entry is not None and entry[0] is code:
        _STORES.move_to_end(id(code))
        _latest[0] = entry
        return entry[1]
    if not create:
        return None
    store = _Store()
    _STORES[id(code)] = _latest[0] = (code, store)
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
    latest = _latest[0]  # (the latest code object's store, read here: a decoding step's one lookup)
    store = latest[1] if type(fn) is types.FunctionType and fn.__code__ is latest[0] else _store(fn)
    if store is None:
        return None, None
    fast = store.fast
    if fast is not None and fast is not _UNGUARDED:
        found = _fast_hit(fast, fn, kind) if _holds(fast.guard, fn) else _MISSED
        if found is not _MISSED:
            if not fast.hit:
                fast.hit = True
            return found, None
        if store.older:  # (alternating closures of one code object: sliding and full attention layers)
            found = _older_hit(store, fn, kind)
            if found is not _MISSED:
                return found, None
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
            _guard_hits(store, fn, (), key, entry)  # (no cell lifted: the key holds every cell's value)
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
    if not key_located:  # (the fast path checks no memory outside the lifted cells)
        _guard_hits(store, fn, cells, key, generic)
    found = _instance_of(template, values)
    if found is not None:
        return found, None  # values met lately (a tensor advanced in place, alternating windows)
    return instance(template, fn, values, keep, located), None


# -- the fast path: the last hit's snapshot, checked by the identities it was made of --
#
# A snapshot is a function of what it reads: a function's code, name, defaults, closure contents and
# the globals its code names, recursively, and the values met there. Where every value met is
# immutable (numbers, strings, dtypes, ...) or compared by identity anyway (torch's and C functions,
# library modules), or a function or a user module read the same way, a guard that finds each of
# those objects to be the very one the snapshot read says the snapshot is unchanged without building
# it: a hit's guard is kept, and the next lookups of the code object check it first, then the guards
# of earlier hits (_MAX_GUARDS in all: each is a whole check of its own snapshot, so whichever holds
# serves its own trace). The top function
# itself may be a new closure (gpt-fast's mod each decoding step): its lifted cells are read as the snapshot reads
# them, the rest by identity. A tensor is checked by identity and by what the snapshot keys it by
# (its memory, or its dtype, shape and device); with lifted cells, only where none of the key's
# tensors is keyed by memory (the template's own are checked by the snapshot). A tuple, list or
# dict, by its length and items; a user object, class or module by its class, __call__ and the
# attributes its reader names. Anything else met (sets, defaults, recursion) gives no guard, and the
# code object's lookups take the snapshot every time; so they do after _MAX_UNUSED guards were dropped
# unhit in a row (each lookup then builds a guard that the next one misses).

_UNGUARDED = ("unguarded",)  # a store whose snapshots the fast path cannot check
_MISSED = ("missed",)
# fast paths kept per code object: closures of one code object that alternate (a model's sliding and full
# attention layers through one and_masks, two windows made by one factory) each keep theirs
_MAX_GUARDS = 4
_MAX_UNUSED = _MAX_GUARDS  # fast paths dropped unhit in a row (a cell holding a new object each call): give up
_MAX_INSTANCES = 4  # per template: the traces of the latest lifted values (alternating windows)
_GUARD_EXACT = frozenset(_VALUE_TYPES | {float})  # immutable values, checked by identity


class _Fast:
    """A fast path: ``guard`` (:func:`_guard`) of a hit's function, the lifted ``cells`` then, and what the
    hit found: the trace entry (no lifted cells), or the template and the lifted cells' kinds in its key;
    ``hit``: whether a lookup has taken it since (one dropped unhit counts towards :data:`_MAX_UNUSED`)."""

    __slots__ = ("guard", "cells", "entry", "template", "kinds", "hit")

    def __init__(self, guard: tuple, cells: tuple, entry: Any = None, template: Any = None, kinds: tuple = ()):
        self.guard, self.cells, self.entry, self.template, self.kinds = guard, cells, entry, template, kinds
        self.hit = False


def _guard_hits(store: _Store, fn: Callable, cells: tuple, key: Any, entry: tuple) -> None:
    """After a hit found by a snapshot: keep the fast path to it first, if ``fn``'s snapshot can be
    guarded, the least recent beyond :data:`_MAX_GUARDS` dropped; the code object's lookups give up the
    fast path for good where it cannot, or where :data:`_MAX_UNUSED` were dropped unhit in a row."""
    latest = store.fast
    if latest is _UNGUARDED:
        return
    try:
        guard = _guard(fn, set(cells), 0, set())
    except (_Unknown, ValueError, AttributeError):
        _unguard(store)
        return
    if cells:
        fast = _Fast(guard, cells, template=entry[0], kinds=tuple([key[5][i] for i in cells]))
    else:
        fast = _Fast(guard, cells, entry=entry)
    if latest is not None:
        older = (latest,) + store.older
        if len(older) >= _MAX_GUARDS:
            store.unused = 0 if older[-1].hit else store.unused + 1
            if store.unused >= _MAX_UNUSED:
                _unguard(store)
                return
            older = older[:_MAX_GUARDS - 1]
        store.older = older
    store.fast = fast


def _unguard(store: _Store) -> None:
    """Give up the fast path of ``store``'s code object: its lookups take the snapshot from now on."""
    store.fast, store.older = _UNGUARDED, ()


def _older_hit(store: _Store, fn: Any, kind: str | None) -> Any:
    """The trace an earlier hit's fast path finds for ``fn``, that path then tried first, or :data:`_MISSED`."""
    older = store.older
    for i, fast in enumerate(older):
        if _holds(fast.guard, fn):
            found = _fast_hit(fast, fn, kind)
            if found is not _MISSED:
                fast.hit = True
                latest = store.fast
                if latest is not _UNGUARDED:  # (another thread may have given up meanwhile)
                    store.older = (latest,) + older[:i] + older[i + 1:]
                    store.fast = fast
                return found
    return _MISSED


def _guard(fn: Any, lifted: set, depth: int, active: set) -> tuple:
    """``(code, name, globals, ((cell index, contents, guard), ...), ((global name, value, guard), ...))``
    of a user function (``lifted``: cells left to the caller), each guard that of a function met there (None
    for a value checked by identity alone); raises :class:`_Unknown` for what the fast path cannot check."""
    if depth > _MAX_DEPTH or type(fn) is not types.FunctionType or id(fn) in active or fn.__defaults__ is not None \
            or fn.__kwdefaults__ is not None:
        raise _Unknown
    active.add(id(fn))
    code = fn.__code__
    names, sorted_names, _ = _code_facts(code)
    cells = tuple([(i, cell.cell_contents, None) for i, cell in enumerate(fn.__closure__ or ()) if i not in lifted])
    cells = tuple([(i, x, _value_guard(x, depth + 1, active, names)) for i, x, _ in cells])
    globs = fn.__globals__
    reads = tuple([(name, x, _value_guard(x, depth + 1, active, names))
                   for name, x in ((name, globs.get(name, _MISSING)) for name in sorted_names)])
    active.discard(id(fn))
    return (code, fn.__name__, globs, cells, reads)


def _value_guard(x: Any, depth: int, active: set, names: frozenset) -> tuple | None:
    """The guard of a value met by a snapshot, as :meth:`_Snapshot.value` sees it (``names``: those the code
    reading ``x`` names): None where its identity says its snapshot; ``(code,)`` for torch's functions,
    whose identity does while their code is that one; a user function's :func:`_guard`; else ``(tag,
    body)``: ``"tensor"``, ``"items"`` (tuple, list), ``"mapping"`` (dict), ``"module"`` (user module or
    class) or ``"object"``. Raises :class:`_Unknown` for what no guard can check."""
    t = type(x)
    if t in _GUARD_EXACT or x is _MISSING:
        return None
    if t is types.FunctionType:
        code = x.__code__  # (torch's functions: by identity, while their code is torch's)
        return (code,) if _code_facts(code)[2] else _guard(x, set(), depth, active)
    if t is torch.Tensor or isinstance(x, torch.Tensor):
        # (the object itself is checked by identity by its holder) as the snapshot keys it: the memory
        # it views, or, keyed by identity (it requires grad), its dtype, shape and device
        return ("tensor", _tensor_key(x))
    if isinstance(x, (tuple, list)):
        if depth > _MAX_DEPTH or len(x) > _MAX_ITEMS or _has_own_attributes(x):
            raise _Unknown  # (a subclass with attributes of its own: no guard)
        # (the container itself is checked by identity by its holder) its length and each item by
        # identity, as the snapshot reads them: a list may have been edited in place since
        return ("items", (len(x), tuple([(i, v, _value_guard(v, depth + 1, active, names)) for i, v in enumerate(x)])))
    if t is types.ModuleType:
        if _is_library_module(x):
            return None
        # a user module (a helper called as ``masks.causal(...)``): the attributes the reading code
        # names, as _Snapshot.attributes reads them
        return ("module", _attribute_guards(x, names, depth, active))
    if isinstance(x, dict):
        if depth > _MAX_DEPTH or len(x) > _MAX_ITEMS or _has_own_attributes(x):
            raise _Unknown  # (a subclass with attributes of its own: no guard)
        # its items in order, each key by identity (immutable values only) and each value as any value
        items = []
        for k, v in x.items():
            if _value_guard(k, depth + 1, active, names) is not None:
                raise _Unknown
            items.append((k, v, _value_guard(v, depth + 1, active, names)))
        return ("mapping", (len(x), tuple(items)))
    if isinstance(x, (set, frozenset)):
        raise _Unknown  # (no guard for their items: snapshotted on every lookup)
    if t is functools.partial or t is types.MethodType:
        # (both have a __dict__, but the snapshot reads their function and arguments or bound object,
        # which no attribute named by the reader reaches: they are not objects to guard)
        raise _Unknown
    if _unchanging(x):
        return None  # (C functions and torch's own objects, by identity as the snapshot keys them)
    if isinstance(x, type):
        if _is_library_class(x):
            return None
        return ("module", _attribute_guards(x, names, depth, active))  # (a user class: as a user module)
    if hasattr(x, "__dict__") and id(x) not in active:
        # a user object (a callable one, or a model holding a mod's settings): its class, its __call__ and
        # the attributes the reading code names, with those its __call__ names, as _Snapshot.value reads them
        call, names = _call_and_names(x, names)
        active.add(id(x))
        try:
            return ("object", (type(x), call, None if call is None else _value_guard(call, depth + 1, active, names),
                               _attribute_guards(x, names, depth, active)))
        finally:
            active.discard(id(x))
    raise _Unknown


def _attribute_guards(x: Any, names: frozenset, depth: int, active: set) -> tuple:
    """``((name, value, its guard), ...)`` of the attributes of ``x`` that ``names`` names (a module's,
    a class's or an object's), as :meth:`_Snapshot.attributes` reads them."""
    if depth > _MAX_DEPTH:
        raise _Unknown
    attributes = [(name, _attribute(x, name)) for name in sorted(names)]
    return tuple([(name, value, None if value is _MISSING else _value_guard(value, depth + 1, active, names))
                  for name, value in attributes])


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name`` as a snapshot reads it: :data:`_MISSING` when absent (or when reading it raises)."""
    try:
        return getattr(obj, name)
    except Exception:
        return _MISSING


def _holds(guard: tuple, fn: Any) -> bool:
    """Whether ``fn`` (a function of ``guard``'s code, or the value a ``(tag, body)`` guard was made of)
    reads now the very objects ``guard`` names."""
    if len(guard) == 1:  # a library function, snapshotted by identity
        return fn.__code__ is guard[0]
    if len(guard) == 2:
        tag = guard[0]
        if tag == "tensor":  # a tensor: still as the snapshot keyed it
            return _tensor_key(fn) == guard[1]
        if tag == "items":  # a tuple or list: the same items
            length, items = guard[1]
            if len(fn) != length:
                return False
            for i, x, inner in items:
                if fn[i] is not x or inner is not None and not _holds(inner, x):
                    return False
            return True
        if tag == "mapping":  # a dict: the same items, in the same order
            length, items = guard[1]
            if len(fn) != length:
                return False
            for (k, v), (key, x, inner) in zip(fn.items(), items):
                if k is not key or v is not x or inner is not None and not _holds(inner, x):
                    return False
            return True
        attributes = guard[1]
        if tag == "object":  # a user object: its class and __call__, then its attributes as a module's
            cls, call, call_guard, attributes = attributes
            if type(fn) is not cls or call is not None and (type(fn).__call__ is not call
                                                            or call_guard is not None and not _holds(call_guard, call)):
                return False
        for name, x, inner in attributes:  # a user module or class: the attributes its reader names
            if _attribute(fn, name) is not x or inner is not None and not _holds(inner, x):
                return False
        return True
    code, name, globs, cells, reads = guard
    if (fn.__code__ is not code or fn.__globals__ is not globs or fn.__name__ != name or fn.__defaults__ is not None
            or fn.__kwdefaults__ is not None):
        return False
    if cells:
        closure = fn.__closure__
        try:
            for i, x, inner in cells:
                if closure[i].cell_contents is not x or inner is not None and not _holds(inner, x):
                    return False
        except ValueError:  # a cell emptied since
            return False
    for name, x, inner in reads:
        if globs.get(name, _MISSING) is not x or inner is not None and not _holds(inner, x):
            return False
    return True


def _fast_hit(fast: _Fast, fn: Any, kind: str | None) -> Any:
    """The trace a snapshot of ``fn`` would find (``fn`` holding ``fast.guard``), or :data:`_MISSED`. (The
    guard checks every cell but ``fast.cells`` by identity, so those are the cells :func:`_lift_cells` lifts
    where theirs are liftable still.)"""
    if not fast.cells:
        entry = fast.entry
        if (kind is None or entry[0].kind == kind) and still_located(entry[2]):
            return entry[0]
        return _MISSED
    template = fast.template
    if kind is not None and template.traced.kind != kind:
        return _MISSED
    # the lifted cells as _Snapshot.lifted reads them
    closure, values, keep, located = fn.__closure__, [], [], []
    for i in fast.cells:
        x = closure[i].cell_contents
        t = type(x)
        if t is torch.Tensor:  # (lifted_cells.liftable_value: plain strided tensors; _memory checks)
            where = _memory(x)
            if where is None or keep and any([y is x for y in keep]):  # (a tensor in two cells is not lifted)
                return _MISSED
            values.append(where)
            keep.append(x)
            located.append((x, where))
        elif t is int or t is float:  # (lifted_cells.liftable_value) as _Snapshot.value keys them
            values.append((t, x) if t is int else (float, x.hex()))
        else:
            return _MISSED
    values = tuple(values)
    latest = template.latest  # (the latest instance first, inline: gpt-fast's every decoding step)
    if latest and latest[0][0] == values and still_located(latest[0][3]):
        return latest[0][1]  # (equal values have the kinds of the template's key)
    found = _instance_of(template, values) if latest else None  # (an earlier value: alternating windows)
    if found is not None:
        return found
    if tuple([_memory_kind(v) if v[0] == "memory" else ("lifted", v[0]) for v in values]) != fast.kinds:
        return _MISSED
    return instance(template, fn, values, keep, tuple(located))


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
        template.latest = ((values, traced, keep, located),) + (template.latest or ())[:_MAX_INSTANCES - 1]
    return traced


def _instance_of(template: Any, values: tuple) -> Any:
    """The instance of ``template`` for ``values`` among its latest (:func:`instance`), or None; a hit
    becomes the most recent."""
    latest = template.latest
    if latest:
        for i, entry in enumerate(latest):
            if entry[0] == values and still_located(entry[3]):
                if i:
                    template.latest = (entry,) + latest[:i] + latest[i + 1:]
                return entry[1]
    return None


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
    _latest[0] = (None, None)
