"""Values remembered for tensors as they are now: their identity and version counters are the key.

A tensor written in place (or through a view: views share the counter) bumps its version, so a value
computed from its contents is asked for again, never served stale. Entries hold the tensors weakly
(a remembered value never keeps its tensors alive) and the most recently used ``size`` are kept.
Tensors made under inference mode have no version counter: their values cannot be remembered.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence


class VersionedMemo:
    """A thread-safe, least-recently-used memo keyed by tensors' identity and version counters."""

    def __init__(self, size: int):
        self._entries: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, tensors: Sequence, key: Any, build: Callable[[], Any],
            unversioned: Callable[[], Any] | None = None) -> Any:
        """``build()``, remembered for ``tensors`` (unmodified since) and ``key``. When a tensor has
        no version counter, ``unversioned()`` (default ``build()``) answers, unremembered."""
        try:
            full_key = (tuple([(id(t), t._version) for t in tensors]), key)
        except RuntimeError:  # inference tensors track no version
            return (unversioned or build)()
        entry = self._entries.get(full_key)  # (a dict read is atomic: no lock on the per-call hit)
        if entry is not None and all([ref() is t for ref, t in zip(entry[0], tensors)]):
            with self._lock:
                if full_key in self._entries:
                    self._entries.move_to_end(full_key)
            return entry[1]
        value = build()
        with self._lock:
            self._entries[full_key] = ([weakref.ref(t) for t in tensors], value)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value


__all__ = ["VersionedMemo"]
