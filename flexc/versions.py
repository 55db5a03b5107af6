"""What identifies a tensor's contents, for caches that must never serve a stale value.

A value computed from a tensor's elements stays right while the tensor views the same elements
and nothing was written to them. :func:`contents_state` says both: the storage (its C object),
offset, shape, strides and dtype the tensor views, and ``tensor._version``, which counts in-place
writes (through any view or alias sharing the counter). The tensor object alone is not enough:
``param.data = new`` (``nn.utils.vector_to_parameters``, a swapped buffer) gives the same object
other elements without moving its version counter, and ``set_`` another storage.

A storage's C object can be freed and another made at its address, so a cache keeps states as
:func:`pinned` gives them: equal to the plain states, and holding their storages weakly (a storage
object is not replaced at its address while a weak reference to it lives, and no memory is kept
alive), so a state kept is never taken for another storage's.

Tensors made under ``torch.inference_mode()`` (common when decoding) have no version counter and
tensors with no storage (fake, functional or other subclasses) no address: their state is a fresh
object equal only to itself, so caches never hit for them and the work is redone, which is always
correct. While ``torch.compile`` traces, the state of every tensor is :data:`TRACED` (a value no
eager state equals): what a traced call records (a BlockMask slice's provenance) is never trusted
by an eager one.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# what reading a state raises for tensors that have none (inference, fake, storage-less tensors)
_NO_STATE = (RuntimeError, NotImplementedError, TypeError, AttributeError)
TRACED = "traced by torch.compile"  # (a constant: dynamo traces no object())


def contents_state(t: torch.Tensor) -> Any:
    """``(storage, offset, shape, strides, dtype, version)`` of ``t``: a state equal to one kept
    :func:`pinned` means the same elements, unwritten since; for a tensor without a version counter
    or a storage, a fresh object equal only to itself (:data:`TRACED` while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return TRACED
    try:
        return (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
    except _NO_STATE:
        return object()


def contents_states(tensors: Sequence) -> tuple:
    """:func:`contents_state` of each tensor in ``tensors`` (None stays None), read on every call of
    the caches that use it (a decoding step reads a block mask's tables several times)."""
    if torch.compiler.is_compiling():
        return tuple([None if t is None else TRACED for t in tensors])
    try:  # (the attributes read inline: a function call per tensor costs as much as the reads)
        return tuple([(t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
                      if t is not None else None for t in tensors])
    except _NO_STATE:  # an inference or storage-less tensor among them
        return tuple([contents_state(t) if t is not None else None for t in tensors])


def rememberable(states: tuple) -> bool:
    """Whether every state in ``states`` (from :func:`contents_states`) can be found again: no tensor
    among them lacks a version counter or a storage."""
    return all([s is None or type(s) is tuple for s in states])


class PinnedStates(tuple):
    """States (equal to, and hashed as, the plain tuple) that hold their storages weakly in ``pins``."""


def pinned(states: tuple, tensors: Sequence) -> tuple:
    """``states`` (:func:`contents_states` of ``tensors``) as a cache keeps them: the same tuple,
    holding weak references to the tensors' storages, so no other storage object takes one of their
    places (and states) while the cache keeps it."""
    if torch.compiler.is_compiling():
        return states  # (TRACED: equal to no state)
    kept = PinnedStates(states)
    refs = []
    for t in tensors:
        try:
            refs.append(StorageWeakRef(t.untyped_storage()) if t is not None else None)
        except _NO_STATE:
            refs.append(None)
    kept.pins = refs
    return kept


# the states of a BlockMask's kv tables (absent full tables stay None): contents_states itself, no call between
table_states = contents_states
