"""A compiled call's mods handed to flexc's tracer: the subgraph nodes that compute a mod replayed on
proxies, so the tensors it captures become the traced mod's buffers; after a graph break in a mod, the
warning that the call runs eagerly."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.fx

from ..errors import warn_once
from ..mods.mod_key import mod_key
from ..mods.trace import trace
from ..mods.traced_mod import SCORE_MOD
from .fx_replay import ancestors, run_node
from .subgraph_plan import Plan


def name_of(fn: Any, default: str) -> str:
    """A mod's name for the compiled graph's spec (``default`` for a callable without one)."""
    return getattr(fn, "__name__", None) or default


def warn_call_runs_eagerly() -> None:
    """Say once that dynamo could not trace a mod, so its call runs eagerly."""
    warn_once("compiled call runs eagerly",
              "flexc: torch.compile could not trace a score_mod or mask_mod (a graph break in it, reported by "
              "dynamo): its flex_attention or create_block_mask call runs eagerly, outside the compiled graph, "
              "with the same result. Fix: compile with fullgraph=True to see the break, and keep the mod to tensor "
              "arithmetic dynamo traces.")


def replayed_mod(gm: torch.fx.GraphModule, plan: Plan, inputs: tuple, kind: str, name: str | None) -> tuple[str, list]:
    """``(mod_key, captured tensors)`` of one mod ("" and [] for none); traced once per subgraph."""
    if name is None:
        return "", []
    if kind in plan.traced:
        key, positions = plan.traced[kind]
        return key, [inputs[i] for i in positions]
    traced = _trace_output(gm, plan, plan.mod_outs[kind], inputs, kind, name)
    key = mod_key(traced)
    position = {id(t): i for i, t in enumerate(inputs)}
    if all(id(t) in position for t in traced.buffers):  # else (tensors made in the mod) trace every call
        plan.traced[kind] = (key, [position[id(t)] for t in traced.buffers])
    return key, list(traced.buffers)


def _reads_a_tensorified_number(node: torch.fx.Node, env: dict) -> bool:
    """Whether ``node`` is ``t.item()`` of a 0-d tensor input: a Python float the mod captures that
    changed between calls, which dynamo passes as a 0-d tensor and reads back with ``item()``. The
    replay reads the tensor itself (a captured buffer, read afresh every call; a 0-d tensor promotes
    as the number would): its ``item()`` is a SymFloat while AOT autograd traces, which the tracer
    cannot take, and a number would be baked into the mod."""
    if node.op != "call_method" or node.target != "item" or not node.args:
        return False
    value = env.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and node.args[0].op == "placeholder"


def _trace_output(gm: torch.fx.GraphModule, plan: Plan, root: torch.fx.Node, inputs: tuple, kind: str, name: str):
    """Trace the subgraph nodes that compute ``root`` as a ``kind`` mod of flexc's tracer."""
    needed = ancestors(root)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    arg_slots = plan.mod_args if kind == SCORE_MOD else plan.mod_args[-4:]

    computed, boundary = plan.numbers.get("nodes", ((), ()))
    numbers = dict(zip(boundary, inputs[len(placeholders):]))  # number nodes -> this call's 0-d tensors
    skip = set(computed) | set(numbers)  # number arithmetic: done by with_numbers, read from `numbers`

    def mod(*args):
        env: dict = {}
        for i, node in enumerate(placeholders):
            env[node] = inputs[i]
        for i, value in zip(arg_slots, args):
            env[placeholders[i]] = value
        env.update(numbers)
        for node in gm.graph.nodes:
            if node in needed and node not in skip and node.op != "placeholder":
                env[node] = (env[node.args[0]] if _reads_a_tensorified_number(node, env)
                             else run_node(gm, node, env, plan.functions))
        return env[root]

    traced = trace(_ScoreReplay(mod) if kind == SCORE_MOD else _MaskReplay(mod), kind)
    # name the captured tensors after the subgraph inputs they came from (e.g. l_self_slopes_)
    names = {id(inputs[i]): node.name for i, node in enumerate(placeholders)}
    names.update((id(t), node.name) for node, t in numbers.items())
    return replace(traced, name=name, fn=_named(mod, name),
                   buffer_names=tuple(names.get(id(t), f"buf{i}") for i, t in enumerate(traced.buffers)))


class _ScoreReplay:
    """The replayed subgraph as a score_mod. A callable object rather than a function, so the trace
    cache (which keys functions by what they capture) leaves it alone: it captures this call's
    inputs, fake tensors and symbolic sizes included."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)


class _MaskReplay(_ScoreReplay):
    """The replayed subgraph as a mask_mod (see :class:`_ScoreReplay`)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn
