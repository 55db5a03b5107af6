"""Decoding's ``block_mask[:, :, index]`` in one device op: a query-block row gathered from a table
that lays every kv table's row side by side.

On a GPU the row index is a device tensor (``input_pos // 128``): reading it would be a sync, so
the slice is gathered on the device. Gathering each of the four kv tables costs four indexing ops
a decoding step. Instead, once per state of the parent's tables (and CUDA stream), a
:class:`StackedRows` lays them out as one ``[nQ, width]`` table whose row ``q`` holds row ``q`` of
every table, each table's part contiguous in ``(batch, head)`` order and 16-byte aligned; a step
gathers one row of it (``stacked[index]``, torch's indexing: a negative row wraps, one out of range
raises, as slicing each table does). The :class:`GatheredRow` is a copy, as torch's slice is
(editing the parent afterwards does not reach it), and its tables are views of that copy, laid out
as torch's slices are (contiguous ``[B, H, 1]`` and ``[B, H, 1, nKV]``), made when asked for.

The laid-out table is kept by the parent BlockMask (freed with it): a copy of its kv tables, so
tables of more than :data:`LIMIT` index entries are sliced table by table instead.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .. import device as gpu
from ..versions import pinned, table_states

# index entries up to which a parent's tables are laid out again for gathering (more: each table is
# indexed on its own, and no copy of the parent is kept): at most 32 MiB more for int32 tables
LIMIT = 1 << 22
_INDEX_DTYPES = (torch.int64, torch.int32)


class StackedRows:
    """The kv tables ``tables`` of a BlockMask laid out for :func:`gather`: ``stacked [nQ, width]``,
    each present table's row in ``widths`` entries (padded), in order, with the sliced table's
    ``shapes`` (None for an absent full table). ``states`` (their contents states as they were,
    pinned) and ``token`` (the stream it was made on) say when it is still theirs; ``states`` and
    ``layout`` are what a slice's plan is keyed by (:mod:`flexc.call.signature`)."""

    def __init__(self, tables: tuple, states: tuple, token: Any, stacked: torch.Tensor, widths: list,
                 shapes: tuple):
        self.tables, self.states, self.token = tables, states, token
        self.stacked, self.widths, self.shapes = stacked, tuple(widths), shapes
        device = stacked.device
        # the sliced tables' (shape, dtype, device), as a slice's plan key names them
        self.layout = tuple(None if shape is None else (torch.Size(shape), stacked.dtype, device) for shape in shapes)
        # a slice's tables as its plan is keyed (flexc.call.signature: as an unedited slice of these tables)
        self.key = ("slice", self.states, self.layout)
        offsets = [sum(widths[:i]) for i in range(len(widths))] + [0, 0]
        # (offset, entries, shape) of each table's view of a gathered row
        self.views = tuple(None if shape is None else (offset, math.prod(shape), shape)
                           for offset, shape in zip(offsets, shapes))


class GatheredRow:
    """One query-block row of :class:`StackedRows` ``source``, gathered into ``row`` (``[1, width]``, a
    copy): :meth:`tables` are the four kv tables of the slice, views of ``row``; ``provenance``, once
    they are made, is the slice's as :attr:`flexc.masks.block_mask.BlockMask.sliced_from` gives it."""

    __slots__ = ("row", "source", "made", "provenance")

    def __init__(self, row: torch.Tensor, source: StackedRows):
        # made: the tables once :meth:`tables` made them (whoever holds them may have edited the row since)
        self.row, self.source, self.made, self.provenance = row, source, None, None

    def tables(self) -> tuple:
        """``(kv_num_blocks [B, H, 1], kv_indices [B, H, 1, nKV], full counts, full indices)``, contiguous
        views of :attr:`row` (the same objects on every call; None for absent full tables)."""
        tables = self.made
        if tables is None:
            tables = self.views()
            source = self.source  # (rows of the tables it was gathered from, as they were then; unedited now)
            self.provenance = (source.tables, source.states, pinned(table_states(tables), tables))
            self.made = tables
        return tables

    def views(self) -> tuple:
        """:meth:`tables` made now (view ops torch.compile traces, should a slice reach a compiled function)."""
        row = self.row
        return tuple(None if view is None else row.narrow(1, view[0], view[1]).view(view[2])
                     for view in self.source.views)


def one_row_index(index: Any) -> torch.Tensor | None:
    """``index[2]`` when ``index`` is ``(:, :, t)`` with ``t`` a one-element 1-D integer tensor, else None."""
    if type(index) is not tuple or len(index) != 3:
        return None
    t = index[2]
    if (type(t) is torch.Tensor and index[0] == index[1] == _ALL and t.dim() == 1 and t.dtype in _INDEX_DTYPES
            and t.numel() == 1):
        return t
    return None


_ALL = slice(None)


def gather(tables: tuple, kept: StackedRows | None, index: torch.Tensor
           ) -> tuple[GatheredRow | None, StackedRows | None]:
    """``(row, the laid-out tables to keep)``: row ``index`` (a one-element tensor) of the kv ``tables``
    (a mask's, ``[B, H, nQ]`` counts and ``[B, H, nQ, nKV]`` entries), gathered from ``kept`` when it is
    still theirs, else from tables laid out now. ``(None, kept)`` for tables this cannot serve (other
    layouts, mixed dtypes or devices, too large, tables without write counts) or while a CUDA graph is
    captured (nothing made then may be kept): the caller indexes each table."""
    idx = tables[1]
    if type(idx) is not torch.Tensor:
        return None, kept
    device = idx.device
    token = gpu.stream_token(device)
    if token is not None and not gpu.keeps(token):
        return None, kept
    states = table_states(tables)
    if kept is None or kept.tables is not tables or kept.token != token or kept.states != states:
        kept = _laid_out(tables, states, token)
        if kept is None:
            return None, None
    if not (index.is_cpu or index.device == device):
        return None, kept
    return GatheredRow(kept.stacked[index], kept), kept


def _laid_out(tables: tuple, states: tuple, token: Any) -> StackedRows | None:
    """:class:`StackedRows` of ``tables`` now, or None for tables it does not serve."""
    num, idx, full_num, full_idx = tables
    if (type(num) is not torch.Tensor or type(idx) is not torch.Tensor or num.dim() != 3 or idx.dim() != 4
            or idx.shape[:3] != num.shape or idx.numel() > LIMIT or idx.dtype != num.dtype
            or idx.dtype not in _INDEX_DTYPES or idx.device != num.device or (full_num is None) != (full_idx is None)):
        return None
    if full_num is not None and (type(full_num) is not torch.Tensor or type(full_idx) is not torch.Tensor
                                 or full_num.shape != num.shape or full_idx.shape != idx.shape
                                 or full_num.dtype != num.dtype or full_idx.dtype != num.dtype
                                 or full_num.device != num.device or full_idx.device != num.device):
        return None
    if not all(s is None or type(s) is tuple for s in states):
        return None  # (tables without write counts: an edit could not be seen)
    B, H, nq, n_kv = idx.shape
    if B * H * nq == 0:
        return None
    align = 16 // idx.element_size()  # each table's part starts 16-byte aligned (Triton specializes on it)
    parts, widths, shapes = [], [], []
    with torch.inference_mode(False):  # (kept across calls: a normal tensor, whatever the mode)
        for t in tables:
            if t is None:
                shapes.append(None)
                continue
            per_row = t.permute(2, 0, 1, *range(3, t.dim())).reshape(nq, t.numel() // nq)  # row q: its (b, h[, column]) entries
            size = per_row.shape[1]
            padded = -(-size // align) * align
            parts += [per_row] + ([per_row.new_zeros(nq, padded - size)] if padded > size else [])
            widths.append(padded)
            shapes.append((B, H, 1) + tuple(t.shape[3:]))
        stacked = torch.cat(parts, 1)
    return StackedRows(tables, pinned(states, tables), token, stacked, widths, tuple(shapes))


__all__ = ["GatheredRow", "LIMIT", "StackedRows", "gather", "one_row_index"]
