"""Fixtures the tracer's tests share."""
import pytest

from flexc.mods import trace_cache
from flexc.mods.tracing.tracer import Tracer


@pytest.fixture
def runs(monkeypatch):
    """How many times the tracer really ran (a cached or templated trace does not run it)."""
    count = [0]
    original = Tracer.run

    def counting(self):
        count[0] += 1
        return original(self)

    monkeypatch.setattr(Tracer, "run", counting)
    return count


@pytest.fixture
def snapshots(monkeypatch):
    """How many snapshots the trace cache's lookups took (a lookup its fast path serves takes none)."""
    count = [0]
    original = trace_cache.snapshot

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(trace_cache, "snapshot", counting)
    return count
