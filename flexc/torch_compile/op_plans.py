"""One plan per signature of a compiled call: what flexc's custom ops decide, worked out once and kept.

Inside a compiled graph each flex_attention call is one op node (:mod:`flexc.torch_compile.custom_ops`)
whose eager body receives tensors and constants: the mods as structure strings with their captured
tensors, the BlockMask as its tables. Like an eager call's plan (:mod:`flexc.call.plans`), an
:class:`OpPlan` holds what the op decides before its kernels run (the tables' validity and whether
their empty entries need compacting, the options, the backend and its path, which mods' bounds
depend on captured values, and the backend's forward or training pair prepared for these shapes), and
:func:`op_plan` finds it by the call's signature: the inputs' layouts, the tables' contents states
(held weakly: a plan keeps no tensor of a call, so compiled graphs' memory pools stay their own),
the mods' structure strings and their captured tensors' layouts, and the constants. Each call then
runs it on its own tensors: the kernels read that call's tables and captured tensors.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

from ..analysis import bounds
from ..backends import registry
from ..call import validate
from ..call.forward_path import GENERATED, Forward
from ..call.plan import dropout_backend
from ..call.plan_store import PlanStore
from ..call.signature import Unkeyable, Unpinned, environment_signature, held, tensor_signature
from ..codegen.printer import precise_math_for
from ..masks.empty_entries import without_empty_entries
from ..versions import contents_states, rememberable

_PLANS = PlanStore()


@functools.lru_cache(maxsize=64)
def _parsed_options(kernel_options: str) -> dict:
    return json.loads(kernel_options)


def options_of(kernel_options: str) -> dict:
    """The ops' ``kernel_options`` JSON as a dict (parsed once per distinct string; each call gets its own copy)."""
    return dict(_parsed_options(kernel_options))


def training_pair(backend: str):
    """``registry.TRAINING[backend]`` (the backend's forward that saves its backward's statistics, and that
    backward), or None; the backend's package imported on first need (Triton registers itself then)."""
    registry.available(backend)
    return registry.TRAINING.get(backend)


def op_signature(query, key, value, tables, score_buffers, mask_buffers, constants: tuple, sinks
                 ) -> tuple[tuple, tuple] | None:
    """``(signature, what it names)`` of a compiled call (see the module docstring; the second item as
    :func:`flexc.call.signature.call_signature`'s), or None when it cannot be keyed (tables without
    write counts, tensor subclasses, a CUDA graph being captured). ``constants``: the op's non-tensor
    arguments."""
    try:
        states = contents_states(tables)
        if not rememberable(states):
            raise Unkeyable
        signature = (tensor_signature(query), tensor_signature(key), tensor_signature(value),
                     None if sinks is None else tensor_signature(sinks), states,
                     tuple([tensor_signature(t) for t in score_buffers]),
                     tuple([tensor_signature(t) for t in mask_buffers]), constants, environment_signature(query))
    except (Unkeyable, AttributeError, RuntimeError, NotImplementedError):
        return None
    return signature, (Unpinned(states, tables),)


class OpPlan:
    """What every call of one compiled signature runs (see the module docstring): the forward op's
    (``forward``; ``need_max``, ``need_lse``; ``training``: the op that autograd records, whose
    forward runs the backend's training forward where it has one, since its backward op reads that
    forward's statistics), else the backward op's (``grad_slots``). Which forward runs is
    :mod:`flexc.call.forward_path`'s rule, as in eager calls."""

    def __init__(self, query, key, value, score, mask, block_mask, scale: float, kernel_options: str,
                 dropout_p: float, sinks, forward: bool = True, need_max: bool = False, need_lse: bool = True,
                 grad_slots: tuple = (), training: bool = True):
        B, Hq, L, _ = query.shape
        if block_mask is not None and forward:  # the value checks eager flex_attention makes (dynamo cannot read values)
            validate.check_block_tables(block_mask, L, key.shape[2])
        # (negative entries in the counts: empty blocks; not remembered, see without_empty_entries)
        compacted = without_empty_entries(block_mask, remember=False)
        self.compacts = compacted is not block_mask
        self.rechecked = False
        if forward:
            for traced in (score, mask):  # the checks eager flex_attention makes, on the real tensors
                bounds.check_mod(traced, B, Hq, L, key.shape[-2], "flex_attention", compacted)
            self.rechecked = any(bounds.has_checks(m) for m in (score, mask))
        self.options = options_of(kernel_options)
        self.backend = dropout_backend(self.options["BACKEND"], dropout_p)
        self.generated = training_pair(self.backend) if training else None
        # the backend's functions decided for this signature: they read each call's tables and captured
        # tensors, and take the mods as the call gives them (the planned structure is theirs)
        self.prepared_training = False
        score, mask = precise_math_for(self.options, score, mask)  # FAST_MATH=False, as in eager calls
        dropped, has_sinks = dropout_p > 0, sinks is not None
        if self.generated is not None:
            prepare = registry.PREPARE_TRAINING.get(self.backend)
            if prepare is not None:
                self.generated = prepare(query, key, value, score, mask, compacted, scale, self.options, grad_slots,
                                         dropped, has_sinks, compiled=True, same_tables=True)
                self.prepared_training = True
        self.forward_plan: Forward | None = None
        # (whether the forward reads only the captured tensors of the mods a call passes: prepared ones do)
        self.prepared_forward = False
        if forward:
            self.forward_plan = Forward(self.backend, self.generated, query, key, value, score, mask, compacted,
                                        scale, self.options, need_lse, need_max, dropped, has_sinks, compiled=True,
                                        same_tables=True)
            self.prepared_forward = (self.prepared_training if self.forward_plan.path == GENERATED
                                     else self.forward_plan.prepared is not None)

    def block_mask(self, block_mask: Any) -> Any:
        """This call's BlockMask as its kernels read it (compacted when the plan's tables needed it)."""
        return without_empty_entries(block_mask, remember=False) if self.compacts else block_mask

    def training_mods(self, score, mask) -> tuple:
        """The mods the backend's training functions take: this call's, with FAST_MATH applied unless
        the functions were prepared (then only their captured tensors are read)."""
        return (score, mask) if self.prepared_training else precise_math_for(self.options, score, mask)

    def forward(self, query, key, value, score, mask, block_mask, drop, sinks):
        """The op's forward on this call's tensors: ``(out, lse, row maxima or None, stats or None)``."""
        block_mask = self.block_mask(block_mask)
        if self.rechecked:
            for traced in (score, mask):
                bounds.check_mod(traced, query.shape[0], query.shape[1], query.shape[2], key.shape[-2],
                                 "flex_attention", block_mask)
        if not self.prepared_forward:
            score, mask = precise_math_for(self.options, score, mask)
        return self.forward_plan.run(query, key, value, score, mask, block_mask, drop, sinks)


def op_plan(found: tuple | None, make: Callable[[], OpPlan]) -> OpPlan:
    """The plan kept for :func:`op_signature`'s ``found``, or ``make()``'s, kept when the call could be
    keyed (with its tables' states pinned, weakly: no table is kept alive)."""
    plan = _PLANS.get(found[0]) if found is not None else None
    if plan is None:
        plan = make()
        if found is not None:
            _PLANS.keep(found[0], plan, held(found[1]))
    return plan


def clear() -> None:
    """Forget every compiled call's plan."""
    _PLANS.clear()


__all__ = ["OpPlan", "clear", "op_plan", "op_signature", "options_of", "training_pair"]
