"""Turn a BlockMask's block tables into the work list of the CPU backend.

The CPU backend does not visit key blocks one at a time: for each query block row it groups the
listed key blocks (partial and full) into *chunks* of at most ``max_cols`` key positions, so one
batched matmul covers many blocks. Consecutive blocks stay one contiguous span, so their keys and
values are read as views without copying. Positions past the key length are cut off here, which
is all the handling ragged lengths need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...analysis.spans import intersect
from ...masks.kv_tables import block_sizes_of, kv_tables
from ..versioned_memo import VersionedMemo


@dataclass(frozen=True)
class Chunk:
    """Key positions scored together: ``spans`` are half-open ``(start, end)`` position ranges,
    concatenated in order; ``partial`` lists ``(offset, length)`` column ranges (within the chunk)
    that need the mask_mod, the rest are full blocks."""

    spans: tuple[tuple[int, int], ...]
    partial: tuple[tuple[int, int], ...]
    n_cols: int


@dataclass(frozen=True)
class Row:
    """Query rows ``[q0, q1)`` and the chunks of key positions they attend to; ``segments`` are the
    row's ``(start, end, is_partial)`` position ranges before chunking (for other chunkings)."""

    q0: int
    q1: int
    chunks: tuple[Chunk, ...]
    segments: tuple[tuple[int, int, bool], ...] = ()


def _segments(partial_blocks: list[int], full_blocks: list[int], kv_block: int, kv_len: int) -> list[tuple[int, int, bool]]:
    """Sorted ``(start, end, is_partial)`` position ranges of the listed blocks, clipped to kv_len,
    with neighbouring blocks of the same kind merged."""
    blocks = sorted([(b, True) for b in partial_blocks] + [(b, False) for b in full_blocks])
    out: list[list] = []
    for blk, is_partial in blocks:
        start, end = blk * kv_block, min((blk + 1) * kv_block, kv_len)
        if start >= end:
            continue  # a block wholly past the key length (tables built for a longer sequence)
        if out and out[-1][1] == start and out[-1][2] == is_partial:
            out[-1][1] = end
        else:
            out.append([start, end, is_partial])
    return [tuple(s) for s in out]


def _chunks(segments: Sequence[tuple[int, int, bool]], max_cols: int) -> tuple[Chunk, ...]:
    """Pack segments greedily into chunks of at most ``max_cols`` columns."""
    chunks: list[Chunk] = []
    spans: list[list[int]] = []
    partial: list[tuple[int, int]] = []
    used = 0

    def flush() -> None:
        nonlocal spans, partial, used
        if used:
            chunks.append(Chunk(tuple(tuple(s) for s in spans), tuple(partial), used))
        spans, partial, used = [], [], 0

    for start, end, is_partial in segments:
        while start < end:
            if used == max_cols:
                flush()
            take = min(end - start, max_cols - used)
            if spans and spans[-1][1] == start:
                spans[-1][1] = start + take
            else:
                spans.append([start, start + take])
            if is_partial:
                if partial and partial[-1][0] + partial[-1][1] == used:
                    partial[-1] = (partial[-1][0], partial[-1][1] + take)
                else:
                    partial.append((used, take))
            used += take
            start += take
    flush()
    return tuple(chunks)


def row_plan(tables: "Tables", bm: int, hm: int, q_len: int, kv_len: int, max_rows: int, max_cols: int) -> list[Row]:
    """The work list for BlockMask batch ``bm``, head ``hm``: one :class:`Row` per query row range."""
    q_block, kv_block = tables.block_size
    rows: list[Row] = []
    for i, n_partial in enumerate(tables.kv_num[bm][hm]):
        q_start = i * q_block
        if q_start >= q_len:
            break
        partial = tables.kv_idx[bm][hm][i][:n_partial]
        full = tables.full_idx[bm][hm][i][:tables.full_num[bm][hm][i]] if tables.full_num is not None else []
        segments = _segments(partial, full, kv_block, kv_len)
        if not segments:
            continue  # no key block listed: the rows stay fully masked
        chunks = _chunks(segments, max_cols)
        q_end = min(q_start + q_block, q_len)
        for r0 in range(q_start, q_end, max_rows):
            rows.append(Row(r0, min(r0 + max_rows, q_end), chunks, tuple(segments)))
    return rows


# Rows are cut into parts of these many query rows (largest first) when their partial blocks'
# allowed columns then shrink enough: each part is its own task, with its own calls
SUB_ROWS = (64, 32)
# columns of a trimmed partial range start and end on multiples of this
TRIM_ALIGN = 16
# partial-block elements the mask_mod is evaluated on to trim one plan; past it rows stay whole (a
# mask whose every block is partial gains little from trimming and would pay most)
TRIM_ELEMENTS = 1 << 22


def trimmed_rows(rows: Sequence[Row], allowed: Callable[[int, int, int, int], torch.Tensor], max_cols: int,
                 budget: list[int] | None = None) -> list[Row]:
    """``rows`` with their partial key ranges cut to the columns the mask allows, at the height that
    pays: ``allowed(q0, q1, start, end)`` is the ``[q1 - q0, end - start]`` boolean tile of pairs some
    head of the group allows. A narrow window's diagonal blocks (17 keys of 128 per row) are then
    scored as a band of 32-row parts and the few dozen columns each needs, not as whole blocks.
    Only columns no row of a part allows are cut, so the result is unchanged. ``budget`` (a one-item
    list, shared by a plan's calls) counts down the elements evaluated, from :data:`TRIM_ELEMENTS`."""
    budget = [TRIM_ELEMENTS] if budget is None else budget
    out: list[Row] = []
    for row in rows:
        partial = [(a, b) for a, b, is_partial in row.segments if is_partial]
        size = (row.q1 - row.q0) * sum(b - a for a, b in partial)
        if not partial or size > budget[0]:
            out.append(row)
            continue
        budget[0] -= size
        tiles = [(a, b, allowed(row.q0, row.q1, a, b)) for a, b in partial]
        full = [seg for seg in row.segments if not seg[2]]
        best = None
        for height in (row.q1 - row.q0,) + tuple(h for h in SUB_ROWS if h < row.q1 - row.q0):
            parts = []
            for r0 in range(row.q0, row.q1, height):
                r1 = min(r0 + height, row.q1)
                segments = list(full)
                for a, b, tile in tiles:
                    cols = tile[r0 - row.q0:r1 - row.q0].any(0).nonzero()
                    if len(cols):
                        lo = a + int(cols[0]) // TRIM_ALIGN * TRIM_ALIGN
                        hi = min(b, a + -(-(int(cols[-1]) + 1) // TRIM_ALIGN) * TRIM_ALIGN)
                        segments.append((lo, hi, True))
                parts.append((r0, r1, tuple(sorted(segments))))
            work = sum((r1 - r0) * sum(b - a for a, b, _ in segments) for r0, r1, segments in parts)
            if best is None or work < 0.75 * best[0]:  # a lower part pays only for a clear saving
                best = (work, parts)
        out.extend(Row(r0, r1, _chunks(segments, max_cols), segments) for r0, r1, segments in best[1] if segments)
    return out


def fused_pieces(segments: tuple[tuple[int, int, bool], ...], max_masked_cols: int, mode: str) -> tuple[Chunk, ...]:
    """Key chunks for a fused attention kernel that takes an optional additive mask per call.

    Partial blocks always go into masked chunks of at most ``max_masked_cols`` columns. Full blocks:

    * ``"mask"`` (no score_mod): one unmasked chunk of any width (the kernel bounds its own
      memory); but a row that is one contiguous range at least half partial (sliding windows)
      stays one masked chunk, saving a gather and a merge;
    * ``"bias"`` (a bias applies everywhere): chunks of at most ``max_masked_cols`` columns;
    * ``"relative"`` (a bias of ``kv - q`` only, built as a strided view): one chunk per
      contiguous span, of any width.
    """
    full = [s for s in segments if not s[2]]
    partial = _chunks([s for s in segments if s[2]], max_masked_cols)
    if mode == "bias":
        return _chunks(full, max_masked_cols) + partial
    if mode == "relative":
        return tuple(Chunk(((start, end),), (), end - start) for start, end, _ in full) + partial
    n_total = sum(end - start for start, end, _ in segments)
    n_partial = sum(end - start for start, end, is_partial in segments if is_partial)
    contiguous = all(a[1] == b[0] for a, b in zip(segments, segments[1:]))
    if contiguous and 2 * n_partial >= n_total and n_total <= max_masked_cols:
        return _chunks(segments, max_masked_cols)
    return _chunks(full, max(n_total, 1)) + partial


def _subtract(a: list, b: list) -> list:
    """Spans of ``a`` not covered by ``b`` (both sorted, disjoint)."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
        if start < end:
            out.append((start, end))
    return out


def shared_full_columns(a: Row, b: Row) -> int:
    """How many key positions are full blocks for both rows."""
    full = lambda row: [(start, end) for start, end, partial in row.segments if not partial]
    return sum(end - start for start, end in intersect(full(a), full(b)))


def tree_calls(rows: Sequence[Row], max_masked_cols: int, mode: str) -> list[tuple[int, int, Chunk]]:
    """Kernel calls ``(q0, q1, chunk)`` for consecutive rows (``rows[i].q1 == rows[i + 1].q0``).

    Over a binary tree of the rows, key spans that are full for every row of a subtree are
    attended once by one tall call for all its rows (a causal mask's prefix: a few tall
    rectangles instead of a thin call per row; the kernel runs tall calls faster). Each row's
    remaining full spans and its partial blocks follow as in :func:`fused_pieces`. The calls of
    a row are merged by logsumexp, so their order does not matter.
    """
    calls: list[tuple[int, int, Chunk]] = []
    full = [[(a, b) for a, b, partial in row.segments if not partial] for row in rows]

    def visit(lo: int, hi: int, done: list) -> None:
        if hi - lo == 1:
            row = rows[lo]
            rest = [(a, b, False) for a, b in _subtract(full[lo], done)]
            segments = sorted(rest + [seg for seg in row.segments if seg[2]])
            calls.extend((row.q0, row.q1, c) for c in fused_pieces(tuple(segments), max_masked_cols, mode))
            return
        common = full[lo]
        for spans in full[lo + 1:hi]:
            common = intersect(common, spans)
        new = _subtract(common, done)
        q0, q1 = rows[lo].q0, rows[hi - 1].q1
        if mode == "relative":
            calls.extend((q0, q1, Chunk(((a, b),), (), b - a)) for a, b in new)
        elif new:
            calls.append((q0, q1, Chunk(tuple(new), (), sum(b - a for a, b in new))))
        done = sorted(done + new)
        mid = (lo + hi) // 2
        visit(lo, mid, done)
        visit(mid, hi, done)

    visit(0, len(rows), [])
    return calls


@dataclass(frozen=True)
class Tables:
    """A BlockMask's kv tables as Python lists (they are small: one entry per block)."""

    kv_num: list
    kv_idx: list
    full_num: list | None
    full_idx: list | None
    block_size: tuple[int, int]
    batch: int
    heads: int


def read_tables(block_mask: Any, q_len: int, kv_len: int) -> Tables:
    """Read the kv tables of a flexc or torch BlockMask; ``None`` gives one all-full block."""
    if block_mask is None:
        return Tables([[[0]]], [[[[]]]], [[[1]]], [[[[0]]]], (max(q_len, 1), max(kv_len, 1)), 1, 1)
    kv_num, kv_idx, full_num, full_idx = kv_tables(block_mask)
    return Tables(
        kv_num.tolist(), kv_idx.tolist(),
        full_num.tolist() if full_num is not None else None,
        full_idx.tolist() if full_idx is not None else None,
        block_sizes_of(block_mask), kv_num.shape[0], kv_num.shape[1],
    )


def _listed(tables: Tables, bm: int, hm: int) -> list:
    """Every block row's listed partial and full key blocks for table entry ``(bm, hm)``, sorted."""
    rows = []
    for i, n in enumerate(tables.kv_num[bm][hm]):
        full = tables.full_idx[bm][hm][i][:tables.full_num[bm][hm][i]] if tables.full_num is not None else []
        rows.append((sorted(tables.kv_idx[bm][hm][i][:n]), sorted(full)))
    return rows


def merged_tables(tables: Tables) -> Tables:
    """``tables`` with its heads (and batches) folded into one entry when every head (batch) lists the
    same blocks: a mask built per head whose blocks do not differ by head (causal with ``H`` given,
    or a per-head window inside the same blocks) then runs as one group of all heads, whose calls
    are as many as one head's, not one set per head. The mask_mod still sees every head's index."""
    heads = tables.heads > 1 and all(_listed(tables, bm, hm) == _listed(tables, bm, 0)
                                     for bm in range(tables.batch) for hm in range(1, tables.heads))
    if heads:
        pick = lambda t: [row[:1] for row in t] if t is not None else None
        tables = Tables(pick(tables.kv_num), pick(tables.kv_idx), pick(tables.full_num), pick(tables.full_idx),
                        tables.block_size, tables.batch, 1)
    batches = tables.batch > 1 and all(_listed(tables, bm, hm) == _listed(tables, 0, hm)
                                       for bm in range(1, tables.batch) for hm in range(tables.heads))
    if batches:
        pick = lambda t: t[:1] if t is not None else None
        tables = Tables(pick(tables.kv_num), pick(tables.kv_idx), pick(tables.full_num), pick(tables.full_idx),
                        tables.block_size, 1, tables.heads)
    return tables


def all_full(tables: Tables, q_len: int, kv_len: int) -> bool:
    """Whether every block row of every entry lists every key block as full: the mask_mod is never
    read, and the call is attention with no mask (``noop``, ``kv_idx >= 0``)."""
    q_block, kv_block = tables.block_size
    n_rows, n_cols = -(-q_len // q_block), -(-kv_len // kv_block)
    for bm in range(tables.batch):
        for hm in range(tables.heads):
            listed = _listed(tables, bm, hm)
            if len(listed) < n_rows or any(partial or full[:n_cols] != list(range(n_cols))
                                           for partial, full in listed[:n_rows]):
                return False
    return True


def chunk_kv_index(chunk: Chunk, positions: torch.Tensor) -> torch.Tensor:
    """The key positions of ``chunk`` as a 1-D tensor (a view of ``positions`` when contiguous)."""
    if len(chunk.spans) == 1:
        start, end = chunk.spans[0]
        return positions[start:end]
    return torch.cat([positions[start:end] for start, end in chunk.spans])


def chunk_rows(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """Rows of ``t`` (dim -2) at the chunk's key positions: a view when contiguous, else a copy."""
    if len(chunk.spans) == 1:
        start, end = chunk.spans[0]
        return t[..., start:end, :]
    return torch.cat([t[..., start:end, :] for start, end in chunk.spans], dim=-2)


def add_chunk_rows(t: torch.Tensor, chunk: Chunk, update: torch.Tensor, sum_batch: bool = False) -> None:
    """``t[..., chunk's key positions, :] += update`` (the inverse of :func:`chunk_rows`); with
    ``sum_batch``, ``update`` is first summed over dim 0 (rows whose batch ``t`` broadcasts)."""
    if sum_batch:
        update = update.sum(0, keepdim=True)
    off = 0
    for start, end in chunk.spans:
        t[..., start:end, :] += update[..., off:off + end - start, :]
        off += end - start


# plans of the most recently used (block mask, call shape) pairs: a training step plans its
# forward and its backward alike, and a model's layers share one block mask
_PLANS = VersionedMemo(32)


def memo_by_tables(block_mask: Any, key: tuple, build: Callable[[], Any], tensors: Sequence = (),
                   unversioned: Callable[[], Any] | None = None) -> Any:
    """``build()``, remembered for ``block_mask``'s block tables (as these very tensors, unmodified
    since), the ``tensors`` it also reads (a mask_mod's captured tensors) and ``key``
    (:class:`flexc.backends.versioned_memo.VersionedMemo`). Tables or tensors without a version
    counter (made under inference mode) cannot be remembered: then ``unversioned()`` (default
    ``build()``) answers, for a caller whose work only pays when remembered."""
    tables = [t for t in (*(kv_tables(block_mask) if block_mask is not None else ()), *tensors)
              if isinstance(t, torch.Tensor)]
    return _PLANS.get(tables, key, build, unversioned)
