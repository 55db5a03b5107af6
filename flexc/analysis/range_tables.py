"""Minimum and maximum of a captured tensor over index ranges, for many ranges at once.

A lookup such as ``doc[q_idx]`` over a tile whose ``q_idx`` runs from ``q0`` to ``q1`` takes values
between ``min(doc[q0:q1+1])`` and ``max(doc[q0:q1+1])``. :class:`RangeMinMax` answers such queries
for a whole tensor of ranges with a sparse table: level ``j`` holds the min/max of every window of
``2**j`` consecutive entries, and any range is covered by two overlapping windows of one level.
Levels are built only up to the longest range asked for, so tiles of 128 need 8 levels whatever
the tensor's length.
"""
from __future__ import annotations

import torch


class RangeMinMax:
    """Range min/max queries along dimension ``dim`` of ``values`` (an integer or bool tensor).

    The other dimensions are addressed by exact indices in :meth:`query`. Build one per call of the
    analysis: the table reads the tensor's values, which may change between calls.
    """

    def __init__(self, values: torch.Tensor, dim: int):
        if values.dtype == torch.bool:
            values = values.to(torch.uint8)  # min/max tables need an ordered numeric dtype
        self.values = values.movedim(dim, -1).contiguous()
        self.length = self.values.shape[-1]
        self.mins = [self.values]
        self.maxs = [self.values]
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def _grow(self, levels: int) -> None:
        while len(self.mins) < levels:
            half = 1 << (len(self.mins) - 1)
            lo, hi = self.mins[-1], self.maxs[-1]
            # window of 2*half starting at i = windows of half at i and i + half; the last `half`
            # entries have no partner and keep the previous level's value (never queried there)
            new_lo, new_hi = lo.clone(), hi.clone()
            if half < self.length:
                torch.minimum(lo[..., :-half], lo[..., half:], out=new_lo[..., :-half])
                torch.maximum(hi[..., :-half], hi[..., half:], out=new_hi[..., :-half])
            self.mins.append(new_lo)
            self.maxs.append(new_hi)
            self._stacked = None

    def query(self, fixed: tuple, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max of ``values[fixed..., lo:hi+1]`` (moved dim last), elementwise over the
        broadcast of ``fixed``, ``lo`` and ``hi`` (int64 tensors, ``0 <= lo <= hi < length``)."""
        span = hi - lo + 1
        longest = int(span.max()) if span.numel() else 1
        self._grow(max(1, longest.bit_length()))
        if self._stacked is None:
            self._stacked = (torch.stack(self.mins), torch.stack(self.maxs))
        mins, maxs = self._stacked
        # level = floor(log2(span)), exactly, from the float exponent (span < 2**53)
        level = torch.frexp(span.to(torch.float64)).exponent.to(torch.int64) - 1
        second = hi - (torch.ones_like(level) << level) + 1
        low = torch.minimum(mins[(level, *fixed, lo)], mins[(level, *fixed, second)])
        high = torch.maximum(maxs[(level, *fixed, lo)], maxs[(level, *fixed, second)])
        return low, high
