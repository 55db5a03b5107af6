"""Tensor write counters for caches that must notice in-place edits.

``tensor._version`` counts in-place writes, so a cache keyed by a tensor's identity and version
is never stale. Tensors made under ``torch.inference_mode()`` (common when decoding) have no
counter and raise on reading it; for them :func:`write_count` gives a value equal to nothing
else, so such caches simply never hit and the work is redone, which is always correct.
"""
from __future__ import annotations

from typing import Any

import torch


def write_count(t: torch.Tensor) -> Any:
    """``t._version``, or a fresh object (equal only to itself) for an inference tensor."""
    try:  # (one attribute read: caches check several tables on every decoding step)
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return object()


def table_states(tables) -> tuple:
    """``(id, write count)`` of each tensor in ``tables`` (None stays None): a BlockMask's tables'
    identity and edits, read on every decoding step."""
    try:  # (the attribute read inline: four function calls cost more than the rest of the key)
        return tuple([(id(t), t._version) if t is not None else None for t in tables])
    except RuntimeError:  # an inference tensor among them
        return tuple([(id(t), write_count(t)) if t is not None else None for t in tables])
