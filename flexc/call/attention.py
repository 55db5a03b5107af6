"""``flex_attention``: the drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

The call validates its inputs, traces the mods once (:func:`flexc.trace`), picks a forward backend
from :data:`BACKENDS`, and wraps it in a ``torch.autograd.Function`` whose backward is the torch
block-sparse path (:func:`flexc.backends.cpu.torch_cpu.torch_backward`), so every backend trains.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch

from ..analysis import bounds
from ..backends import dropout
from ..torch_compile import under_compile
from . import validate
from .. import device as gpu
from ..backends.cpu.torch_cpu import forward_with_max, torch_backward, torch_forward
from ..codegen.printer import precise_math_for
from ..masks.empty_entries import without_empty_entries
from ..backends.layout import laid_out_like as _laid_out_like
from .sinks import check_sinks, with_sinks
from ..mods.trace import SCORE_MOD, MASK_MOD, TracedMod, trace


class AuxRequest(NamedTuple):
    """Extra outputs to return: ``lse`` (logsumexp per query row) and ``max_scores`` (row maxima)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """Extra outputs: ``[B, Hq, L]`` tensors (lse float64 for float64 inputs, else fp32; max_scores
    fp32), or None when not requested."""

    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


# Forward backends by kernel_options["BACKEND"] name. Signature:
#   forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse)
#     -> (out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] float32 natural log, or None if not need_lse)
# score_mod/mask_mod are TracedMod or None; block_mask is a BlockMask (flexc or torch) or None
# (everything allowed). "TORCH" is the CPU block-sparse path; the Triton backend adds "TRITON".
BACKENDS: dict[str, Callable] = {"TORCH": torch_forward}
# Backends that also generate their backward: name -> (forward, backward). The forward has the
#   signature forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options)
#   -> (out, lse natural log, float64 for float64 inputs); the backward is torch_backward's plus
#   kernel_options. Backends not listed train through the torch row loop (torch_backward).
TRAINING: dict[str, tuple[Callable, Callable]] = {}


def _choose_backend(options: dict, device: torch.device) -> str:
    name = options["BACKEND"]
    if name == "AUTO":
        # (a CPU device first: reading device.type builds a string, a noticeable cost per decoding call)
        name = "TRITON" if gpu.is_gpu(device) and _triton_available() else "TORCH"
    if name == "TRITON" and not _triton_available():
        raise ValueError("flex_attention: kernel_options['BACKEND']='TRITON' but no Triton backend is available "
                         "(flexc.backends.triton.forward did not register one). Fix: use 'TORCH' or 'AUTO'.")
    return name


def _triton_available() -> bool:
    if "TRITON" not in BACKENDS:
        try:  # registers itself on import once it exists
            from ..backends.triton import forward as triton_backend  # noqa: F401
        except ImportError:
            return False
    return "TRITON" in BACKENDS


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch's logsumexp dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _in_dtype_of(query: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (key or value) in query's dtype. torch accepts key/value of another dtype (e.g. low-precision
    caches) and computes in query's: exact for a narrower key/value, rounded for a wider one. The cast
    is differentiable, so gradients reach key/value in their own dtype."""
    return t if t.dtype == query.dtype else t.to(query.dtype)


def _grad_slots(score_mod: TracedMod | None) -> tuple[int, ...]:
    """Slots of the score_mod's captured float tensors that require grad."""
    if score_mod is None:
        return ()
    return tuple(i for i, t in enumerate(score_mod.buffers) if t.is_floating_point() and t.requires_grad)


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
    # FAST_MATH=False: tanh and sigmoid keep libdevice's lowering in every kernel of the call
    traced_score, traced_mask = precise_math_for(options, traced_score, traced_mask)
    return scale, options, traced_score, traced_mask


class FallbackWarning(UserWarning):
    """A backend's generated kernel cannot run part of a call, and another path runs it instead; the
    message says which and why. ``BACKEND: "TRITON"`` training a score_mod whose backward
    :mod:`flexc.mods.derivative` cannot build (a ``torch.autograd.Function`` whose ``backward`` cannot
    be traced) trains through the torch backward. Warned once per score_mod; ``dropout_p > 0`` on a
    backend whose kernels do not drop runs on the TORCH backend, warned once per backend."""


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


def _generated_backward_applies(score_mod: TracedMod | None) -> bool:
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
                  f"(flexc.backends.cpu.torch_cpu.torch_backward, per query row), not the generated backward kernel: "
                  f"{reason.rstrip('.')}. Fix: write the Function's backward with operations flexc traces (as a mod), or "
                  f"ignore this warning: the gradients are the same, only slower.", FallbackWarning, stacklevel=3)


def _falls_back(forward: Callable, training: Any) -> str | None:
    """The name of the backend whose forward is ``forward`` when it generates its backward but this
    call trains without it (``training`` None), else None."""
    if training is not None:
        return None
    return next((name for name in TRAINING if BACKENDS.get(name) is forward), None)


def sink_free_request(query: torch.Tensor, sinks: Any, enable_gqa: bool, return_lse: bool,
                      return_aux: Any) -> tuple[torch.Tensor, AuxRequest]:
    """A call with ``sinks`` runs the call without them, asking for its logsumexp (and max_scores if
    asked), then merges the sinks in torch (:func:`flexc.call.sinks.with_sinks`). Returns the checked
    sinks' rows and that inner call's ``return_aux``; shared with :func:`flexc.kernel_source`."""
    validate.check_flags(enable_gqa, return_lse, return_aux)
    rows = check_sinks(sinks, query)
    return rows, AuxRequest(lse=True, max_scores=bool(return_aux is not None and return_aux.max_scores))


class CallPlan(NamedTuple):
    """What one eager :func:`flex_attention` call runs, decided by :func:`plan_call` for the call
    itself and for :func:`flexc.kernel_source` (one rule, so the source shown is the one launched)."""

    backend: str  # the forward backend's name in BACKENDS ("TORCH", "TRITON")
    training: bool  # autograd records the call: an input or a captured float tensor requires grad
    generated: tuple[Callable, Callable] | None  # TRAINING[backend] when training runs it, else None
    want_lse: bool
    want_max: bool
    slots: tuple[int, ...]  # the score_mod's captured tensors that receive gradients


def plan_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
              mask_mod: TracedMod | None, options: dict, return_lse: bool, return_aux: Any,
              training: bool | None = None, dropout_p: float = 0.0) -> CallPlan:
    """The backend and paths a call with these (prepared) arguments takes; raises what the call raises.

    Training is decided as autograd would record the call (``torch.is_grad_enabled()`` and an input
    or a captured float tensor that requires grad); ``training`` overrides that (``kernel_source``'s
    ``backward=True`` asks about the call as trained). A training call runs the backend's generated
    forward and backward (:data:`TRAINING`) when :func:`_generated_backward_applies`, otherwise the
    backend's forward with the logsumexp and the torch backward. ``dropout_p > 0`` runs on the TORCH
    backend (the generated kernels do not drop yet; warned once).
    """
    backend = _choose_backend(options, query.device)
    if dropout_p and backend != "TORCH":
        _warn_dropout_runs_on_torch(backend)
        backend = "TORCH"
    # lookups and divisors proven in range (or checked) once here, so no backend reads out of bounds
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    bounds.check_mod(score_mod, B, Hq, L, S, "flex_attention")
    bounds.check_mod(mask_mod, B, Hq, L, S, "flex_attention")
    want_lse = bool(return_lse) or bool(return_aux is not None and return_aux.lse)
    want_max = bool(return_aux is not None and return_aux.max_scores)
    if want_max and backend != "TORCH":
        raise ValueError(f"flex_attention: return_aux.max_scores is supported by the TORCH backend only, got "
                         f"BACKEND={backend!r}. Fix: pass kernel_options={{'BACKEND': 'TORCH'}} or drop max_scores.")
    slots = _grad_slots(score_mod)
    if training is None:
        training = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad or bool(slots))
    generated = TRAINING.get(backend) if training and _generated_backward_applies(score_mod) else None
    return CallPlan(backend, training, generated, want_lse, want_max, slots)


@functools.lru_cache(maxsize=None)
def _warn_dropout_runs_on_torch(backend: str) -> None:
    warnings.warn(f"flexc: dropout_p > 0 runs on the TORCH backend (its row loop draws the dropout mask); the "
                  f"{backend} kernels do not drop yet. This call and later ones with dropout use TORCH.",
                  FallbackWarning, stacklevel=4)


class _FlexAttentionFunction(torch.autograd.Function):
    """Forward on the chosen backend; backward recomputes scores per query row on the torch path."""

    @staticmethod
    def forward(ctx, query, key, value, forward, training, score_mod, mask_mod, block_mask, scale, options, slots,
                drop, *grad_buffers):
        ctx.backward_fn = training[1] if training is not None else None
        fallback = _falls_back(forward, training)
        if fallback is not None:
            warn_fallback(score_mod, fallback)
        ctx.options, ctx.dropout = options, drop
        if training is not None:
            out, lse = training[0](query, key, value, score_mod, mask_mod, block_mask, scale, options)
        elif forward is torch_forward and (query.dtype == torch.float64 or drop is not None):
            # a float64 logsumexp, for the backward and for the caller (torch returns float64 too)
            out, lse, _ = forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale,
                                           need_max=False, lse_dtype=_lse_dtype(query.dtype), dropout=drop)
        else:
            out, lse = forward(query, key, value, score_mod, mask_mod, block_mask, scale, options, True)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mods = (score_mod, mask_mod, block_mask, scale, slots)
        return out, lse.to(_lse_dtype(query.dtype))

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        score_mod, mask_mod, block_mask, scale, slots = ctx.mods
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if ctx.backward_fn is not None:  # the backend's generated backward
            dq, dk, dv, buf_grads = ctx.backward_fn(query, key, value, out, lse, grad_out, grad_lse, score_mod,
                                                    mask_mod, block_mask, scale, slots, ctx.options)
        else:
            dq, dk, dv, buf_grads = torch_backward(query, key, value, out, lse, grad_out, grad_lse, score_mod,
                                                   mask_mod, block_mask, scale, slots, dropout=ctx.dropout)
        dq, dk, dv = (_laid_out_like(g, t) for g, t in ((dq, query), (dk, key), (dv, value)))
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None, *buf_grads)


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
    if sinks is not None:  # attention without the sinks, then their logsumexp merge (flexc.call.sinks)
        rows, inner = sink_free_request(query, sinks, enable_gqa, return_lse, return_aux)
        out, aux = flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                  kernel_options=kernel_options, return_aux=inner, dropout_p=dropout_p,
                                  generator=generator)
        out, lse = with_sinks(out, aux.lse, rows)
        if return_aux is not None:
            return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=aux.max_scores)
        return (out, lse) if return_lse else out
    dropout_p = dropout.check(dropout_p, generator)
    if torch.compiler.is_compiling():
        if dropout_p:
            raise NotImplementedError("flex_attention: dropout_p > 0 under torch.compile is not supported yet. "
                                      "Fix: call flexc.flex_attention eagerly for the dropout step, or pass "
                                      "dropout_p=0.0 inside the compiled region.")
        return _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                              return_lse, return_aux)
    scale, options, traced_score, traced_mask = prepare_call(query, key, value, score_mod, block_mask, scale,
                                                             enable_gqa, kernel_options,
                                                             outputs=(return_lse, return_aux))
    block_mask = without_empty_entries(block_mask)  # negative entries in the counts: blocks never visited
    key, value = _in_dtype_of(query, key), _in_dtype_of(query, value)
    plan = plan_call(query, key, value, traced_score, traced_mask, options, return_lse, return_aux,
                     dropout_p=dropout_p)
    drop = dropout.draw(dropout_p, generator) if dropout_p else None
    backend, want_lse, want_max, slots = plan.backend, plan.want_lse, plan.want_max, plan.slots
    max_scores = None
    if plan.training:
        forward = BACKENDS[backend]
        grad_buffers = [traced_score.buffers[i] for i in slots]
        out, lse = _FlexAttentionFunction.apply(query, key, value, forward, plan.generated, traced_score,
                                                traced_mask, block_mask, scale, options, slots, drop, *grad_buffers)
        if want_max:
            with torch.no_grad():
                max_scores = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                              dropout=drop)[2]
    elif want_max:
        out, lse, max_scores = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                                lse_dtype=_lse_dtype(query.dtype), dropout=drop)
    elif drop is not None or (want_lse and backend == "TORCH" and query.dtype == torch.float64):
        # (a float64 lse for float64 inputs, as torch's)
        out, lse, _ = forward_with_max(query, key, value, traced_score, traced_mask, block_mask, scale,
                                       need_max=False, lse_dtype=_lse_dtype(query.dtype), dropout=drop)
    else:
        out, lse = BACKENDS[backend](query, key, value, traced_score, traced_mask, block_mask, scale, options, want_lse)
    out = _laid_out_like(out, query)
    if lse is not None and lse.dtype != _lse_dtype(query.dtype):
        lse = lse.to(_lse_dtype(query.dtype))

    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    if return_lse:
        return out, lse
    return out


def _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, return_lse,
                   return_aux):
    """flex_attention under torch.compile: the same checks, then one custom-op node (:mod:`flexc.torch_compile.under_compile`)."""
    validate.check_tensors(query, key, value, enable_gqa)
    validate.check_flags(enable_gqa, return_lse, return_aux)
    validate.check_mod(score_mod)
    validate.check_block_mask(block_mask, query, key)
    scale = validate.check_scale(scale, query)
    options = validate.check_kernel_options(kernel_options)
    key, value = _in_dtype_of(query, key), _in_dtype_of(query, value)
    backend = options["BACKEND"] = _choose_backend(options, query.device)
    want_max = bool(return_aux is not None and return_aux.max_scores)
    if want_max and backend != "TORCH":
        raise ValueError(f"flex_attention: return_aux.max_scores is supported by the TORCH backend only, got "
                         f"BACKEND={backend!r}. Fix: pass kernel_options={{'BACKEND': 'TORCH'}} or drop max_scores.")
    want_lse = return_lse or bool(return_aux is not None and return_aux.lse)
    out, lse, max_scores = under_compile.flex_attention(query, key, value, score_mod, block_mask, scale, options,
                                                        want_max, want_lse)
    out, lse = _laid_out_like(out, query), lse.to(_lse_dtype(query.dtype))  # as in eager (empty if not wanted)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores if want_max else None)
    if return_lse:
        return out, lse
    return out
