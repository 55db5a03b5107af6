"""Rows of ordered block tables (each row's valid entries ascending columns, as create_block_mask and
torch write them): found ordered, searched and compared without a dense tile grid."""
from __future__ import annotations

import torch

# rows of an ordered table checked per chunk of about this many entries (the temporaries stay in cache)
_CHUNK_ENTRIES = 1 << 19
_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def ascending_rows(num: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One table pair (``num [..., nQ]``, ``idx [..., nQ, W]``) as ``(entries [rows, n], counts
    [rows])``: a row per leading index and query block, ``n`` the longest count, counts clamped to
    ``[0, W]`` as :func:`~flexc.analysis.tiles.ordered_to_dense` reads them. ``entries`` is a view of ``idx``
    where it can be; only the first ``n`` entries of a row are read (a sliding window at a million
    tokens: a few of 8192).

    None unless every row's valid entries are distinct columns of ``[0, W)`` in ascending order, as
    create_block_mask, dense_to_ordered and torch write them.
    """
    if num.shape != idx.shape[:-1] or num.dtype not in _INDEX_DTYPES or idx.dtype not in _INDEX_DTYPES:
        return None
    width, rows = idx.shape[-1], num.numel()
    counts = num.reshape(rows).to(torch.int64).clamp(0, width)
    n = int(counts.max()) if rows else 0
    entries = idx[..., :n].reshape(rows, n)
    if n == 0:
        return entries, counts
    # ascending, so in range when the first entry is not negative and the last below W
    first, last = entries[:, 0], entries.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    if bool(((counts > 0) & ((first < 0) | (last >= width))).any()):
        return None
    step = max(1, _CHUNK_ENTRIES // n)
    for r0 in range(0, rows if n > 1 else 0, step):
        chunk = entries[r0:r0 + step]
        descent = chunk[:, 1:] <= chunk[:, :-1]
        # the first descent in each row must lie past the row's valid entries
        at = descent.view(torch.uint8).argmax(1)
        if bool((descent.gather(1, at[:, None])[:, 0] & (at < counts[r0:r0 + step] - 1)).any()):
            return None
    return entries, counts


def lower_bound(entries: torch.Tensor, counts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows, m]``: per row, how many of its valid entries (the first ``counts``, ascending)
    are below each of ``values`` (``[rows, m]`` or ``[m]``); a binary search of all rows at once."""
    rows, n = entries.shape
    shape = (rows, values.shape[-1])
    lo = torch.zeros(shape, dtype=torch.int64, device=entries.device)
    hi = counts[:, None].expand(shape).clone()
    for _ in range(n.bit_length()):  # each step at least halves every row's interval
        mid = (lo + hi) >> 1
        active = lo < hi
        below = entries.gather(1, mid.clamp(max=n - 1)) < values
        lo = torch.where(active & below, mid + 1, lo)
        hi = torch.where(active & ~below, mid, hi)
    return lo


def disjoint(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], width: int) -> bool:
    """Whether no row of two ordered tables (``(entries, counts)``, :func:`ascending_rows`) holds
    one column in both."""
    (a, a_counts), (b, b_counts) = a, b
    if a.shape[1] == 0 or b.shape[1] == 0:
        return True
    if a.shape[1] > b.shape[1]:
        (a, a_counts), (b, b_counts) = (b, b_counts), (a, a_counts)
    a_valid = torch.arange(a.shape[1], device=a.device) < a_counts[:, None]
    if a.shape[1] * b.shape[1].bit_length() * 4 <= width:
        # few entries against many columns: search the narrower table's entries in the wider one
        at = lower_bound(b, b_counts, a)
        found = (at < b_counts[:, None]) & (b.gather(1, at.clamp(max=b.shape[1] - 1)) == a)
        return not bool((found & a_valid).any())
    # both wide: mark one table's columns a chunk of rows at a time and look the other's up
    b_valid = torch.arange(b.shape[1], device=b.device) < b_counts[:, None]
    step = max(1, _CHUNK_ENTRIES // (width + 1))
    for r0 in range(0, a.shape[0], step):
        rows = slice(r0, r0 + step)
        marks = torch.zeros(a[rows].shape[0], width + 1, dtype=torch.uint8, device=a.device)
        marks.scatter_(1, torch.where(a_valid[rows], a[rows].long(), width), 1)
        marked = marks.gather(1, torch.where(b_valid[rows], b[rows].long(), width)).bool()
        if bool((marked & b_valid[rows]).any()):
            return False
    return True
