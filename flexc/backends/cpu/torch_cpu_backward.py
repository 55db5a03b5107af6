"""The block-sparse torch backend's backward: gradients of flex attention recomputed per query row.

The backward recomputes each row's scores, forms ``dS`` from the saved logsumexp, and lets
autograd carry ``dS`` through the score_mod to the raw scores and the captured tensors. It takes
the forward's paths where the forward took them (:mod:`flexc.backends.cpu.torch_cpu`): causal calls
and small dense tiles as torch's fused backward, rows on the fused kernel's backward, bands, or
the row loop here. With learned attention sinks the forward's logsumexp includes the sink; the
probabilities ``exp(s - lse)`` are right as they are, and the per-row renormalisation counts the
sink's share ``exp(sink - lse)``. Large jobs spread their rows over single-threaded workers
(:mod:`flexc.workers`).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ..dropout import Dropout
from ...dtypes import work_dtype
from ...mods.trace import TracedMod
from ... import workers
from . import band_calls, band_plain, causal_call, dense_tile, fused_cpu
from ..nonfinite import all_finite, matmul_skipping_zeros
from .block_plan import Chunk, Row, add_chunk_rows, chunk_kv_index, chunk_rows
from .head_groups import Group, row_tasks
from .row_mods import Mods, add_minus_inf, fill, zero_blocked
from .torch_cpu import band_cost, band_tasks, batched, causal_starts, plain_bands, scaled_query_rows

_NEG_INF = float("-inf")
# The backward's softmax takes the natural exp, as the reference's does (see _chunk_probs); torch's
# CPU exp is ~30x slower on inputs below -88 (masked and far-away scores), so it keeps its argument
# above a floor (_exp_floored_).
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}  # exp of each is still a normal number


@functools.lru_cache(maxsize=None)
def _exp_floor(dtype: torch.dtype) -> tuple[float, float]:
    """``(floor, exp(floor))`` for ``dtype``, exp taken by the same vectorised kernel as the scores'."""
    floor = _EXP_FLOOR[dtype]
    return floor, torch.full((64,), floor, dtype=dtype).exp_()[0].item()


def _exp_floored_(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in place, off the slow path torch's CPU exp takes on -inf (~5x) and on underflow
    (~100x below -87 in fp32): the argument is floored where exp is still a normal number and
    exp(floor) taken off again, so arguments at or below the floor give exactly 0 and every result
    above ~2^-100 is bit-identical to exp's."""
    floor, at_floor = _exp_floor(x.dtype)
    return x.clamp_(min=floor).exp_().sub_(at_floor)


def torch_backward(query, key, value, out, lse, grad_out, grad_lse, score_mod: TracedMod | None,
                   mask_mod: TracedMod | None, block_mask: Any, scale: float,
                   grad_slots: Sequence[int] = (), dropout: Dropout | None = None,
                   sinks: torch.Tensor | None = None):
    """Gradients ``(dq, dk, dv, buffer_grads)`` of block-sparse attention, recomputed per query row.

    ``grad_slots`` are the score_mod buffer slots that need gradients; ``buffer_grads`` follows
    their order. ``grad_lse`` may be None. Rows with ``lse == -inf`` (fully masked) get zero gradients.
    ``sinks`` (``[B or 1, Hq, 1]``): the forward's, whose ``lse`` includes them; the sinks' own
    gradient is the caller's (:func:`flexc.call.sinks.sink_grad`).
    """
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, _ = value.shape
    starts = (causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout)
              if grad_lse is None or not bool(grad_lse.any()) else None)
    if starts is not None:  # as the forward ran
        dq, dk, dv = causal_call.backward(query, key, value, out, lse, grad_out, scale, starts)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), []
    work = work_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=work, device=query.device)
    dk = torch.zeros(key.shape, dtype=work, device=query.device)
    dv = torch.zeros(value.shape, dtype=work, device=query.device)
    buffers = list(score_mod.buffers) if score_mod is not None else []
    leaves, dtypes = [], []
    for slot in grad_slots:
        # a 16-bit captured tensor's gradient sums many small terms: the leaf is an exact fp32 copy,
        # so autograd accumulates in fp32 and the sum is rounded once at the end (the mod's values
        # are unchanged: the scores it meets are fp32 already)
        dtypes.append(buffers[slot].dtype)
        wide = torch.float32 if buffers[slot].dtype in (torch.float16, torch.bfloat16) else buffers[slot].dtype
        buffers[slot] = buffers[slot].detach().to(wide).requires_grad_()
        leaves.append(buffers[slot])
    buf_grads = [torch.zeros_like(t) for t in leaves]
    if B * Hq * L == 0:
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), [g.to(d) for g, d in zip(buf_grads, dtypes)]
    if (dense_tile.applies(query, key, value, score_mod, dropout, sinks) and fused_cpu.FLASH_BACKWARD is not None
            and not grad_slots and (grad_lse is None or not bool(grad_lse.any()))):  # as the forward ran (dense_tile.forward)
        lse_bw = lse.to(query.dtype).masked_fill(lse == _NEG_INF, float("inf"))
        q_, k_, v_, o_, go_ = (fused_cpu.unit_last_stride(t) for t in (query, key, value, out, grad_out))
        dense_tile.backward(q_, k_, v_, o_, lse_bw, go_, dq, dk, dv, score_mod, mask_mod, block_mask, scale)
        return _summed(query, key, value, dq, [(dk, dv, buf_grads)], buf_grads, dtypes)
    tasks, costs, n_workers, _ = row_tasks(block_mask, query, value, Hkv, score_mod, mask_mod, dropout)
    finite = not (tasks and tasks[0][1].mask_mod is not None) or all_finite(query, key, value)
    fused = finite and tasks and fused_cpu.backward_supported(query, value, tasks[0][1], grad_lse, grad_slots)
    if fused:  # large C++ calls that release the GIL, each on a one-thread worker (fused_cpu.denormals_flushed)
        n_workers = workers.worker_count(len(tasks), sum(costs), fused_cpu.MIN_COST_PER_WORKER)
    # dq rows are disjoint; dk, dv and buffer gradients sum over rows, so each worker has its own
    sums = [(dk, dv, buf_grads)] + [(torch.zeros_like(dk), torch.zeros_like(dv), [torch.zeros_like(t) for t in leaves])
                                    for _ in range(n_workers - 1)]
    if fused:
        # the forward's own fused kernel calls, backward: a few large C++ calls per row instead of
        # the row loop's dozens of torch ops (fused_cpu.backward_row)
        lse_bw = lse.to(query.dtype).masked_fill(lse == _NEG_INF, float("inf"))
        q_, k_, v_, o_, go_ = (fused_cpu.unit_last_stride(t) for t in (query, key, value, out, grad_out))

        bands, tasks = band_tasks(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = fused_cpu.group_tasks(tasks, n_workers)  # runs of rows share tall calls, as forward
        tasks, costs = bands + tasks, [band_cost(task) for task in bands] + costs

        def fused_row(task, worker):
            g, mods, rows = task
            if isinstance(rows, band_calls.Band):
                band_calls.backward(q_, k_, v_, o_, lse_bw, go_, dq, sums[worker][0], sums[worker][1], g, rows, mods,
                                    scale)
                return
            fused_cpu.backward_rows(q_, k_, v_, o_, lse_bw, go_, dq, sums[worker][0], sums[worker][1], g, rows, mods,
                                    scale)
        workers.run(tasks, costs, fused_row, n_workers, torch_threads=False)
        return _summed(query, key, value, dq, sums, buf_grads, dtypes)
    # the softmax Jacobian's correction delta = rowsum(dO * P * dP) - dLSE. With a score_mod,
    # _backward_row sums its dO part from its own probabilities (see there); without one, the
    # flash identity rowsum(dO * out) is as accurate (fp32 rmse within 1.2x of SDPA's) and saves
    # that first pass over the row
    own_delta = score_mod is not None
    delta = (-grad_lse.to(work).unsqueeze(-1) if grad_lse is not None
             else torch.zeros(B, Hq, L, 1, dtype=work, device=query.device))
    if not own_delta:
        delta = delta + (grad_out.to(work) * out.to(work)).sum(-1, keepdim=True)
    lse_safe = lse.to(work).masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)
    # each row's sink share exp(sink - lse): its probabilities sum to 1 with it (0 without sinks)
    sink_share = None
    if sinks is not None and own_delta:
        sink_share = (sinks.to(work).unsqueeze(-1) - lse_safe).exp().expand(B, Hq, L, 1)

    if tasks and plain_bands(tasks[0][1], query, finite, dropout, sinks) and not leaves:
        cost_of = {id(task): cost for task, cost in zip(tasks, costs)}
        bands, tasks = band_tasks(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = bands + tasks, [band_cost(task) for task in bands] + [cost_of[id(task)] for task in tasks]

    def one_row(task, worker):
        g, mods, row = task
        dk_w, dv_w, buf_w = sums[worker]
        if isinstance(row, band_calls.Band):
            band_plain.backward(query, key, value, grad_out, delta, lse_safe, dq, dk_w, dv_w, g, row, mods, scale,
                                work)
            return
        _backward_row(query, key, value, grad_out, delta, lse_safe, dq, dk_w, dv_w, buffers, leaves,
                      buf_w, g, row, mods, scale, work, Bkv == 1 and B > 1, finite, own_delta, sink_share)

    workers.run(tasks, costs, one_row, n_workers, torch_threads=False)
    return _summed(query, key, value, dq, sums, buf_grads, dtypes)


def _summed(query, key, value, dq, sums, buf_grads, dtypes):
    """``(dq, dk, dv, buffer_grads)`` in the inputs' dtypes, the workers' dk, dv and buffer sums added up."""
    dk, dv, _ = sums[0]
    for dk_w, dv_w, buf_w in sums[1:]:
        dk += dk_w
        dv += dv_w
        for total, part in zip(buf_grads, buf_w):
            total += part
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
            [g.to(d) for g, d in zip(buf_grads, dtypes)])


# Probabilities and dO @ V^T kept from the first pass of a row for its second pass, up to this
# many elements per row task (beyond it the second pass recomputes them).
_KEEP_ELEMENTS = 1 << 22


def _chunk_probs(qb, k_g, v_g, dob_g, lse_r, buffers, chunk: Chunk, mods: Mods, q0: int, q1: int, Hqg: int,
                 work, grad: bool, finite: bool = True, grad_buffers: bool = False):
    """One chunk's ``(kc, s4, post, p, dp, blocked)``: scores, the score_mod's output (with its graph
    when ``grad``; soft-capping without captured tensors wanting gradients: None, and s4 its tanh), softmax probabilities from the saved logsumexp, and ``dO @ V^T`` (0 on masked
    pairs when ``finite`` is False: a masked NaN/inf value must not reach delta, dS or the buffers)."""
    Bg, r = qb.shape[0], q1 - q0
    kv = chunk_kv_index(chunk, mods.kv_pos)
    kc = chunk_rows(k_g, chunk).to(work)
    vc = chunk_rows(v_g, chunk).to(work)
    s4 = torch.matmul(qb, kc.transpose(-1, -2)).view(Bg, Hqg, r, chunk.n_cols)
    blocked = mods.blocked(chunk, q0, q1, kv)
    post = None
    if mods.tanh_cap is not None and not grad_buffers:
        # soft-capping: qb holds the query times the mod's pre-factor, so s4 = score * pre; its tanh,
        # in place, is kept in s4 for the slope (_backward_row), and p = exp(cap * tanh - lse), the
        # product and the logsumexp in one pass
        cap = mods.tanh_cap[1]
        p = torch.add(lse_r.neg(), s4.tanh_(), alpha=cap)
        if -abs(cap) - float(lse_r.max()) > _exp_floor(p.dtype)[0]:
            p.exp_()  # every argument is above exp's slow range: no floor needed
        else:
            _exp_floored_(p)
    else:
        if mods.score_mod is not None:
            if grad and "score" in mods.score_reads:
                s4.requires_grad_()
            with torch.set_grad_enabled(grad):
                post = mods.score(s4, q0, q1, kv, buffers).expand(s4.shape)
            p = torch.empty_like(s4).copy_(post.detach())
        else:
            p = s4
        # natural exp, as the softmax of the reference (exp2 of (s - lse) * log2(e) adds one rounding)
        _exp_floored_(p.sub_(lse_r))
    zero_blocked(p, blocked)
    dp = torch.matmul(dob_g, vc.transpose(-1, -2)).view(Bg, Hqg, r, -1)
    if not finite:
        fill(dp, blocked, 0.0)
    kept = None
    if mods.dropout is not None:  # d out / d p through the kept pairs only (the forward's mask, regenerated)
        kept = mods.kept(q0, q1, kv, dp.dtype)
        dp.mul_(kept)
    return kc, s4, post, p, dp, blocked, kept


def _mask_only_chunk(qb, k_g, v_g, dob_g, lse_r, delta_r, dq_r, dk_g, dv_g, chunk: Chunk, mods: Mods,
                     q0: int, q1: int, scale: float, work, sum_kv_batch: bool) -> None:
    """One chunk's share of dq, dk and dv for a backward with neither score_mod nor dropout, on
    finite inputs, in few passes: blocked pairs enter ``s - lse`` as ``-inf`` (so ``p`` is exactly
    0 there, with no zeroing pass) and ``dS = P * (dP - delta)`` is formed in place. (``baddbmm``
    from the broadcast row terms was no faster: torch copies the broadcast input first.)"""
    Bg, Hkvg, Gr, E = qb.shape
    r, c = q1 - q0, chunk.n_cols
    batch = Bg * Hkvg
    kv = chunk_kv_index(chunk, mods.kv_pos)
    kc = batched(chunk_rows(k_g, chunk).to(work), Bg, batch)
    vc = batched(chunk_rows(v_g, chunk).to(work), Bg, batch)
    q3, do3 = qb.reshape(batch, Gr, E), dob_g.reshape(batch, Gr, -1)
    p = torch.bmm(q3, kc.transpose(-1, -2)).sub_(lse_r.reshape(batch, Gr, 1))
    add_minus_inf(p.view(Bg, -1, r, c), mods.blocked(chunk, q0, q1, kv))
    _exp_floored_(p)
    ds = torch.bmm(do3, vc.transpose(-1, -2)).sub_(delta_r.reshape(batch, Gr, 1)).mul_(p)  # P * (dP - delta)
    dq_r.view(batch, Gr, E).add_(torch.bmm(ds, kc), alpha=scale)
    for grad, lhs, rhs in ((dk_g, ds, q3), (dv_g, p, do3)):
        _add_product(grad, chunk, lhs.transpose(-1, -2), rhs, Bg, sum_kv_batch)


def _add_product(grad_g: torch.Tensor, chunk: Chunk, lhs: torch.Tensor, rhs: torch.Tensor, Bg: int,
                 sum_kv_batch: bool) -> None:
    """``grad_g[..., chunk rows, :] += lhs @ rhs`` (``[batch, c, *]`` products of a group's key heads).
    A product into the rows' strided view would run batch by batch (torch splits a baddbmm_ whose
    output batches are not evenly strided into one addmm_ each), so it is formed apart and added."""
    update = torch.bmm(lhs, rhs).view(Bg, -1, chunk.n_cols, grad_g.shape[-1])
    add_chunk_rows(grad_g, chunk, update, sum_kv_batch)


def _backward_row(query, key, value, grad_out, delta, lse_safe, dq, dk, dv, buffers, leaves, buf_grads,
                  g: Group, row: Row, mods: Mods, scale: float, work, sum_kv_batch: bool, finite: bool = True,
                  own_delta: bool = True, sink_share: torch.Tensor | None = None):
    q0, q1 = row.q0, row.q1
    capped = mods.tanh_cap is not None and not leaves  # soft-capping's slope formed in place
    pre = mods.tanh_cap[0] if capped else 1.0
    qb = scaled_query_rows(query, g, q0, q1, scale * pre, work)
    Bg, Hkvg, Gr, E = qb.shape
    Hqg, r = Hkvg * g.G, q1 - q0
    dob = grad_out[g.b, g.qh, q0:q1].to(work)
    dob_g = dob.reshape(Bg, Hkvg, Gr, -1)
    lse_r = lse_safe[g.b, g.qh, q0:q1]
    k_g, v_g = key[g.kb, g.kvh], value[g.kb, g.kvh]
    dk_g, dv_g = dk[g.kb, g.kvh], dv[g.kb, g.kvh]
    dq_r = torch.zeros(Bg, Hkvg, Gr, E, dtype=work, device=query.device)
    args = (qb, k_g, v_g, dob_g, lse_r, buffers)
    extra = {"finite": finite, "grad_buffers": bool(leaves)}
    # Pass 1: delta = rowsum(P * dP) - dLSE from this backward's own probabilities. The flash
    # identity rowsum(dO * out) equals it only up to the forward's rounding, and that mismatch
    # doubled dq/dk errors with learnable biases (fp32 rmse vs float64, L=256: dq 1.25x -> 1.12x
    # of SDPA's, dbias 1.35x -> 1.19x).
    # It also sums each row's probabilities: exp(s - lse) from the saved logsumexp sums to 1 only up
    # to the forward's rounding of lse and of the scores (one factor on a whole row), and that
    # factor, uncorrected, is a bias in every dS of the row. Pass 2 divides by the sum, so its
    # probabilities sum to 1 in this pass's own arithmetic (fp32 rmse vs float64, L=256, worst of
    # 20 seeds: dbias 1.27x -> 1.07x of SDPA's, dq 1.16x -> 1.03x).
    delta_r = delta[g.b, g.qh, q0:q1].clone()
    if not own_delta and mods.dropout is None and finite:
        for chunk in row.chunks:
            _mask_only_chunk(qb, k_g, v_g, dob_g, lse_r, delta_r, dq_r, dk_g, dv_g, chunk, mods, q0, q1, scale, work,
                             sum_kv_batch)
        dq[g.b, g.qh, q0:q1] = dq_r.view(Bg, Hqg, r, E)
        return
    if own_delta:
        # the row's probabilities sum to 1 with the sink's share (which has no value row, so no dP)
        p_dp = torch.zeros_like(delta_r)
        p_sum = sink_share[g.b, g.qh, q0:q1].clone() if sink_share is not None else torch.zeros_like(delta_r)
    kept, budget = [None] * len(row.chunks), _KEEP_ELEMENTS
    for i, chunk in enumerate(row.chunks if own_delta else ()):
        keep = budget >= Bg * Hqg * r * chunk.n_cols
        piece = _chunk_probs(*args, chunk, mods, q0, q1, Hqg, work, grad=keep, **extra)
        p_dp += (piece[3] * piece[4]).sum(-1, keepdim=True)
        p_sum += piece[3].sum(-1, keepdim=True)
        kept[i] = piece if keep else None
        budget -= Bg * Hqg * r * chunk.n_cols if keep else 0
    if own_delta:
        p_sum = torch.where(p_sum > 0, p_sum, 1.0)  # rows with nothing allowed: p is 0 there anyway
        delta_r += p_dp / p_sum
    for chunk, piece in zip(row.chunks, kept):
        kc, s4, post, p, dp, blocked, kept = piece or _chunk_probs(*args, chunk, mods, q0, q1, Hqg, work, grad=True,
                                                                   **extra)
        if own_delta:
            p.div_(p_sum)  # a kept chunk's p is pass 1's tensor, met here once
        p_g = (p if kept is None else p * kept).view(Bg, Hkvg, Gr, -1)
        dv_c = torch.matmul(p_g.transpose(-1, -2), dob_g)
        ds = dp.sub_(delta_r).mul_(p)  # gradient w.r.t. the post-mod score
        slope = 1.0  # a constant factor of dS left to the (smaller) products below
        if capped:  # times the slope over pre (pre is in qb): cap * (1 - tanh^2), from s4's tanh
            slope = mods.tanh_cap[1]
            ds.addcmul_(ds, s4.mul_(s4), value=-1.0)
        elif post is not None:
            wrt = ([s4] if s4.requires_grad else []) + leaves
            grads = torch.autograd.grad(post, wrt, ds, allow_unused=True) if post.requires_grad and wrt else [None] * len(wrt)
            for i, gb in enumerate(grads[len(wrt) - len(leaves):]):
                if gb is not None:
                    buf_grads[i] += gb
            ds = grads[0] if s4.requires_grad else None
        if ds is not None:
            ds = ds.contiguous()
            if post is not None or not finite:  # (else p, so dS, is 0 there already)
                zero_blocked(ds, blocked)  # masked entries never reach the output, whatever the mod's slope
            ds_g = ds.view(Bg, Hkvg, Gr, -1)
            # a masked pair (dS = 0) must not bring a NaN or inf key into dq, or such a query into dk
            matmul = torch.matmul if finite or not blocked else matmul_skipping_zeros
            dq_r.add_(matmul(ds_g, kc), alpha=scale * pre * slope)
            dk_c = matmul(ds_g.transpose(-1, -2), qb)
            add_chunk_rows(dk_g, chunk, dk_c.mul_(slope) if slope != 1.0 else dk_c, sum_kv_batch)
        add_chunk_rows(dv_g, chunk, dv_c, sum_kv_batch)
    dq[g.b, g.qh, q0:q1] = dq_r.view(Bg, Hqg, r, E)
