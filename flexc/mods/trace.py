"""Trace a ``score_mod`` or ``mask_mod`` into an :mod:`flexc.mods.ir` graph.

The mod is called once with proxy objects standing in for ``score``, ``b``, ``h``, ``q_idx`` and
``kv_idx``. Python operators on proxies build graph nodes; torch functions and tensor methods are
intercepted by a :class:`~torch.overrides.TorchFunctionMode` while the mod runs. Tensors the mod
captures (closures, globals, defaults, ``functools.partial`` arguments) become buffer parameters
the moment a proxy indexes them or meets them in arithmetic. Anything that would make the graph
depend on a concrete value (``if``, ``bool()``, ``int()``, ``.item()``) raises :class:`TraceError`
with the offending line and a fix.

The tracer's parts live in :mod:`flexc.mods.tracing`: the proxies (``proxies``), what each torch op builds
(``torch_ops``), how torch calls reach the tracer (``dispatch``), the tracer itself (``tracer``), and what
a mod captures and where its lines are (``captures``, ``source_lines``). This module keeps the entry,
:func:`trace`, and re-exports the names it had.
"""
from __future__ import annotations

from typing import Any, Callable

from . import derived, lifted_cells, trace_cache
from .traced_mod import (MASK_MOD, MASK_MOD_ARGS, SCORE_MOD, SCORE_MOD_ARGS, ArityError, TraceError,  # noqa: F401
                         TracedMod, code_of, def_site, mod_kind, mod_name)
from .tracing.captures import captured_numbers  # noqa: F401
from .tracing.dispatch import TraceMode, hook_function_apply  # noqa: F401
from .tracing.proxies import Proxy  # noqa: F401
from .tracing.tracer import Tracer


def trace(fn: Callable, kind: str | None = None) -> TracedMod:
    """Trace ``fn`` once with proxies and return its :class:`TracedMod`.

    ``kind`` (``"score_mod"``/``"mask_mod"``) is inferred from the arity when omitted. Raises
    :class:`TraceError` for code that cannot become a graph. The trace is cached on the function and
    reused while nothing the mod can read has changed (see :mod:`flexc.mods.trace_cache`).

    >>> print(trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))
    q_idx >= kv_idx
    """
    token = None
    if not isinstance(fn, TracedMod):
        cached, token = trace_cache.lookup(fn, kind)
        if cached is not None:
            return cached if cached.derivations is None else derived.current(cached)
    actual = fn.kind if isinstance(fn, TracedMod) else mod_kind(fn)
    if kind is not None and kind != actual:
        source = fn.fn if isinstance(fn, TracedMod) else fn
        raise TraceError(
            f"cannot trace {mod_name(source)}{def_site(source)}: expected a {kind} but it is a {actual} "
            f"({len(SCORE_MOD_ARGS if actual == SCORE_MOD else MASK_MOD_ARGS)} positional parameters). "
            f"Fix: pass a {kind} taking ({', '.join(SCORE_MOD_ARGS if kind == SCORE_MOD else MASK_MOD_ARGS)})."
        )
    if isinstance(fn, TracedMod):
        return fn if fn.derivations is None else derived.current(fn)
    if trace_cache.wants_template(token):
        traced = _from_template(fn, actual, token)
        if traced is not None:
            return traced
    tracer = Tracer(fn, actual)
    traced = tracer.run()
    if not tracer.reads_values:  # a trace that baked in a tensor's value must be redone each call
        trace_cache.remember(token, traced)
    return traced


def _from_template(fn: Callable, kind: str, token: Any) -> TracedMod | None:
    """Trace ``fn`` once with its liftable cells as placeholders (flexc.mods.lifted_cells), remember the
    template (or that there is none) and return ``fn``'s trace from it; None: trace with the values."""
    cells = trace_cache.template_cells(token)
    clone, numbers = lifted_cells.clone_with_markers(fn, cells)
    template = None
    try:
        tracer = Tracer(clone, kind)
        traced = tracer.run()
        if not tracer.reads_values:
            template = lifted_cells.template_of(traced, fn, cells, numbers)
    except Exception:  # any failure: the trace with the values decides (and raises its own error)
        template = None
    trace_cache.remember_template(token, template)
    return (trace_cache.instance(template, fn, token.key[1], token.keep, token.located) if template is not None
            else None)
