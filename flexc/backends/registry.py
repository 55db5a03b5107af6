"""The backends by name: what ``kernel_options["BACKEND"]`` selects.

A forward backend has the signature
``forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse)
-> (out [B, Hq, L, Ev] in query's dtype, lse [B, Hq, L] float32 natural log or None)``, where the
mods are :class:`flexc.TracedMod` or None and ``block_mask`` is a BlockMask (flexc's or torch's) or
None (everything allowed). ``"TORCH"`` is the CPU block-sparse path; the Triton backend registers
``"TRITON"`` when its package is imported, which :func:`available` does on first need.

A backend that also generates its backward registers it in :data:`TRAINING` as ``(forward,
backward)``: that forward returns ``(out, lse natural log, float64 for float64 inputs, stats)``, and
the backward takes :func:`flexc.backends.cpu.torch_cpu_backward.torch_backward`'s arguments with ``stats``
(whatever that forward saves for it) in place of the logsumexp, plus kernel_options.
Backends not listed there train through the torch row loop.

A call with attention dropout (flexc's ``dropout_p > 0``) passes ``dropout=`` (a
:class:`flexc.backends.dropout.Dropout`) to these functions, only on the backends that draw it
(:data:`flexc.call.plan.DROPOUT_BACKENDS`: TORCH and TRITON, the same mask for the same seed).
"""
from __future__ import annotations

import importlib
from typing import Callable

from .cpu.prepared_forward import prepare_forward
from .cpu.torch_cpu import torch_forward

# The names, spelled here only: every other module reads them from this one (tests/test_house.py checks).
AUTO = "AUTO"  # not a backend: the call's device chooses (TRITON on a GPU where Triton is installed, else TORCH)
TORCH = "TORCH"
TRITON = "TRITON"

BACKENDS: dict[str, Callable] = {TORCH: torch_forward}

# a backend's forward decided once per call signature (optional): ``prepare(query, key, value, score_mod,
# mask_mod, block_mask, scale, kernel_options, need_lse, dropout: bool, sinks: bool)`` returns a
# callable ``(query, key, value, block_mask, dropout, sinks, mods=None, same_tables=False) -> (out, lse
# or None)`` that eager calls of that signature run (:mod:`flexc.call.plans`) with their own BlockMask
# (of the planned layout; the callable keeps no table, so a dropped mask is freed), and compiled calls
# with their mods too (``mods``: whose captured tensors to read); ``same_tables``: the caller vouches
# the mask holds the tables of the earlier calls. Backends without one run their forward each call
# (TORCH's: flexc.backends.cpu.prepared_forward)
PREPARE: dict[str, Callable] = {TORCH: prepare_forward}
TRAINING: dict[str, tuple[Callable, Callable]] = {}
# a backend's training forward and backward decided once per call signature (optional):
# ``prepare(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, grad_slots,
# dropout: bool, sinks: bool, compiled: bool = False, same_tables: bool = False)`` returns ``(forward,
# backward)`` with TRAINING's signatures, for the calls of that signature (``compiled``: they read the
# captured tensors of the mods they are passed; ``same_tables``: as PREPARE's callables take it)
PREPARE_TRAINING: dict[str, Callable] = {}

# backends that live in a package of their own, imported when first asked for (Triton is optional)
_PACKAGES = {TRITON: "flexc.backends.triton"}


def register(name: str, forward: Callable, prepare: Callable | None = None) -> None:
    """Make ``forward`` the backend ``name`` (the first registration wins); ``kernel_options["BACKEND"]``
    then accepts ``name`` (upper case, as validation compares it) eagerly and under torch.compile.
    ``prepare``: the same forward decided once per call signature (see :data:`PREPARE`)."""
    if not isinstance(name, str) or name != name.upper() or name == AUTO:
        raise ValueError(f"flexc.backends.registry.register: name must be an upper-case str other than {AUTO!r} "
                         f"(kernel_options['BACKEND'] is compared upper-cased), got {name!r}. Fix: register "
                         f"{str(name).upper()!r}.")
    if BACKENDS.setdefault(name, forward) is forward and prepare is not None:
        PREPARE.setdefault(name, prepare)
    _changes[0] += 1


def unregister(name: str) -> None:
    """Remove backend ``name`` (and its training pair) registered by :func:`register`; a later call
    naming it is refused as an unknown backend. The built-in backends stay."""
    if name in (TORCH, *_PACKAGES):
        raise ValueError(f"flexc.backends.registry.unregister: {name!r} is built in and stays registered, got "
                         f"name={name!r}. Fix: unregister only a backend you registered.")
    BACKENDS.pop(name, None)
    TRAINING.pop(name, None)
    PREPARE.pop(name, None)
    PREPARE_TRAINING.pop(name, None)
    _changes[0] += 1


# how many times the backends changed: part of every plan's signature (flexc.call.signature), so a
# plan made for a backend since unregistered or replaced is never run
_changes = [0]


def changes() -> int:
    """How many times a backend was registered or unregistered (plans made before a change are not run)."""
    return _changes[0]


def names() -> tuple[str, ...]:
    """Every name ``kernel_options["BACKEND"]`` may take: AUTO, the registered backends and those whose
    package is imported on first need."""
    return (AUTO, *BACKENDS, *(name for name in _PACKAGES if name not in BACKENDS))


def register_training(name: str, forward: Callable, backward: Callable, prepare: Callable | None = None) -> None:
    """Backend ``name`` trains with its own ``forward`` (which returns the logsumexp) and ``backward``;
    ``prepare``: both decided once per call signature (see :data:`PREPARE_TRAINING`)."""
    if TRAINING.setdefault(name, (forward, backward)) == (forward, backward) and prepare is not None:
        PREPARE_TRAINING.setdefault(name, prepare)
    _changes[0] += 1


def available(name: str) -> bool:
    """Whether backend ``name`` can run here, importing its package on first need."""
    if name not in BACKENDS and name in _PACKAGES:
        try:
            importlib.import_module(_PACKAGES[name])
        except ImportError:  # triton is not installed
            return False
    return name in BACKENDS
