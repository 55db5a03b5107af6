"""Bands of narrow rows (:mod:`flexc.backends.cpu.band_calls`) with a general score_mod (soft-capping),
forward and backward, in plain torch ops over all of a band's tiles at once.

The fused kernel takes no score_mod but an additive one, so soft-capping runs on the row loop
(:mod:`flexc.backends.cpu.torch_cpu`), whose Python per 32-row part costs several times its arithmetic
on a narrow window (L=4096, H=8, window 17: ~230 ns per allowed pair against ~170 ns with no mod).
Here a band's tiles ``[Bg, Hg, n, r, c]`` are scored by one batched matmul over the strided key
windows, modded by one evaluation of the mod on index tensors for the tiles, and softmaxed whole:
every allowed pair of a row lies in its window, so there is no online rescaling. Tiles are taken
:data:`TILE_ELEMENTS` scores at a time.

Which calls come here is the caller's: finite inputs (masking is an additive -inf), no dropout,
sinks or row maxima, and for the backward no captured tensor that wants a gradient.
"""
from __future__ import annotations

import torch

from ...constants import LN2, LOG2E
from ...mods.evaluate import evaluate
from .band_calls import Band, add_windows, call_mask, index_values, query_rows, sub_band, windows

_NEG_INF = float("-inf")
# scores of one batch of tiles (the backward holds about four such tensors)
TILE_ELEMENTS = 1 << 20


def _slices(band: Band, Bg: int, Hg: int):
    """``band`` cut into sub-bands of at most :data:`TILE_ELEMENTS` scores."""
    step = max(1, TILE_ELEMENTS // (Bg * Hg * band.r * band.c))
    for t0 in range(0, band.n, step):
        yield sub_band(band, t0, min(t0 + step, band.n))


def _scores(query, key, g, band: Band, Bg: int, Hg: int, scale: float, work) -> torch.Tensor:
    """``q k^T * scale`` over the band's tiles, ``[Bg, Hg, n, r, c]``."""
    q = query_rows(query, g, band, Bg, Hg).to(work) * scale
    k = windows(key, g, band, Bg).to(work)
    return torch.matmul(q, k.transpose(-1, -2)).view(Bg, Hg, band.n, band.r, band.c)


def _blocked(band: Band, mods, Bg: int, Hg: int, dtype, device) -> torch.Tensor:
    """Pairs no block or mask_mod allows, ``[Bg, Hg, n, r, c]`` or ``[1, 1, n, r, c]``."""
    blocked = torch.isneginf(call_mask(band, mods, Bg, Hg, dtype, device))
    return blocked.view(Bg, Hg, *blocked.shape[1:]) if blocked.shape[0] > 1 else blocked.unsqueeze(0)


def forward(query, key, value, out, lse, g, band: Band, mods, scale: float, work) -> None:
    """The band's rows of ``out`` and ``lse`` (base-2 softmax, as the row loop's)."""
    Bg, Hg = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh])
    for part in _slices(band, Bg, Hg):
        s = _scores(query, key, g, part, Bg, Hg, scale * mods.pre_scale, work)
        modded = evaluate(mods.log2_mod, clamp_lookups=True, overwrite_score=True, score=s,
                          **index_values(part, mods, mods.score_reads - {"score"}, s.device))
        if modded is not s:
            s.copy_(modded)
        if not mods.log2_folded:
            s.mul_(LOG2E)
        s.masked_fill_(_blocked(part, mods, Bg, Hg, s.dtype, s.device), _NEG_INF)
        m = s.amax(-1, keepdim=True)
        m.masked_fill_(m == _NEG_INF, 0.0)  # a row with nothing allowed: exp2(-inf - 0) = 0
        p = s.sub_(m).exp2_()
        total = p.sum(-1, keepdim=True)
        o = torch.matmul(p.view(Bg * Hg, part.n, part.r, part.c), windows(value, g, part, Bg).to(work))
        o = o.view(Bg, Hg, part.n, part.r, -1).div_(torch.where(total == 0, 1.0, total))
        out[g.b, g.qh, part.q0:part.q1].unflatten(2, (part.n, part.r)).copy_(o)
        rows_lse = torch.where(total == 0, _NEG_INF, (m + torch.log2(total)) * LN2).squeeze(-1)
        lse[g.b, g.qh, part.q0:part.q1].unflatten(2, (part.n, part.r)).copy_(rows_lse)


def backward(query, key, value, grad_out, delta, lse_safe, dq, dk, dv, g, band: Band, mods, scale: float,
             work) -> None:
    """The band's gradients added into ``dq``, ``dk`` and ``dv``, as the row loop forms them: each
    row's probabilities ``exp(s - lse)`` renormalised to sum to 1 in this arithmetic, ``delta`` (the
    rows' ``-dLSE``, ``[B, Hq, L, 1]``) plus ``rowsum(P * dP)``, and dS through the mod (soft-capping's
    slope from its tanh in place, else autograd). ``lse_safe``: the logsumexp with -inf made 0."""
    Bg, Hg = len(range(dq.shape[0])[g.b]), len(range(dq.shape[1])[g.qh])
    capped = mods.tanh_cap
    pre = capped[0] if capped is not None else 1.0
    for part in _slices(band, Bg, Hg):
        shape = (Bg, Hg, part.n, part.r)
        rows = lambda t: t[g.b, g.qh, part.q0:part.q1].unflatten(2, (part.n, part.r))
        s = _scores(query, key, g, part, Bg, Hg, scale * pre, work)
        reads = index_values(part, mods, mods.score_reads - {"score"}, s.device)
        post = None
        lse_rows = rows(lse_safe).to(work)
        if capped is not None:  # s holds score * pre: its tanh, kept for the slope; cap * tanh - lse
            p = torch.add(lse_rows.neg(), s.tanh_(), alpha=capped[1])
        else:
            s.requires_grad_()
            with torch.enable_grad():
                post = evaluate(mods.score_mod, clamp_lookups=True, score=s, **reads).expand(s.shape)
            p = post.detach() - lse_rows
        # blocked pairs are zeroed after the exp: exp(-inf) takes torch's slow path (~5x)
        blocked = _blocked(part, mods, Bg, Hg, p.dtype, p.device)
        p.exp_().masked_fill_(blocked, 0.0)
        total = p.sum(-1, keepdim=True)
        p.div_(torch.where(total > 0, total, 1.0))
        do = rows(grad_out).to(work).reshape(Bg * Hg, part.n, part.r, -1)
        v = windows(value, g, part, Bg).to(work)
        dp = torch.matmul(do, v.transpose(-1, -2)).view(*shape, part.c)
        d = rows(delta).to(work) + (p * dp).sum(-1, keepdim=True)
        ds = dp.sub_(d).mul_(p)  # the gradient w.r.t. the modded score
        p3 = p.view(Bg * Hg, part.n, part.r, part.c)
        add_windows(dv, g, part, torch.matmul(p3.transpose(-1, -2), do), Bg)
        slope = 1.0
        if capped is not None:  # times cap * (1 - tanh^2); pre is in the query's scale
            slope = capped[1]
            ds.addcmul_(ds, s.mul_(s), value=-1.0)
        else:
            ds = torch.autograd.grad(post, s, ds)[0]
            ds = ds.masked_fill(blocked, 0.0)  # whatever the mod's slope on pairs that never count
        ds3 = ds.reshape(Bg * Hg, part.n, part.r, part.c)
        k = windows(key, g, part, Bg).to(work)
        rows(dq).add_(torch.matmul(ds3, k).view(*shape, -1), alpha=scale * pre * slope)
        q = query_rows(query, g, part, Bg, Hg).to(work)
        add_windows(dk, g, part, torch.matmul(ds3.transpose(-1, -2), q).mul_(scale * pre * slope), Bg)
