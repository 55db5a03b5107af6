"""The CPU forward for short queries (decoding with a KV cache): a few batched ops, no row loop.

With at most :data:`MAX_ROWS` query rows the cost of a call is its Python and dispatch overhead,
not arithmetic, so this path trades the row machinery of :mod:`flexc.backends.cpu.torch_cpu` for a
handful of whole-tensor operations over every batch and head at once:

1. the key blocks any ``(batch, head, query block)`` lists (partial or full) form one sorted set;
   their key rows are a slice of the cache when the set is contiguous (causal, sliding windows),
   else one ``index_select``;
2. GQA-packed scores: the ``G`` query heads of a key head are stacked as rows, so
   ``q [B, Hkv, G*L, E] @ k^T [Bkv, Hkv, E, n]`` reads each key row once for its whole group;
3. the score_mod, then ``allowed = full tile | (partial tile & mask_mod)`` (the mask_mod is
   evaluated over the gathered positions; full tiles ignore it, as the kernels do), each tile
   looked up per element from the BlockMask's kv tables;
4. a base-2 softmax, ``P @ V`` with the same head packing, and the logsumexp. A query row that
   allows no key gets output 0 and logsumexp ``-inf``.

Without a score_mod, in fp32/fp64 with equal head dims, and a mask_mod that reads only ``q_idx``
and ``kv_idx`` on a one-row plan, steps 2-4 are one call of torch's fused CPU flash kernel
(what SDPA runs; :mod:`flexc.backends.cpu.fused_cpu`) over the key slice, with the mask_mod's verdict
on the partial-block columns as an additive 0/-inf mask: keys and values are read once. For one
query row and a mask of affine comparisons those verdicts come from :mod:`flexc.analysis.row_intervals`
(the allowed keys as intervals, no element evaluated), else from a numpy evaluation.

:func:`applies` decides when this path is used: short queries whose scores fit a modest budget.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from ... import device as gpu
from ...device import is_gpu, is_plain_cpu
from ...constants import DECODE_MAX_ROWS as MAX_ROWS, LN2, LOG2E
from ...dtypes import work_dtype
from ...mods import ir
from ...mods.evaluate import evaluate
from ...mods.evaluate_numpy import evaluate_small
from ...analysis.row_intervals import allowed_intervals
from ...analysis.spans import intersect
from ...masks.kv_tables import block_sizes_of, kv_tables
from ...masks.table_lists import contents_of, row_blocks
from ...analysis.tiles import ordered_to_dense
from ...mods.trace import TracedMod
from ...mods.lifted_cells import structure
from . import fused_cpu
from .row_mods import is_true
from ..nonfinite import all_finite, matmul_skipping_zeros

# Scores [B, Hq, L, n] above this many elements go to the row path (bounded working memory).
MAX_SCORES = 1 << 24
_NEG_INF = float("-inf")
_NAN = float("nan")
_ALLOWED, _BLOCKED = b"\x01", b"\x00"  # a bool verdict's byte


def applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """True for at most :data:`MAX_ROWS` query rows whose full score matrix stays under :data:`MAX_SCORES`."""
    B, Hq, L, _ = query.shape
    _, Hkv, S, _ = key.shape
    # no key heads (H == 0): the row path returns the empty output (the GQA group would divide by 0)
    return 0 < L <= MAX_ROWS and B * Hq * L * S <= MAX_SCORES and S > 0 and Hkv > 0


def _reads(mod: TracedMod) -> frozenset[str]:
    """The mod arguments the graph reads (by the template graph of a lifted trace; cached by graph)."""
    return ir.inputs_read(structure(mod)[0])


_MAX_SPANS = 4  # more partial spans than this: the mask_mod is evaluated over every position at once


def _index_tensor(shape: tuple, device: torch.device) -> torch.Tensor:
    """``arange`` laid along the one non-1 dim of ``shape`` (b, h or q_idx); never written to. Made once
    per stream (:func:`flexc.device.stream_token`: a device tensor is read only on the stream that made it)."""
    stream = gpu.stream_token(device)
    if not gpu.keeps(stream):  # (being captured into a CUDA graph: made, not kept)
        return torch.arange(max(shape), device=device).view(shape)
    return _index_tensor_on(shape, device, stream)


@functools.lru_cache(maxsize=64)
def _index_tensor_on(shape: tuple, device: torch.device, stream) -> torch.Tensor:
    return torch.arange(max(shape), device=device).view(shape)


@functools.lru_cache(maxsize=64)
def _index_array(shape: tuple) -> np.ndarray | np.int64:
    """:func:`_index_tensor` for numpy evaluation (read-only); a one-element index (``q_idx`` of one
    query row, ``b`` of batch 1) as an int64 scalar, which promotes and wraps as the array would
    but costs a fraction of an array operation."""
    if max(shape) == 1:
        return np.int64(0)
    array = np.arange(max(shape), dtype=np.int64).reshape(shape)
    array.flags.writeable = False
    return array


class _RowPlan(NamedTuple):
    """The key range of a one-row decoding mask, reused while its table row is unchanged.

    ``positions``: the key positions of the listed blocks (sorted); ``start``: their first one when
    they are contiguous (the cache rows are then a slice), else None; ``spans``: ``(offset, length)``
    runs of partial-block columns, the only ones the mask_mod is evaluated on (as in the kernels);
    ``span_kv``: ``kv_idx`` for one mask_mod evaluation covering the spans (their positions side
    by side). Never written to.
    """

    positions: torch.Tensor | None
    start: int | None
    spans: tuple
    span_kv: torch.Tensor | None
    span_kv_array: np.ndarray | None  # the same for numpy evaluation
    span_starts: tuple | None  # kv_idx of each span's first column when every span is a kv range


_NOTHING_LISTED = _RowPlan(None, None, (), None, None, None)
# (cached too) a row the general plan serves: more partial runs than _MAX_SPANS; told apart by identity
_TOO_MANY_SPANS = _RowPlan(None, None, (), None, None, None)
# (table contents, block sizes, L, S, device) -> _RowPlan: the tables of a decoding step's sliced
# mask repeat for every token of a query-block row
_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 64
_last_plan: list = [None, None, None]  # (row lists, shape key, plan) of the last lookup


def _first_row_blocks(block_mask: Any) -> tuple[tuple, list, list] | tuple[None, list, list]:
    """``(content key or None, partial blocks, full blocks)`` of the tables' first row."""
    contents = contents_of(block_mask)
    if contents is not None:
        return contents, *row_blocks(contents, 0)
    tables = kv_tables(block_mask)
    rows = []
    for counts, indices in (tables[:2], tables[2:]):
        rows.append(indices.view(-1)[:int(counts.view(-1)[0])].tolist() if counts is not None else [])
    return None, *rows


def _one_row_plan(block_mask: Any, L: int, S: int, device: torch.device) -> _RowPlan | None:
    """The plan for the usual decoding mask: every batch and head share one table row (a
    broadcast mask sliced to one block row). :data:`_NOTHING_LISTED` when no block is listed; None
    when the mask has several rows or too many partial runs (the general plan then serves it)."""
    q_block, kv_block = block_sizes_of(block_mask)
    rows = getattr(block_mask, "lazy_rows", None)
    batch_heads = rows.num_shape[:2] if rows is not None else tuple(block_mask.kv_num_blocks.shape[:2])
    if batch_heads != (1, 1) or L > q_block:
        return None
    shape = (q_block, kv_block, L, S, device)
    if rows is not None and rows is _last_plan[0] and shape == _last_plan[1]:  # the same row lists: no hashing
        plan = _last_plan[2]
    else:
        contents, partial, full = _first_row_blocks(block_mask)
        key = (contents, *shape) if contents is not None else None
        plan = _PLANS.get(key) if key is not None else None
        if plan is None:
            plan = _plan_row(partial, full, kv_block, S, device)
            if key is not None:
                _PLANS[key] = plan
                while len(_PLANS) > _MAX_PLANS:
                    _PLANS.popitem(last=False)
        if contents is not None:
            _last_plan[:] = [contents, shape, plan]  # (kept: its id stays unique while remembered)
    return plan if plan is not _TOO_MANY_SPANS else None


def _plan_row(partial: list, full: list, kv_block: int, S: int, device: torch.device) -> _RowPlan:
    n_blocks = -(-S // kv_block)
    classes: dict[int, bool] = {}  # block -> is partial
    for blocks, is_partial in ((partial, True), (full, False)):
        for block in blocks:
            if block < n_blocks:
                classes[block] = classes.get(block, False) or is_partial
    if not classes:
        return _NOTHING_LISTED
    blocks = sorted(classes)
    partial_blocks: list[tuple[int, int]] = []  # (offset, length) of each partial block
    runs: list[tuple[int, int]] = []  # the same merged into runs of adjacent blocks
    offset = 0
    for block in blocks:
        length = min(kv_block, S - block * kv_block)
        if classes[block]:
            partial_blocks.append((offset, length))
            if runs and runs[-1][0] + runs[-1][1] == offset:  # extends the previous run
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((offset, length))
        offset += length
    if len(runs) > _MAX_SPANS:
        return _TOO_MANY_SPANS
    # block by block when few: each is then found entirely allowed or blocked for the rows on its own
    spans = partial_blocks if len(partial_blocks) <= _MAX_SPANS else runs
    if blocks[-1] - blocks[0] + 1 == len(blocks):
        start = blocks[0] * kv_block
        positions = torch.arange(start, start + offset, device=device)
    else:
        start = None
        block_t = torch.tensor(blocks, device=device)
        positions = (block_t[:, None] * kv_block + torch.arange(kv_block, device=device)).flatten()
        positions = positions[positions < S]
    # the spans' key positions side by side: one mask_mod evaluation covers them all
    span_kv = torch.cat([positions[o:o + n] for o, n in spans]).view(1, 1, 1, -1) if spans else None
    span_kv_array = span_kv.numpy().copy() if spans and device.type == "cpu" else None
    if span_kv_array is not None:
        span_kv_array.flags.writeable = False
    firsts = [(int(positions[o]), int(positions[o + n - 1])) for o, n in spans]
    span_starts = (tuple(first for first, _ in firsts)
                   if all(last - first == n - 1 for (first, last), (_, n) in zip(firsts, spans)) else None)
    return _RowPlan(positions, start, tuple(spans), span_kv, span_kv_array, span_starts)


def _visited_positions(block_mask: Any, L: int, S: int, device: torch.device):
    """``(positions, start, partial, full)``: sorted key positions of every listed block, the
    start when they form one contiguous range (else None), and per-element tile lookups
    ``partial``/``full`` (bool ``[Bm, Hm, L, n]``, ``full`` None without full tables)."""
    q_block, kv_block = block_sizes_of(block_mask)
    n_cols = block_mask.kv_indices.shape[-1]
    q_rows = torch.arange(L, device=device) // q_block
    # tile occupancy of the query blocks these rows fall in: [Bm, Hm, L, nKV]
    partial = ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, n_cols).bool()[:, :, q_rows]
    full = None
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        full = ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_cols).bool()[:, :, q_rows]
    visited = partial if full is None else partial | full
    listed = visited.flatten(0, -2).any(0)[: -(-S // kv_block)]
    blocks = listed.nonzero().flatten()
    if blocks.numel() == 0:
        return None, None, None, None
    lo, hi = int(blocks[0]), int(blocks[-1])
    if hi - lo + 1 == blocks.numel():  # one contiguous range: the cache rows are a view
        start, end = lo * kv_block, min((hi + 1) * kv_block, S)
        positions = torch.arange(start, end, device=device)
    else:
        start = None
        positions = (blocks[:, None] * kv_block + torch.arange(kv_block, device=device)).flatten()
        positions = positions[positions < S]
    cols = positions // kv_block
    return positions, start, partial[..., cols], (full[..., cols] if full is not None else None)


def _masked_columns_on_device(mask_mod: TracedMod, plan: _RowPlan, index: dict, n: int) -> tuple[list, int, int]:
    """:func:`_masked_columns` for a GPU's tensors: every partial span masked on the device and no
    column range narrowed (deciding which spans block a pair would read the verdicts on the host, a
    sync and copies both ways on every call)."""
    allowed = evaluate(mask_mod, **{k: (plan.span_kv if k == "kv_idx" else index[k]) for k in _reads(mask_mod)})
    blocked = ~torch.as_tensor(allowed).to(torch.bool)
    width = plan.span_kv.shape[-1]
    if blocked.shape[-1] != width:  # a mask_mod that ignores kv_idx gives one verdict column
        blocked = blocked.expand(*blocked.shape[:-1], width)
    masked, column = [], 0
    for offset, length in plan.spans:
        masked.append((offset, length, blocked[..., column:column + length]))
        column += length
    return masked, 0, n


def _masked_columns(mask_mod: TracedMod, plan: _RowPlan, index: dict, n: int) -> tuple[list, int, int]:
    """``(masked, lo, hi)``: ``(offset, length, blocked)`` of the partial spans of ``plan`` whose
    mask_mod verdicts block some pair (``blocked`` a bool tensor over the span's columns, offsets
    from ``lo``), and the column range ``[lo, hi)`` still worth reading.

    One mask_mod evaluation covers every span; its verdicts are then read as a numpy array (a few
    element checks per span instead of a tensor reduction each). A partial block is partial for its
    whole query-block row, but the few rows of a decoding call often see it entirely allowed (the
    diagonal block of a causal mask at the block's last row: no mask needed) or entirely blocked
    (the block a sliding window just left: its keys need not be read at all, when it lies at either
    end of the range). One query row whose verdicts do not depend on the batch or head also has its
    ends narrowed to the allowed keys when a span at an end is blocked up to (or from) some column:
    the causal diagonal and a sliding window's trailing edge then need no mask at all.
    """
    if is_gpu(plan.span_kv.device):
        return _masked_columns_on_device(mask_mod, plan, index, n)
    verdicts = None
    if plan.span_kv_array is not None:  # (None: a mask on another device)
        verdicts = evaluate_small(mask_mod, {k: (plan.span_kv_array if k == "kv_idx" else _index_array(index[k].shape))
                                             for k in _reads(mask_mod)})
    if verdicts is None:
        allowed = evaluate(mask_mod, clamp_lookups=True,
                           **{k: (plan.span_kv if k == "kv_idx" else index[k]) for k in _reads(mask_mod)})
        verdicts = allowed.cpu().numpy()  # (the tables of a mask on a GPU: a few hundred verdicts)
    if verdicts.dtype != np.bool_:
        verdicts = verdicts != 0
    width = plan.span_kv.shape[-1]
    if verdicts.shape[-1] != width:  # a mask_mod that ignores kv_idx gives one verdict column
        verdicts = np.repeat(verdicts, width, axis=-1)
    # one row (verdicts alike for every batch and head): its verdicts as bytes, 1 = allowed, which
    # Python searches faster than numpy reduces a few hundred elements
    row = verdicts.tobytes() if verdicts.size == width else None
    masked, column = [], 0  # (offset, length, allowed runs, verdict column) of spans blocking some pair
    for offset, length in plan.spans:
        if row is not None:
            if _BLOCKED in row[column:column + length]:
                masked.append((offset, length, _allowed_runs(row, column, length), column))
        else:  # (over broadcast dims too: none allowed means blocked for every row)
            span = verdicts[..., column:column + length]
            if not span.all():
                masked.append((offset, length, None if span.any() else [], column))
        column += length
    masked, lo, hi = _narrowed(masked, n)
    device = plan.span_kv.device
    return [(offset - lo, length, torch.from_numpy(~verdicts[..., column:column + length]).to(device))
            for offset, length, _, column in masked], lo, hi


def _allowed_runs(row: bytes, column: int, length: int) -> list:
    """The runs of allowed columns in ``row[column:column + length]`` (verdict bytes), as
    ``(start, end)`` offsets within the span."""
    runs, at, end = [], column, column + length
    while (start := row.find(_ALLOWED, at, end)) >= 0:
        at = row.find(_BLOCKED, start, end)
        at = end if at < 0 else at
        runs.append((start - column, at - column))
    return runs


def _narrowed(masked: list, n: int) -> tuple[list, int, int]:
    """``(the spans still masked, lo, hi)``: the columns ``[lo, hi)`` of ``[0, n)`` worth reading.

    ``masked`` holds ``(offset, length, runs, ...)`` for the partial spans that block some key,
    ``runs`` their allowed ``(start, end)`` columns within the span (None when rows differ). A span
    at either end of the range that allows nothing is dropped from the range; one whose allowed
    columns are one run reaching its inner edge moves that end of the range to the run and needs
    no mask (the causal diagonal, a sliding window's trailing edge)."""
    lo, hi = 0, n
    while masked and masked[0][0] == lo:  # a leading span blocked entirely, or up to some column
        offset, length, runs = masked[0][:3]
        if runs is None or len(runs) > 1 or runs and runs[0][1] != length:
            break
        lo = offset + (runs[0][0] if runs else length)
        masked.pop(0)
    while masked and masked[-1][0] + masked[-1][1] == hi:  # a trailing span blocked entirely, or from some column
        offset, length, runs = masked[-1][:3]
        if runs is None or len(runs) > 1 or runs and runs[0][0] != 0:
            break
        hi = offset + (runs[0][1] if runs else 0)
        masked.pop()
    return masked, lo, hi


@functools.lru_cache(maxsize=256)
def _reads_only_row_inputs(root) -> bool:
    """Whether the graph reads no index but ``q_idx`` and ``kv_idx`` (its verdicts are alike for every batch and head)."""
    return ir.inputs_read(root) <= {"q_idx", "kv_idx"}


def _masked_by_intervals(allowed: tuple, plan: _RowPlan, n: int) -> tuple[list, int, int]:
    """:func:`_masked_columns` for one query row whose allowed ``kv_idx`` are the intervals
    ``allowed`` (:func:`flexc.analysis.row_intervals.allowed_intervals`) and whose spans are kv ranges:
    each span's allowed columns are its overlaps with them, no element evaluated."""
    masked = []  # (offset, length, the span's allowed (start, end) columns) of spans blocking some key
    for (offset, length), first in zip(plan.spans, plan.span_starts):
        inside, covered = [], 0
        for lo, hi in intersect(allowed, ((first, first + length),)):
            inside.append((lo - first, hi - first))
            covered += hi - lo
        if covered < length:
            masked.append((offset, length, inside))
    masked, lo, hi = _narrowed(masked, n)
    out = []
    for offset, length, inside in masked:
        blocked = torch.ones(length, dtype=torch.bool, device=plan.positions.device)
        for start, end in inside:
            blocked[start:end] = False
        out.append((offset - lo, length, blocked))
    return out, lo, hi


def _finite_columns(masked: list, *tensors: torch.Tensor) -> bool:
    """Whether the masked columns (dim 2) of ``tensors`` are finite: an additive -inf mask (and
    ``0 * value`` for a masked key) turns NaN or inf there into NaN; elsewhere they are allowed
    and propagate, as in torch."""
    return all(all_finite(*(t[:, :, o:o + n] for t in tensors)) for o, n, _ in masked)


def flash(query: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, masked: list, scale: float,
          need_lse: bool = True):
    """``(out, lse)`` from one fused-kernel call: GQA query heads stacked as rows, the masked
    columns' verdicts (a mask_mod reading only q_idx/kv_idx) as an additive mask. With no masked
    columns, any query length: unmasked attention is exactly this one call. ``need_lse=False``
    returns the kernel's logsumexp without its fix-ups (dead rows, +inf scores): a call that
    discards it saves them."""
    B, Hq, L, E = query.shape
    Hkv, n = k_sel.shape[1], k_sel.shape[2]
    G = Hq // Hkv
    if query.stride()[-1] != 1 or k_sel.stride()[-1] != 1 or v_sel.stride()[-1] != 1:
        query, k_sel, v_sel = (fused_cpu.unit_last_stride(t) for t in (query, k_sel, v_sel))
    if k_sel.shape[0] != B:  # one key batch for every query batch: the kernel takes a stride-0 view
        k_sel, v_sel = k_sel.expand(B, *k_sel.shape[1:]), v_sel.expand(B, *v_sel.shape[1:])
    mask = None
    if masked:
        mask = torch.zeros(1, 1, L, n, dtype=query.dtype, device=query.device)
        for offset, length, blocked in masked:
            mask[..., offset:offset + length].masked_fill_(blocked, _NEG_INF)
        mask = fused_cpu.stack_heads(mask, G)
    o, lse = fused_cpu.FLASH(query.reshape(B, Hkv, G * L, E) if G > 1 else query, k_sel, v_sel, attn_mask=mask,
                              scale=scale)
    if need_lse:
        if masked and sum(length for _, length, _ in masked) == n:  # no allowed block: rows may be dead
            fused_cpu.fix_dead_rows(lse, mask)
        lse = lse.nan_to_num_(nan=_NAN, posinf=_NAN, neginf=_NEG_INF)  # a +inf score: NaN, as on the other paths
    if G > 1:
        o, lse = o.reshape(B, Hq, L, v_sel.shape[-1]), lse.reshape(B, Hq, L)
    return o.contiguous(), lse


# Short queries reading at least this many key elements (8 MiB in fp32): two batched products
# beat the fused kernel, whose key-blocked pass slows down once keys and values no longer fit the
# cache (D=64, one thread, one row per key head: 0.75-0.85x its time at H=8 and 4096 keys, 0.78x
# at 8192, 1.06x at 2048; four GQA rows per key head: about 0.7x at 4096, 1.7x at 1024)
PRODUCTS_MIN_KEY_ELEMENTS = 1 << 21


def _products_pay(query: torch.Tensor, k_sel: torch.Tensor, masked: list) -> bool:
    """Whether :func:`two_products` serves this call: large key slices whose batch and heads fold
    into one matmul batch without a copy, and some key allowed by the masked columns' spans."""
    B = query.shape[0]
    return (k_sel.numel() >= PRODUCTS_MIN_KEY_ELEMENTS and k_sel.shape[0] == B
            and (B == 1 or k_sel.stride(0) == k_sel.shape[1] * k_sel.stride(1))
            and sum(length for _, length, _ in masked) < k_sel.shape[2])


def two_products(query: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, masked: list, scale: float,
                 need_lse: bool = True):
    """:func:`flash` as two batched products: ``K @ q^T`` (the GQA query heads of a key head and
    the query rows stacked as ``R`` columns), a softmax with the masked columns at -inf, and
    ``P @ V``. The caller guarantees what :func:`flash` needs (finite masked keys and values) and
    some column outside the masked spans (allowed for every row: no fully masked row, so the
    softmax and logsumexp need no special case)."""
    B, Hq, L, E = query.shape
    Hkv, n, Ev = k_sel.shape[1], k_sel.shape[2], v_sel.shape[3]
    R = Hq // Hkv * L
    q = query.reshape(B * Hkv, R, E) * scale
    # K @ q^T reads the keys as stored, row by row (q @ K^T is several times slower for R > 1);
    # its [n, R] result is laid out again as R rows of scores
    s = torch.bmm(k_sel.reshape(B * Hkv, n, E), q.transpose(1, 2)).transpose(1, 2).contiguous()
    if masked:  # (rows of a key head are its query heads' rows: s is [B, Hq, L, n] too)
        s4 = s.view(B, Hq, L, n)
        for offset, length, blocked in masked:
            s4[..., offset:offset + length].masked_fill_(blocked, _NEG_INF)
    lse = None
    if need_lse:  # a +inf score gives NaN, as on the other paths (not logsumexp's +inf)
        lse = torch.logsumexp(s, -1).view(B, Hq, L).nan_to_num_(nan=_NAN, posinf=_NAN, neginf=_NEG_INF)
    out = torch.bmm(s.softmax(-1), v_sel.reshape(B * Hkv, n, Ev)).view(B, Hq, L, Ev)
    return out, lse


# allowed intervals kept per prepared step (a decoding row's 128 positions: 128 of them)
_MAX_COLUMNS = 512


class _Columns(NamedTuple):
    """What a one-row step reads for one set of allowed ``kv_idx`` intervals: the masked spans
    (:func:`_masked_by_intervals`), the key slice ``[start, start + n)`` (``start`` None: the
    positions ``read``, gathered; ``n`` 0: nothing allowed), and the computation (:func:`flash`
    or :func:`two_products`; None for the fused kernel called straight). Never written to."""

    masked: list
    start: int | None
    n: int
    read: torch.Tensor | None
    run: Callable | None


def prepare_one_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, scale: float, need_lse: bool, general: Callable,
                    finish: Callable) -> Callable | None:
    """For the decoding calls of one signature whose BlockMask has one table row (a decoding step's
    slice; the caller vouches that every call brings that row: a signature keys its lists or its
    tables' states), the function ``(query, key, value, block_mask, sinks) -> (out, lse or None)``
    of :func:`forward`'s fused-kernel path, decided once: the row's key range
    (:func:`_one_row_plan`), whether the kernel serves the call, and how it is called. A call then
    reads only what its values decide: the mask_mod's allowed keys for its captured values (one
    query row of affine comparisons, :func:`flexc.analysis.row_intervals.allowed_intervals`), the
    slice and spans they give (remembered by those intervals: a pure function of them), and the
    finiteness of the masked columns. A call that leaves the path (values the intervals do not
    describe, a non-finite masked column) runs ``general`` (the same arguments and dropout None);
    the path's ``(out, lse, sinks, need_lse)`` go through ``finish`` unless nothing is left to do.
    None for signatures the path does not serve."""
    B, Hq, L, E = query.shape
    Bkv, Hkv, S, Ev = value.shape
    if (score_mod is not None or block_mask is None or fused_cpu.FLASH is None or not is_plain_cpu(query.device)
            or query.dtype not in (torch.float32, torch.float64) or E != Ev):
        return None
    plan = _one_row_plan(block_mask, L, S, query.device)
    if plan is None or plan.positions is None:
        return None
    spans = plan.spans if not is_true(mask_mod) else ()
    if spans and not (L == 1 and plan.span_starts is not None and _reads_only_row_inputs(structure(mask_mod)[0])):
        return None  # (verdicts evaluated per element: forward's general steps)
    # no logsumexp, one query head per key head, layouts the kernel reads as they are: the output is
    # the kernel's first result (what flash does then, without its checks)
    plain = (not need_lse and Hq == Hkv and B == Bkv
             and query.stride(3) == key.stride(3) == value.stride(3) == 1)
    columns: dict = {}  # allowed intervals -> _Columns
    # the inputs' layouts, which the signature fixes (no tensor of a call kept alive by its plan)
    query, key = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (query, key))

    def found(intervals: tuple) -> _Columns:
        listed = plan.positions.numel()
        masked, lo, hi = _masked_by_intervals(intervals, plan, listed) if spans else ([], 0, listed)
        if lo >= hi:
            return _Columns([], None, 0, None, None)
        start = plan.start + lo if plan.start is not None else None
        read = plan.positions[lo:hi] if start is None else None
        k_sel = (key.narrow(2, start, hi - lo) if start is not None  # (index_select's gather: contiguous)
                 else key.new_empty((*key.shape[:2], hi - lo, key.shape[3])))
        run = two_products if _products_pay(query, k_sel, masked) else flash
        return _Columns(masked, start, hi - lo, read, None if plain and not masked and run is flash else run)

    def step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
             sinks: torch.Tensor | None):
        intervals = allowed_intervals(mask_mod, 0, S) if spans else ()
        if intervals is None:
            return general(query, key, value, block_mask, None, sinks)
        chosen = columns.get(intervals)
        if chosen is None:
            if len(columns) >= _MAX_COLUMNS:
                columns.clear()
            chosen = columns[intervals] = found(intervals)
        n = chosen.n
        if not n:
            return finish(*_nothing_allowed(query, Ev, False, torch.float32)[:2], sinks, need_lse)
        if chosen.start is None:
            k_sel, v_sel = key.index_select(2, chosen.read), value.index_select(2, chosen.read)
        elif n == S:
            k_sel, v_sel = key, value
        else:
            k_sel, v_sel = key.narrow(2, chosen.start, n), value.narrow(2, chosen.start, n)
        run = chosen.run
        if run is None and sinks is None:  # (the usual step: nothing masked, no logsumexp)
            out = fused_cpu.FLASH(query, k_sel, v_sel, attn_mask=None, scale=scale)[0]
            return (out if L == 1 else out.contiguous()), None  # (one row: contiguous as it comes)
        masked = chosen.masked
        if masked and not (all_finite(query) and _finite_columns(masked, k_sel, v_sel)):
            # (an additive -inf mask turns a masked NaN into NaN: forward's NaN-safe steps)
            return general(query, key, value, block_mask, None, sinks)
        return finish(*(run or flash)(query, k_sel, v_sel, masked, scale, need_lse or sinks is not None),
                      sinks, need_lse)
    return step


def _nothing_allowed(query: torch.Tensor, Ev: int, need_max: bool, lse_dtype: torch.dtype):
    """Every query row blocked: output 0, logsumexp (and row maxima) -inf."""
    B, Hq, L, _ = query.shape
    out = torch.zeros(B, Hq, L, Ev, dtype=query.dtype, device=query.device)
    dead = torch.full((B, Hq, L), _NEG_INF, dtype=lse_dtype, device=query.device)
    return out, dead, (dead.float() if need_max else None)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
            mask_mod: TracedMod | None, block_mask: Any, scale: float, need_max: bool = False,
            lse_dtype: torch.dtype = torch.float32, need_lse: bool = True, sinks: torch.Tensor | None = None):
    """``(out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] in lse_dtype, row maxima or None)``.

    ``need_lse=False``: the caller discards the logsumexp (None or unfinished may come back).
    ``sinks`` (``[B or 1, Hq, 1]``): learned attention sinks, joined to the finished rows' softmax as
    one more part (:func:`flexc.backends.cpu.fused_cpu.fold_sink`; most rows here end in torch's fused
    kernel); the row maxima stay the scores' own.
    """
    if sinks is None:
        return _forward(query, key, value, score_mod, mask_mod, block_mask, scale, need_max, lse_dtype, need_lse)
    out, lse, row_max = _forward(query, key, value, score_mod, mask_mod, block_mask, scale, need_max, lse_dtype)
    return (*fused_cpu.fold_sink(out, lse, sinks), row_max)


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
             mask_mod: TracedMod | None, block_mask: Any, scale: float, need_max: bool = False,
             lse_dtype: torch.dtype = torch.float32, need_lse: bool = True):
    """:func:`forward` without sinks."""
    B, Hq, L, E = query.shape
    Bkv, Hkv, S, Ev = value.shape
    G = Hq // Hkv
    device = query.device
    work = work_dtype(query.dtype)
    shapes = {"b": (B, 1, 1, 1), "h": (1, Hq, 1, 1), "q_idx": (1, 1, L, 1)}

    def index(name: str) -> torch.Tensor:  # only the index tensors a mod reads are built
        if name == "kv_idx":
            return (positions[lo:hi] if positions is not None else _index_tensor((S,), device)).view(1, 1, 1, n)
        return _index_tensor(shapes[name], device)

    spans = None  # (offset, length) column runs that need the mask_mod, when known per column
    partial = full = None
    if block_mask is None:  # every key (kv_idx built only if a mod reads it)
        positions, start, n = None, 0, S
    else:
        plan = _one_row_plan(block_mask, L, S, device)
        if plan is not None:
            positions, start, spans = plan.positions, plan.start, plan.spans
        else:
            positions, start, partial, full = _visited_positions(block_mask, L, S, device)
        if positions is None:  # no key block listed anywhere
            return _nothing_allowed(query, Ev, need_max, lse_dtype)
        n = positions.numel()
    lo, hi = 0, n  # the columns of ``positions`` read (sliced only where needed: a view costs a call)
    masked = []  # (offset, length, blocked) of the columns the mask_mod blocks in part (one-row plans)
    if spans and not is_true(mask_mod):  # only partial blocks need the mask_mod; full ones need nothing
        intervals = None  # one row of a mask of affine comparisons: its allowed keys as intervals
        if L == 1 and plan.span_starts is not None and _reads_only_row_inputs(structure(mask_mod)[0]):
            intervals = allowed_intervals(mask_mod, 0, S)  # (None: the mod needs its elements evaluated)
        if intervals is not None:
            masked, lo, hi = _masked_by_intervals(intervals, plan, n)
        else:
            given = {k: index(k) for k in _reads(mask_mod) if k != "kv_idx"}
            masked, lo, hi = _masked_columns(mask_mod, plan, given, n)
        if lo >= hi:
            return _nothing_allowed(query, Ev, need_max, lse_dtype)
        if (lo, hi) != (0, n):  # blocked blocks at either end of the range are not read at all
            n = hi - lo
            start = start + lo if start is not None else None
    if (start, n) == (0, S):
        k_sel, v_sel = key, value
    elif start is not None:
        k_sel, v_sel = key.narrow(2, start, n), value.narrow(2, start, n)
    else:
        read = positions[lo:hi]
        k_sel, v_sel = key.index_select(2, read), value.index_select(2, read)
    if (score_mod is None and not need_max and fused_cpu.FLASH is not None and is_plain_cpu(query.device)
            and query.dtype in (torch.float32, torch.float64) and E == Ev
            and (block_mask is None or spans is not None)
            and (not masked or _reads(mask_mod) <= {"q_idx", "kv_idx"})
            and (not masked or (all_finite(query) and _finite_columns(masked, k_sel, v_sel)))):
        run = two_products if _products_pay(query, k_sel, masked) else flash
        out, lse = run(query, k_sel, v_sel, masked, scale, need_lse)
        return out, (lse.to(lse_dtype) if need_lse else None), None

    # scores in log2 units unless a score_mod needs natural ones: [B, Hkv, G*L, n] read as [B, Hq, L, n]
    general = score_mod is not None
    q = query.to(work) * (scale if general else scale * LOG2E)
    s = torch.matmul(q.reshape(B, Hkv, G * L, E), k_sel.to(work).transpose(-1, -2))
    s4 = s.view(B, Hq, L, n)
    if general:
        modded = evaluate(score_mod, clamp_lookups=True,
                          **{k: (s4 if k == "score" else index(k)) for k in _reads(score_mod)})
        if modded is not s4:
            s4.copy_(modded)
        s4.mul_(LOG2E)
    for offset, length, blocked in masked:
        s4[..., offset:offset + length].masked_fill_(blocked, _NEG_INF)
    allowed = None
    if partial is not None:
        allowed = partial
        if not is_true(mask_mod):
            allowed = allowed & evaluate(mask_mod, clamp_lookups=True, **{k: index(k) for k in _reads(mask_mod)})
        if full is not None:
            allowed = allowed | full
    elif spans is None and not is_true(mask_mod):  # no BlockMask tables but a mask_mod: evaluate it everywhere
        allowed = evaluate(mask_mod, clamp_lookups=True, **{k: index(k) for k in _reads(mask_mod)})
    if allowed is not None:
        s4.masked_fill_(allowed.logical_not(), _NEG_INF)

    m = s4.amax(-1, keepdim=True)
    # a fully masked row: exp2(-inf - 0) = 0 (NaN and +inf maxima stay, so such rows get lse NaN)
    m_safe = m.masked_fill(m == _NEG_INF, 0.0)
    s4.sub_(m_safe).exp2_()
    # a row with any allowed key has l >= 1 (its maximum contributes exp2(0)); a fully masked row
    # has l = 0, P = 0 and m = -inf: clamping l to 1 gives it output 0 and lse -inf without a branch
    l = s4.sum(-1, keepdim=True).clamp_min_(1.0)
    # masked keys' NaN/inf values must not reach P @ V through 0 * NaN (an uninitialised cache);
    # on one-row plans only the masked columns can hold such keys; a GPU's values are not read on
    # the host to decide (a sync every call, the gathered columns being new tensors): the safe product
    finite = not is_gpu(v_sel.device) and (all_finite(v_sel) if allowed is not None else _finite_columns(masked, v_sel))
    matmul = torch.matmul if finite else matmul_skipping_zeros
    o = matmul(s, v_sel.to(work)).view(B, Hq, L, Ev).div_(l)
    lse = m.add_(l.log2_()).mul_(LN2).squeeze(-1) if not need_max else (m + l.log2()).mul_(LN2).squeeze(-1)
    row_max = (m * LN2).squeeze(-1).float() if need_max else None
    return o.to(query.dtype), lse.to(lse_dtype), row_max
