"""Training through flexc's autograd Function: the backend's forward, then its generated backward or torch's.

:class:`FlexAttentionFunction` runs a call's forward on the chosen backend and saves what its
backward reads: the generated backward's statistics (:data:`flexc.backends.registry.TRAINING`) or
the logsumexp for the torch backward (:func:`flexc.backends.cpu.torch_cpu_backward.torch_backward`, per
query row), so every backend trains. Learned attention sinks get their gradient here too.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..backends.cpu.torch_cpu_backward import torch_backward
from ..backends.layout import laid_out_like, output_strides
from ..dtypes import work_dtype
from .forward_path import Forward, backend_keywords
from .plan import falls_back, warn_fallback
from .sinks import sink_grad


class Trainer(NamedTuple):
    """What :class:`FlexAttentionFunction` runs for the calls of one plan, decided with the plan."""

    forward: Forward  # the forward that saves what the backward reads (flexc.call.forward_path's rule)
    training: tuple[Callable, Callable] | None  # its generated (forward, backward), prepared; None: torch's backward
    score_mod: Any  # the call's traced mods, scale, options and the score_mod's slots that receive gradients
    mask_mod: Any
    scale: float
    options: dict
    slots: tuple
    fallback: str | None  # the backend whose generated backward this call trains without (warned once)
    grad_strides: tuple  # the strides the query's, key's and value's gradients are returned with


def trainer(backend_forward: Callable, forward: Forward, training: tuple | None, score_mod: Any, mask_mod: Any,
            scale: float, options: dict, slots: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
            ) -> Trainer:
    """The :class:`Trainer` of a plan's calls (inputs of the layouts of ``query``, ``key``, ``value``) on the
    backend whose registered forward is ``backend_forward``."""
    return Trainer(forward, training, score_mod, mask_mod, scale, options, tuple(slots),
                   falls_back(backend_forward, training), tuple(output_strides(t.shape, t) for t in (query, key, value)))


class FlexAttentionFunction(torch.autograd.Function):
    """Forward on the chosen backend; backward by its generated kernels, or recomputing scores per
    query row on the torch path. ``apply(query, key, value, trainer, block_mask, drop, sinks,
    *grad_buffers)`` returns ``(out, lse)``, and the row maxima third when the plan wants them
    (a None output would cost every call autograd's handling of it); the non-tensor arguments in one
    :class:`Trainer` (what autograd's apply reads per argument costs a warm call's host time)."""

    @staticmethod
    def forward(ctx, query, key, value, trainer: Trainer, block_mask, drop, sinks, *grad_buffers):
        if trainer.fallback is not None:
            warn_fallback(trainer.score_mod, trainer.fallback)
        ctx.trainer, ctx.block_mask, ctx.dropout = trainer, block_mask, drop
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: no zeros made and read back
        out, lse, row_max, stats = trainer.forward.run(query, key, value, trainer.score_mod, trainer.mask_mod,
                                                       block_mask, drop, sinks)
        # what the backward reads: the generated backward's own statistics, else the logsumexp; with
        # sinks also the logsumexp and the sinks, for the sinks' gradient
        saved = lse if stats is None else stats
        if sinks is None:
            ctx.save_for_backward(query, key, value, out, saved)
        else:
            ctx.save_for_backward(query, key, value, out, saved, lse, sinks)
        lse_dtype = work_dtype(query.dtype)
        lse = lse if lse.dtype == lse_dtype else lse.to(lse_dtype)
        if row_max is None:
            return out, lse
        ctx.mark_non_differentiable(row_max)
        return out, lse, row_max

    @staticmethod
    def backward(ctx, grad_out, grad_lse, *grad_max):
        query, key, value, out, saved, *with_sinks = ctx.saved_tensors
        lse, sinks = with_sinks or (None, None)
        trainer, block_mask = ctx.trainer, ctx.block_mask
        score_mod, mask_mod, scale, slots = trainer.score_mod, trainer.mask_mod, trainer.scale, trainer.slots
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if trainer.training is not None:  # the backend's generated backward (its statistics include the sinks)
            dq, dk, dv, buf_grads = trainer.training[1](query, key, value, out, saved, grad_out, grad_lse, score_mod,
                                                        mask_mod, block_mask, scale, slots, trainer.options,
                                                        **backend_keywords(ctx.dropout, sinks))
        else:
            dq, dk, dv, buf_grads = torch_backward(query, key, value, out, saved, grad_out, grad_lse, score_mod,
                                                   mask_mod, block_mask, scale, slots, dropout=ctx.dropout,
                                                   sinks=sinks)
        # laid out as torch returns gradients (the backend's own layout when it is that one already)
        q_strides, k_strides, v_strides = trainer.grad_strides
        dq, dk = laid_out_like(dq, query, q_strides), laid_out_like(dk, key, k_strides)
        dv = laid_out_like(dv, value, v_strides)
        # the sinks' gradient, eagerly from the output, dO and the logsumexp (no kernel computes it:
        # it is one pass over the output per call, flexc.call.sinks.sink_grad)
        d_sinks = (sink_grad(sinks, out, grad_out, lse, grad_lse) if sinks is not None and ctx.needs_input_grad[6]
                   else None)
        return (dq, dk, dv, None, None, None, d_sinks, *buf_grads)


__all__ = ["FlexAttentionFunction", "Trainer", "trainer"]
