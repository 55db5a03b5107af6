"""Captured tensors that a mod computes from other captured tensors, kept current.

A mod may apply torch operations to whole captured tensors: ``score * torch.exp(log_temp)``,
``kv_idx < pos + 0``, ``slopes.softmax(0)[h]``. The tracer runs such operations on the real tensors
(they involve no proxy) and the result becomes a buffer of the graph. That result is a snapshot: an
optimizer step or ``pos.fill_(25)`` changes the tensors it was computed from, not the result, and a
result computed with autograd keeps a graph that one backward frees.

So the tracer records each such operation as a :class:`Step`, and :func:`current` replays the steps
whenever the result could differ: when a tensor they read was written since the last replay, or
given other elements (``.data = new``: :func:`flexc.versions.contents_state`), or when gradients
must flow through them (each forward needs its own graph).
Captured tensors stay parameters, as the design promises, whether the mod reads them directly or
through a computation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import device as gpu
from ..versions import contents_states, pinned

_CPU = torch.device("cpu")


@dataclass(frozen=True, eq=False)
class Step:
    """One torch operation the mod applied to captured tensors: ``func(*args, **kwargs)``, output
    ``item`` of a tuple result (``None`` for a tensor result), which made ``result`` at trace time."""

    func: Callable
    args: tuple
    kwargs: dict
    item: int | None
    result: torch.Tensor


@dataclass(eq=False)
class Derivations:
    """The steps behind a trace's derived buffers and the buffers last computed from them.

    ``slots`` maps buffer slot -> the step that makes it; ``sources`` are the captured tensors the
    steps read (made outside the mod). ``latest`` holds the last replay without autograd, reused
    while the sources hold the same contents, on the stream that made it.
    """

    steps: tuple  # of Step, in the order the mod ran them (a step's inputs come before it)
    slots: dict  # buffer slot -> Step
    sources: tuple
    latest: tuple | None = field(default=None, repr=False)  # (trace, sources' pinned states, stream, refreshed trace)

    def source_states(self) -> tuple:
        return contents_states(self.sources)

    def device(self) -> torch.device:
        """Where the replay makes its buffers: the first derived buffer's device off the CPU, else the CPU."""
        for step in self.slots.values():
            if step.result.device.type != "cpu":
                return step.result.device
        return _CPU

    def needs_graph(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.sources)

    def replay(self, substitute: dict | None = None) -> dict:
        """Run every step again on the current (or substituted, by ``id``) sources: ``id(trace-time
        result) -> new result``."""
        made: dict[int, torch.Tensor] = dict(substitute or {})

        def fresh(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return made.get(id(x), x)
            if isinstance(x, (list, tuple)):
                return type(x)(fresh(y) for y in x)
            if isinstance(x, dict):
                return {k: fresh(y) for k, y in x.items()}
            return x

        outputs: dict[int, Any] = {}  # one call for the several outputs of a tuple-returning op
        for step in self.steps:
            key = (id(step.func), id(step.args), id(step.kwargs))
            if step.item is None or key not in outputs:
                out = step.func(*fresh(step.args), **fresh(step.kwargs))
                outputs[key] = out
            out = outputs[key]
            made[id(step.result)] = out if step.item is None else out[step.item]
        return made


class Recorder:
    """Collects :class:`Step` s while a mod is traced (one per tracer)."""

    def __init__(self):
        self._made: dict[int, torch.Tensor] = {}  # every tensor an operation made during the trace
        self._derived: dict[int, Step] = {}  # those that depend on a captured tensor
        self._steps: list[Step] = []
        self._sources: dict[int, torch.Tensor] = {}

    def note(self, func: Callable, args: tuple, kwargs: dict, tensors: list, result: Any) -> None:
        """Record ``result = func(*args, **kwargs)``, run on the concrete ``tensors`` among its
        arguments; results that depend on no captured tensor are constants and need no replay."""
        outputs = [(None, result)] if isinstance(result, torch.Tensor) else (
            list(enumerate(result)) if isinstance(result, (tuple, list)) else [])
        depends = False
        for t in tensors:
            if id(t) in self._derived:
                depends = True
            elif id(t) not in self._made:  # made outside the mod: a captured tensor
                self._sources.setdefault(id(t), t)
                depends = True
        for item, out in outputs:
            if not isinstance(out, torch.Tensor):
                continue
            self._made[id(out)] = out
            if depends:
                step = Step(func, args, kwargs, item, out)
                self._derived[id(out)] = step
                self._steps.append(step)

    def derivations(self, buffers: list) -> Derivations | None:
        """The derivations of the buffers that were computed from captured tensors, or None."""
        slots = {slot: self._derived[id(t)] for slot, t in enumerate(buffers) if id(t) in self._derived}
        if not slots:
            return None
        # only the steps the buffers need (walking back from them), and the sources those read
        wanted = {id(step.result) for step in slots.values()}
        steps, sources = [], {}
        for step in reversed(self._steps):
            if id(step.result) not in wanted:
                continue
            steps.append(step)
            for t in leaves((step.args, step.kwargs)):
                if not isinstance(t, torch.Tensor):
                    continue
                if id(t) in self._derived:
                    wanted.add(id(t))
                elif id(t) in self._sources:
                    sources.setdefault(id(t), t)
        steps.reverse()
        return Derivations(tuple(steps), slots, tuple(sources.values()))


def leaves(x: Any):
    """The non-container values in nested lists, tuples and dicts (an operation's arguments)."""
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from leaves(y)
    else:
        yield x


def current(traced: Any, substitute: dict | None = None) -> Any:
    """``traced`` with derived buffers recomputed from their sources' current contents.

    ``substitute`` (``id(captured tensor) -> tensor``) swaps captured tensors, both the buffers the
    mod reads directly and the sources of derived buffers (context parallelism swaps trainable
    tensors for ones whose gradient is summed over ranks). Without substitutions, a replay without
    autograd is reused while every source holds the same contents.
    """
    derivations: Derivations | None = traced.derivations
    if derivations is None:
        if not substitute:
            return traced
        return dataclasses.replace(traced, buffers=tuple(substitute.get(id(t), t) for t in traced.buffers))
    if not substitute:
        if not derivations.needs_graph():
            states = derivations.source_states()
            # the replay's buffers are device tensors made on one stream: served to that stream only
            # (flexc.device.stream_token)
            stream = gpu.stream_token(derivations.device())
            latest = derivations.latest
            if latest is not None and latest[0] is traced and latest[1] == states and latest[2] == stream:
                return latest[3]
            refreshed = _rebuilt(traced, derivations, None)
            if gpu.keeps(stream):  # (not a replay made while a CUDA graph is captured: the graph's)
                derivations.latest = (traced, pinned(states, derivations.sources), stream, refreshed)
            return refreshed
    return _rebuilt(traced, derivations, substitute)


def _rebuilt(traced: Any, derivations: Derivations, substitute: dict | None) -> Any:
    made = derivations.replay(substitute)
    buffers = tuple(made[id(derivations.slots[slot].result)] if slot in derivations.slots
                    else (substitute or {}).get(id(t), t) for slot, t in enumerate(traced.buffers))
    # a trace with substituted tensors is for one call: passed on as a TracedMod, it must not be
    # replayed again from the original tensors
    return dataclasses.replace(traced, buffers=buffers, derivations=None if substitute else derivations)


def sources(traced: Any) -> tuple:
    """Every captured tensor ``traced`` reads: its plain buffers and the sources of derived ones."""
    derivations: Derivations | None = traced.derivations
    if derivations is None:
        return tuple(traced.buffers)
    plain = [t for slot, t in enumerate(traced.buffers) if slot not in derivations.slots]
    seen = {id(t) for t in plain}
    return tuple(plain) + tuple(t for t in derivations.sources if id(t) not in seen)
