"""A call's plan: its inputs checked and its mods traced once, then the backend and paths it takes.

:func:`flex_attention` and :func:`flexc.kernel_source` both decide here, so the source shown is the
source launched; the torch.compile path uses the same choices (:func:`choose_backend`,
:func:`generated_backward_applies`), and all of them ask :mod:`flexc.call.forward_path` which
forward runs.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch

from ..errors import FallbackWarning

from .. import device as gpu
from ..analysis import bounds
from ..backends import registry
from ..codegen.printer import precise_math_for
from ..mods.trace import trace
from ..mods.traced_mod import MASK_MOD, SCORE_MOD, TracedMod, trainable_slots, unless_identity
from . import validate


class AuxRequest(NamedTuple):
    """Extra outputs to return: ``lse`` (logsumexp per query row) and ``max_scores`` (row maxima)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """Extra outputs: ``[B, Hq, L]`` tensors (lse float64 for float64 inputs, else fp32; max_scores
    fp32), or None when not requested."""

    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


def choose_backend(options: dict, device: torch.device) -> str:
    """The registered backend ``options["BACKEND"]`` names, AUTO resolved for ``device``; raises when it
    cannot run here."""
    name = options["BACKEND"]
    if name == registry.AUTO:
        # (a CPU device first: reading device.type builds a string, a noticeable cost per decoding call)
        name = registry.TRITON if gpu.is_gpu(device) and registry.available(registry.TRITON) else registry.TORCH
    if not registry.available(name):
        raise ValueError(f"flex_attention: kernel_options['BACKEND']={name!r} but no {name} backend is available "
                         f"(its package failed to import: is triton installed?). Fix: use "
                         f"{registry.TORCH!r} or {registry.AUTO!r}.")
    return name


def in_dtype_of(query: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (key or value) in query's dtype. torch accepts key/value of another dtype (e.g. low-precision
    caches) and computes in query's: exact for a narrower key/value, rounded for a wider one. The cast
    is differentiable, so gradients reach key/value in their own dtype."""
    return t if t.dtype == query.dtype else t.to(query.dtype)


def prepare_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None,
                 block_mask: Any, scale: float | None, enable_gqa: bool, kernel_options: dict | None,
                 outputs: tuple[Any, Any] | None = None) -> tuple[float, dict, TracedMod | None, TracedMod | None]:
    """Validate a call's inputs (before any work) and trace its mods.

    ``outputs`` is flex_attention's ``(return_lse, return_aux)``, checked in its place in the order.
    Returns ``(scale, kernel_options with defaults, traced score_mod or None, traced mask_mod or None)``;
    shared by :func:`flex_attention` and :func:`flexc.kernel_source` so both see one set of rules.
    """
    validate.check_tensors(query, key, value, enable_gqa)
    if outputs is not None:
        validate.check_flags(enable_gqa, *outputs)
    validate.check_mod(score_mod)
    validate.check_block_mask(block_mask, query, key)
    scale = validate.check_scale(scale, query)
    options = validate.check_kernel_options(kernel_options)
    traced_score = trace(score_mod, SCORE_MOD) if score_mod is not None else None
    mask_fn = getattr(block_mask, "mask_mod", None)
    traced_mask = trace(mask_fn, MASK_MOD) if mask_fn is not None else None
    validate.check_captured(traced_score, query.device)
    validate.check_captured(traced_mask, query.device)
    traced_score = unless_identity(traced_score)
    # FAST_MATH=False: tanh and sigmoid keep libdevice's lowering in every kernel of the call
    traced_score, traced_mask = precise_math_for(options, traced_score, traced_mask)
    return scale, options, traced_score, traced_mask


# why a backend's generated backward cannot train a score_mod graph (None: it can), by graph
_fallback_reasons: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def generated_backward_fallback(score_mod: TracedMod | None) -> str | None:
    """Why a backend's generated backward cannot train ``score_mod`` (training then runs the torch
    backward), or None when it can. Every op the tracer accepts has a derivative rule
    (:mod:`flexc.mods.derivative`, reductions and autograd Functions included); what remains is a
    ``torch.autograd.Function`` whose ``backward`` cannot be traced (an unsupported op, a tensor the
    score_mod does not capture, a vector input)."""
    if score_mod is None:
        return None
    root = score_mod.root
    try:
        return _fallback_reasons[root]
    except KeyError:
        pass
    from ..mods.derivative import differentiate

    try:
        differentiate(score_mod)
        reason = None
    except NotImplementedError as e:
        reason = str(e) or type(e).__name__
    _fallback_reasons[root] = reason
    return reason


def generated_backward_applies(score_mod: TracedMod | None) -> bool:
    """Whether a backend's generated backward can train this score_mod (see
    :func:`generated_backward_fallback`). Otherwise training uses the torch backward."""
    return generated_backward_fallback(score_mod) is None


def warn_fallback(score_mod: TracedMod | None, backend: str) -> None:
    """A :class:`FallbackWarning` (once per score_mod) when ``backend``'s generated backward cannot
    train ``score_mod`` and the torch backward runs instead."""
    reason = generated_backward_fallback(score_mod)
    if reason is None or score_mod.root in _warned:
        return
    _warned.add(score_mod.root)
    warnings.warn(f"flex_attention: BACKEND={backend!r} trains score_mod {score_mod.name} through the torch backward "
                  f"(flexc.backends.cpu.torch_cpu_backward.torch_backward, per query row), not the generated backward kernel: "
                  f"{reason.rstrip('.')}. Fix: write the Function's backward with operations flexc traces (as a mod), or "
                  f"ignore this warning: the gradients are the same, only slower.", FallbackWarning, stacklevel=3)


def falls_back(forward: Callable, training: Any) -> str | None:
    """The name of the backend whose forward is ``forward`` when it generates its backward but this
    call trains without it (``training`` None), else None."""
    if training is not None:
        return None
    return next((name for name in registry.TRAINING if registry.BACKENDS.get(name) is forward), None)


def wanted_outputs(backend: str, return_lse: bool, return_aux: Any) -> tuple[bool, bool]:
    """``(want_lse, want_max)`` of a call on ``backend``: the logsumexp (``return_lse`` or
    ``return_aux.lse``) and the row maxima (``return_aux.max_scores``, which only the TORCH backend's
    row loop computes: raises on another). Eager and compiled calls."""
    want_lse = bool(return_lse) or bool(return_aux is not None and return_aux.lse)
    want_max = bool(return_aux is not None and return_aux.max_scores)
    if want_max and backend != registry.TORCH:
        raise ValueError(f"flex_attention: return_aux.max_scores is supported by the TORCH backend only, got "
                         f"BACKEND={backend!r}. Fix: pass kernel_options={{'BACKEND': 'TORCH'}} or drop max_scores.")
    return want_lse, want_max


class CallPlan(NamedTuple):
    """What one eager :func:`flex_attention` call runs, decided by :func:`plan_call` for the call
    itself and for :func:`flexc.kernel_source` (one rule, so the source shown is the one launched)."""

    backend: str  # the forward backend's name in the registry ("TORCH", "TRITON")
    training: bool  # autograd records the call: an input or a captured float tensor requires grad
    generated: tuple[Callable, Callable] | None  # TRAINING[backend] when training runs it, else None
    want_lse: bool
    want_max: bool
    slots: tuple[int, ...]  # the score_mod's captured tensors that receive gradients


def plan_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
              mask_mod: TracedMod | None, options: dict, return_lse: bool, return_aux: Any,
              training: bool | None = None, dropout_p: float = 0.0, dropout_positions: bool = False,
              sinks: torch.Tensor | None = None, block_mask: Any = None) -> CallPlan:
    """The backend and paths a call with these (prepared) arguments takes; raises what the call raises.

    Training is decided as autograd would record the call (``torch.is_grad_enabled()`` and an input
    or a captured float tensor that requires grad); ``training`` overrides that (``kernel_source``'s
    ``backward=True`` asks about the call as trained). A training call runs the backend's generated
    forward and backward (:data:`flexc.backends.registry.TRAINING`) when :func:`generated_backward_applies`, otherwise the
    backend's forward with the logsumexp and the torch backward. ``dropout_p > 0`` runs on the TORCH and
    TRITON backends, whose kernels draw the same mask; ``dropout_positions`` (a context-parallel
    shard's pairs drawn at global positions) runs on TORCH (:func:`dropout_backend`). ``sinks`` that
    require grad make the call train too.
    """
    backend = dropout_backend(choose_backend(options, query.device), dropout_p, dropout_positions)
    # lookups and divisors proven in range (or checked) once here, so no backend reads out of bounds
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    # (over the tiles ``block_mask`` lists: no path evaluates a mod elsewhere)
    bounds.check_mod(score_mod, B, Hq, L, S, "flex_attention", block_mask)
    bounds.check_mod(mask_mod, B, Hq, L, S, "flex_attention", block_mask)
    want_lse, want_max = wanted_outputs(backend, return_lse, return_aux)
    slots = trainable_slots(score_mod)
    if training is None:
        training = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad or bool(slots)
            or (sinks is not None and sinks.requires_grad))
    generated = registry.TRAINING.get(backend) if training and generated_backward_applies(score_mod) else None
    return CallPlan(backend, training, generated, want_lse, want_max, slots)


# the backends whose kernels draw attention dropout (the same mask for the same seed)
DROPOUT_BACKENDS = (registry.TORCH, registry.TRITON)


def dropout_backend(backend: str, dropout_p: float, positions: bool = False) -> str:
    """The backend a call with ``dropout_p`` runs: ``backend``, or "TORCH" when it drops and the
    backend's kernels do not, or draw at the call's own indices while ``positions`` asks for a
    context-parallel shard's global ones (a :class:`FallbackWarning` once per backend and reason).
    Eager and compiled calls."""
    if dropout_p and backend != registry.TORCH and (positions or backend not in DROPOUT_BACKENDS):
        _warn_dropout_runs_on_torch(backend, positions)
        return registry.TORCH
    return backend


@functools.lru_cache(maxsize=None)
def _warn_dropout_runs_on_torch(backend: str, positions: bool) -> None:
    why = ("draw the pairs at the call's own indices, not a context-parallel shard's global positions" if positions
           else "do not drop")
    warnings.warn(f"flexc: dropout_p > 0 runs on the TORCH backend here (its row loop draws the dropout mask); the "
                  f"{backend} kernels {why}. This call and later ones like it use TORCH.",
                  FallbackWarning, stacklevel=5)
