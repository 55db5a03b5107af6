"""Small BlockMask tables as Python lists: a content key for decoding's validation and planning.

A decoding step slices a one-row BlockMask out of a large one and calls attention with it. The
tables then hold a few dozen entries, and every tensor operation on them costs more than the
arithmetic. Read once as Python lists (one ``tolist`` per table), their contents are a hashable
key: masks with the same entries share one validation verdict and one key-range plan, whichever
objects hold them, so neither is redone while decoding stays inside one query-block row.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from ..versions import contents_states, pinned, table_states
from .kv_tables import kv_tables

LIMIT = 4096  # entries of kv_indices up to which tables are read as lists

# the contents states of the tables read last (pinned: no other storage takes their addresses, and
# no table is kept alive) and their contents: validation and planning of one call read the same tables
_last: list = [None, None]


class TableContents(NamedTuple):
    """The kv tables of a BlockMask as Python values; equal contents mean equal tables."""

    layout: tuple  # (shape, dtype) of each of the four tables, None for absent full tables
    num_shape: tuple  # kv_num_blocks' shape [B, H, nQ]: the flat rows below follow it
    n_kv: int  # entries per row of the index tables
    counts: tuple
    indices: tuple  # row r's entries are indices[r * n_kv:(r + 1) * n_kv]
    full_counts: tuple | None
    full_indices: tuple | None


def table_lists(tables: tuple) -> TableContents | None:
    """The contents of ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``, or None
    when they are not small tensors (at most :data:`LIMIT` index entries)."""
    identity = contents_states(tables)  # (equal to no earlier one when an entry is not a tensor)
    if _last[0] == identity:
        return _last[1]
    num, idx = tables[0], tables[1]
    if (not all(isinstance(t, torch.Tensor) for t in tables if t is not None) or num is None or idx is None
            or idx.numel() > LIMIT or idx.dim() < 1 or (tables[2] is None) != (tables[3] is None)):
        return None
    flat = [_flat_values(t) if t is not None else None for t in tables]
    layout = tuple((tuple(t.shape), t.dtype) if t is not None else None for t in tables)
    contents = TableContents(layout, tuple(num.shape), idx.shape[-1], *flat)
    _last[:] = [pinned(identity, tables), contents]
    return contents


def _flat_values(t: torch.Tensor) -> tuple:
    if t.dim() and 0 < t.numel() == t.shape[-1]:  # one row (a decoding step's slice, made anew each compiled call):
        values = t.tolist()  # nested only in 1-long dims, unwrapped by indexing (0.7 us, numpy's 2.3)
        for _ in range(t.dim() - 1):
            values = values[0]
        return tuple(values)
    if t.is_cpu and not t.requires_grad:  # numpy reads it without torch's dispatch (a few us a table)
        return tuple(t.numpy().ravel().tolist())
    return tuple(t.reshape(-1).tolist())


def row_blocks(contents: TableContents, row: int) -> tuple[tuple, tuple]:
    """``(partial blocks, full blocks)`` listed by flat row ``row`` of ``contents``."""
    n_kv = contents.n_kv
    partial = contents.indices[row * n_kv: row * n_kv + contents.counts[row]]
    if contents.full_counts is None:
        return partial, ()
    return partial, contents.full_indices[row * n_kv: row * n_kv + contents.full_counts[row]]


# (contents states of a mask's four kv tables, pinned, row) -> (a weak reference to kv_indices, the
# row's TableContents): a decoding loop slices one query-block row for every token of that block (no
# table is kept alive: a mask the caller drops is freed)
_ROWS: OrderedDict = OrderedDict()
_MAX_ROWS = 64


def row_contents(tables: tuple, row: int) -> TableContents | None:
    """The contents of query-block row ``row`` of ``tables`` (CPU ``[B, H, nQ, ...]`` kv tables), as
    :func:`table_lists` gives for ``table[:, :, row:row + 1]``; None for tables on another device or
    rows over :data:`LIMIT` entries. Read once per row while the tables are unchanged."""
    idx = tables[1]
    if not idx.is_cpu or idx.dim() != 4:
        return None
    states = table_states(tables)
    hit = _ROWS.get((states, row))
    if hit is not None and hit[0]() is idx:
        return hit[1]
    if idx.shape[0] * idx.shape[1] * idx.shape[3] > LIMIT:
        return None
    contents = table_lists(tuple(t.narrow(2, row, 1) if t is not None else None for t in tables))
    _ROWS[(pinned(states, tables), row)] = (weakref.ref(idx), contents)
    while len(_ROWS) > _MAX_ROWS:
        _ROWS.popitem(last=False)
    return contents


def contents_of(block_mask: Any) -> TableContents | None:
    """The kv tables of ``block_mask`` as lists: a lazily sliced row's own lists, else
    :func:`table_lists` of its tensors (None when they are not small)."""
    rows = getattr(block_mask, "lazy_rows", None)
    if rows is not None:
        return rows
    return table_lists(kv_tables(block_mask))
