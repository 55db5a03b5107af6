"""Plans kept by signature: the bounded store that eager calls' and compiled calls' plans share.

:mod:`flexc.call.plans` and :mod:`flexc.torch_compile.op_plans` each keep one :class:`PlanStore`. A
signature that turns out unhashable keeps nothing (the call is planned each time); past its limit the
store drops its oldest plan (kept in the order made: a signature's hash costs enough that reordering
on every hit would cost more than a rare re-plan).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class PlanStore:
    """``signature -> plan``, at most ``limit`` of them, each with what its signature names (``held``:
    kept alive with the plan, so no id or storage address in the signature is reused while it is)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, signature: tuple | None) -> Any:
        """The plan kept for ``signature``, or None (also for None or an unhashable signature)."""
        if signature is None:
            return None
        try:
            entry = self._plans.get(signature)
        except TypeError:
            return None
        return None if entry is None else entry[0]

    def keep(self, signature: tuple | None, plan: Any, held: Any = None) -> None:
        """Keep ``plan`` for ``signature`` (nothing for None or an unhashable signature)."""
        if signature is None:
            return
        with self._lock:
            try:
                self._plans[signature] = (plan, held)
            except TypeError:
                return
            while len(self._plans) > self.limit:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


__all__ = ["PlanStore"]
