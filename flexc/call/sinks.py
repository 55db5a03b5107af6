"""Learned attention sinks: one extra logit per query head that joins the softmax's denominator
but has no value row (gpt-oss and others). flexc's own keyword ``sinks=`` of
:func:`flexc.flex_attention`; torch's FlexAttention has none.

With ``s`` the sink logit of a row's head (and batch), the row's probabilities are
``exp(score - lse)`` where ``lse = log(exp(s) + sum exp(score))``, and the sink's own share
``exp(s - lse)`` is dropped. Every path folds the sink into its online softmax: the row's running
max starts at ``s`` and its denominator at ``exp(s - s) = 1`` (instead of ``-inf`` and 0), as for a
key already seen that has no value row, so the output's normalisation and the logsumexp include it:

* the CPU row loop and the Triton forward kernel start each row's softmax there (the kernel gets the
  sink code and argument only for a call with sinks: ``ForwardSpec.sinks``);
* the split-KV decode kernel's merge (``MergeSpec.sinks``) starts from the sink as from one more
  split with output 0; context parallelism folds it into each rank's own-blocks part, so once per row;
* the CPU paths whose softmax ends inside torch's fused kernel join it as that part after it;
* under torch.compile the sinks are an input of the call's one custom-op node
  (:mod:`flexc.torch_compile.custom_ops`), which passes them to the same backends, so compiled and
  eager calls fold them alike.

A -inf sink is no sink; a row with nothing allowed gets output 0 and logsumexp ``s``. The returned
logsumexp includes the sink, as Hugging Face transformers' rescaling computes it. Gradients: the
training forward's statistics include the sink, so the backward's probabilities are the sink-aware
ones (the torch backward's per-row renormalisation counts the sink's share); the sink's own gradient
is ``sum over rows of p_sink * (grad_lse - rowsum(out * dO))`` (:func:`sink_grad`), computed by the
autograd Function's backward in eager calls and by the backward op under torch.compile.
"""
from __future__ import annotations

import torch

from ..dtypes import work_dtype


def check_sinks(sinks, query: torch.Tensor, where: str = "flex_attention") -> torch.Tensor:
    """``sinks`` as a ``[B or 1, Hq, 1]`` view to broadcast over the rows, after checking it: any
    shape that broadcasts to ``[B, Hq]`` (``[]``, ``[1]``, ``[Hq]``, ``[B, 1]``, ...) is expanded over
    the heads, so every path reads one logit per head (autograd sums the gradient back to the
    sinks' own shape)."""
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
    return rows.expand(rows.shape[0], Hq).unsqueeze(-1)


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
              grad_lse: torch.Tensor | None) -> torch.Tensor:
    """The gradient of the sinks ``[B or 1, Hq, 1]`` (:func:`check_sinks`) of a call whose output is
    ``out`` and logsumexp (sink included) ``lse``, given ``grad_out`` and ``grad_lse`` (None: 0).

    ``d lse / d s = p_sink`` and ``d out / d s = -p_sink * out`` with ``p_sink = exp(s - lse)``, so per
    row ``p_sink * (grad_lse - rowsum(out * dO))``, summed over the rows and over the batch where the
    sinks broadcast. Computed eagerly from tensors the backward has anyway: one pass over ``out``."""
    work = work_dtype(lse.dtype)
    lse = lse.to(work)
    # a row with lse -inf (nothing allowed, a -inf sink) has no sink share: exp(-inf - 0) = 0
    p_sink = (sinks.detach().to(work) - lse.masked_fill(lse == float("-inf"), 0.0)).exp()
    delta = (out.to(work) * grad_out.to(work)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(work)
    grad = -(p_sink * delta).sum(-1)  # [B, Hq]
    if sinks.shape[0] == 1:
        grad = grad.sum(0, keepdim=True)
    return grad.unsqueeze(-1).to(sinks.dtype)
