"""The block-sparse torch backend's forward: flex attention with plain torch ops.

For each query block row it visits only the key blocks the BlockMask lists, scores them with one
batched matmul over every head that shares the row's block list, applies the score_mod
everywhere and the mask_mod only on partial blocks (both evaluated from the traced IR on index
tensors for exactly those positions), and merges chunks of keys with an online softmax. Working
memory is a few chunks of scores, never ``L x S``. The groups of heads and their rows of chunks are
:mod:`flexc.backends.cpu.head_groups`'s, the mods as the row loop applies them
:mod:`flexc.backends.cpu.row_mods`'s; the backward is :mod:`flexc.backends.cpu.torch_cpu_backward`.

GQA runs without copying keys: the ``G`` query heads that share a key head are stacked as rows,
so ``q [B, Hkv, G*r, E] @ k^T [B, Hkv, E, c]`` scores all of them at once, and the same memory
read as ``[B, Hq, r, c]`` is what the mods see.

Forwards without a score_mod or with a bias-form one (``score +/- X``), in fp32/fp64 with equal
query and value head dims, run on torch's fused CPU flash kernel instead
(:mod:`flexc.backends.cpu.fused_cpu`; small calls as one dense tile, :mod:`flexc.backends.cpu.dense_tile`);
this module's row loop serves the rest and ``max_scores``. Training calls that autograd can record
as one fused-kernel call are prepared here too (:func:`prepare_recorded`).

Learned attention sinks (flexc's ``sinks=``) start each row's online softmax: its max is the sink
logit and its sum 1, as for a key already seen with no value row (the fused and decode paths, which
end in torch's kernel, join the sink as one more merged part). The logsumexp then includes the sink.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from ..dropout import Dropout
from ...constants import LN2, LOG2E
from ...dtypes import work_dtype
from ...mods.trace import TracedMod
from ... import workers
from . import band_calls, band_plain, causal_call, decode_cpu, dense_tile, fused_cpu
from ..nonfinite import all_finite, matmul_skipping_zeros
from .block_plan import Row, all_full, chunk_kv_index, chunk_rows, memo_by_tables, read_tables
from .head_groups import Group, allowed_tile, row_tasks
from .row_mods import Mods, add_minus_inf, fill, score_bias

_NEG_INF = float("-inf")
# Softmax runs in base 2: torch's exp2 on CPU is several times faster than exp, and exp is ~30x
# slower still on inputs below -88 (masked and far-away scores), which exp2 handles at full speed.
# (The backward's natural exp keeps its argument above a floor instead: torch_cpu_backward.)


def torch_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any,
                  scale: float, kernel_options: dict | None = None, need_lse: bool = True,
                  dropout: Dropout | None = None, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention forward: ``(out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] fp32 or None)``;
    ``sinks`` ``[B or 1, Hq, 1]`` (:func:`flexc.call.sinks.check_sinks`) folded into every row's softmax."""
    out, lse, _ = forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale, need_max=False,
                                   need_lse=need_lse, dropout=dropout, sinks=sinks)
    return out, (lse if need_lse else None)


def causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout) -> causal_call.Starts | None:
    """The causal sequences' starts when the call runs as the fused kernel's causal calls
    (:func:`causal_call.applies`): no score_mod, no dropout and finite inputs (the kernel's own
    masking multiplies a NaN value row by 0 and keeps the NaN); else None."""
    if score_mod is not None or dropout is not None:
        return None
    starts = causal_call.applies(query, key, value, mask_mod, block_mask)
    return starts if starts is not None and all_finite(query, key, value) else None


def unmasked(block_mask: Any, L: int, S: int) -> bool:
    """No block mask, or one whose blocks are all full (:func:`block_plan.all_full`): plain attention."""
    if block_mask is None:
        return True
    return memo_by_tables(block_mask, ("all full", L, S), lambda: all_full(read_tables(block_mask, L, S), L, S),
                          unversioned=lambda: False)


def prepare_recorded(query, key, value, score_mod, mask_mod, block_mask, scale) -> Callable | None:
    """For training calls of one signature (a plan's: the same shapes, strides, dtypes, block-mask
    tables and mods), the function ``(query, key, value) -> output or None`` that computes a call's
    output by ops autograd records itself, or None when no such call can (then flexc's autograd
    Function trains it). With no dropout, sinks, logsumexp or max asked for (the caller's checks)
    and finite inputs, it is one call of the fused kernel, whose backward torch registers in C++: a
    training step then runs no Python after the forward, which is most of a small layer's step
    (B=2, H=4, L=256, D=32). The call is, in this order:

    * with no score_mod, plain causal attention (one sequence per batch) or attention with no block
      mask (or one whose blocks are all full): the kernel's causal or unmasked mode
      (:func:`causal_call.recorder`);
    * with no score_mod or a ``score +/- X`` one, a small call (:func:`dense_tile.fits`) other than
      several causal sequences: the kernel with the whole tile's additive mask
      (:mod:`flexc.backends.cpu.dense_tile`), while no captured tensor of the score_mod wants a gradient.

    What the signature fixes is decided here, once; a call checks only its thread count (where it
    can matter), the mods' captured tensors (their values are not in a signature) and its
    inputs' finiteness. A warm call's Python costs several times its own time inside a training
    step (the kernel's data and the interpreter's evict each other from the caches): deciding it
    all per call cost ~50 us of that step, the checks left ~25 us."""
    if not causal_call.recordable(query, key, value) or not causal_call.kernel_takes(query, value):
        return None
    if score_mod is None and unmasked(block_mask, L=query.shape[2], S=key.shape[2]):
        return _finite_only(causal_call.recorder(query, key, value, scale, causal=False))
    # (made on first need: a causal mask's plan has no use for it)
    dense = functools.cache(lambda: _dense_recorded(query, key, value, score_mod, mask_mod, block_mask, scale))
    if score_mod is not None or mask_mod is None:
        return dense()
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    record = _finite_only(causal_call.recorder(query, key, value, scale))

    def by_starts(starts: causal_call.Starts | None) -> Callable | None:
        # several causal sequences: flexc's Function, whose kernel calls skip the pairs across them
        # (6 documents in L=256 cost 0.8x the dense tile's step)
        if starts == causal_call.ONE_SEQUENCE:
            return record
        return dense() if starts is None else None
    if mask_mod.buffers:  # their values may change what the mask allows: checked each call (a memo lookup)
        def checked(query, key, value):
            run = by_starts(causal_call.sequence_starts(block_mask, mask_mod, B, Hq, L, S))
            return run(query, key, value) if run is not None else None
        return _one_thread_worker(query, key, checked)
    run = by_starts(causal_call.sequence_starts(block_mask, mask_mod, B, Hq, L, S))
    return _one_thread_worker(query, key, run) if run is record else run


def _dense_recorded(query, key, value, score_mod, mask_mod, block_mask, scale) -> Callable | None:
    """:func:`prepare_recorded`'s dense tile (:mod:`flexc.backends.cpu.dense_tile`), or None where the
    tile or its mask is too large or the score_mod is not ``score +/- X``."""
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if not dense_tile.fits(B, Hq, L, S) or (score_mod is not None and score_bias(score_mod)[0] is None):
        return None
    fold = causal_call.foldable(query, key, value)
    mask = lambda fold: dense_tile.call_mask(query, key, score_mod, mask_mod, block_mask, "folded" if fold else "plain")
    if dense_tile.kernel_mask_elements(tuple(mask(fold).shape), B, Hq, fold) > dense_tile.MAX_MASK_ELEMENTS:
        return None
    record = _finite_only(causal_call.recorder(query, key, value, scale, causal=False, mask=mask))
    if score_mod is not None and score_mod.buffers:
        # a captured tensor wanting a gradient needs flexc's backward (the kernel's has none for the mask)
        plain = record
        record = lambda query, key, value: (None if any(isinstance(t, torch.Tensor) and t.requires_grad
                                                        for t in score_mod.buffers) else plain(query, key, value))
    return _one_thread_worker(query, key, record)

def _finite_only(record: Callable) -> Callable:
    """``record`` for finite inputs, None for others (the kernel's masking multiplies a NaN value
    row by 0 and keeps the NaN; the block path leaves the rows before it finite)."""
    return lambda query, key, value: record(query, key, value) if all_finite(query, key, value) else None


def _one_thread_worker(query, key, record: Callable) -> Callable:
    """``record`` while the call takes one worker (:func:`causal_call.workers_for`), None when it
    is split over several (forward and backward, by flexc's Function): checked each call where the
    thread count can change it."""
    if causal_call.workers_for(query, key, threads=sys.maxsize) == 1:
        return record  # (one worker whatever the thread count: small calls)
    return lambda query, key, value: record(query, key, value) if causal_call.workers_for(query, key) == 1 else None


def forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale, need_max=True,
                     lse_dtype=torch.float32, need_lse=True, dropout: Dropout | None = None,
                     sinks: torch.Tensor | None = None):
    """:func:`torch_forward` that also returns the row maxima of the masked, modded scores (or None).

    ``lse_dtype`` lets the backward keep a float64 logsumexp for float64 inputs; ``need_lse=False``
    (the caller discards it) lets the decode path skip the logsumexp's fix-ups. With ``dropout``
    every call takes the row loop (the fused and decode paths cannot drop single pairs). ``sinks``
    (``[B or 1, Hq, 1]``) start every row's softmax; the row maxima stay the scores' own.
    """
    if dropout is None and decode_cpu.applies(query, key):  # short queries (decoding): a few batched ops, no row loop
        return decode_cpu.forward(query, key, value, score_mod, mask_mod, block_mask, scale, need_max, lse_dtype,
                                  need_lse, sinks)
    if (dropout is None and score_mod is None and query.numel() and key.shape[2]
            and fused_cpu.supported(query, value, None, need_max)
            and unmasked(block_mask, query.shape[2], key.shape[2])):  # plain attention: torch's fused kernel
        out, lse = decode_cpu.flash(query, key, value, [], scale)
        if sinks is not None:  # the kernel's softmax has no state to start from: the sink joins after it
            out, lse = fused_cpu.fold_sink(out, lse, sinks)
        return out, lse.to(lse_dtype), None
    starts = causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout) if not need_max else None
    if starts is not None:  # causal sequences: the kernel's causal mode
        out, lse = causal_call.forward(query, key, value, scale, starts)
        if sinks is not None:
            out, lse = fused_cpu.fold_sink(out, lse, sinks)
        return out, lse.to(lse_dtype), None
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, Ev = value.shape
    work = work_dtype(query.dtype)
    out = torch.empty(B, Hq, L, Ev, dtype=query.dtype, device=query.device)  # rows are written once
    lse = torch.full((B, Hq, L), _NEG_INF, dtype=lse_dtype, device=query.device)
    if sinks is not None:  # rows no task writes allow nothing: output 0, lse the sink
        lse.copy_(sinks.squeeze(-1).expand(B, Hq).unsqueeze(-1).expand(B, Hq, L))
    row_max = torch.full((B, Hq, L), _NEG_INF, dtype=torch.float32, device=query.device) if need_max else None
    if B * Hq * L == 0:
        return out, lse, row_max
    if not need_max and dense_tile.applies(query, key, value, score_mod, dropout, sinks):  # one call, its whole tile
        query, key, value = (fused_cpu.unit_last_stride(t) for t in (query, key, value))
        dense_tile.forward(query, key, value, out, lse, score_mod, mask_mod, block_mask, scale)
        return out, lse, row_max
    tasks, costs, n_workers, groups = row_tasks(block_mask, query, value, Hkv, score_mod, mask_mod, dropout)
    _zero_rows_without_blocks(out, groups, tasks, L)
    # Masked pairs must contribute exactly 0 whatever q/k/v hold; the fast paths (an additive -inf
    # mask, torch's fused kernel) turn NaN or inf there into NaN, so they need finite inputs.
    masked = bool(tasks) and tasks[0][1].mask_mod is not None
    finite = not masked or all_finite(query, key, value)
    fused = bool(tasks) and finite and dropout is None and fused_cpu.supported(query, value, tasks[0][1], need_max)
    if fused:  # few, large kernel calls that release the GIL: workers pay off on smaller jobs
        query, key, value = (fused_cpu.unit_last_stride(t) for t in (query, key, value))
        n_workers = workers.worker_count(len(tasks), sum(costs), fused_cpu.MIN_COST_PER_WORKER)
        bands, tasks = band_tasks(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = fused_cpu.group_tasks(tasks, n_workers)
        tasks, costs = bands + tasks, [band_cost(task) for task in bands] + costs

    elif tasks and plain_bands(tasks[0][1], query, finite, dropout, sinks) and row_max is None:
        cost_of = {id(task): cost for task, cost in zip(tasks, costs)}
        bands, tasks = band_tasks(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = bands + tasks, [band_cost(task) for task in bands] + [cost_of[id(task)] for task in tasks]

    def one_row(task, worker):
        g, mods, row = task
        if isinstance(row, band_calls.Band) and not fused:
            band_plain.forward(query, key, value, out, lse, g, row, mods, scale, work)
        elif isinstance(row, band_calls.Band):
            band_calls.forward(query, key, value, out, lse, g, row, mods, scale)
        elif fused:
            fused_cpu.forward_rows(query, key, value, out, lse, g, row, mods, scale, sinks)
        else:
            _forward_row(query, key, value, out, lse, row_max, g, row, mods, scale, work, finite, sinks)

    # rows write disjoint slices of out/lse; a single worker too runs with one torch thread (workers.run)
    workers.run(tasks, costs, one_row, n_workers, dynamic=True, torch_threads=False)
    return out, lse, row_max


def band_tasks(block_mask: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, Hkv: int, tasks: list,
               n_workers: int, sinks: torch.Tensor | None) -> tuple[list, list]:
    """``(bands, rest)``: the row tasks whose rows run as batched band calls
    (:mod:`flexc.backends.cpu.band_calls`, :mod:`flexc.backends.cpu.band_plain`), and the others.
    (Sinks join each row's merge: rows. A band's window may hold keys of blocks its row does not
    list, masked by -inf: finite inputs only.)"""
    if sinks is not None or not tasks or not all_finite(query, key, value):
        return [], tasks
    B, Hq, L, _ = query.shape
    Bkv, _, S, Ev = value.shape
    plan_key = (getattr(block_mask, "BLOCK_SIZE", None), B, Bkv, Hq, Hkv, L, S, Ev, torch.get_num_threads())
    mask_mod = tasks[0][1].mask_mod
    every = lambda q0, q1, start, end: torch.ones(q1 - q0, end - start, dtype=torch.bool)

    def allowed_for(g):
        return every if mask_mod is None else allowed_tile(mask_mod, g, B, Hq, L, S)
    return band_calls.plan_bands(block_mask, plan_key, tasks, n_workers, S,
                                 lambda g: (len(range(B)[g.b]), len(range(Hq)[g.qh])), allowed_for, query.dtype,
                                 query.device)


def plain_bands(mods: Mods, query: torch.Tensor, finite: bool, dropout, sinks) -> bool:
    """Whether the row loop's narrow rows may run as bands in plain torch ops
    (:mod:`flexc.backends.cpu.band_plain`): a general score_mod, float32/64, finite inputs (masks are
    an additive -inf), no dropout or sinks (the caller checks row maxima and gradient-wanting buffers)."""
    return (mods.log2_mod is not None and finite and dropout is None and sinks is None
            and query.dtype in (torch.float32, torch.float64))


def band_cost(task) -> float:
    """A band task's estimated cost (for the workers' split): its heads times its pairs."""
    g, mods, band = task
    return float(mods.b.numel() * mods.h.numel() * band.n * band.r * band.c)


def _batched_view(t: torch.Tensor, shape: tuple) -> torch.Tensor | None:
    """``t`` viewed as ``shape`` without copying, or None when its strides do not allow it."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def batched(kv: torch.Tensor, Bg: int, batch: int) -> torch.Tensor:
    """Key/value rows ``[Bk, Hkv_g, c, D]`` as ``[batch, c, D]`` for bmm, broadcasting Bk == 1 over Bg."""
    if kv.shape[0] != Bg:
        kv = kv.expand(Bg, *kv.shape[1:])
    return kv.reshape(batch, kv.shape[-2], kv.shape[-1])


def _zero_rows_without_blocks(out: torch.Tensor, groups: list, tasks: list, L: int) -> None:
    """Zero the output rows no task writes (query rows whose block rows list no key block)."""
    spans: dict[int, list[tuple[int, int]]] = {id(g): [] for g in groups}
    for g, _, row in tasks:
        spans[id(g)].append((row.q0, row.q1))
    for g in groups:
        start = 0
        for q0, q1 in sorted(spans[id(g)]) + [(L, L)]:
            if q0 > start:
                out[g.b, g.qh, start:q0] = 0
            start = max(start, q1)


def scaled_query_rows(query: torch.Tensor, g: Group, q0: int, q1: int, scale: float, work: torch.dtype) -> torch.Tensor:
    """``q * scale`` for rows ``[q0, q1)`` of the group, as ``[Bg, Hkv_g, G*r, E]`` (a fresh tensor)."""
    q = query[g.b, g.qh, q0:q1]
    q = q.to(work) * scale
    Bg, Hg, r, E = q.shape
    return q.reshape(Bg, Hg // g.G, g.G * r, E)  # a copy only for non-contiguous queries


def _forward_row(query, key, value, out, lse, row_max, g: Group, row: Row, mods: Mods, scale: float, work,
                 finite: bool = True, sinks: torch.Tensor | None = None):
    """One query row range: scores in log2 units (``s * log2(e)``), online softmax over its chunks.

    ``finite=False`` (q/k/v may hold NaN or inf) masks by selection and keeps masked keys' values
    out of the product, so masked pairs contribute exactly 0. ``sinks`` start the softmax.
    """
    q0, q1 = row.q0, row.q1
    # unless a general score_mod needs natural-log scores, fold log2(e) into the query so the
    # matmul yields base-2 scores directly
    bias_mod = mods.bias_node is not None
    general_mod = mods.score_mod is not None and not bias_mod
    qb = scaled_query_rows(query, g, q0, q1, scale * mods.pre_scale if general_mod else scale * LOG2E, work)
    Bg, Hkvg, Gr, _ = qb.shape
    Hqg, r = Hkvg * g.G, q1 - q0
    k_g, v_g = key[g.kb, g.kvh], value[g.kb, g.kvh]
    Ev = value.shape[-1]
    # accumulate P @ V with baddbmm_ into [Bg*Hkv_g, G*r, Ev]: straight into the (zeroed) output
    # rows when their layout allows, else into a scratch tensor; no temporary per chunk
    acc = out[g.b, g.qh, q0:q1]
    acc3 = _batched_view(acc, (Bg * Hkvg, Gr, Ev)) if out.dtype == work else None
    direct = acc3 is not None
    if not direct:
        acc = torch.empty(Bg, Hqg, r, Ev, dtype=work, device=out.device)
        acc3 = acc.view(Bg * Hkvg, Gr, Ev)
    m = l = top = None
    if sinks is not None:
        # the sink is a key already seen with no value row: the max starts at its logit (base 2) and
        # the sum at its exp2(sink - max) = 1 (0 for a -inf sink, which is no sink); acc holds nothing yet
        m = fused_cpu.group_sinks(sinks, g, Bg, r).to(work).unsqueeze(-1) * LOG2E
        l = (m != _NEG_INF).to(work)
    # bounded general score_mods: a fixed offset (not with sinks, which start the max, nor max_scores)
    fixed = mods.fixed_max if general_mod and sinks is None and row_max is None else None
    if fixed is not None:
        m = torch.full((Bg, Hqg, r, 1), fixed, dtype=work, device=out.device)
    first = True
    for chunk in row.chunks:
        kv = chunk_kv_index(chunk, mods.kv_pos)
        kc = chunk_rows(k_g, chunk).to(work)
        vc = chunk_rows(v_g, chunk).to(work)
        s = torch.matmul(qb, kc.transpose(-1, -2))  # [Bg, Hkv_g, G*r, c]
        s4 = s.view(Bg, Hqg, r, chunk.n_cols)
        blocked = mods.blocked(chunk, q0, q1, kv)
        if general_mod:
            # s4 is this chunk's own buffer: the mod's elementwise steps compute into it (soft-capping's
            # divide, tanh and multiply make no temporaries), and whatever they could not is copied in
            modded = mods.score(s4, q0, q1, kv, overwrite=True, mod=mods.log2_mod)
            if modded is not s4:
                s4.copy_(modded)  # broadcasts and casts into the buffer we own
            if not mods.log2_folded:
                s4.mul_(LOG2E)
            fill(s4, blocked, _NEG_INF)
        elif bias_mod:
            s4.add_(mods.bias(q0, q1, kv), alpha=mods.bias_sign * LOG2E)
            fill(s4, blocked, _NEG_INF)
        elif finite:
            add_minus_inf(s4, blocked)
        else:
            fill(s4, blocked, _NEG_INF)
        if fixed is not None:
            # every score is within FIXED_MAX_SPAN below the mod's bound: exp2(s - bound) neither
            # overflows nor underflows, the offset never changes, and no rescaling follows
            s4.sub_(fixed).exp2_()
            p_sum = s4.sum(-1, keepdim=True)
            if mods.dropout is not None:
                s4.mul_(mods.kept(q0, q1, kv, s4.dtype))
            l = p_sum if l is None else l.add_(p_sum)
            m_new = m
        else:
            m_new = s4.amax(-1, keepdim=True)
            if row_max is not None and sinks is not None:  # max_scores: the scores' own max, without the sink
                top = m_new if top is None else torch.maximum(top, m_new)
            if m is not None:
                m_new = torch.maximum(m, m_new)
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # a row masked so far: exp2(-inf - 0) = 0
            s4.sub_(m_safe).exp2_()
            p_sum = s4.sum(-1, keepdim=True)
            if mods.dropout is not None:  # the denominator keeps every pair; the values see the kept ones
                s4.mul_(mods.kept(q0, q1, kv, s4.dtype))
            if l is None:
                l = p_sum
            else:
                alpha = (m - m_safe).exp2_()
                l.mul_(alpha).add_(p_sum)
                if not first:  # (the first chunk's product below overwrites acc)
                    acc.mul_(alpha)
        if finite or not blocked:
            # the first chunk overwrites (beta=0 ignores whatever the rows held)
            acc3.baddbmm_(s.view(Bg * Hkvg, Gr, -1), batched(vc, Bg, Bg * Hkvg), beta=0.0 if first else 1.0)
        else:
            part = matmul_skipping_zeros(s.view(Bg * Hkvg, Gr, -1), batched(vc, Bg, Bg * Hkvg))
            acc3.copy_(part) if first else acc3.add_(part)
        first = False
        m = m_new
    acc.div_(torch.where(l == 0, 1.0, l))  # fully masked rows: acc is 0, output 0
    if not direct:
        out[g.b, g.qh, q0:q1] = acc
    m_safe = m.masked_fill(m == _NEG_INF, 0.0)
    # l is 0 only for rows with nothing allowed; NaN (a NaN or +inf score) stays NaN, as in torch
    lse[g.b, g.qh, q0:q1] = torch.where(l == 0, _NEG_INF, (m_safe + torch.log2(l)) * LN2).squeeze(-1)
    if row_max is not None:
        row_max[g.b, g.qh, q0:q1] = ((m if top is None else top) * LN2).squeeze(-1)
