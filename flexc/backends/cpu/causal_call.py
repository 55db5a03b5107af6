"""Causal masks, and causal sequences packed one after another, as calls of torch's fused CPU
kernel in its causal mode.

``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)`` masks ``kv > q``
(top-left aligned, any lengths) inside its own tile loop and skips the key tiles past each query
tile's diagonal, with no additive mask to read; its backward does the same. A block mask that
allows each query row exactly the keys from the start of its sequence up to itself (``kv_idx <=
q_idx``; or a document mask with causal attention inside each document, as packed training
batches use) is therefore one kernel call per sequence each way, instead of calls per query block,
their logsumexp merge, their masks and their Python. Measured against the block path (1 thread,
B=2, H=4, L=256, D=32 up to B=1, H=8, L=4096, D=64): causal forward 1.06-1.37x and training step
1.1-1.6x faster; 6 documents forward 1.6x (L=4096) and training step 1.55x (L=1024) faster.

:func:`sequence_starts` decides it on the block mask as a call reads it (full blocks allowed, the
mask_mod evaluated on the partial ones, nothing elsewhere): every query row ``q`` must see exactly
the keys ``[start, q]`` (``[start, S)`` for rows past the last key), where ``start`` is the row's
own index (a new sequence) or its predecessor's. The tables' full blocks give whole key ranges;
the partial blocks are evaluated (for the batches and heads each table entry covers, when the
mask reads ``b`` or ``h``), one query block after another, stopping at the first row that breaks
the pattern. The answer is remembered with the tables and the mask_mod's captured tensors
(identity and version), so a captured tensor changed in place is decided again; tables or tensors
made under inference mode have no version counter, and their calls keep the block path.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, NamedTuple

import torch

from ... import workers
from ...mods import ir
from ...mods.evaluate import evaluate
from ...mods.trace import TracedMod
from . import causal_chunks, fused_cpu
from ...masks.kv_tables import block_sizes_of, kv_tables
from .block_plan import memo_by_tables

# partial-block elements the mask_mod is evaluated on to decide (a causal mask's diagonal blocks
# are L x BLOCK_SIZE per table entry); past it the block path runs
MAX_CHECKED_ELEMENTS = 1 << 26
# a batch whose sequences are shorter than this on average stays on the block path (a call each)
MIN_MEAN_ROWS = 32
# query blocks checked together, at most (groups grow 1, 2, 4, ... blocks)
MAX_GROUP_BLOCKS = 64

Starts = tuple  # per batch (or one entry for every batch): the query rows where a sequence starts
ONE_SEQUENCE: Starts = ((0,),)  # plain causal attention: one sequence from row 0 in every batch


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_mod: TracedMod | None,
            block_mask: Any) -> Starts | None:
    """The sequences' starts when the call (no score_mod, no dropout, no max_scores: the caller's
    checks) runs as causal kernel calls: the fused kernel's dtypes and head dims, GQA only where
    the kernel takes it, and a block mask of causal sequences (:func:`sequence_starts`); else None."""
    if block_mask is None or mask_mod is None or not kernel_takes(query, value):
        return None
    B, Hq, L, _ = query.shape
    return sequence_starts(block_mask, mask_mod, B, Hq, L, value.shape[2])


def kernel_takes(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the fused kernel's calls (forward and backward) take these inputs: its dtypes and
    head dims, no empty dimension, GQA only where the kernel takes it."""
    B, Hq, L, _ = query.shape
    Hkv, S = value.shape[1], value.shape[2]
    if (fused_cpu.FLASH_BACKWARD is None or not fused_cpu.supported(query, value, None, False)
            or L == 0 or S == 0 or B * Hq == 0):
        return False
    return Hq == Hkv or _kernel_takes_gqa()


def sequence_starts(block_mask: Any, mask_mod: TracedMod, B: int, Hq: int, L: int, S: int) -> Starts | None:
    """For a ``[B, Hq, L, S]`` call under ``block_mask`` (with its traced ``mask_mod``), the rows
    where causal sequences start: a tuple of start tuples, one per batch, or one for every batch
    when they agree (``((0,),)``: plain causal attention); None when some row sees other keys (see
    the module docstring)."""
    key = ("causal sequences", mask_mod.root, mask_mod.scalars, B, Hq, L, S)
    # tables or captured tensors made under inference mode have no version counter, so the answer
    # could not be remembered safely; deciding on every call costs more than it saves: block path
    return memo_by_tables(block_mask, key, lambda: _find_starts(block_mask, mask_mod, B, Hq, L, S), mask_mod.buffers,
                          unversioned=lambda: None)


def _find_starts(block_mask: Any, mask_mod: TracedMod, B: int, Hq: int, L: int, S: int) -> Starts | None:
    q_block, kv_block = block_sizes_of(block_mask)
    tables = [t if t is None else t.cpu() for t in kv_tables(block_mask)]
    n_rows = -(-L // q_block)
    if tables[0].shape[-1] < n_rows:
        return None
    reads = ir.inputs_read(mask_mod.root)
    budget = [MAX_CHECKED_ELEMENTS]
    per_batch: list = [None] * B
    Bt, Ht = tables[0].shape[:2]
    for bm in range(Bt):
        for hm in range(Ht):
            batches, heads = range(B)[bm::Bt], range(Hq)[hm::Ht]
            if not batches or not heads:
                continue
            entry = _Entry(q_block, kv_block, L, S,
                           _listed(tables[0][bm, hm], tables[1][bm, hm], n_rows, kv_block, S),
                           None if tables[2] is None else _listed(tables[2][bm, hm], tables[3][bm, hm], n_rows,
                                                                  kv_block, S))
            if _lists_a_block_twice(entry):
                return None  # (a malformed mask: a key counted twice is not one the sums can read)
            # (tiles, b, h, rows, keys): b and h only as far as the mask reads them
            index = {"b": torch.tensor(batches if "b" in reads else [0]).view(1, -1, 1, 1, 1),
                     "h": torch.tensor(heads if "h" in reads else [0]).view(1, 1, -1, 1, 1)}
            new = _sequence_rows(entry, mask_mod, reads, index, budget)
            if new is None:
                return None
            for i, b in enumerate(batches):  # every head of a batch must agree
                for j in range(len(heads)):
                    rows = new[min(i, new.shape[0] - 1), min(j, new.shape[1] - 1)]
                    starts = tuple(rows.nonzero().flatten().tolist())
                    if per_batch[b] not in (None, starts):
                        return None
                    per_batch[b] = starts
    return tuple(per_batch[:1]) if len(set(per_batch)) == 1 else tuple(per_batch)


def _listed(num: torch.Tensor, indices: torch.Tensor, n_rows: int, kv_block: int, S: int) -> tuple:
    """``(query block, key block)`` of every entry one table lists for the first ``n_rows`` query
    blocks (inside each row's count, at a key block that starts before ``S``), as two tensors."""
    num, indices = num[:n_rows].long(), indices[:n_rows].long()
    listed = ((torch.arange(indices.shape[-1]) < num[:, None]) & (indices >= 0)
              & (indices * kv_block < S))
    rows, cols = listed.nonzero(as_tuple=True)
    return rows, indices[rows, cols]


def _lists_a_block_twice(entry: "_Entry") -> bool:
    pairs = [entry.partial] + ([entry.full] if entry.full is not None else [])
    keys = torch.cat([rows * (1 << 31) + cols for rows, cols in pairs])
    return keys.numel() != torch.unique(keys).numel()


class _Entry(NamedTuple):
    """One block-mask entry's listed blocks: ``partial`` and ``full`` as (query block, key block)
    tensors (``full`` None when the mask has no full tables), with the block sizes and lengths."""

    q_block: int
    kv_block: int
    L: int
    S: int
    partial: tuple
    full: tuple | None


def _sequence_rows(entry: _Entry, mask_mod: TracedMod, reads: frozenset, index: dict,
                   budget: list) -> torch.Tensor | None:
    """``[b, h, L]`` booleans, True where a causal sequence starts, for one block-mask entry
    (``b``/``h`` of size 1 unless the mask reads them); None when some row sees anything but
    ``[start, q]`` with ``start`` its own index or its predecessor's, or past the budget.

    A row is read by three sums over the keys it sees (:func:`_key_sums`), taken relative to its
    last allowed key ``top = min(q, S - 1)`` as ``d = kv - top``: the count ``m``, ``sum d`` and
    ``sum d^2``. Its keys are exactly ``[top - m + 1, top]`` if and only if both sums equal that
    range's: ``m`` distinct integers with the range's mean and its variance (the least any ``m``
    distinct integers have, reached only by consecutive ones) are that range. Query blocks are
    checked in groups of 1, 2, 4, ... blocks: a mask that breaks the pattern early (a sliding
    window) costs little, and one that keeps it is evaluated in few batched calls."""
    nb, nh = index["b"].shape[1], index["h"].shape[2]
    L, S, q_block = entry.L, entry.S, entry.q_block
    new = torch.zeros(nb, nh, L, dtype=torch.bool)
    n_starts = torch.zeros(nb, nh, dtype=torch.long)
    previous = torch.full((nb, nh, 1), -1)  # (row 0 must start a sequence)
    block0, size, n_blocks = 0, 1, -(-L // q_block)
    while block0 < n_blocks:
        block1 = min(block0 + size, n_blocks)
        q = torch.arange(block0 * q_block, min(block1 * q_block, L))
        sums = _key_sums(entry, block0, block1, mask_mod, reads, index, budget)
        if sums is None:
            return None
        m, k1, k2 = sums
        top = q.clamp(max=S - 1)
        sum_d, sum_d2 = k1 - m * top, k2 - 2 * top * k1 + m * top * top
        if not (bool((m > 0).all()) and bool((sum_d == -(m * (m - 1) // 2)).all())
                and bool((sum_d2 == (m - 1) * m * (2 * m - 1) // 6).all())):
            return None  # a row sees keys after itself, a gap, or nothing
        lo = top - m + 1
        starts_here = lo == q
        if not bool((starts_here | (lo == torch.cat([previous, lo[..., :-1]], -1))).all()):
            return None  # a row's first key is neither itself nor its predecessor's
        new[..., q[0]:q[-1] + 1] = starts_here
        n_starts += starts_here.sum(-1)
        if int(n_starts.max()) * MIN_MEAN_ROWS > L:
            return None  # sequences too short on average for a call each (known as soon as they are many)
        previous = lo[..., -1:]
        block0, size = block1, min(2 * size, MAX_GROUP_BLOCKS)
    return new


def _key_sums(entry: _Entry, block0: int, block1: int, mask_mod: TracedMod, reads: frozenset, index: dict,
              budget: list) -> tuple | None:
    """``(count, sum kv, sum kv^2)`` over the keys each row of query blocks ``[block0, block1)``
    sees, ``[b, h, rows]`` int64: full blocks in closed form, partial ones from the mask_mod
    evaluated once over all their tiles (indices past the lengths clamped into them, those keys
    then not seen) and summed by one matrix product (:func:`_offset_sums`)."""
    q_block, kv_block, L, S = entry.q_block, entry.kv_block, entry.L, entry.S
    nb, nh = index["b"].shape[1], index["h"].shape[2]
    q0, q1 = block0 * q_block, min(block1 * q_block, L)
    rows_per_block = torch.tensor([min(q_block, L - i * q_block) for i in range(block0, block1)])
    per_block = [torch.zeros(block1 - block0, dtype=torch.long) for _ in range(3)]
    if entry.full is not None:  # full blocks: every row of the query block sees all their keys
        rows, cols = entry.full
        pick = (rows >= block0) & (rows < block1)
        rows, cols = rows[pick] - block0, cols[pick]
        first, last = cols * kv_block, ((cols + 1) * kv_block).clamp(max=S) - 1
        for total, value in zip(per_block, _closed_sums(first, last)):
            total.scatter_add_(0, rows, value)
    # per row, with one slot more at the end where the partial tiles' rows past L land
    sums = [torch.cat([t.repeat_interleave(rows_per_block), t.new_zeros(1)]).expand(nb, nh, -1).clone()
            for t in per_block]
    rows, cols = entry.partial
    pick = (rows >= block0) & (rows < block1)
    rows, cols = rows[pick], cols[pick]
    if rows.numel():
        budget[0] -= rows.numel() * q_block * kv_block * nb * nh
        if budget[0] < 0:
            return None
        q = rows[:, None] * q_block + torch.arange(q_block)  # [tiles, rows]
        kv = cols[:, None] * kv_block + torch.arange(kv_block)  # [tiles, keys]
        values = {**index, "q_idx": q.clamp(max=L - 1).view(-1, 1, 1, q_block, 1),
                  "kv_idx": kv.clamp(max=S - 1).view(-1, 1, 1, 1, kv_block)}
        allowed = torch.broadcast_to(evaluate(mask_mod, clamp_lookups=True, **{name: values[name] for name in reads}),
                                     (len(rows), nb, nh, q_block, kv_block))
        if bool((kv >= S).any()):
            allowed = allowed & (kv < S).view(-1, 1, 1, 1, kv_block)
        c0, c1, c2 = _offset_sums(allowed.contiguous().view(-1, kv_block)).view(3, *allowed.shape[:-1]).unbind(0)
        start = (cols * kv_block).view(-1, 1, 1, 1)
        tile_sums = (c0, start * c0 + c1, start * start * c0 + 2 * start * c1 + c2)
        at = (q - q0).clamp(max=q1 - q0).view(-1, 1, 1, q_block).expand(-1, nb, nh, -1)
        flat = lambda t: t.permute(1, 2, 0, 3).reshape(nb, nh, -1)
        for total, value in zip(sums, tile_sums):
            total.scatter_add_(-1, flat(at), flat(value))
    return tuple(t[..., :-1] for t in sums)


def _offset_sums(allowed: torch.Tensor) -> torch.Tensor:
    """``[3, rows]`` int64: the count, ``sum j`` and ``sum j^2`` of the allowed offsets ``j`` in each
    row of the boolean ``[rows, c]``. One int8 product (exact in int32) with ``1`` and the 7-bit
    digits of ``j`` and ``j^2`` as columns, where the kernel exists and ``c`` allows; else a
    float64 product (exact: every sum is far below 2^53). The int8 product reads the booleans as
    they are; converting them to float costs several times the product."""
    c = allowed.shape[-1]
    j = torch.arange(c)
    if c % 8 == 0 and c <= 1 << 14 and allowed.shape[0] > 16:
        digits = lambda x, n: [(x >> (7 * i)) & 127 for i in range(n)]
        columns = torch.stack([torch.ones_like(j), *digits(j, 2), *digits(j * j, 4), torch.zeros_like(j)], 1)
        try:
            d = torch._int_mm(allowed.view(torch.int8), columns.to(torch.int8)).long()
        except (RuntimeError, AttributeError):  # (a torch without the CPU kernel)
            pass
        else:
            return torch.stack([d[:, 0], d[:, 1] + (d[:, 2] << 7),
                                d[:, 3] + (d[:, 4] << 7) + (d[:, 5] << 14) + (d[:, 6] << 21)])
    jf = j.to(torch.float64)
    return (allowed.to(torch.float64) @ torch.stack([torch.ones_like(jf), jf, jf * jf], 1)).round_().long().T


def _closed_sums(first: torch.Tensor, last: torch.Tensor) -> tuple:
    """``(count, sum kv, sum kv^2)`` of the key ranges ``[first, last]`` (``0 <= first <= last``)."""
    s1 = lambda x: x * (x + 1) // 2
    s2 = lambda x: x * (x + 1) * (2 * x + 1) // 6
    return last - first + 1, s1(last) - s1(first - 1), s2(last) - s2(first - 1)


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
    fold = foldable(query, key, value)
    q, k, v = _kernel_inputs(query, key, value, fold)
    calls, n_workers = _split(_calls(starts, query.shape[1], q.shape[2], k.shape[2], fold), q.shape[0], q.shape[1])
    if len(calls) == 1:
        out, lse = causal_chunks.forward(q, k, v, scale)
    else:
        out, lse = causal_chunks.kernel_layout(q, v.shape[-1]), q.new_empty(q.shape[:-1])

        def one_call(call, worker):
            rows, qs, ks = call
            out[rows, :, qs], lse[rows, :, qs] = causal_chunks.forward(q[rows, :, qs], k[rows, :, ks], v[rows, :, ks],
                                                                       scale)
        workers.run(calls, _costs(calls, q.shape[1]), one_call, n_workers, dynamic=True)
    # (unfolded, the kernel's lse is [B, L, H]-strided: laid out row-major like every path's)
    return _unfolded(out, query, fold), _unfolded(lse, query, fold).contiguous()


def recordable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`recorder`'s gradients come out in the inputs' own layouts (flexc's
    and torch's contract): row-major inputs that fold, or inputs laid out as the kernel lays its
    gradients out (``[B, L, H, E]`` memory, one key batch per query batch). A row-major GQA call's
    gradients would come back ``[B, L, H, E]``-strided."""
    if foldable(query, key, value):
        return True
    return key.shape[0] == query.shape[0] and all(t.transpose(1, 2).is_contiguous() for t in (query, key, value))


def recorder(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
             causal: bool = True, mask: Callable[[bool], torch.Tensor] | None = None
             ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The function ``(query, key, value) -> output`` of plain causal attention
    (:data:`ONE_SEQUENCE`; ``causal=False``: attention with no mask, or with the additive mask
    ``mask(folded)`` returns for the kernel's inputs, batch and heads folded or not) as one kernel
    call recorded by autograd, for :func:`recordable` inputs laid out as these (shapes and strides:
    what it decides here, once, holds for every call of a plan): torch's own backward node for the
    kernel (and for the fold's views) computes the gradients. The logsumexp the kernel returns is
    not differentiable, so it is not returned. A causal call that :func:`causal_chunks.split`
    splits is one node of flexc's instead, the split calls' (faster)."""
    fold = foldable(query, key, value)
    chunked = causal and causal_chunks.split(query.shape[2], key.shape[2])
    if fold and not chunked and mask is None:
        # (the fold's sizes worked out here, once: a warm call's Python costs several times its own
        # time inside a training step, its data evicted by the kernel's)
        q_size, k_size, v_size, out_size, _ = _fold_sizes(query, key, value)

        def record_folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            out, _ = fused_cpu.FLASH(query.view(q_size), key.view(k_size), value.view(v_size), is_causal=causal,
                                     scale=scale)
            return out.view(out_size)
        return record_folded

    def record(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        q, k, v = _kernel_inputs(query, key, value, fold)
        if chunked:
            out = causal_chunks.RecordedChunks.apply(q, k, v, scale)
        elif mask is not None:
            out, _ = fused_cpu.FLASH(q, k, v, attn_mask=mask(fold), scale=scale)
        else:
            out, _ = fused_cpu.FLASH(q, k, v, is_causal=causal, scale=scale)
        return _unfolded(out, query, fold)
    return record


def prepared_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, starts: Starts
                     ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`forward` for the calls of one plan's signature (shapes, strides and ``starts`` as
    here): plain causal attention on inputs that fold, while it takes one worker, is
    :func:`forward_folded` with the fold's sizes worked out once (:func:`forward` decides its fold,
    calls and workers at every call: ~10 us of a warm CPU forward's ~55 us of Python); anything
    else is :func:`forward`."""
    if starts != ONE_SEQUENCE or not foldable(query, key, value):
        return lambda query, key, value: forward(query, key, value, scale, starts)
    sizes = _fold_sizes(query, key, value)
    one_worker = workers_for(query, key, threads=sys.maxsize) == 1  # (whatever the thread count: small calls)

    def folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not one_worker and workers_for(query, key) > 1:
            return forward(query, key, value, scale, starts)
        return forward_folded(query, key, value, scale, sizes)
    return folded


def forward_folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, sizes: tuple
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` of plain causal attention (:data:`ONE_SEQUENCE`) in one worker, for
    :func:`foldable` inputs: one causal call on the inputs folded to ``sizes`` (:func:`_fold_sizes`)."""
    q_size, k_size, v_size, out_size, lse_size = sizes
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        with torch.no_grad():  # (as forward: outputs that need no grad, whoever calls)
            return forward_folded(query, key, value, scale, sizes)
    out, lse = causal_chunks.forward(query.view(q_size), key.view(k_size), value.view(v_size), scale)
    return out.view(out_size), lse.view(lse_size).contiguous()


def fills_past_the_diagonal(starts: Starts, L: int, S: int) -> bool:
    """Whether every kernel call of these sequences masks in the kernel's causal mode, which fills
    the scores past the diagonal with -inf (none is split by :func:`causal_chunks.split`, whose
    chunks add a -inf mask): a non-finite query or key then stays in the rows that see it, and only
    a non-finite value row (times its 0 probabilities) reaches earlier rows."""
    return not any(causal_chunks.split(qs.stop - qs.start, ks.stop - ks.start)
                   for _, qs, ks in _calls(starts, 1, L, S, False))


def _fold_sizes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple:
    """``(query, key, value sizes folded, output size, logsumexp size)`` of :func:`foldable` inputs:
    batch and heads folded into the kernel's batch of one head, and the outputs' sizes unfolded."""
    B, H, L, _ = query.shape
    return (*((B * H, 1, *t.shape[2:]) for t in (query, key, value)), (B, H, L, value.shape[3]), (B, H, L))


@torch.no_grad()
def backward(query, key, value, out, lse, grad_out, scale: float,
             starts: Starts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the forward's ``out`` and ``lse`` over the same kernel calls, in the
    inputs' dtypes (a key batch broadcast over the query's gets its gradients summed)."""
    fold = foldable(query, key, value, out, grad_out)
    q, k, v = _kernel_inputs(query, key, value, fold)
    o, go, l = (_folded(t, fold) for t in (out, grad_out, lse.to(query.dtype)))
    calls, n_workers = _split(_calls(starts, query.shape[1], q.shape[2], k.shape[2], fold), q.shape[0], q.shape[1])
    if len(calls) == 1:
        dq, dk, dv = causal_chunks.backward(go, q, k, v, o, l, scale)
    else:  # each key belongs to one sequence of its batch: every gradient row is written once
        dq, dk, dv = (causal_chunks.kernel_layout(t) for t in (q, k, v))

        def one_call(call, worker):
            rows, qs, ks = call
            dq[rows, :, qs], dk[rows, :, ks], dv[rows, :, ks] = causal_chunks.backward(
                go[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], o[rows, :, qs], l[rows, :, qs],
                scale)
        workers.run(calls, _costs(calls, q.shape[1]), one_call, n_workers, dynamic=True)
    if key.shape[0] != query.shape[0]:
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return _unfolded(dq, query, fold), _unfolded(dk, key, fold), _unfolded(dv, value, fold)


def workers_for(query: torch.Tensor, key: torch.Tensor, threads: int | None = None) -> int:
    """How many one-thread workers plain causal attention's kernel calls take (:func:`_split`) at
    torch's thread count (or ``threads``); 1: one call in this thread, on torch's own threads."""
    B, H, L, _ = query.shape
    return _worker_count(B * H, B * H * L * key.shape[2] / 2, threads)


def _worker_count(n_calls: int, cost: float, threads: int | None = None) -> int:
    return workers.worker_count(n_calls, cost, fused_cpu.MIN_COST_PER_WORKER, threads)


def _split(calls: list, rows: int, heads: int) -> tuple[list, int]:
    """``(calls, n_workers)``: with several workers, each call split into one call per row of the
    kernel's first dimension (``rows`` of them, ``heads`` heads each: a head when folded, else a
    batch), taken by one-thread workers as they come free. torch's own threads split one call
    statically, and the one on a core another process holds then stalls the call (6 documents,
    L=4096, two threads with one core busy: 4.8x the quiet one-thread time); here the other
    worker takes more of the calls."""
    split = [(slice(i, i + 1), qs, ks) for row_range, qs, ks in calls for i in range(*row_range.indices(rows))]
    n_workers = _worker_count(len(split), sum(_costs(split, heads)))
    return (split, n_workers) if n_workers > 1 else (calls, 1)


def _costs(calls: list, heads: int) -> list[float]:
    """Scores each call computes (about half its tile: causal)."""
    return [float((qs.stop - qs.start) * (ks.stop - ks.start) * heads / 2) for _, qs, ks in calls]


def _calls(starts: Starts, H: int, L: int, S: int, fold: bool) -> list[tuple[slice, slice, slice]]:
    """``(batch rows, query rows, key rows)`` of each kernel call: the first dimension of the
    kernel's inputs holds a batch's H heads when folded, the batch itself otherwise."""
    per_batch = [(slice(None), starts[0])] if len(starts) == 1 else [
        (slice(b * H, (b + 1) * H) if fold else slice(b, b + 1), batch_starts) for b, batch_starts in enumerate(starts)]
    calls = []
    for rows, batch_starts in per_batch:
        for start, next_start in zip(batch_starts, batch_starts[1:] + (None,)):
            # the last sequence runs to the end of the queries and of the keys
            calls.append((rows, slice(start, next_start or L), slice(start, next_start or S)))
    return calls


# The kernel lays its outputs and gradients out as [B, L, H, E] (torch's SDPA layout), which a
# row-major [B, H, L, E] caller would then copy (flexc returns torch FlexAttention's layouts,
# flexc.backends.layout). Batch and heads folded into one batch of one head make that layout the
# row-major one: the same work, split the same way, and no copies.

def foldable(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is row-major with the query's batch and heads (no GQA, no key batch
    broadcast), so batch and heads fold into one dimension as views."""
    B, H = tensors[0].shape[:2]
    return all(t.shape[:2] == (B, H) and t.is_contiguous() for t in tensors)


def _folded(t: torch.Tensor, fold: bool) -> torch.Tensor:
    return fused_cpu.heads_folded(t) if fold else fused_cpu.unit_last_stride(t)


def _unfolded(t: torch.Tensor, like: torch.Tensor, fold: bool) -> torch.Tensor:
    return t.view(*like.shape[:2], *t.shape[2:]) if fold else t


def _kernel_inputs(query, key, value, fold: bool):
    query, key, value = (_folded(t, fold) for t in (query, key, value))
    if key.shape[0] != query.shape[0]:  # one key batch for every query batch: a stride-0 view
        key, value = key.expand(query.shape[0], *key.shape[1:]), value.expand(query.shape[0], *value.shape[1:])
    return query, key, value
