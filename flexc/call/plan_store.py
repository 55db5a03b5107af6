"""Plans kept by signature: the bounded store that eager calls' and compiled calls' plans share.

:mod:`flexc.call.plans` and :mod:`flexc.torch_compile.op_plans` each keep one :class:`PlanStore`. A
signature that turns out unhashable keeps nothing (the call is planned each time); past its limit the
store drops its oldest plan (kept in the order made: a signature's hash costs enough that reordering
on every hit would cost more than a rare re-plan). The last plan found is compared first: a decoding
loop or a training step repeats one signature, and comparing two equal signatures costs about half
of hashing one (the comparison of each part stops at identical objects).
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
        # (signature, plan, held) of the last plan found (holding what its signature names, as the store does)
        self._last: tuple | None = None

    def get(self, signature: tuple | None) -> Any:
        """The plan kept for ``signature``, or None (also for None or an unhashable signature)."""
        if signature is None:
            return None
        last = self._last
        if last is not None and last[0] == signature:
            return last[1]
        try:
            entry = self._plans.get(signature)
        except TypeError:
            return None
        if entry is None:
            return None
        self._last = (signature, *entry)
        return entry[0]

    def keep(self, signature: tuple | None, plan: Any, held: Any = None) -> None:
        """Keep ``plan`` for ``signature`` (nothing for None or an unhashable signature)."""
        if signature is None:
            return
        with self._lock:
            try:
                self._plans[signature] = (plan, held)
            except TypeError:
                return
            self._last = None  # (it may be the plan replaced, or one dropped below: not kept longer)
            while len(self._plans) > self.limit:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._last = None


__all__ = ["PlanStore"]
