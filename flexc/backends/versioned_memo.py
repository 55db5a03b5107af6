"""Values remembered for tensors as they are now: what identifies their contents is the key.

A value is filed under each tensor's :func:`flexc.versions.contents_state`: its storage, offset,
shape, strides, dtype and version counter. So the same tensor objects again find it (an eager
call passing its block mask's tables), and so do other tensor objects over the same elements (a
compiled backward's autograd-saved aliases of the tables, new objects every step); a tensor
written in place (or through a view or an alias: they share the counter), given other elements
(``.data = new``, ``set_``) or freed and its memory reused asks for the value again, never served
stale. Entries hold storages weakly (a remembered value never keeps its tensors alive, and a
storage is not replaced at its place while a weak reference to it lives), and the most recently
used ``size`` values are kept. Tensors made under inference mode have no version counter, and
tensors with no storage (fake or meta tensors, some subclasses) no address: their values cannot
be remembered.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ..versions import contents_states, pinned, rememberable


_MISSING = object()


class VersionedMemo:
    """A thread-safe, least-recently-used memo keyed by tensors' contents (storage, layout, version)."""

    def __init__(self, size: int):
        self._entries: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self._newest: Any = _MISSING  # the value used or filed last (equal values: any of them)

    def get(self, tensors: Sequence, key: Any, build: Callable[[], Any],
            unversioned: Callable[[], Any] | None = None) -> Any:
        """``build()``, remembered for ``tensors`` (the same elements, unmodified since) and ``key``.
        When a tensor has no version counter or no storage, ``unversioned()`` (default ``build()``)
        answers, unremembered."""
        states = contents_states(tensors)
        full_key = (states, key)
        value = self._entries.get(full_key, _MISSING)  # (a dict read is atomic: no lock on the per-call hit)
        if value is not _MISSING:
            if value is not self._newest:  # (the value used last is already at the end: no rehashing)
                with self._lock:
                    if full_key in self._entries:
                        self._entries.move_to_end(full_key)
                        self._newest = value
            return value
        if not rememberable(states):
            return (unversioned or build)()
        value = build()
        with self._lock:  # (pinned: no other storage takes the place of one in the key while it is kept)
            self._entries[(pinned(states, tensors), key)] = value
            self._newest = value
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value


__all__ = ["VersionedMemo"]
