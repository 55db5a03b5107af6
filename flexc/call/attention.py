"""``flex_attention``: the drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

An eager call runs the plan of its signature (:mod:`flexc.call.plans`): on the first call of a
signature the inputs are validated, the mods traced (:func:`flexc.trace`), a forward backend picked
from :mod:`flexc.backends.registry` and, for training, wrapped in flexc's autograd Function
(:mod:`flexc.call.training`), so every backend trains; later calls of that signature launch. Learned
attention sinks are folded into the backends' softmax (:mod:`flexc.call.sinks`). Under torch.compile
the call becomes one custom-op node (:mod:`flexc.torch_compile.under_compile`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from ..backends import dropout
from ..backends.layout import laid_out_like
from ..dtypes import work_dtype
from . import plans, validate
from .plan import (AuxOutput, AuxRequest, CallPlan, FallbackWarning, choose_backend, falls_back,  # noqa: F401
                   generated_backward_fallback, in_dtype_of, plan_call, prepare_call, wanted_outputs, warn_fallback)
from .sinks import check_sinks


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
    if type(dropout_p) is not float or dropout_p != 0.0 or generator is not None:  # (the default needs no check)
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
    context parallelism passes a dropout whose pairs are the full sequence's. Runs the plan of the
    call's signature (:mod:`flexc.call.plans`: decided on the first call of that signature)."""
    plan = plans.plan_for(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                          return_aux, drop, sinks)
    out, lse, max_scores = plan.run(query, key, value, block_mask, drop, sinks)
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
    want_lse, want_max = wanted_outputs(backend, return_lse, return_aux)
    from ..torch_compile import under_compile  # (the compile path, imported when a compiled call needs it)

    out, lse, max_scores = under_compile.flex_attention(query, key, value, score_mod, block_mask, scale, options,
                                                        want_max, want_lse, dropout_p, seed, sinks)
    out, lse = laid_out_like(out, query), lse.to(work_dtype(query.dtype))  # as in eager (empty if not wanted)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores if want_max else None)
    if return_lse:
        return out, lse
    return out
