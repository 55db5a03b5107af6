"""``flexc.kernel_source``: the exact source of the kernels a ``flex_attention`` call launches.

It decides as :func:`flexc.flex_attention` does (:mod:`flexc.call.plan`) and asks the Triton
backend for the kernels of its plan (:func:`flexc.backends.triton.forward.plan_forward`,
:func:`flexc.backends.triton.backward.backward_source`) and their sources; nothing is compiled.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..backends import dropout, registry
from ..backends.triton.backward import backward_source
from ..backends.triton.forward import plan_forward
from ..backends.triton.sources import sources_text
from .forward_path import GENERATED, forward_path
from .plan import generated_backward_fallback, plan_call, prepare_call
from .sinks import check_sinks


def kernel_source(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None = None,
                  block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                  return_lse: bool = False, kernel_options: dict | None = None, *, return_aux: Any = None,
                  sinks: torch.Tensor | None = None, dropout_p: float = 0.0, generator: Any = None,
                  backward: bool = False) -> str:
    """The exact Triton source of the kernels :func:`flexc.flex_attention` launches for these arguments.

    Takes ``flex_attention``'s arguments, and decides as it does: the backend from
    ``kernel_options`` and the device (under :func:`flexc.device.simulate` the GPU's choices and
    its CUDA source), the logsumexp from ``return_lse``/``return_aux``, training from the inputs'
    ``requires_grad`` (and captured tensors that require grad) under ``torch.is_grad_enabled()``.

    * inference: the forward kernel (the variant that writes the logsumexp when it is returned);
    * training: the forward kernel that writes the logsumexp, which the backward reads;
    * at most 16 query rows (decoding): two kernels, the split-KV decode kernel and the merge of its
      splits (not in training with the generated backward, which runs the forward kernel). Their
      sources are concatenated in launch order, after a comment naming both, each opening with a
      ``# ======== kernel i/n: NAME ========`` line; the text still parses as Python;
    * ``backward=True``: the backward kernel a training call launches (whether or not the inputs
      require grad now; captured tensors that require grad receive gradients).

    With ``sinks`` the kernels are their sink variants, which fold the sinks into the softmax (the
    forward kernel, or the decode kernel's merge: :mod:`flexc.call.sinks`); the backward kernel is the
    same as without them (the forward's statistics include the sinks). With ``dropout_p > 0``
    the kernels are their dropout variants (for short queries the decode kernel's), which draw the
    mask from the call's seed.

    When the call runs no generated kernel (the TORCH backend, the default on CPU tensors; a backward
    of a score_mod the generated backward cannot differentiate, which trains through the torch
    backward; no rows or no keys), the text is a comment saying what runs instead. Nothing is
    compiled.

    >>> print(flexc.kernel_source(q, k, v, score_mod=alibi, block_mask=causal))  # doctest: +SKIP
    """
    rows = check_sinks(sinks, query) if sinks is not None else None
    _, options, traced_score, traced_mask = prepare_call(query, key, value, score_mod, block_mask, scale,
                                                         enable_gqa, kernel_options, outputs=(return_lse, return_aux))
    dropout_p = dropout.check(dropout_p, generator)
    plan = plan_call(query, key, value, traced_score, traced_mask, options, return_lse, return_aux,
                     training=True if backward else None, dropout_p=dropout_p, sinks=rows, block_mask=block_mask)
    if plan.backend != registry.TRITON:
        return _runs_instead(plan.backend, query.device, backward, own_backward=plan.generated is not None)
    if backward:
        if plan.generated is None:
            reason = (generated_backward_fallback(traced_score) or "").replace("\n", " ")
            why = (f"the generated backward cannot differentiate its\n# score_mod ({reason})"
                   if registry.TRITON in registry.TRAINING else "no generated backward is registered\n# for the TRITON backend")
            return (f"# flexc: this call's backward runs no generated kernel: {why}, so training runs the torch "
                    f"backward\n# (flexc.backends.cpu.torch_cpu_backward.torch_backward, per query row on {query.device}) "
                    f"after the generated forward.\n")
        return backward_source(query, value, traced_score, traced_mask, block_mask, options, dropout=bool(dropout_p))
    # the forward a call runs (training saves the logsumexp, or the generated pair's statistics)
    want_lse = plan.want_lse or plan.training
    path = forward_path(plan.backend, plan.generated is not None, plan.want_max, want_lse, query.dtype,
                        bool(dropout_p))
    forward = plan_forward(query, key, value, traced_score, traced_mask, block_mask, options, want_lse,
                           training=path == GENERATED, dropout=bool(dropout_p), sinks=rows is not None)
    return sources_text(forward.kernels, query.device)


def _runs_instead(backend: str, device: torch.device, backward: bool, own_backward: bool) -> str:
    """kernel_source's text for a call whose backend generates no kernel; for a backward, also what
    trains it (the backend's registered backward, else the torch backward)."""
    what = "backward" if backward else "call"
    if backend == registry.TORCH:
        runs = ("flexc's block-sparse PyTorch path, forward\n# (flexc.backends.cpu.torch_cpu) and backward "
                "(flexc.backends.cpu.torch_cpu_backward)")
    elif backward:
        trains = ("its own registered backward (flexc.backends.registry.TRAINING)" if own_backward else
                  "the torch backward\n# (flexc.backends.cpu.torch_cpu_backward.torch_backward)")
        runs = f"the {backend!r} backend's forward and trains through {trains}"
    else:
        runs = f"the {backend!r} backend"
    return (f"# flexc: this {what} runs no generated kernel: kernel_options['BACKEND'] resolves to {backend!r} for "
            f"tensors on {device},\n# so it runs {runs}.\n"
            f"# Fix: pass kernel_options={{'BACKEND': 'TRITON'}} to run (and show) the generated Triton kernels "
            f"(on CPU tensors\n# through Triton's interpreter), or wrap the call in flexc.device.simulate('sm_90') "
            f"to see the CUDA source a GPU runs.\n")


__all__ = ["kernel_source"]
