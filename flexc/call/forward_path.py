"""Which forward a call runs, and running it: one rule for eager calls, their training and compiled calls.

:func:`forward_path` decides, from the backend, whether a generated training pair runs, the outputs
asked for, the dtype and dropout, which forward computes a call's output: the backend's training
forward (:data:`flexc.backends.registry.TRAINING`, saving what its generated backward reads), the
TORCH path that also returns the row maxima, draws dropout or keeps a float64 logsumexp
(:func:`flexc.backends.cpu.torch_cpu.forward_with_max`), or the backend's forward (prepared once per
signature, :data:`flexc.backends.registry.PREPARE`, else the registered one). :class:`Forward` holds
that decision for one call signature and runs it. An eager call's plan (:mod:`flexc.call.plans`),
its autograd Function (:mod:`flexc.call.training`), the custom ops under torch.compile
(:mod:`flexc.torch_compile.op_plans`) and :func:`flexc.kernel_source` all ask here, so a change to the
rule is made once.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..backends import dropout as dropouts
from ..backends import registry
from ..backends.cpu.torch_cpu import forward_with_max
from ..dtypes import work_dtype

GENERATED = "generated"  # the backend's training forward, which saves its generated backward's statistics
ROWS = "rows"  # the TORCH path with the row maxima, dropout or a float64 logsumexp
FORWARD = "forward"  # the backend's forward (prepared for the signature where the backend prepares one)


def forward_path(backend: str, generated: bool, want_max: bool, want_lse: bool, dtype: torch.dtype,
                 dropout: bool) -> str:
    """The forward a call runs (see the module docstring). ``generated``: the call trains through the
    backend's generated pair; ``want_lse``: the logsumexp is returned or saved for a backward."""
    if generated:
        return GENERATED
    # TORCH's forward returns neither row maxima nor a float64 logsumexp: forward_with_max does, in
    # one pass that also gives the output (and draws the dropout as the registered forward would)
    if backend == registry.TORCH and (want_max or dropout or (want_lse and dtype == torch.float64)):
        return ROWS
    return FORWARD


def backend_keywords(drop: dropouts.Dropout | None, sinks: torch.Tensor | None) -> dict:
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


class Forward:
    """One call signature's forward on :func:`forward_path`'s path, decided once. :attr:`run`, called per
    call with ``(query, key, value, score_mod, mask_mod, block_mask, drop, sinks)``, returns ``(out, lse
    or None, row maxima or None, the generated backward's statistics or None)``.

    ``pair``: the backend's (possibly prepared) training forward and backward when the call trains
    through them, else None. ``compiled``: the calls pass their own mods, whose captured tensors a
    prepared forward reads (a compiled call's mods are rebuilt per call); ``same_tables``: as
    :data:`flexc.backends.registry.PREPARE`'s callables take it."""

    def __init__(self, backend: str, pair: tuple[Callable, Callable] | None, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, score_mod: Any, mask_mod: Any, block_mask: Any, scale: float, options: dict,
                 want_lse: bool, want_max: bool, dropout: bool, sinks: bool, compiled: bool = False,
                 same_tables: bool = False):
        self.path = forward_path(backend, pair is not None, want_max, want_lse, query.dtype, dropout)
        self.prepared: Callable | None = None
        if self.path == FORWARD:
            prepare = registry.PREPARE.get(backend)
            if prepare is not None:
                self.prepared = prepare(query, key, value, score_mod, mask_mod, block_mask, scale, options, want_lse,
                                        dropout, sinks)
        # the path as one function (no branch at each call; it keeps no reference to this object)
        self.run: Callable = _runner(self.path, backend, pair, self.prepared, scale, options, want_lse, want_max,
                                     work_dtype(query.dtype), compiled, same_tables)


def _runner(path: str, backend: str, pair: tuple | None, prepared: Callable | None, scale: float, options: dict,
            want_lse: bool, want_max: bool, lse_dtype: torch.dtype, compiled: bool, same_tables: bool) -> Callable:
    """:attr:`Forward.run` for ``path``."""
    if prepared is not None and compiled:  # (the prepared forward reads these mods' captured tensors)
        def run(query, key, value, score_mod, mask_mod, block_mask, drop, sinks):
            out, lse = prepared(query, key, value, block_mask, drop, sinks, (score_mod, mask_mod),
                                same_tables=same_tables)
            return out, lse, None, None
    elif prepared is not None:  # (the plan's own mods: the same objects)
        def run(query, key, value, score_mod, mask_mod, block_mask, drop, sinks):
            out, lse = prepared(query, key, value, block_mask, drop, sinks, same_tables=same_tables)
            return out, lse, None, None
    elif path == GENERATED:
        training_forward = pair[0]

        def run(query, key, value, score_mod, mask_mod, block_mask, drop, sinks):
            out, lse, stats = training_forward(query, key, value, score_mod, mask_mod, block_mask, scale, options,
                                               **backend_keywords(drop, sinks))
            return out, lse, None, stats
    elif path == ROWS:
        def run(query, key, value, score_mod, mask_mod, block_mask, drop, sinks):
            return (*forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale, need_max=want_max,
                                      lse_dtype=lse_dtype, dropout=drop, sinks=sinks), None)
    else:  # the registered forward (a plan made before the registry changed is not run: flexc.call.signature)
        forward = registry.BACKENDS[backend]

        def run(query, key, value, score_mod, mask_mod, block_mask, drop, sinks):
            out, lse = forward(query, key, value, score_mod, mask_mod, block_mask, scale, options, want_lse,
                               **backend_keywords(drop, sinks))
            return out, lse, None, None
    return run


__all__ = ["FORWARD", "Forward", "GENERATED", "ROWS", "backend_keywords", "forward_path"]
