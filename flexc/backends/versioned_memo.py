"""Values remembered for tensors as they are now: the tensors and their version counters are the key.

A value is filed twice: under the tensor objects' identities (the same objects again, as an eager
call passes its block mask's tables, are found without reading their storages) and under where
their data lives (storage, offset, shape, strides, dtype): another tensor object over the same
elements finds it too, as a compiled backward's autograd-saved aliases of the tables do, new
objects every step. Both keys carry the version counters: a tensor written in place (or through a
view or an alias: they share the counter) bumps its version, so a value computed from its contents
is asked for again, never served stale. Entries hold tensors and storages weakly (a remembered value
never keeps its tensors alive; a storage's address is not reused while a weak reference to it
lives, and an entry whose tensors or storages were freed is never served), and the most recently
used ``size`` values are kept. Tensors made under inference mode have no version counter, and
tensors with no storage (fake or meta tensors, some subclasses) no address: their values cannot
be remembered.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

from torch.multiprocessing.reductions import StorageWeakRef


class VersionedMemo:
    """A thread-safe, least-recently-used memo keyed by tensors' data and version counters."""

    def __init__(self, size: int):
        self._entries: OrderedDict = OrderedDict()
        self._size = 2 * size  # (each value is filed under two keys)
        self._lock = threading.Lock()

    def get(self, tensors: Sequence, key: Any, build: Callable[[], Any],
            unversioned: Callable[[], Any] | None = None) -> Any:
        """``build()``, remembered for ``tensors`` (unmodified since) and ``key``. When a tensor has
        no version counter or no storage, ``unversioned()`` (default ``build()``) answers, unremembered."""
        try:
            # the same tensor objects again (an eager call's tables): found without reading storages
            object_key = ("objects", tuple([(id(t), t._version) for t in tensors]), key)
        except RuntimeError:  # inference tensors track no version
            return (unversioned or build)()
        entry = self._entries.get(object_key)  # (a dict read is atomic: no lock on the per-call hit)
        if entry is not None and all([ref() is t for ref, t in zip(entry[0], tensors)]):
            return self._used(object_key, entry[1])
        try:
            storages = [t.untyped_storage() for t in tensors]
        except (RuntimeError, NotImplementedError, TypeError):  # fake, meta or storage-less tensors
            return (unversioned or build)()
        data_key = ("data", tuple([(s._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
                                   for s, t in zip(storages, tensors)]), key)
        entry = self._entries.get(data_key)
        if entry is not None and not any([ref.expired() for ref in entry[0]]):
            return self._used(data_key, entry[1])
        value = build()
        with self._lock:
            self._entries[object_key] = ([weakref.ref(t) for t in tensors], value)
            self._entries[data_key] = ([StorageWeakRef(s) for s in storages], value)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value

    def _used(self, full_key: tuple, value: Any) -> Any:
        with self._lock:
            if full_key in self._entries:
                self._entries.move_to_end(full_key)
        return value


__all__ = ["VersionedMemo"]
