"""Fixtures the tracer's tests share."""
import pytest

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
