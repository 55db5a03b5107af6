"""A check the trace cache's tests share: what it serves is what a fresh trace gives."""
from __future__ import annotations

from flexc.mods.trace import Tracer, mod_kind, trace


def assert_current(fn):
    """The trace :func:`flexc.trace` serves for ``fn`` now, asserted equal to a fresh trace (the same
    interned graph, captured tensors at the same memory)."""
    cached, fresh = trace(fn), Tracer(fn, mod_kind(fn)).run()
    assert cached.root is fresh.root, (str(cached), str(fresh))
    assert [(t.data_ptr(), t.shape, t.dtype) for t in cached.buffers] == \
        [(t.data_ptr(), t.shape, t.dtype) for t in fresh.buffers]
    return cached
