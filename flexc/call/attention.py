"""``flex_attention``: the drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

The call validates its inputs, traces the mods once (:func:`flexc.trace`), picks a forward backend
from :mod:`flexc.backends.registry`, and wraps it in a ``torch.autograd.Function`` whose backward is the torch
block-sparse path (:func:`flexc.backends.cpu.torch_cpu.torch_backward`), so every backend trains.
Learned attention sinks are folded into the backends' softmax (:mod:`flexc.call.sinks`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from ..backends import dropout, registry
from ..backends.cpu.torch_cpu import forward_with_max, recorded_forward, torch_backward, torch_forward
from ..backends.layout import laid_out_like
from ..dtypes import work_dtype
from ..masks.empty_entries import without_empty_entries
from . import validate
from .plan import (AuxOutput, AuxRequest, CallPlan, FallbackWarning, choose_backend, falls_back,  # noqa: F401
                   generated_backward_fallback, in_dtype_of, plan_call, prepare_call, warn_fallback)
from .sinks import check_sinks, sink_grad


class _FlexAttentionFunction(torch.autograd.Function):
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
        extra = _dropout_keyword(drop) | _sinks_keyword(sinks)
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
                                                    **_dropout_keyword(ctx.dropout), **_sinks_keyword(sinks))
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


def _dropout_keyword(drop: dropout.Dropout | None) -> dict:
    """``dropout=drop`` for a backend's functions when the call drops (a backend without dropout
    support is never asked: :func:`flexc.call.plan.dropout_backend`)."""
    return {"dropout": drop} if drop is not None else {}


def _sinks_keyword(sinks: torch.Tensor | None) -> dict:
    """``sinks=rows`` (``[B or 1, Hq, 1]``) for a backend's forward when the call has sinks; a call
    without them passes nothing, so it runs exactly the sink-free kernels."""
    return {"sinks": sinks} if sinks is not None else {}


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | None = None, block_mask: Any = None, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False, kernel_options: dict | None = None,
                   *, return_aux: AuxRequest | None = None, sinks: torch.Tensor | None = None,
                   dropout_p: float = 0.0, generator: torch.Generator | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, AuxOutput]:
    """Attention with a programmable score and a block-sparse mask, with torch 2.13's semantics.

    Args:
        query: ``[B, Hq, L, E]``. key: ``[B or 1, Hkv, S, E]``. value: ``[B or 1, Hkv, S, Ev]``.
            fp16, bf16, fp32 or fp64, one dtype and device.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score
            ``q.k * scale`` before masking; ``h`` is the query head. Captured float tensors that
            require grad receive gradients (0-d scalars and repeated lookups included).
        block_mask: a BlockMask from ``flexc.create_block_mask`` or torch's; ``None`` allows all.
            Its ``seq_lengths`` must be ``(L, S)``; its batch/heads must be 1 or match the input.
        scale: default ``1/sqrt(E)``.
        enable_gqa: allow ``Hq`` a multiple of ``Hkv``; query head ``h`` reads key head ``h // (Hq // Hkv)``.
        return_lse: also return the logsumexp (prefer ``return_aux``).
        kernel_options: torch's keys are accepted; ``BACKEND`` picks ``"TORCH"`` (CPU block-sparse,
            the default on CPU), ``"TRITON"`` (default on CUDA) or ``"AUTO"``.
        return_aux: ``AuxRequest(lse=True, max_scores=True)`` to get an :class:`AuxOutput`.
        sinks: flexc's own (torch has none): learned attention-sink logits, ``[Hq]`` or broadcastable
            to ``[B, Hq]``, any float dtype, may require grad; each joins its rows' softmax
            denominator with no value row, and the returned lse includes it (:mod:`flexc.call.sinks`).
        dropout_p, generator: flexc's own: attention dropout (as SDPA's: kept probabilities scaled
            by ``1 / (1 - p)``), its mask drawn per (b, h, q_idx, kv_idx) from a seed taken from
            ``generator`` (:mod:`flexc.backends.dropout`); 0 is exactly the call without it.

    Returns:
        ``out [B, Hq, L, Ev]`` in the query's dtype; with ``return_lse`` also ``lse``, with
        ``return_aux`` also an :class:`AuxOutput`. ``out`` keeps the query's dimension order (a
        query permuted from ``[B, L, H, E]`` gives an output whose transpose back is free), as
        torch's does. lse is natural-log ``[B, Hq, L]``, float64 for float64 inputs and fp32
        otherwise. A query
        row with nothing allowed gets output 0, lse ``-inf`` and zero gradients.

    Example:
        >>> causal = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
        >>> out = flexc.flex_attention(q, k, v, block_mask=causal)
    """
    rows = None
    if sinks is not None:
        validate.check_flags(enable_gqa, return_lse, return_aux)
        rows = check_sinks(sinks, query)
    dropout_p = dropout.check(dropout_p, generator)
    if torch.compiler.is_compiling():
        seed = (dropout.seed_tensor(None) if generator is None else _generator_seed_outside_the_graph(generator)) if dropout_p else None
        return _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                              return_lse, return_aux, dropout_p, seed, rows)
    drop = dropout.draw(dropout_p, generator) if dropout_p else None
    return attend(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                  return_aux, drop, rows)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None, block_mask: Any,
           scale: float | None, enable_gqa: bool, return_lse: bool, kernel_options: dict | None,
           return_aux: AuxRequest | None, drop: dropout.Dropout | None, sinks: torch.Tensor | None = None):
    """:func:`flex_attention`'s eager call with its dropout already drawn (``drop``, None for none) and
    its sinks checked (``[B or 1, Hq, 1]`` from :func:`flexc.call.sinks.check_sinks`, or None);
    context parallelism passes a dropout whose pairs are the full sequence's."""
    scale, options, traced_score, traced_mask = prepare_call(query, key, value, score_mod, block_mask, scale,
                                                             enable_gqa, kernel_options,
                                                             outputs=(return_lse, return_aux))
    block_mask = without_empty_entries(block_mask)  # negative entries in the counts: blocks never visited
    key, value = in_dtype_of(query, key), in_dtype_of(query, value)
    plan = plan_call(query, key, value, traced_score, traced_mask, options, return_lse, return_aux,
                     dropout_p=drop.p if drop is not None else 0.0,
                     dropout_positions=drop is not None and (drop.q_positions is not None
                                                             or drop.kv_positions is not None), sinks=sinks,
                     block_mask=block_mask)
    backend, want_lse, want_max, slots = plan.backend, plan.want_lse, plan.want_max, plan.slots
    max_scores = None
    recorded = (recorded_forward(query, key, value, traced_score, traced_mask, block_mask, scale)
                if (plan.training and backend == registry.TORCH and drop is None and sinks is None and not want_lse
                    and not want_max) else None)
    if recorded is not None:  # torch's own autograd nodes: no Python in the backward
        out, lse = recorded, None
    elif plan.training:
        forward = registry.BACKENDS[backend]
        grad_buffers = [traced_score.buffers[i] for i in slots]
        out, lse = _FlexAttentionFunction.apply(query, key, value, forward, plan.generated, traced_score,
                                                traced_mask, block_mask, scale, options, slots, drop, sinks,
                                                *grad_buffers)
        if want_max:
            with torch.no_grad():
                max_scores = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                              dropout=drop)[2]
    elif want_max:
        out, lse, max_scores = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                                lse_dtype=work_dtype(query.dtype), dropout=drop, sinks=sinks)
    elif backend == registry.TORCH and (drop is not None or (want_lse and query.dtype == torch.float64)):
        # (the row loop draws the dropout; a float64 lse for float64 inputs, as torch's)
        out, lse, _ = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                       need_max=False, lse_dtype=work_dtype(query.dtype), dropout=drop, sinks=sinks)
    else:
        out, lse = registry.BACKENDS[backend](query, key, value, traced_score, traced_mask, block_mask, scale, options,
                                              want_lse, **_dropout_keyword(drop), **_sinks_keyword(sinks))
    out = laid_out_like(out, query)
    if lse is not None and lse.dtype != work_dtype(query.dtype):
        lse = lse.to(work_dtype(query.dtype))

    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    if return_lse:
        return out, lse
    return out


# torch._disable_dynamo, not torch.compiler.disable: the latter imports dynamo (and sympy, seconds) when
# flexc is imported; this one imports it on the first call, which happens only inside a compiled region
@torch._disable_dynamo
def _generator_seed_outside_the_graph(generator: torch.Generator) -> torch.Tensor:
    """The seed of a compiled call with an explicit ``generator``: drawn eagerly (a graph break), said once."""
    _warn_generator_breaks_graph()
    return dropout.seed_tensor(generator)


@functools.lru_cache(maxsize=None)
def _warn_generator_breaks_graph() -> None:
    warnings.warn("flexc: flex_attention(dropout_p > 0, generator=...) under torch.compile draws its seed outside "
                  "the graph (dynamo cannot trace a torch.Generator): the graph breaks before the call, and "
                  "fullgraph=True refuses it. The result is eager's. Fix: pass generator=None inside the compiled "
                  "region to keep one graph (the seed then comes from torch's default generator, seeded with "
                  "torch.manual_seed).", FallbackWarning, stacklevel=3)


def _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, return_lse,
                   return_aux, dropout_p=0.0, seed=None, sinks=None):
    """flex_attention under torch.compile: the same checks, then one custom-op node (:mod:`flexc.torch_compile.under_compile`);
    a dropout call's ``seed`` (a 0-d int64 tensor drawn as eager draws it) and the checked ``sinks``
    (``[B or 1, Hq, 1]``) are inputs of that node, which folds the sinks as eager calls do."""
    validate.check_tensors(query, key, value, enable_gqa)
    validate.check_flags(enable_gqa, return_lse, return_aux)
    validate.check_mod(score_mod)
    validate.check_block_mask(block_mask, query, key)
    scale = validate.check_scale(scale, query)
    options = validate.check_kernel_options(kernel_options)
    key, value = in_dtype_of(query, key), in_dtype_of(query, value)
    backend = options["BACKEND"] = choose_backend(options, query.device)
    want_max = bool(return_aux is not None and return_aux.max_scores)
    if want_max and backend != registry.TORCH:
        raise ValueError(f"flex_attention: return_aux.max_scores is supported by the TORCH backend only, got "
                         f"BACKEND={backend!r}. Fix: pass kernel_options={{'BACKEND': 'TORCH'}} or drop max_scores.")
    want_lse = return_lse or bool(return_aux is not None and return_aux.lse)
    from ..torch_compile import under_compile  # (the compile path, imported when a compiled call needs it)

    out, lse, max_scores = under_compile.flex_attention(query, key, value, score_mod, block_mask, scale, options,
                                                        want_max, want_lse, dropout_p, seed, sinks)
    out, lse = laid_out_like(out, query), lse.to(work_dtype(query.dtype))  # as in eager (empty if not wanted)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores if want_max else None)
    if return_lse:
        return out, lse
    return out
