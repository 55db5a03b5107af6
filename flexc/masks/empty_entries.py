"""Negative kv-table entries inside a row's count are empty blocks: compacted away before any backend.

torch's ``PagedAttention.convert_logical_block_mask`` maps logical key blocks through the page
table, and a batch with no reserved pages maps them to -1. torch's kernels accept such tables (its
``mask_mod`` then masks everything those entries would reach), so flexc treats a negative entry
inside a row's count as a block that is never visited. Rather than teach every backend (the CPU
planner, the decode path, the Triton forward, backward and decode kernels) to skip them, the call
gets tables with each row's non-negative entries first and the count reduced: device ops only (no
host reads on a GPU), done once per tables' contents (:func:`flexc.versions.contents_state`) and
CUDA stream (the compacted tables are served only to the stream that made them), so steady-state
calls pay one dictionary look-up.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import device as gpu
from ..versions import pinned, table_states
from .kv_tables import block_sizes_of, kv_tables

# id(kv_indices) -> (a weak reference to it, the tables' states, the stream the compacted tables were made
# on (flexc.device.stream_token), the compacted mask (None: the mask itself))
_compacted: dict[int, tuple] = {}
_MAX_REMEMBERED = 64
# id(kv_indices) -> (a weak reference to it, the tables' states, whether they hold no empty entry):
# the tables masks are sliced from (see _free_of_empty)
_clean_parents: dict[int, tuple] = {}
# the lists of the one-row slice found free of negative entries last (a decoding loop's next step
# slices the same row while it stays in one query-block row)
_last_rows: list = [None]


def without_empty_entries(block_mask: Any, remember: bool = True) -> Any:
    """``block_mask``, or a flexc BlockMask with the same mask_mod, block size and lengths whose kv
    tables hold no negative entry inside a row's count (each such entry dropped, the count reduced).
    On a GPU new tables are compacted without reading whether any entry is negative, except a slice
    of tables found free of them (read once per parent)."""
    if block_mask is None:
        return None
    rows = getattr(block_mask, "lazy_rows", None)
    if rows is not None:  # a one-row slice still held as lists
        if rows is _last_rows[0] or not _lists_have_empty(rows):
            _last_rows[0] = rows
            return block_mask
    tables = kv_tables(block_mask)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tables) or tables[1].dim() < 1:
        return block_mask
    state = table_states(tables)
    provenance = getattr(block_mask, "sliced_from", None)
    if provenance is not None and provenance[2] == state and _free_of_empty(*provenance[:2]):
        return block_mask  # unedited rows of tables with no empty entry (a decoding step's slice)
    seen = _compacted.get(id(tables[1]))
    stream = None
    if seen is not None and seen[0]() is tables[1] and seen[1] == state:
        rebuilt = seen[3]
        if rebuilt is None:
            return block_mask
        # compacted tables are device tensors made on one stream: served to that stream only
        # (flexc.device.stream_token); another stream compacts again
        stream = gpu.stream_token(tables[1].device)
        if seen[2] == stream:
            if (rebuilt.mask_mod is block_mask.mask_mod and rebuilt.BLOCK_SIZE == block_sizes_of(block_mask)
                    and rebuilt.seq_lengths == tuple(block_mask.seq_lengths)):
                return rebuilt  # one object per tables: caches keyed by the mask keep hitting
            new = (rebuilt.kv_num_blocks, rebuilt.kv_indices, rebuilt.full_kv_num_blocks, rebuilt.full_kv_indices)
        else:
            new = compact_tables(tables)
    else:
        new = compact_tables(tables)
    rebuilt = None if new is None else _rebuilt(block_mask, new)
    if rebuilt is not None and stream is None:
        stream = gpu.stream_token(tables[1].device)
    # not kept: tables made while a CUDA graph is captured (the graph's), or for a compiled graph's
    # call (remember=False: its tables are new every call, and cudagraph trees refuse memory of their
    # pool that a cache keeps alive)
    if not remember or not gpu.keeps(stream):
        return block_mask if rebuilt is None else rebuilt
    if len(_compacted) >= _MAX_REMEMBERED:
        _compacted.clear()
    # (forgotten when the caller's table is freed: the compacted copy is kept no longer than its source)
    _compacted[id(tables[1])] = (weakref.ref(tables[1], _forget(id(tables[1]))), pinned(state, tables), stream,
                                 rebuilt)
    return block_mask if rebuilt is None else rebuilt


def _forget(key: int, store: dict = _compacted):
    """A weak reference's callback dropping the compacted copy of the tables whose ``kv_indices`` had id
    ``key`` (``store``: bound now, so the callback still works while the interpreter shuts down)."""
    def forget(_ref) -> None:
        entry = store.get(key)
        if entry is not None and entry[0]() is None:
            store.pop(key, None)
    return forget


def _free_of_empty(parent: tuple, parent_state: tuple) -> bool:
    """Whether the tables a slice was taken from hold no negative entry inside a count, read once per
    tables' state (a decoding loop slices one parent every step; on a GPU this one read is the sync
    that spares every step's slice the compaction ops)."""
    if not all(t is None or isinstance(t, torch.Tensor) for t in parent) or table_states(parent) != parent_state:
        return False
    seen = _clean_parents.get(id(parent[1]))
    if seen is None or seen[0]() is not parent[1] or seen[1] != parent_state:
        seen = (weakref.ref(parent[1]), pinned(parent_state, parent), compact_tables(parent, read=True) is None)
        if len(_clean_parents) >= _MAX_REMEMBERED:
            _clean_parents.clear()
        _clean_parents[id(parent[1])] = seen
    return seen[2]


def compact_tables(tables: tuple, read: bool | None = None) -> tuple | None:
    """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` with negative entries
    inside the counts dropped (a row's other entries keep their order, entries past the new count
    are 0), or None when ``read`` (default: on the CPU) finds none. Without ``read`` (a GPU) the
    tables are compacted with device ops only."""
    on_gpu = not read if read is not None else gpu.is_gpu(tables[1].device)
    out = list(tables)
    changed = False
    for slot in (0, 2):
        count, index = tables[slot], tables[slot + 1]
        if count is None or index.numel() == 0:
            continue
        n_kv = index.shape[-1]
        columns = torch.arange(n_kv, device=index.device)
        inside = columns < count.unsqueeze(-1)
        empty = inside & (index < 0)
        if not on_gpu and not bool(empty.any()):
            continue
        keep = inside & ~empty
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept entries first, in order
        new_count = keep.sum(-1).to(count.dtype)
        packed = torch.gather(index, -1, order)
        out[slot] = new_count
        out[slot + 1] = torch.where(columns < new_count.unsqueeze(-1), packed, torch.zeros_like(packed))
        changed = True
    return tuple(out) if changed else None


def _lists_have_empty(rows: Any) -> bool:
    n_kv = rows.n_kv
    for counts, entries in ((rows.counts, rows.indices), (rows.full_counts, rows.full_indices)):
        if counts is None:
            continue
        for r, c in enumerate(counts):
            if any(block < 0 for block in entries[r * n_kv: r * n_kv + c]):
                return True
    return False


def _rebuilt(block_mask: Any, tables: tuple) -> Any:
    from .block_mask import DERIVED, BlockMask  # (block_mask imports the validation this serves)

    return BlockMask(tuple(block_mask.seq_lengths), *tables, *(DERIVED,) * 4, BLOCK_SIZE=block_sizes_of(block_mask),
                     mask_mod=block_mask.mask_mod)


