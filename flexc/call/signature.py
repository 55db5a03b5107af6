"""The signature of an eager call: everything its plan depends on, as one hashable key.

:mod:`flexc.call.plans` keeps one plan per signature: two calls with equal signatures decide the same
(validation verdicts, backend, kernels, tables, grids), so the second runs the first's plan on its
own tensors. A signature holds:

- query, key, value and the checked sinks: shape, strides, dtype, device, ``requires_grad`` and
  whether the address is 16-byte aligned (Triton specializes pointers by it, a TMA descriptor
  needs it);
- grad mode, the simulated GPU (:func:`flexc.device.simulate`) and, on CUDA, the current stream
  (a plan keeps device tables made on one stream, :func:`flexc.device.stream_token`; while a CUDA
  graph is captured no signature matches, so a capture records every step);
- the BlockMask by contents, not identity (a decoding step's new slice of the same row matches):
  its type, ``seq_lengths``, ``BLOCK_SIZE``, and its kv tables' contents states
  (:func:`flexc.versions.contents_states`: storage, offset, shape, strides, dtype and write count,
  so ``.data =`` swaps, in-place edits and reused storage all differ), or a one-row slice's row
  lists, or for an unedited slice (``block_mask[:, :, row]``) the states of the tables it was
  sliced from and its tables' layout; a training call adds the query-direction tables where a
  backend's own backward may read them (a GPU's call, simulated or not, or one with
  ``kernel_options``: a plain CPU call with default options trains on TORCH, which reads none);
- the mods as traced: the :class:`~flexc.mods.traced_mod.TracedMod` the trace cache serves while
  nothing the mod can read has changed (:mod:`flexc.mods.trace_cache`: code, closure, globals,
  captured tensors' memory), with the captured tensors' ``requires_grad``;
- scale, ``enable_gqa``, ``return_lse``, ``return_aux``, ``kernel_options`` and dropout's ``p``, and
  the registry's count of changes (a backend registered or unregistered since makes new plans).

A captured tensor's values are not in it: kernels read them at each call, and the checks that depend
on them run each call (:attr:`flexc.call.plans.Plan.rechecked`). :func:`call_signature` gives None
(the call decides from scratch, and no plan is kept) where something cannot be keyed: a mod not
traced yet or traced on every call, tables without write counts (made under inference mode), tensor
subclasses, unhashable options.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, NamedTuple

import torch

from .. import device as gpu
from ..backends import registry
from ..errors import warn_once
from ..masks.kv_tables import kv_tables
from ..mods import derived, trace_cache
from ..mods.traced_mod import MASK_MOD, SCORE_MOD, TracedMod
from ..versions import contents_states, pinned, rememberable, table_states

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Q_TABLES = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
_PLAIN_VALUES = (bool, int, float, str, type(None))  # option values a signature keys (compared by value)
_SCALES = (float, int, type(None))  # scales a signature keys
_REQUIRES_GRAD = operator.attrgetter("requires_grad")  # (mapped over captured tensors: no Python frame per tensor)


class Unpinned(NamedTuple):
    """Tables' contents states, to be pinned (:func:`flexc.versions.pinned`) if the signature is kept."""

    states: tuple
    tensors: list


def held(named: tuple) -> tuple:
    """What :func:`call_signature` says its signature names, as a plan keeps it: tables' states
    pinned (weak references to their storages, so no other storage takes their addresses while the
    plan lives, and no table is kept alive), everything else as it is."""
    return tuple(pinned(*x) if type(x) is Unpinned else x for x in named)


class Unkeyable(Exception):
    """Some part of the call cannot be part of a signature: the call is planned from scratch."""


def cached_trace(fn: Callable | None, kind: str) -> TracedMod | None:
    """The trace :func:`flexc.trace` would return for ``fn`` now, if the trace cache holds it (a
    function traced before, nothing it reads changed since); raises :class:`Unkeyable` otherwise."""
    if fn is None:
        return None
    cached, _ = trace_cache.lookup(fn, kind)
    if cached is None:
        raise Unkeyable
    return cached if cached.derivations is None else derived.current(cached)


def tensor_signature(t: torch.Tensor) -> tuple:
    if type(t) not in _PLAIN:
        raise Unkeyable
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 15 == 0)


def block_mask_signature(block_mask: Any, training: bool, keep: list, q_tables: bool = True) -> tuple | None:
    """The BlockMask's part; what its ids and storage addresses name goes to ``keep`` (a plan holds
    it, so no other object takes those addresses while the plan lives). A training call's part has
    the tables' states, with the query-direction tables' where ``q_tables``."""
    if block_mask is None:
        return None
    gathered = None if training else getattr(block_mask, "gathered_row", None)  # a one-row slice gathered on the device
    rows = None if training or gathered is not None else getattr(block_mask, "lazy_rows", None)  # (as lists)
    if gathered is not None:
        # a decoding step's block_mask[:, :, pos // 128] on a GPU, its tables not asked for (so not
        # edited): keyed as an unedited slice is, below (read off what it was gathered from)
        source = gathered.source
        keep.append(source.states)
        tables: tuple = source.key
    elif rows is not None:
        keep.append(rows)
        tables = ("rows", id(rows))  # (the same lists object for every slice of that row)
    elif (provenance := None if training else getattr(block_mask, "sliced_from", None)) is not None \
            and table_states(kv_tables(block_mask)) == provenance[2]:
        # an unedited slice (a decoding step's block_mask[:, :, pos // 128], new tables every step):
        # keyed by the tables it was sliced from as they were then (their states pinned, weakly), and
        # its tables' layout
        keep.append(provenance[1])
        tables = ("slice", provenance[1], tuple([None if t is None else (t.shape, t.dtype, t.device)
                                                 for t in kv_tables(block_mask)]))
    else:
        kept = list(kv_tables(block_mask))
        if training and q_tables:
            kept += [getattr(block_mask, name, None) for name in _Q_TABLES]
        tables = contents_states(kept)
        if not rememberable(tables):
            _warn_unkept_plans()
            raise Unkeyable
        keep.append(Unpinned(tables, kept))  # (pinned, weakly, only if kept: a kept plan holds no table)
    return (type(block_mask), tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE), tables)


def options_signature(kernel_options: dict) -> tuple:
    """The options' items, each value of a plain type (others are not keyed: a signature is compared with
    ``==``, :class:`flexc.call.plan_store.PlanStore`, which for a tensor would compare values)."""
    if type(kernel_options) is not dict:
        raise Unkeyable
    items = tuple(kernel_options.items())
    _check_plain(v for _, v in items)
    hash(items)  # (TypeError for an unhashable key)
    return items


def aux_signature(return_aux: Any) -> tuple:
    """``return_aux``'s type and fields (plain values only, as for the options)."""
    _check_plain(return_aux)
    return (type(return_aux), *return_aux)


def _check_plain(values: Iterable) -> None:
    """Raise :class:`Unkeyable` unless every value is of a plain type (:data:`_PLAIN_VALUES`)."""
    for v in values:
        if type(v) not in _PLAIN_VALUES:
            raise Unkeyable


def call_signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None,
                   block_mask: Any, scale: Any, enable_gqa: bool, return_lse: bool, kernel_options: dict | None,
                   return_aux: Any, dropout: Any, sinks: torch.Tensor | None
                   ) -> tuple[tuple, tuple] | None:
    """``(signature, what it names)`` of an eager call, or None when the call cannot be keyed (see the
    module docstring). Whoever keeps the signature keeps :func:`held` of the second item too: the
    objects whose ids and storage addresses the signature holds, so none is reused while it is kept. Reads only what
    it keys: a call with invalid arguments gives None or a signature no valid call was planned under."""
    keep: list = []
    try:
        traced_score = None if score_mod is None else cached_trace(score_mod, SCORE_MOD)
        mask_mod = None if block_mask is None else getattr(block_mask, "mask_mod", None)
        traced_mask = None if mask_mod is None else cached_trace(mask_mod, MASK_MOD)
        # (the tensors' parts read inline, in one comprehension: a call per tensor costs as much as the reads)
        tensors = (query, key, value) if sinks is None else (query, key, value, sinks)
        described = tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 15 == 0)
                           for t in tensors if type(t) in _PLAIN])
        if len(described) != len(tensors):
            raise Unkeyable
        grad = torch.is_grad_enabled()
        training = grad and (described[0][4] or described[1][4] or described[2][4]
                             or (traced_score is not None and any(map(_REQUIRES_GRAD, traced_score.buffers)))
                             or (sinks is not None and described[3][4]))
        if dropout is not None and (dropout.q_positions is not None or dropout.kv_positions is not None):
            raise Unkeyable  # (a context-parallel shard's dropout: planned each call)
        # the query-direction tables only where a backend's own backward can read them (Triton's): a
        # plain CPU call with default options trains on TORCH, whose backward reads none (~15 us of a
        # CPU training step)
        q_tables = training and (kernel_options is not None or gpu.is_gpu(query.device)
                                 or registry.TORCH in registry.TRAINING)
        signature = (described, grad, environment_signature(query),
                     None if block_mask is None else block_mask_signature(block_mask, training, keep, q_tables),
                     # the mods as traced, with their captured tensors' requires_grad
                     None if traced_score is None
                     else (id(traced_score), tuple(map(_REQUIRES_GRAD, traced_score.buffers))),
                     None if traced_mask is None else (id(traced_mask), tuple(map(_REQUIRES_GRAD, traced_mask.buffers))),
                     scale if type(scale) in _SCALES else _unkeyable(), bool(enable_gqa), bool(return_lse),
                     None if return_aux is None else aux_signature(return_aux),
                     None if kernel_options is None else options_signature(kernel_options),
                     None if dropout is None else dropout.p)
    except (Unkeyable, TypeError, AttributeError, ValueError, RuntimeError, NotImplementedError):
        return None
    return signature, (traced_score, traced_mask, *keep)  # (hashed where it is looked up: unhashable, no plan)


def environment_signature(query: torch.Tensor) -> tuple:
    """What outside a call's arguments changes its decisions: the simulated GPU, the CUDA stream (a
    plan's device values are made on one; raises :class:`Unkeyable` while a CUDA graph is captured, so
    a capture records every step as it runs), TF32 for fp32 calls, and the registry's changes."""
    stream = None
    if query.is_cuda:
        stream = gpu.stream_token(query.device)
        if not gpu.keeps(stream):
            raise Unkeyable
    return (gpu.simulated_facts(), stream, query.dtype == torch.float32 and gpu.allows_tf32(), registry.changes())


def _warn_unkept_plans() -> None:
    warn_once("plans of tables without write counts",
              "flexc: a BlockMask whose tables have no write counter (made under torch.inference_mode(), or "
              "tensors without storage) cannot be told from an edited one, so calls with it are planned from "
              "scratch every time (the same results; about 90 us more host time a call in bench/host.py's "
              "forward). Fix: build the BlockMask outside torch.inference_mode() (torch.no_grad() keeps write "
              "counters).", stacklevel=6)


def _unkeyable() -> None:
    raise Unkeyable


__all__ = ["Unkeyable", "Unpinned", "cached_trace", "call_signature", "environment_signature", "held", "tensor_signature"]
