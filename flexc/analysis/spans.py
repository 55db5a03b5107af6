"""Sets of integers as sorted, disjoint half-open ``(lo, hi)`` spans, and their algebra.

Shared by the kv intervals a mask allows along one query row (:mod:`flexc.analysis.row_intervals`) and the
CPU path's chunk planning (:mod:`flexc.backends.cpu.block_plan`). Ends may be ``-inf``/``inf``.
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
    # (locals and conditional expressions, not repeated indexing and max/min calls: decoding
    # intersects a row's intervals with each partial block on every step)
    out, i, j, nx, ny = [], 0, 0, len(x), len(y)
    while i < nx and j < ny:
        (x_lo, x_hi), (y_lo, y_hi) = x[i], y[j]
        lo, hi = (x_lo if x_lo > y_lo else y_lo), (x_hi if x_hi < y_hi else y_hi)
        if lo < hi:
            out.append((lo, hi))
        if x_hi < y_hi:
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
