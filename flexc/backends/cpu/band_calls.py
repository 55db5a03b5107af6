"""Narrow query rows of the fused CPU path as one batched kernel call per run of rows (a *band*); the
bands of general score_mods run in plain torch ops (:mod:`flexc.backends.cpu.band_plain`).

A sliding window of 17 keys, a 7-key neighbourhood or small documents leave each row of the plan
(32 query rows after trimming, :func:`flexc.backends.cpu.block_plan.trimmed_rows`) a few dozen key
columns: the fused kernel's work per row is then tiny, and the row's Python (its mask, views, the
call, the merge into the output) costs more than the kernel (L=4096, H=8, window 17: 128 rows,
~39 ms of kernel in a 104 ms training step). A band takes a run of consecutive rows of one group,
all of the same height ``r``, and gives row ``t`` the window of ``c`` key positions starting ``off``
from its first query (one offset and width for the run, covering every row's allowed pairs):
queries ``[Bg*Hg, n, r, E]``, keys and values ``[Bg*Hg, n, c, E]`` (strided views, the windows
overlapping), and one additive mask ``[1 or Bg*Hg, n, r, c]`` (0 on full blocks, the mask_mod on
partial ones, -inf on columns the row does not list; plus a bias score_mod). One forward call and
one backward call then cover the run (L=4096, H=8, window 17, one thread: 13 ms and ~55 ms instead
of 32 ms and 72 ms, most of it the kernel's own work on 32 x 49 tiles); the mask is evaluated once
per plan and remembered with it
(:func:`flexc.backends.cpu.block_plan.memo_by_tables`).

Only rows whose keys span at most :data:`BAND_COLS` positions and :data:`BAND_SHAPE` times their
height join a band, and a run stops when padding its rows to one window would score more than
:data:`PADDING` times their own columns.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ...mods.evaluate import evaluate
from .block_plan import Row, memo_by_tables
from .fused_cpu import FLASH, FLASH_BACKWARD, denormals_flushed, fix_dead_rows

_NEG_INF = float("-inf")
# a row joins a band when its listed keys span at most this many positions (wider rows make
# kernel calls large enough that their Python does not matter)
BAND_COLS = 256
# ... and at most this many times its query rows
BAND_SHAPE = 4
# columns scored in a band (every row padded to the widest) at most this many times its rows' own
PADDING = 1.5
# one band's additive mask holds at most this many elements, 8 MiB in fp32 (a run is cut where it
# would exceed it; L=4096, H=8, window 17 with ALiBi's per-head bias: 1.6M)
BAND_MASK_ELEMENTS = 1 << 21
# a plan's bands keep their masks (for the next calls, forward and backward) up to this many
# elements in all; the rest are built at each call
KEPT_MASK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class Band:
    """Query rows ``q0 + t * r`` to ``q0 + (t + 1) * r`` for ``t < n``; row ``t`` scores the ``c`` key
    positions from ``q0 + t * r + off`` (windows a constant distance from their rows, so the keys
    are one strided view). ``listed`` (``[n, c]`` int8) says which of them its row's blocks list:
    0 none, 1 a partial block, 2 a full block. ``mask``: the additive mask, or None when it is built
    at each call (:func:`band_mask`)."""

    q0: int
    r: int
    n: int
    off: int
    c: int
    listed: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def q1(self) -> int:
        return self.q0 + self.n * self.r


def sub_band(band: Band, t0: int, t1: int) -> Band:
    """Rows ``t0`` to ``t1`` of ``band`` (same windows), for callers that bound their tiles' size."""
    mask = band.mask[:, t0:t1] if band.mask is not None else None
    return Band(band.q0 + t0 * band.r, band.r, t1 - t0, band.off, band.c, band.listed[t0:t1], mask)


def bandable(g, mods, row: Row) -> bool:
    """Whether a row task may join a band: one query head per key head, and keys within
    :data:`BAND_COLS` positions and :data:`BAND_SHAPE` times its rows (wider rows are mostly full
    blocks, which the row path attends unmasked, in tall calls shared by consecutive rows)."""
    if g.G != 1 or not row.segments:
        return False
    span = row.segments[-1][1] - row.segments[0][0]
    return span <= min(BAND_COLS, BAND_SHAPE * (row.q1 - row.q0))


def extent(row: Row, allowed) -> tuple[int, int] | None:
    """The key positions ``[lo, hi)`` from the row's first allowed pair to its last (None: none), with
    ``allowed(q0, q1, start, end)`` the ``[r, end - start]`` pairs some head of the group allows on a
    partial block; full blocks allow every pair."""
    lo = hi = None
    for a, b, partial in row.segments:
        if partial:
            cols = allowed(row.q0, row.q1, a, b).any(0).nonzero()
            if not len(cols):
                continue
            a, b = a + int(cols[0]), a + int(cols[-1]) + 1
        lo = a if lo is None else min(lo, a)
        hi = b if hi is None else max(hi, b)
    return None if lo is None else (lo, hi)


def _mask_rows(mods, Bg: int, Hg: int) -> int:
    """Mask rows per query row: the group's heads (and batches) when the mods read h (b)."""
    reads = mods.bias_reads | mods.mask_reads
    return (Bg if "b" in reads else 1) * (Hg if "h" in reads else 1)


def split_runs(tasks: list, extents: list, n_workers: int, S: int, Bg_Hg) -> tuple[list, list]:
    """``(runs, rest)``: band runs ``(task indices, off, c)`` and the task indices that stay rows. A run is
    consecutive row tasks of one group and height whose windows ``[q0 + off, q0 + off + c)`` cover
    their rows' extents (``extents[i]``, None for tasks that stay rows) within ``[0, S)``, with at
    most :data:`PADDING` times the extents' columns and :data:`BAND_MASK_ELEMENTS` mask elements,
    and at most a ``1 / n_workers`` share of the banded rows (one run per worker); a run has two rows
    or more."""
    runs: list = []
    rest: list[int] = []
    n_band = sum(e is not None for e in extents)
    max_rows = max(1, -(-n_band // max(1, n_workers)))
    used = 0
    for i, ((g, mods, row), ext) in enumerate(zip(tasks, extents)):
        if ext is None:
            rest.append(i)
            continue
        lo, hi = ext
        r = row.q1 - row.q0
        if runs:
            members, off, c = runs[-1]
            lg, _, first = tasks[members[0]]
            last = tasks[members[-1]][2]
            new_off = min(off, lo - row.q0)
            new_c = max(off + c, hi - row.q0) - new_off
            n = len(members) + 1
            Bg, Hg = Bg_Hg(g)
            if (lg is g and last.q1 == row.q0 and last.q1 - last.q0 == r and n <= max_rows
                    and first.q0 + new_off >= 0 and row.q0 + new_off + new_c <= S
                    and n * new_c <= PADDING * (used + hi - lo)
                    and _mask_rows(mods, Bg, Hg) * n * r * new_c <= BAND_MASK_ELEMENTS):
                runs[-1] = (members + [i], new_off, new_c)
                used += hi - lo
                continue
        runs.append(([i], lo - row.q0, hi - lo))
        used = hi - lo
    # a run of one row gains nothing over the row's own calls (which leave its full blocks unmasked)
    rest.extend(members[0] for members, _, _ in runs if len(members) == 1)
    return [run for run in runs if len(run[0]) > 1], sorted(rest)


def new_band(rows: list[Row], off: int, c: int) -> Band:
    """The band of consecutive rows of one height with windows ``off`` from their rows, ``c`` wide."""
    r, n = rows[0].q1 - rows[0].q0, len(rows)
    listed = torch.zeros(n, c, dtype=torch.int8)
    for t, row in enumerate(rows):
        start = row.q0 + off
        for a, b, partial in row.segments:
            a, b = max(a, start), min(b, start + c)
            if a < b:
                listed[t, a - start:b - start] = 1 if partial else 2
    return Band(rows[0].q0, r, n, off, c, listed)


def index_values(band: Band, mods, reads, device) -> dict[str, torch.Tensor]:
    """The ``reads`` of ``b``, ``h``, ``q_idx`` and ``kv_idx`` over the band's tiles, broadcastable to
    ``[Bg, Hg, n, r, c]``."""
    n, r, c = band.n, band.r, band.c
    values = {"b": lambda: mods.b.view(-1, 1, 1, 1, 1), "h": lambda: mods.h.view(1, -1, 1, 1, 1),
              "q_idx": lambda: (band.q0 + torch.arange(n * r, device=device)).view(1, 1, n, r, 1),
              "kv_idx": lambda: (band.q0 + band.off + r * torch.arange(n, device=device).view(n, 1)
                                 + torch.arange(c, device=device)).view(1, 1, n, 1, c)}
    return {name: values[name]() for name in reads if name in values}


def band_mask(band: Band, mods, Bg: int, Hg: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The band's additive mask ``[1 or Bg*Hg, n, r, c]``: the bias (or 0) where a full block, or a
    partial block whose mask_mod allows the pair, lists the key; -inf elsewhere."""
    n, r, c = band.n, band.r, band.c
    at = lambda reads: index_values(band, mods, reads, device)
    listed = band.listed.to(device).view(1, 1, n, 1, c)
    allowed = listed == 2
    if mods.mask_mod is not None:
        allowed = allowed | ((listed == 1) & evaluate(mods.mask_mod, clamp_lookups=True, **at(mods.mask_reads)))
    else:
        allowed = allowed | (listed == 1)
    if mods.bias_node is not None:
        bias = evaluate(mods.bias_node, clamp_lookups=True, buffers=mods.score_mod.buffers,
                        **at(mods.bias_reads)).to(dtype)
        if mods.bias_sign < 0:
            bias = bias.neg()
        mask = torch.where(allowed, bias, torch.tensor(_NEG_INF, dtype=dtype, device=device))
    else:
        mask = torch.zeros((), dtype=dtype, device=device).masked_fill(allowed.logical_not(), _NEG_INF)
    mask = mask.reshape((1,) * (5 - mask.dim()) + tuple(mask.shape))
    if mask.shape[0] * mask.shape[1] == 1:
        return mask.expand(1, 1, n, r, c).reshape(1, n, r, c)
    return mask.expand(Bg, Hg, n, r, c).reshape(Bg * Hg, n, r, c)


def plan_bands(block_mask, key: tuple, tasks: list, n_workers: int, S: int, Bg_Hg, allowed_for, dtype: torch.dtype,
               device) -> tuple[list, list]:
    """``(band_tasks, rest)``: the row tasks' bands as tasks ``(g, mods, Band)``, and the tasks
    that stay rows; ``allowed_for(g)`` is group ``g``'s :func:`extent` function. The bands and their
    masks are remembered for the block mask's tables, the mods' captured tensors and ``key`` (which
    must fix the task list: the plan's key and the mods' graphs)."""
    if not tasks or not any(bandable(*task) for task in tasks):
        return [], tasks
    mods = tasks[0][1]
    captured = [t for m in (mods.mask_mod, mods.score_mod) if m is not None for t in m.buffers
                if isinstance(t, torch.Tensor)]
    roots = tuple(m.root if m is not None else None for m in (mods.mask_mod, mods.score_mod))

    def build(keep_masks: bool):
        """``([(first task index, Band)], rest task indices)``."""
        allowed = {}
        extents = []
        for g, m, row in tasks:
            if not bandable(g, m, row):
                extents.append(None)
                continue
            if id(g) not in allowed:
                allowed[id(g)] = allowed_for(g)
            extents.append(extent(row, allowed[id(g)]))
        runs, rest = split_runs(tasks, extents, n_workers, S, Bg_Hg)
        bands, kept = [], 0
        for members, off, c in runs:
            g, m, _ = tasks[members[0]]
            band = new_band([tasks[i][2] for i in members], off, c)
            Bg, Hg = Bg_Hg(g)
            size = _mask_rows(m, Bg, Hg) * band.n * band.r * band.c
            if keep_masks and kept + size <= KEPT_MASK_ELEMENTS:
                band = dataclasses.replace(band, mask=band_mask(band, m, Bg, Hg, dtype, device))
                kept += size
            bands.append((members[0], band))
        return bands, rest

    bands, rest = memo_by_tables(block_mask, ("bands", n_workers, str(dtype), roots, mods.bias_sign) + key,
                                 lambda: build(True), captured, unversioned=lambda: build(False))
    return [(tasks[i][0], tasks[i][1], band) for i, band in bands], [tasks[i] for i in rest]


def query_rows(t: torch.Tensor, g, band: Band, Bg: int, Hg: int) -> torch.Tensor:
    """Rows ``[q0, q1)`` of group ``g`` in ``t [B, H, L, *]`` as ``[Bg*Hg, n, r, *]`` (a view when possible)."""
    rows = t[g.b, g.qh, band.q0:band.q1]
    return rows.reshape(Bg * Hg, band.n, band.r, *t.shape[3:])


def windows(t: torch.Tensor, g, band: Band, Bg: int) -> torch.Tensor:
    """Keys or values of group ``g``'s band windows, ``[Bg*Hg, n, c, D]``: a strided view of ``t``
    (overlapping windows), copied only when its batches broadcast over several heads."""
    kv = t[g.kb, g.kvh]
    Bk, Hk, _, D = kv.shape
    sb, sh, ss, sd = kv.stride()
    windows = kv.as_strided((Bk, Hk, band.n, band.c, D), (sb, sh, band.r * ss, ss, sd),
                            kv.storage_offset() + (band.q0 + band.off) * ss)
    if Bk != Bg:
        windows = windows.expand(Bg, *windows.shape[1:])
    return windows.reshape(Bg * Hk, band.n, band.c, D)


def add_windows(grad: torch.Tensor, g, band: Band, part: torch.Tensor, Bg: int) -> None:
    """``grad``'s rows under the band's windows += ``part`` (``[Bg*Hg, n, c, D]``), a column range
    at a time: ``r`` columns of every window are disjoint rows, so each range is one strided add."""
    target = grad[g.kb, g.kvh]
    Bk, Hk, _, D = target.shape
    part = part.view(Bg, Hk, band.n, band.c, D)
    if Bk != Bg:  # keys broadcast over the query batches: their gradients add up
        part = part.sum(0, keepdim=True)
    sb, sh, ss, sd = target.stride()
    for j in range(0, band.c, band.r):
        width = min(band.r, band.c - j)
        rows = target.as_strided((Bk, Hk, band.n, width, D), (sb, sh, band.r * ss, ss, sd),
                                 target.storage_offset() + (band.q0 + band.off + j) * ss)
        rows.add_(part[..., j:j + width, :])


def call_mask(band: Band, mods, Bg: int, Hg: int, dtype, device) -> torch.Tensor:
    """The band's additive mask: the one kept with the plan, else built now (:func:`band_mask`)."""
    return band.mask if band.mask is not None and band.mask.dtype == dtype else band_mask(band, mods, Bg, Hg, dtype, device)


def forward(query, key, value, out, lse, g, band: Band, mods, scale: float) -> None:
    """The band's rows of ``out`` and ``lse``, by one fused kernel call."""
    Bg, Hg = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh])
    mask = call_mask(band, mods, Bg, Hg, query.dtype, query.device)
    o, l = FLASH(query_rows(query, g, band, Bg, Hg), windows(key, g, band, Bg), windows(value, g, band, Bg),
                 attn_mask=mask, scale=scale)
    fix_dead_rows(l, mask)
    out[g.b, g.qh, band.q0:band.q1].unflatten(2, (band.n, band.r)).copy_(o.view(Bg, Hg, band.n, band.r, -1))
    l = l.view(Bg, Hg, band.n, band.r)
    lse[g.b, g.qh, band.q0:band.q1].unflatten(2, (band.n, band.r)).copy_(l.masked_fill(l.isposinf(), float("nan")))


def backward(query, key, value, out, lse, grad_out, dq, dk, dv, g, band: Band, mods, scale: float) -> None:
    """The band's gradients added into ``dq``, ``dk`` and ``dv``: one fused backward call over the
    forward's windows and mask. ``lse`` is the saved one with -inf made +inf (probabilities 0)."""
    Bg, Hg = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh])
    mask = call_mask(band, mods, Bg, Hg, query.dtype, query.device)
    view = lambda t: query_rows(t, g, band, Bg, Hg)
    k_w, v_w = windows(key, g, band, Bg), windows(value, g, band, Bg)
    l = lse[g.b, g.qh, band.q0:band.q1].reshape(Bg * Hg, band.n, band.r)
    with denormals_flushed() if mods.bias_node is not None else contextlib.nullcontext():
        gq, gk, gv = FLASH_BACKWARD(view(grad_out), view(query), k_w, v_w, view(out), l, 0.0, False,
                                    attn_mask=mask, scale=scale)
    dq[g.b, g.qh, band.q0:band.q1].unflatten(2, (band.n, band.r)).add_(gq.view(Bg, Hg, band.n, band.r, -1))
    add_windows(dk, g, band, gk, Bg)
    add_windows(dv, g, band, gv, Bg)
