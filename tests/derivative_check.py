"""flexc.mods.derivative's gradients of a score_mod, evaluated from the IR alone on an index grid in
float64, against torch.autograd through a direct (untraced) call of the same score_mod."""
from __future__ import annotations

import torch

import flexc
from flexc.mods.derivative import differentiate
from flexc.mods.evaluate import evaluate
from reference import index_tensors

B, H, L, S = 2, 4, 33, 29  # the grid every check runs on


def promote_buffers(fn, dtype=torch.float64):
    """Turn the float tensors ``fn`` captures into ``dtype`` leaves that require grad (in place)."""
    traced = flexc.trace(fn)
    leaves = []
    for t in traced.buffers:
        if t.is_floating_point():
            t.data = t.data.to(dtype)
            t.requires_grad_()
            leaves.append(t)
    return leaves


def ir_gradients(fn, score, w):
    """``(d score, [d buffer])`` of ``sum(w * fn(score, ...))`` from the derivative IR alone."""
    traced = flexc.trace(fn)
    d = differentiate(traced)
    b, h, q, kv = index_tensors(B, H, L, S)
    grid = dict(score=score.detach(), b=b, h=h, q_idx=q, kv_idx=kv)
    d_score = evaluate(d.as_mod(d.d_score, "d_score"), **grid) * w
    grads = {slot: torch.zeros_like(t, dtype=torch.float64) for slot, t in enumerate(traced.buffers)
             if t.is_floating_point()}
    for g in d.gathers:
        value = (evaluate(d.as_mod(g.grad, "g"), **grid) * w).expand(score.shape)
        target = grads[g.slot]
        if not g.indices:
            target += value.sum()
            continue
        index = []
        for dim, node in enumerate(g.indices):
            i = evaluate(d.as_mod(node, "i"), **grid).long().expand(score.shape)
            index.append(i % target.shape[dim])  # negative lookups count from the end
        target.index_put_(tuple(index), value, accumulate=True)
    return d_score.expand(score.shape), [grads[slot] for slot in sorted(grads)]


def autograd_gradients(fn, score, w, leaves):
    b, h, q, kv = index_tensors(B, H, L, S)
    out = torch.broadcast_to(fn(score, b, h, q, kv), score.shape)
    if not out.requires_grad:  # a score_mod that reads neither the score nor a leaf
        return [torch.zeros_like(x) for x in [score, *leaves]]
    grads = torch.autograd.grad((out * w).sum(), [score, *leaves], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, [score, *leaves])]


def check_derivative(fn, seed=0):
    """d score and d each captured float tensor from the derivative IR equal torch.autograd's, on the grid."""
    leaves = promote_buffers(fn)
    gen = torch.Generator().manual_seed(seed)
    score = (torch.randn(B, H, L, S, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    w = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64)
    want = autograd_gradients(fn, score, w, leaves)
    d_score, d_buffers = ir_gradients(fn, score, w)
    for i, (got, ref) in enumerate(zip([d_score, *d_buffers], want)):
        assert got.shape == ref.shape
        # (float32 captured tables and float32 index arithmetic round differently along the two
        # evaluation orders: a few float32 ulps of each term, so a captured tensor's gradient, a sum
        # over the grid whose terms may cancel, is compared at the scale of its largest element; a
        # wrong derivative is off by far more)
        atol = 1e-7 if i == 0 else max(1e-7, 2e-5 * float(ref.abs().max()))
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-5, atol=atol)
