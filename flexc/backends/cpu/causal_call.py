"""Causal masks, and causal sequences packed one after another, as calls of torch's fused CPU
kernel in its causal mode.

``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)`` masks ``kv > q``
(top-left aligned, any lengths) inside its own tile loop and skips the key tiles past each query
tile's diagonal, with no additive mask to read; its backward does the same. A block mask that
allows each query row exactly the keys from the start of its sequence up to itself (``kv_idx <=
q_idx``; or a document mask with causal attention inside each document, as packed training
batches use) is therefore one kernel call per sequence each way, instead of calls per query block,
their logsumexp merge, their masks and their Python. Measured against the block path (1 thread):
forward 1.0-1.4x and a training step 1.3-1.6x faster, from B=2, H=4, L=256, D=32 to B=1, H=8,
L=4096, D=64.

:func:`sequence_starts` decides it on the block mask as a call reads it (full blocks allowed, the
mask_mod evaluated on the partial ones, nothing elsewhere): every query row ``q`` must see exactly
the keys ``[start, q]`` (``[start, S)`` for rows past the last key), where ``start`` is the row's
own index (a new sequence) or its predecessor's. The tables' full blocks give whole key ranges;
the partial blocks are evaluated (for the batches and heads each table entry covers, when the
mask reads ``b`` or ``h``), one query block after another, stopping at the first row that breaks
the pattern. The answer is remembered with the tables and the mask_mod's captured tensors
(identity and version), so a captured tensor changed in place is decided again.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ...mods import ir
from ...mods.evaluate import evaluate
from ...mods.trace import TracedMod
from . import fused_cpu
from .block_plan import memo_by_tables, read_tables, row_plan

# partial-block elements the mask_mod is evaluated on to decide (a causal mask's diagonal blocks
# are L x BLOCK_SIZE per table entry); past it the block path runs
MAX_CHECKED_ELEMENTS = 1 << 26
# sequences shorter than this on average are left to the block path (one kernel call each)
MIN_MEAN_ROWS = 32

Starts = tuple  # per batch (or one entry for every batch): the query rows where a sequence starts


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_mod: TracedMod | None,
            block_mask: Any) -> Starts | None:
    """The sequences' starts when the call (no score_mod, no dropout, no max_scores: the caller's
    checks) runs as causal kernel calls: the fused kernel's dtypes and head dims, GQA only where
    the kernel takes it, and a block mask of causal sequences (:func:`sequence_starts`); else None."""
    B, Hq, L, E = query.shape
    Bkv, Hkv, S, Ev = value.shape
    if (block_mask is None or mask_mod is None or fused_cpu.FLASH_BACKWARD is None
            or not fused_cpu.supported(query, value, None, False) or L == 0 or S == 0 or B * Hq == 0):
        return None
    if Hq != Hkv and not _kernel_takes_gqa():
        return None
    return sequence_starts(block_mask, mask_mod, B, Hq, L, S)


def sequence_starts(block_mask: Any, mask_mod: TracedMod, B: int, Hq: int, L: int, S: int) -> Starts | None:
    """For a ``[B, Hq, L, S]`` call under ``block_mask`` (with its traced ``mask_mod``), the rows
    where causal sequences start: a tuple of start tuples, one per batch, or one for every batch
    when they agree (``((0,),)``: plain causal attention); None when some row sees other keys (see
    the module docstring)."""
    key = ("causal sequences", mask_mod.root, mask_mod.scalars, B, Hq, L, S)
    return memo_by_tables(block_mask, key, lambda: _find_starts(block_mask, mask_mod, B, Hq, L, S), mask_mod.buffers)


def _find_starts(block_mask: Any, mask_mod: TracedMod, B: int, Hq: int, L: int, S: int) -> Starts | None:
    tables = read_tables(block_mask, L, S)
    reads = ir.inputs_read(mask_mod.root)
    budget = [MAX_CHECKED_ELEMENTS]
    per_batch: list = [None] * B
    for bm in range(tables.batch):
        for hm in range(tables.heads):
            batches, heads = range(B)[bm::tables.batch], range(Hq)[hm::tables.heads]
            index = {"b": torch.tensor(batches).view(-1, 1, 1, 1) if "b" in reads else torch.zeros(1, 1, 1, 1, dtype=torch.long),
                     "h": torch.tensor(heads).view(1, -1, 1, 1) if "h" in reads else torch.zeros(1, 1, 1, 1, dtype=torch.long)}
            rows = row_plan(tables, bm, hm, L, S, max(tables.block_size[0], 1), S)
            new = _sequence_rows(rows, mask_mod, reads, index, L, S, budget)
            if new is None:
                return None
            for i, b in enumerate(batches):  # every head of a batch must agree
                for j in range(len(heads)):
                    starts = tuple(new[min(i, new.shape[0] - 1), min(j, new.shape[1] - 1)].nonzero().flatten().tolist())
                    if per_batch[b] not in (None, starts):
                        return None
                    per_batch[b] = starts
    if len(set(per_batch)) == 1:
        per_batch = per_batch[:1]
    if sum(len(starts) for starts in per_batch) * MIN_MEAN_ROWS > len(per_batch) * L:
        return None
    return tuple(per_batch)


def _sequence_rows(rows: list, mask_mod: TracedMod, reads: frozenset, index: dict, L: int, S: int,
                   budget: list) -> torch.Tensor | None:
    """``[b, h, L]`` booleans, True where a causal sequence starts, for one table entry's ``rows``
    (``b``/``h`` of size 1 unless the mask reads them); None at the first row that sees anything
    but ``[start, q]`` with ``start`` its own index or its predecessor's, or past the budget."""
    nb, nh = index["b"].shape[0], index["h"].shape[1]
    new = torch.zeros(nb, nh, L, dtype=torch.bool)
    previous = torch.full((nb, nh, 1), -1)  # (row 0 must start a sequence)
    covered = 0
    for row in rows:
        q0, q1 = row.q0, row.q1
        if q0 != covered:
            return None  # a query block that lists no key
        covered = q1
        r = q1 - q0
        lo = torch.full((nb, nh, r), S)
        hi = torch.full((nb, nh, r), -1)
        n = torch.zeros((nb, nh, r), dtype=torch.long)
        for start, end, partial in row.segments:
            if not partial:
                lo.clamp_(max=start)
                hi.clamp_(min=end - 1)
                n += end - start
                continue
            budget[0] -= nb * nh * r * (end - start)
            if budget[0] < 0:
                return None
            index["q_idx"] = torch.arange(q0, q1).view(1, 1, -1, 1)
            index["kv_idx"] = torch.arange(start, end).view(1, 1, 1, -1)
            allowed = torch.broadcast_to(evaluate(mask_mod, **{name: index[name] for name in reads}),
                                         (nb, nh, r, end - start)).to(torch.uint8)
            count = allowed.sum(-1)
            seen = count > 0
            lo = torch.where(seen, torch.minimum(lo, start + allowed.argmax(-1)), lo)
            hi = torch.where(seen, torch.maximum(hi, end - 1 - allowed.flip(-1).argmax(-1)), hi)
            n += count
        q = torch.arange(q0, q1)
        if not (bool((hi == q.clamp(max=S - 1)).all()) and bool((n == hi - lo + 1).all())):
            return None  # a row sees keys after itself, or a gap
        starts_here = lo == q
        if not bool((starts_here | (lo == torch.cat([previous, lo[..., :-1]], -1))).all()):
            return None  # a row's first key is neither itself nor its predecessor's
        new[..., q0:q1] = starts_here
        previous = lo[..., -1:]
    return new if covered == L else None


@functools.lru_cache(maxsize=1)
def _kernel_takes_gqa() -> bool:
    """Whether this torch's fused CPU kernel (forward and backward) takes fewer key heads than
    query heads (torch 2.13's does; the GPU stack's older torch may not)."""
    q = torch.zeros(1, 2, 2, 4)
    kv = torch.zeros(1, 1, 2, 4)
    try:
        out, lse = fused_cpu.FLASH(q, kv, kv, is_causal=True)
        grads = fused_cpu.FLASH_BACKWARD(out, q, kv, kv, out, lse, 0.0, True, scale=0.5)
    except (RuntimeError, TypeError, ValueError):
        return False
    return tuple(grads[1].shape) == tuple(kv.shape)


@torch.no_grad()  # (a custom operator's real implementation runs with autograd on: its outputs must not need grad)
def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            starts: Starts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over the causal sequences that start at ``starts``
    (:func:`sequence_starts`): one kernel call per sequence (``key``/``value`` of one batch are
    broadcast over the query's as stride-0 views; every row sees its sequence's first key, so no
    row is dead)."""
    fold = _foldable(query, key, value)
    q, k, v = _kernel_inputs(query, key, value, fold)
    calls = _calls(starts, query.shape[1], q.shape[2], k.shape[2], fold)
    if len(calls) == 1:
        out, lse = fused_cpu.FLASH(q, k, v, is_causal=True, scale=scale)
    else:
        out, lse = q.new_empty(*q.shape[:-1], v.shape[-1]), None
        for rows, qs, ks in calls:
            o, l = fused_cpu.FLASH(q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], is_causal=True, scale=scale)
            lse = q.new_empty(q.shape[:-1], dtype=l.dtype) if lse is None else lse
            out[rows, :, qs], lse[rows, :, qs] = o, l
    # (unfolded, the kernel's lse is [B, L, H]-strided: laid out row-major like every path's)
    return _unfolded(out, query, fold), _unfolded(lse, query, fold).contiguous()


@torch.no_grad()
def backward(query, key, value, out, lse, grad_out, scale: float,
             starts: Starts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the forward's ``out`` and ``lse`` over the same kernel calls, in the
    inputs' dtypes (a key batch broadcast over the query's gets its gradients summed)."""
    fold = _foldable(query, key, value) and _foldable(out, grad_out)
    q, k, v = _kernel_inputs(query, key, value, fold)
    o, go, l = (_folded(t, fold) for t in (out, grad_out, lse.to(query.dtype)))
    calls = _calls(starts, query.shape[1], q.shape[2], k.shape[2], fold)
    if len(calls) == 1:
        dq, dk, dv = fused_cpu.FLASH_BACKWARD(go, q, k, v, o, l, 0.0, True, scale=scale)
    else:  # each key belongs to one sequence of its batch: every gradient row is written once
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        for rows, qs, ks in calls:
            dq[rows, :, qs], dk[rows, :, ks], dv[rows, :, ks] = fused_cpu.FLASH_BACKWARD(
                go[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], o[rows, :, qs], l[rows, :, qs],
                0.0, True, scale=scale)
    if key.shape[0] != query.shape[0]:
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return _unfolded(dq, query, fold), _unfolded(dk, key, fold), _unfolded(dv, value, fold)


def _calls(starts: Starts, H: int, L: int, S: int, fold: bool) -> list[tuple[slice, slice, slice]]:
    """``(batch rows, query rows, key rows)`` of each kernel call: the first dimension of the
    kernel's inputs holds a batch's H heads when folded, the batch itself otherwise."""
    per_batch = [(slice(None), starts[0])] if len(starts) == 1 else [
        (slice(b * H, (b + 1) * H) if fold else slice(b, b + 1), batch_starts) for b, batch_starts in enumerate(starts)]
    calls = []
    for rows, batch_starts in per_batch:
        ends = batch_starts[1:]
        for j, start in enumerate(batch_starts):
            calls.append((rows, slice(start, ends[j] if j < len(ends) else L), slice(start, ends[j] if j < len(ends) else S)))
    return calls


# The kernel lays its outputs and gradients out as [B, L, H, E] (torch's SDPA layout), which a
# row-major [B, H, L, E] caller would then copy (flexc returns torch FlexAttention's layouts,
# flexc.backends.layout). Batch and heads folded into one batch of one head make that layout the
# row-major one: the same work, split the same way, and no copies.

def _foldable(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is row-major with the query's batch and heads (no GQA, no key batch
    broadcast), so batch and heads fold into one dimension as views."""
    B, H = tensors[0].shape[:2]
    return all(t.shape[:2] == (B, H) and t.is_contiguous() for t in tensors)


def _folded(t: torch.Tensor, fold: bool) -> torch.Tensor:
    if fold:
        return t.view(t.shape[0] * t.shape[1], 1, *t.shape[2:])
    return fused_cpu.unit_last_stride(t)


def _unfolded(t: torch.Tensor, like: torch.Tensor, fold: bool) -> torch.Tensor:
    return t.view(*like.shape[:2], *t.shape[2:]) if fold else t


def _kernel_inputs(query, key, value, fold: bool):
    query, key, value = (_folded(t, fold) for t in (query, key, value))
    if key.shape[0] != query.shape[0]:  # one key batch for every query batch: a stride-0 view
        key, value = key.expand(query.shape[0], *key.shape[1:]), value.expand(query.shape[0], *value.shape[1:])
    return query, key, value
