"""A traced mod: its kind, graph, captured tensors and origin, and the rules that name a mod's kind.

Every stage after tracing reads :class:`TracedMod`; only :mod:`flexc.mods.trace` builds one.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import ir
from ..device import resolve

SCORE_MOD, MASK_MOD = "score_mod", "mask_mod"
SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")


class TraceError(TypeError):
    """A mod cannot be traced: the message names the mod, the line, and the fix."""


class ArityError(TraceError, AssertionError):
    """A mod takes neither 4 nor 5 positional parameters (torch asserts the same, so code that
    catches torch's AssertionError catches this too)."""


@dataclass(frozen=True, eq=False)
class TracedMod:
    """A traced mod: its graph, the tensors it captured, and where it came from.

    ``key`` is the structural cache key: it depends on the graph and on each captured tensor's
    dtype and rank, never on tensor values, so re-creating a closure over new data reuses kernels.
    """

    kind: str  # "score_mod" or "mask_mod"
    root: ir.Node
    buffers: tuple  # captured tensors, indexed by the buffer nodes' slot
    buffer_names: tuple
    name: str
    fn: Callable
    # where each lookup and integer division was written: node -> (" (file:line)", source line);
    # bounds errors (flexc.analysis.bounds) quote it
    sites: dict = field(default_factory=dict, repr=False)
    # values of the graph's ``scalar`` nodes by index (set by flexc.codegen.scalars.lift_scalars)
    scalars: tuple = ()
    # how buffers computed from captured tensors (``torch.exp(log_temp)``) are recomputed when those
    # change (flexc.mods.derived); None when the mod reads captured tensors only directly
    derivations: Any = field(default=None, repr=False)
    # a trace instantiated from a template over lifted closure cells (flexc.mods.lifted_cells):
    # ``(root, template root, cell values)``; analyses keyed by graph share the template's work
    lifted: Any = field(default=None, repr=False)

    @property
    def key(self) -> tuple:
        return (self.kind, self.root)

    @property
    def arg_names(self) -> tuple:
        return SCORE_MOD_ARGS if self.kind == SCORE_MOD else MASK_MOD_ARGS

    def __str__(self) -> str:
        return ir.format_expr(self.root, self.buffer_names)

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}: {self}>"

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        """Evaluate on (broadcastable) tensors, in the mod's own argument order."""
        from .evaluate import evaluate  # (evaluation reads graphs, not this class)

        return evaluate(self, **dict(zip(self.arg_names, args)))


def mod_kind(fn: Callable) -> str:
    """``"score_mod"`` for 5 positional parameters without defaults, ``"mask_mod"`` for 4 (torch's rule)."""
    if not callable(fn):
        raise TypeError(f"expected a score_mod or mask_mod function, got {type(fn).__name__} {fn!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TraceError(f"cannot read the signature of {mod_name(fn)}: {e}") from None
    positional = [
        p for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    required_keywords = [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) in (4, 5) and required_keywords:
        raise TraceError(
            f"cannot trace {mod_name(fn)}{def_site(fn)}: its keyword-only parameters "
            f"{', '.join(required_keywords)} have no defaults, and flexc passes only the "
            f"{len(positional)} mod arguments. Fix: give them default values or bind them with functools.partial."
        )
    if len(positional) == 5:
        return SCORE_MOD
    if len(positional) == 4:
        return MASK_MOD
    raise ArityError(
        f"cannot trace {mod_name(fn)}{def_site(fn)}: it takes {len(positional)} positional "
        f"parameters without defaults; expected 5 for a score_mod (score, b, h, q_idx, kv_idx) or 4 for a mask_mod "
        f"(b, h, q_idx, kv_idx). Fix: give extra parameters default values or bind them with "
        f"functools.partial."
    )


def mod_name(fn: Callable) -> str:
    """A mod's name for messages (``partial(f)`` for a functools.partial)."""
    if isinstance(fn, functools.partial):
        return f"partial({mod_name(fn.func)})"
    return getattr(fn, "__name__", None) or type(fn).__name__


def code_of(fn: Callable):
    """The code object a mod runs (through partials and callable objects), or None."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is None and hasattr(fn, "__call__"):
        code = getattr(getattr(fn, "__call__"), "__code__", None)
    return code


def def_site(fn: Callable) -> str:
    """`` (file:line)`` where a mod is defined, or "" when unknown."""
    code = code_of(fn)
    return f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def unless_identity(score_mod: "TracedMod | None") -> "TracedMod | None":
    """``score_mod``, or None when it returns the score unchanged (Hugging Face's with no soft-cap
    or mask configured): the call without a score_mod, whose paths (fused kernels, the causal
    mode) then apply."""
    return None if score_mod is not None and score_mod.root is ir.input_("score") else score_mod


def trainable_slots(score_mod: "TracedMod | None") -> tuple[int, ...]:
    """Slots of the score_mod's captured float tensors that require grad (they receive gradients)."""
    if score_mod is None:
        return ()
    return tuple(i for i, t in enumerate(score_mod.buffers) if t.is_floating_point() and t.requires_grad)


def check_captured(traced: "TracedMod | None", device: Any, where: str = "flex_attention") -> None:
    """Captured tensors of a traced mod live on ``device`` as torch means it (``"cuda"`` is the
    current CUDA device; 0-d CPU tensors go with any device but meta, as in torch)."""
    if traced is None or not traced.buffers:
        return
    device = resolve(device)
    for name, t in zip(traced.buffer_names, traced.buffers):
        if t.device != device and resolve(t.device) != device and not (t.is_cpu and t.dim() == 0 and device.type != "meta"):
            raise ValueError(f"{where}: {traced.kind} {traced.name!r} captures tensor {name!r} on {t.device} "
                             f"but it runs on {device}. Fix: create the tensor on {device}, e.g. "
                             f"`{name} = {name}.to({str(device)!r})` before defining the mod"
                             f"{', or pass device=' + repr(str(t.device)) if where.startswith('create_') else ''}.")
