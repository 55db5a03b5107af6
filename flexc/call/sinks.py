"""Learned attention sinks: one extra logit per query head that joins the softmax's denominator
but has no value row (gpt-oss and others). flexc's own keyword ``sinks=`` of
:func:`flexc.flex_attention`; torch's FlexAttention has none.

With ``s`` the sink logit of a row's head (and batch), the row's probabilities are
``exp(score - lse)`` where ``lse = log(exp(s) + sum exp(score))``, and the sink's own share
``exp(s - lse)`` is dropped. Given the attention without the sink, ``(out0, lse0)``, that is one
logsumexp merge, the same one that combines two partial attentions:

    lse = logaddexp(lse0, s),  out = out0 * exp(lse0 - lse)

Every path computes ``(out0, lse0)`` already (the CPU block-sparse and fused paths, the Triton
forward and decode kernels, context parallelism's merged result), so the sink is applied here, once,
as that merge: an elementwise pass over the output. Autograd carries the gradients through it: the
backends' backward receives ``grad_lse`` as it does for ``return_lse`` (both generate it), and the
sink's gradient is ``sum over rows of p_sink * (grad_lse - rowsum(out * dO))``. The logsumexp
returned includes the sink, as Hugging Face transformers' rescaling computes it.
"""
from __future__ import annotations

import torch


def check_sinks(sinks, query: torch.Tensor, where: str = "flex_attention") -> torch.Tensor:
    """``sinks`` as a ``[B or 1, Hq, 1]`` view to broadcast over the rows, after checking it."""
    B, Hq = query.shape[0], query.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{where}: sinks must be a tensor of shape [Hq] (or broadcastable to [B, Hq]), got "
                        f"{type(sinks).__name__}. Fix: pass e.g. torch.zeros({Hq}, requires_grad=True).")
    if not sinks.is_floating_point():
        raise TypeError(f"{where}: sinks must be a floating-point tensor, got {sinks.dtype}. "
                        f"Fix: convert it with `.float()`.")
    if sinks.device != query.device:
        raise ValueError(f"{where}: sinks is on {sinks.device} but the query is on {query.device}. "
                         f"Fix: move it with `.to({str(query.device)!r})`.")
    try:
        grid = torch.broadcast_shapes(tuple(sinks.shape), (B, Hq))
    except RuntimeError:
        grid = None
    if grid != (B, Hq) or sinks.dim() > 2:
        raise ValueError(f"{where}: sinks must have shape [Hq] = [{Hq}] or broadcast to [B, Hq] = [{B}, {Hq}], "
                         f"got {list(sinks.shape)}. Fix: pass one logit per query head, e.g. shape [{Hq}].")
    rows = sinks if sinks.dim() == 2 else sinks.view(1, -1) if sinks.dim() == 1 else sinks.view(1, 1)
    return rows.unsqueeze(-1)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention without sinks, merged with each row's sink logit ``sinks``
    (``[B or 1, Hq, 1]``, from :func:`check_sinks`): the output rescaled by the share the keys keep,
    the logsumexp including the sink. Differentiable in all three."""
    work = lse.dtype  # fp32 (float64 for float64 inputs): the merge keeps the logsumexp's precision
    sink = sinks.to(work).expand_as(lse)
    # a row with nothing allowed (lse0 -inf) keeps output 0 and takes the sink's logsumexp; with a
    # -inf sink too it stays -inf (computed on zeros there, so no NaN reaches the gradients)
    dead = torch.isneginf(lse) & torch.isneginf(sink)
    lse_in, sink_in = torch.where(dead, 0.0, lse), torch.where(dead, 0.0, sink)
    merged = torch.logaddexp(lse_in, sink_in)
    keep = torch.where(dead, 0.0, torch.exp(lse_in - merged))
    out = (out.to(work) * keep.unsqueeze(-1)).to(out.dtype)
    return out, torch.where(dead, float("-inf"), merged)
