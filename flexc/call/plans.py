"""One plan per call signature: what an eager ``flex_attention`` call decides, worked out once and kept.

A :class:`Plan` holds everything a call decides before its kernels run: the validated scale and
options, the traced mods, whether the BlockMask's empty entries need compacting, the backend
(:func:`flexc.call.plan.plan_call`),
the path through training, the logsumexp and the row maxima, and the forward that computes the
output (:mod:`flexc.call.forward_path`, the rule compiled calls follow too) decided for these shapes
(:data:`flexc.backends.registry.PREPARE`: for TRITON the kernels, tables, grids and constants).
:func:`plan_for` finds it by the call's signature (:mod:`flexc.call.signature`) or makes it, so a
warm call checks its signature, allocates its outputs and launches.

What depends on tensor values is not decided once: kernels read the captured tensors and the
BlockMask at each call, the bounds checks of a mod that indexes a captured tensor with another's
values run each call (:attr:`Plan.rechecked`, asserted on the device on a GPU), and so do the CPU's
non-finite guards.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..analysis import bounds
from ..backends import dropout as dropouts
from ..backends import registry
from ..backends.cpu.torch_cpu import prepare_recorded
from ..backends.layout import laid_out_like, output_strides
from ..dtypes import work_dtype
from ..masks.empty_entries import without_empty_entries
from .forward_path import Forward
from .plan import in_dtype_of, plan_call, prepare_call
from .plan_store import PlanStore
from .signature import call_signature, held
from .training import FlexAttentionFunction, trainer

# the paths a call takes, decided once per plan (which forward computes the output, training or
# not: flexc.call.forward_path, the rule compiled calls follow too)
RECORDED = "recorded"  # training on TORCH through ops autograd records itself, when the inputs allow
TRAINED = "trained"  # training through flexc's autograd Function (the backend's generated backward, or torch's)
FORWARD = "forward"  # the forward forward_path chose, without autograd


class Plan:
    """What every call of one signature runs (see the module docstring); :meth:`run` runs it."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None,
                 block_mask: Any, scale: float | None, enable_gqa: bool, return_lse: bool,
                 kernel_options: dict | None, return_aux: Any, drop: dropouts.Dropout | None,
                 sinks: torch.Tensor | None):
        self.scale, self.options, self.score_mod, self.mask_mod = prepare_call(
            query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, outputs=(return_lse, return_aux))
        # negative entries in the counts: blocks never visited. Whether they were compacted is the
        # answer for every call of the signature (the same tables, or slices of the same ones); the
        # BlockMask itself is the call's (a plan keeps no table: a mask the caller drops is freed)
        compacted = without_empty_entries(block_mask)
        self.compacts = compacted is not block_mask
        # every call of the signature brings the very tables (their contents states are in it), so
        # the launches may take the last call's while they live; not a slice's (keyed by the tables
        # it was sliced from: another row has other tables)
        self.same_tables = not (getattr(block_mask, "sliced_from", None) is not None
                                and getattr(block_mask, "lazy_rows", None) is None)
        # the compacted mask, weakly (flexc.masks.empty_entries keeps it while the caller's tables live)
        self.compacted = weakref.ref(compacted) if self.compacts and self.same_tables else None
        block_mask = compacted
        self.casts = key.dtype != query.dtype or value.dtype != query.dtype  # (key/value in query's dtype)
        key, value = in_dtype_of(query, key), in_dtype_of(query, value)
        choice = plan_call(query, key, value, self.score_mod, self.mask_mod, self.options, return_lse, return_aux,
                           dropout_p=drop.p if drop is not None else 0.0,
                           dropout_positions=drop is not None and (drop.q_positions is not None
                                                                   or drop.kv_positions is not None),
                           sinks=sinks, block_mask=block_mask)
        self.backend, self.want_lse, self.want_max = choice.backend, choice.want_lse, choice.want_max
        self.slots, self.generated = choice.slots, choice.generated
        self.lse_dtype = work_dtype(query.dtype)
        # the strides flex_attention returns its output with (the signature fixes them), worked out once
        self.out_strides = output_strides((*query.shape[:3], value.shape[3]), query)
        # the mods whose bounds depend on captured values: checked again at each call
        self.rechecked = tuple(m for m in (self.score_mod, self.mask_mod) if bounds.has_checks(m))
        self.recorded: Callable | None = None
        # the prepared forward, which run calls straight where nothing else is done around it
        self.prepared: Callable | None = None
        if choice.training:
            self.path = (RECORDED if self.backend == registry.TORCH and drop is None and sinks is None
                         and not self.want_lse and not self.want_max else TRAINED)
            if self.path == RECORDED:  # (decided once: a warm call checks only what a signature leaves open)
                self.recorded = prepare_recorded(query, key, value, self.score_mod, self.mask_mod, block_mask,
                                                 self.scale)
            prepare = registry.PREPARE_TRAINING.get(self.backend) if self.generated is not None else None
            if prepare is not None:
                self.generated = prepare(query, key, value, self.score_mod, self.mask_mod, block_mask, self.scale,
                                         self.options, self.slots, drop is not None, sinks is not None,
                                         same_tables=self.same_tables)
            # (the logsumexp always: the backward reads it, or the generated pair's statistics)
            forward = Forward(self.backend, self.generated, query, key, value, self.score_mod, self.mask_mod,
                              block_mask, self.scale, self.options, True, self.want_max, drop is not None,
                              sinks is not None, same_tables=self.same_tables)
            self.trainer = trainer(registry.BACKENDS[self.backend], forward, self.generated, self.score_mod,
                                   self.mask_mod, self.scale, self.options, self.slots, query, key, value)
        else:
            self.path = FORWARD
            self.forward = Forward(self.backend, None, query, key, value, self.score_mod, self.mask_mod, block_mask,
                                   self.scale, self.options, self.want_lse, self.want_max, drop is not None,
                                   sinks is not None, same_tables=self.same_tables)
            self.run_forward = self.forward.run
            if not (self.compacts or self.rechecked or self.casts):
                self.prepared = self.forward.prepared

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
            drop: dropouts.Dropout | None, sinks: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(out laid out like the query, lse in torch's dtype or None, row maxima or None)`` of one call
        of this plan's signature."""
        prepared = self.prepared
        if prepared is not None:  # (a warm forward or decoding step: one call to its launch)
            out, lse = prepared(query, key, value, block_mask, drop, sinks, None, self.same_tables)
            max_scores = None
        else:
            out, lse, max_scores = self._run(query, key, value, block_mask, drop, sinks)
        if out.stride() != self.out_strides:
            out = laid_out_like(out, query, self.out_strides)
        if lse is not None and lse.dtype != self.lse_dtype:
            lse = lse.to(self.lse_dtype)
        return out, lse, max_scores

    def _run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
             drop: dropouts.Dropout | None, sinks: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`run`'s ``(out, lse, row maxima)`` as the path computes them, before their layout and dtype."""
        if self.compacts:
            compacted = self.compacted() if self.compacted is not None else None
            block_mask = compacted if compacted is not None else without_empty_entries(block_mask)
        if self.rechecked:
            B, Hq, L, _ = query.shape
            for mod in self.rechecked:
                bounds.check_mod(mod, B, Hq, L, key.shape[-2], "flex_attention", block_mask)
        if self.casts:
            key, value = in_dtype_of(query, key), in_dtype_of(query, value)
        path = self.path
        if path == FORWARD:
            out, lse, max_scores, _ = self.run_forward(query, key, value, self.score_mod, self.mask_mod, block_mask,
                                                       drop, sinks)
        elif path == RECORDED and self.recorded is not None and (recorded := self.recorded(query, key, value)) is not None:
            out, lse, max_scores = recorded, None, None  # torch's own autograd nodes: no Python in the backward
        else:
            score_mod = self.score_mod
            grad_buffers = [score_mod.buffers[i] for i in self.slots] if self.slots else ()
            outputs = FlexAttentionFunction.apply(query, key, value, self.trainer, block_mask, drop, sinks,
                                                  *grad_buffers)
            out, lse, max_scores = outputs[0], outputs[1], outputs[2] if self.want_max else None
        return out, lse, max_scores


# signature -> (plan, what the signature's ids and addresses name)
_PLANS = PlanStore()


def plan_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None,
             block_mask: Any, scale: float | None, enable_gqa: bool, return_lse: bool, kernel_options: dict | None,
             return_aux: Any, drop: dropouts.Dropout | None, sinks: torch.Tensor | None) -> Plan:
    """The plan of this eager call: kept from an earlier call of the same signature, or made now
    (validating the call, which raises what the call raises) and kept."""
    found = call_signature(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                           return_aux, drop, sinks)
    plan = _PLANS.get(found[0]) if found is not None else None
    if plan is not None:
        return plan
    arguments = (query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                 return_aux, drop, sinks)
    plan = Plan(*arguments)
    found = found or call_signature(*arguments)  # (the mods are traced now)
    if found is not None:
        _PLANS.keep(found[0], plan, held(found[1]))
    return plan


def clear() -> None:
    """Forget every plan."""
    _PLANS.clear()


def cache_clear() -> None:
    """``flexc.cache_clear``: drop every plan (eager calls' and compiled ones',
    :mod:`flexc.torch_compile.op_plans`) and every cached kernel, and reset the kernel cache's counters
    (:func:`flexc.backends.triton.cache.cache_clear`)."""
    from ..backends.triton.cache import cache_clear as clear_kernels  # (imports no triton)
    from ..torch_compile import op_plans  # (the compiled calls' plans)

    clear()
    op_plans.clear()
    clear_kernels()


__all__ = ["FORWARD", "Plan", "RECORDED", "TRAINED", "cache_clear", "clear", "plan_for"]
