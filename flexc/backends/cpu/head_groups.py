"""Groups of query heads that share one BlockMask table, and each group's plan of rows of chunks.

A group (:class:`Group`) is the query batches and heads that read the same BlockMask entry: one
batched matmul scores all of them, and GQA's query heads of one key head stack as rows. Each group's
block rows become rows of key chunks (:func:`flexc.backends.cpu.block_plan.row_plan`), sized to stay
in cache, partial blocks trimmed to the columns the mask_mod allows; the plan is remembered per
block mask, call shape and mask_mod. :func:`row_tasks` lists them as the row tasks the forward
(:mod:`flexc.backends.cpu.torch_cpu`) and the backward (:mod:`flexc.backends.cpu.torch_cpu_backward`)
spread over workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..dropout import Dropout
from ...mods.evaluate import evaluate
from ...mods.trace import TracedMod
from ... import workers
from .block_plan import Row, memo_by_tables, merged_tables, read_tables, row_plan, trimmed_rows, TRIM_ELEMENTS
from .row_mods import Mods, is_true

# Scores of one chunk hold at most this many elements (2 MiB in fp32): small enough to stay in
# cache and keep peak memory near SDPA's, large enough that matmuls are not tiny. Small problems
# use chunks of a quarter of the output's size (but not under a quarter of this), so the working
# memory stays a fraction of the output's.
CHUNK_ELEMENTS = 1 << 19
MAX_ROWS = 128


@dataclass(frozen=True)
class Group:
    """Query batches/heads that read the same BlockMask entry ``(bm, hm)``, and their key batches/heads.

    Within a group, query head ``j`` uses key head ``j // G`` (all slices, so tensors are views).
    """

    b: slice
    kb: slice
    qh: slice
    kvh: slice
    G: int
    bm: int
    hm: int


def _groups(B: int, Bkv: int, Hq: int, Hkv: int, Bm: int, Hm: int) -> list[Group]:
    G = Hq // Hkv
    batches = [(slice(0, B), 0)] if Bm == 1 else [(slice(bm, B, Bm), bm) for bm in range(Bm)]
    if Hm == 1:
        heads = [(slice(0, Hq), slice(0, Hkv), G, 0)]
    else:  # the table differs per head: one query head per group (broadcast by modulo like torch)
        heads = [(slice(h, h + 1), slice(h // G, h // G + 1), 1, h % Hm) for h in range(Hq)]
    out = []
    for b, bm in batches:
        kb = slice(0, 1) if Bkv == 1 else b
        for qh, kvh, g, hm in heads:
            out.append(Group(b, kb, qh, kvh, g, bm, hm))
    return out


def row_tasks(block_mask: Any, query: torch.Tensor, value: torch.Tensor, Hkv: int, score_mod, mask_mod,
              dropout: Dropout | None = None):
    """Every (group, mods, row) to compute, their estimated costs, how many workers to use, and the groups."""
    B, Hq, L, _ = query.shape
    Bkv, _, S, Ev = value.shape
    tasks, costs, groups = [], [], []
    for g, rows in _plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev, None if is_true(mask_mod) else mask_mod):
        groups.append(g)
        mods = Mods(score_mod, mask_mod, g, B, Hq, L, S, query.device, dropout)
        heads = len(range(B)[g.b]) * len(range(Hq)[g.qh])
        for row in rows:
            tasks.append((g, mods, row))
            costs.append(float(heads * (row.q1 - row.q0) * sum(c.n_cols for c in row.chunks)))
    return tasks, costs, workers.worker_count(len(tasks), sum(costs)), groups


def _plan(block_mask: Any, B: int, Bkv: int, Hq: int, Hkv: int, L: int, S: int, Ev: int,
          mask_mod: TracedMod | None = None) -> list[tuple[Group, list[Row]]]:
    """Each group of heads and its rows of chunks (remembered per block mask, call shape and mask_mod),
    partial blocks trimmed to the mask_mod's allowed columns (:func:`block_plan.trimmed_rows`)."""
    key = (getattr(block_mask, "BLOCK_SIZE", None), B, Bkv, Hq, Hkv, L, S, Ev, torch.get_num_threads())
    plain = lambda: _new_plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev)
    if mask_mod is None or block_mask is None:
        return memo_by_tables(block_mask, key, plain)
    # the trim reads the mask_mod: remembered with its graph and captured tensors, and skipped where
    # those cannot be remembered (it pays only once per mask)
    return memo_by_tables(block_mask, key + (mask_mod.root,),
                          lambda: _new_plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev, mask_mod),
                          [t for t in mask_mod.buffers if isinstance(t, torch.Tensor)], unversioned=plain)


def _new_plan(block_mask: Any, B: int, Bkv: int, Hq: int, Hkv: int, L: int, S: int, Ev: int,
              mask_mod: TracedMod | None = None) -> list[tuple[Group, list[Row]]]:
    tables = merged_tables(read_tables(block_mask, L, S))
    plans = []
    trim_budget = [TRIM_ELEMENTS]
    cache: dict[tuple, list[Row]] = {}
    budget = min(CHUNK_ELEMENTS, max(CHUNK_ELEMENTS // 4, B * Hq * L * Ev // 4))
    budget //= max(1, torch.get_num_threads())  # each worker thread holds its own chunk
    for g in _groups(B, Bkv, Hq, Hkv, tables.batch, tables.heads):
        n_heads = len(range(Hq)[g.qh]) * len(range(B)[g.b])
        rows = min(MAX_ROWS, max(tables.block_size[0], 1))
        # at least one key block's worth of columns, even for many heads
        cols = max(budget // (n_heads * rows), min(tables.block_size[1], 128), 16)
        key = (g.bm, g.hm, rows, cols)
        if key not in cache:
            cache[key] = row_plan(tables, g.bm, g.hm, L, S, rows, cols)
        plan = cache[key]
        if mask_mod is not None:
            plan = trimmed_rows(plan, allowed_tile(mask_mod, g, B, Hq, L, S), cols, trim_budget)
        plans.append((g, plan))
    return plans


def allowed_tile(mask_mod: TracedMod, g: Group, B: int, Hq: int, L: int, S: int):
    """``(q0, q1, start, end) -> [q1 - q0, end - start]`` booleans: pairs some head of ``g`` allows."""
    mods = Mods(None, mask_mod, g, B, Hq, L, S, torch.device("cpu"))

    def allowed(q0: int, q1: int, start: int, end: int) -> torch.Tensor:
        tile = evaluate(mask_mod, clamp_lookups=True, **mods.indices(mods.mask_reads, q0, q1, mods.kv_pos[start:end]))
        tile = tile.reshape((1,) * (4 - tile.dim()) + tuple(tile.shape)).any(0).any(0)
        return tile.expand(q1 - q0, end - start)
    return allowed

