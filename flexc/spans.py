"""Sets of integers as sorted, disjoint half-open ``(lo, hi)`` spans, and their algebra.

Shared by the kv intervals a mask allows along one query row (:mod:`flexc.row_intervals`) and the
CPU path's chunk planning (:mod:`flexc.backends.block_plan`). Ends may be ``-inf``/``inf``.
"""
from __future__ import annotations

INF = float("inf")
ALL = ((-INF, INF),)  # every integer
NONE = ()


def intersect(x, y) -> tuple:
    """The intersection of two span sequences."""
    if x is ALL:
        return y
    if y is ALL:
        return x
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if lo < hi:
            out.append((lo, hi))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def complement(x) -> tuple:
    """The integers outside a span sequence."""
    out, start = [], -INF
    for lo, hi in x:
        if start < lo:
            out.append((start, lo))
        start = hi
    if start < INF:
        out.append((start, INF))
    return tuple(out)


def union(x, y) -> tuple:
    """The union of two span sequences."""
    return complement(intersect(complement(x), complement(y)))
