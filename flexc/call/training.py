"""Training through flexc's autograd Function: the backend's forward, then its generated backward or torch's.

:class:`FlexAttentionFunction` runs a call's forward on the chosen backend and saves what its
backward reads: the generated backward's statistics (:data:`flexc.backends.registry.TRAINING`) or
the logsumexp for the torch backward (:func:`flexc.backends.cpu.torch_cpu.torch_backward`, per
query row), so every backend trains. Learned attention sinks get their gradient here too.
"""
from __future__ import annotations

import torch

from ..backends import dropout
from ..backends.cpu.torch_cpu import forward_with_max, torch_backward, torch_forward
from ..backends.layout import laid_out_like
from ..dtypes import work_dtype
from .plan import falls_back, warn_fallback
from .sinks import sink_grad


class FlexAttentionFunction(torch.autograd.Function):
    """Forward on the chosen backend; backward recomputes scores per query row on the torch path."""

    @staticmethod
    def forward(ctx, query, key, value, forward, training, score_mod, mask_mod, block_mask, scale, options, slots,
                drop, sinks, *grad_buffers):
        ctx.backward_fn = training[1] if training is not None else None
        fallback = falls_back(forward, training)
        if fallback is not None:
            warn_fallback(score_mod, fallback)
        ctx.options, ctx.dropout = options, drop
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: no zeros made and read back
        extra = backend_keywords(drop, sinks)
        stats = None
        if training is not None:
            out, lse, stats = training[0](query, key, value, score_mod, mask_mod, block_mask, scale, options, **extra)
        elif forward is torch_forward and (query.dtype == torch.float64 or drop is not None):
            # a float64 logsumexp, for the backward and for the caller (torch returns float64 too)
            out, lse, _ = forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale,
                                           need_max=False, lse_dtype=work_dtype(query.dtype), **extra)
        else:
            out, lse = forward(query, key, value, score_mod, mask_mod, block_mask, scale, options, True, **extra)
        # what the backward reads: the generated backward's own statistics, else the logsumexp; with
        # sinks also the logsumexp and the sinks, for the sinks' gradient
        saved = lse if stats is None else stats
        ctx.save_for_backward(query, key, value, out, saved, *(() if sinks is None else (lse, sinks)))
        ctx.mods = (score_mod, mask_mod, block_mask, scale, slots)
        return out, lse.to(work_dtype(query.dtype))

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, saved, *with_sinks = ctx.saved_tensors
        lse, sinks = with_sinks or (None, None)
        score_mod, mask_mod, block_mask, scale, slots = ctx.mods
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if ctx.backward_fn is not None:  # the backend's generated backward (its statistics include the sinks)
            dq, dk, dv, buf_grads = ctx.backward_fn(query, key, value, out, saved, grad_out, grad_lse, score_mod,
                                                    mask_mod, block_mask, scale, slots, ctx.options,
                                                    **backend_keywords(ctx.dropout, sinks))
        else:
            dq, dk, dv, buf_grads = torch_backward(query, key, value, out, saved, grad_out, grad_lse, score_mod,
                                                   mask_mod, block_mask, scale, slots, dropout=ctx.dropout,
                                                   sinks=sinks)
        dq, dk, dv = (laid_out_like(g, t) for g, t in ((dq, query), (dk, key), (dv, value)))
        # the sinks' gradient, eagerly from the output, dO and the logsumexp (no kernel computes it:
        # it is one pass over the output per call, flexc.call.sinks.sink_grad)
        d_sinks = (sink_grad(sinks, out, grad_out, lse, grad_lse) if sinks is not None and ctx.needs_input_grad[12]
                   else None)
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None, d_sinks, *buf_grads)


def backend_keywords(drop: dropout.Dropout | None, sinks: torch.Tensor | None) -> dict:
    """A backend function's keywords for a call's dropout and sinks: ``dropout=drop`` when the call
    drops (a backend without dropout support is never asked: :func:`flexc.call.plan.dropout_backend`)
    and ``sinks=rows`` (``[B or 1, Hq, 1]``) when it has sinks; a call without them passes nothing,
    so it runs exactly the sink-free, dropout-free kernels."""
    keywords: dict = {}
    if drop is not None:
        keywords["dropout"] = drop
    if sinks is not None:
        keywords["sinks"] = sinks
    return keywords


__all__ = ["FlexAttentionFunction", "backend_keywords"]
