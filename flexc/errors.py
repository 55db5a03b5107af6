"""Exception types that are flexc's rule and torch's at once, and the warning of a path run instead.

flexc raises ``TypeError``/``ValueError`` for bad inputs. For a few of the same inputs torch's
FlexAttention raises ``NotImplementedError`` or ``RuntimeError`` instead, and code written against
torch (its own test suite included) catches those. The classes below derive from both, so an
``except`` clause written for either library catches flexc's error. Their messages open with
torch's sentence for the same condition, then flexc's fix. :class:`FallbackWarning` (here so every
stage can warn with it) says when another path runs part of a call.
"""
from __future__ import annotations

import threading
import warnings


class UnsupportedInputError(ValueError, NotImplementedError):
    """A value torch does not implement (e.g. 3-D or 5-D query/key/value)."""


class UnsupportedTypeError(TypeError, NotImplementedError):
    """A kind of object torch does not implement (e.g. nested tensors)."""


class InvalidValueError(ValueError, RuntimeError):
    """A value torch rejects with ``RuntimeError`` (e.g. a 1-D BlockMask table, BACKEND with
    FORCE_USE_FLEX_ATTENTION, a sliced BlockMask passed to flex_attention)."""


class AssertedValueError(ValueError, AssertionError):
    """A value torch rejects with ``AssertionError``: unpaired BlockMask tables (``full_kv_num_blocks``
    without ``full_kv_indices``), kernel_options keys torch reserves for itself (``OUTPUT_LOGSUMEXP``)."""


class InvalidTypeError(TypeError, RuntimeError):
    """A kind of object torch rejects with ``RuntimeError`` (e.g. a non-callable in and_masks)."""


class FallbackWarning(UserWarning):
    """A backend's generated kernel cannot run part of a call, and another path runs it instead; the
    message says which and why. ``BACKEND: "TRITON"`` training a score_mod whose backward
    :mod:`flexc.mods.derivative` cannot build (a ``torch.autograd.Function`` whose ``backward`` cannot
    be traced) trains through the torch backward. Warned once per score_mod; ``dropout_p > 0`` on a
    backend whose kernels do not drop, or in a context-parallel shard on the TRITON backend (whose
    kernels draw the pairs at the call's own indices), runs on the TORCH backend, warned once per
    backend and reason; under ``torch.compile`` a dropout call's ``generator=`` draws its seed outside
    the graph, warned once. A Triton kernel that needs more GPU resources than the GPU has runs with
    smaller tiles, and a TMA variant that fails to compile with plain loads, warned once per kernel and
    GPU capability (:mod:`flexc.backends.triton.retry`). A torch kernel option flexc does not implement
    (``BACKEND="FLASH"``, ``"TRITON_DECODE"``) runs flexc's choice, warned once per option value."""


_warned_once: set = set()
_warned_lock = threading.Lock()


def warn_once(key: object, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` as a :class:`FallbackWarning` the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned_once:
            return
        _warned_once.add(key)
    warnings.warn(message, FallbackWarning, stacklevel=stacklevel)
