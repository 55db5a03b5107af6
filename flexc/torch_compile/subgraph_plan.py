"""The subgraph dynamo speculated for a compiled call, read back outside dynamo: where its mod arguments,
tensors and call numbers are (:class:`Plan`, kept per subgraph), and its number arithmetic evaluated on
this call's values."""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.fx

from ..mods.traced_mod import MASK_MOD, SCORE_MOD
from .fx_replay import ancestors, run_node


class Plan(NamedTuple):
    """Where the wrapper finds things among the subgraph's inputs."""

    mod_args: tuple[int, ...]  # input positions of score, b, h, q_idx, kv_idx
    tensors: tuple[int, ...]  # input positions of query, key, value and the present tables
    mod_outs: dict  # kind -> the subgraph node of that mod's value
    traced: dict  # kind -> (mod_key, input positions of its buffers) once traced
    numbers: dict  # "nodes" -> the subgraph's number nodes (see with_numbers), found on the first call
    functions: dict  # autograd_function_apply node -> its Function class (see flexc.torch_compile.fx_replay)
    call_numbers: tuple = ()  # a call's scale, dropout_p and block size: each a constant or its subgraph node


# each speculated subgraph's plan, read on its first call
plans: "weakref.WeakKeyDictionary[torch.fx.GraphModule, Plan]" = weakref.WeakKeyDictionary()


def with_numbers(gm: torch.fx.GraphModule, plan: Plan, inputs: tuple, device: torch.device) -> tuple:
    """The subgraph's inputs followed by its numbers that tensor arithmetic reads, as 0-d tensors.

    A Python number a mod captures is a constant of the dynamo graph until it changes; then dynamo
    makes it symbolic (a decoding loop's position) and passes it as an input of the subgraph: a
    ``SymInt`` while AOT autograd traces, a plain int when the dynamo graph runs as is. The number
    arithmetic dynamo recorded on it (``torch.sym_float``, ``torch._sym_sqrt``, ``torch.sym_min``,
    ``w // 2``, ...) is evaluated here on this call's values, and each number where it meets a
    tensor becomes a 0-d tensor on ``device``: a captured buffer of the traced mod, read afresh on
    every call, as torch's compiled mods read it. Traced as a number it would be baked into the mod
    (the first value reused for every later one). 0-d tensors take part in type promotion as Python
    numbers do, so dtypes are unchanged. The mod's replay reads these tensors in place of the nodes.
    """
    if "nodes" not in plan.numbers:
        plan.numbers["nodes"] = _number_nodes(gm, inputs)
    computed, boundary = plan.numbers["nodes"]
    if not boundary:
        return inputs
    env = {node: value for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs)}
    for node in gm.graph.nodes:
        if node in computed:
            env[node] = run_node(gm, node, env)
    return (*inputs, *(_as_tensor(env[node], device) for node in boundary))


def _number_nodes(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[list, list]:
    """``(nodes computing numbers from number inputs only, the number inputs and nodes a tensor node reads)``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    numeric = {n for n, x in zip(placeholders, inputs) if not isinstance(x, torch.Tensor)}
    computed = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and node.all_input_nodes \
                and all(a in numeric for a in node.all_input_nodes):
            numeric.add(node)
            computed.append(node)
    boundary = [n for n in gm.graph.nodes if n in numeric and any(u not in numeric for u in n.users)]
    return computed, boundary


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):  # a tensor the mod builds from numbers (torch.tensor(w))
        return value
    for kinds, dtype in (((bool, torch.SymBool), torch.bool), ((int, torch.SymInt), torch.int64),
                         ((float, torch.SymFloat), torch.float64)):
        if isinstance(value, kinds):
            return torch.scalar_tensor(value, dtype=dtype, device=device)
    raise TypeError(f"flexc: a mod under torch.compile computes {type(value).__name__} {value!r} from captured "
                    f"numbers; expected an int, float or bool. Fix: capture a tensor instead.")


def number_value(gm: torch.fx.GraphModule, arg: Any, inputs: tuple) -> Any:
    """A call number read off its node's argument: a constant as it is, else this call's value of
    the subgraph node (an input, or number arithmetic on inputs): a float, or a SymFloat while AOT
    autograd traces, which the custom op takes as it is."""
    if not isinstance(arg, torch.fx.Node):
        return arg
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, inputs))
    needed = ancestors(arg)
    for node in gm.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = run_node(gm, node, env)
    return env[arg]


def read_plan(gm: torch.fx.GraphModule, n_mod_args: int, n_tensors: int, n_numbers: int = 0) -> Plan:
    """The :class:`Plan` of a subgraph that starts as the bridge emits it: a ``torch.stack`` of the mod
    arguments, a ``detach`` per tensor input, a ``torch.full`` per call number."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    stack = body[0] if body else None
    if stack is None or stack.target is not torch.stack or len(stack.args[0]) != n_mod_args:
        raise RuntimeError(f"flexc: unexpected subgraph from torch.compile (first node {stack}); expected the "
                           f"torch.stack over the mod arguments that flexc.torch_compile.under_compile emits:\n{gm.code}")
    detaches = body[1:1 + n_tensors]
    if any(n.op != "call_method" or n.target != "detach" for n in detaches):
        raise RuntimeError(f"flexc: unexpected subgraph from torch.compile; expected {n_tensors} detach nodes "
                           f"after the torch.stack:\n{gm.code}")
    # (number arithmetic dynamo recorded, e.g. a tensorified float's item(), may come before them)
    fulls = [n for n in body[1 + n_tensors:] if n.target is torch.full][:n_numbers]
    if len(fulls) < n_numbers:
        raise RuntimeError(f"flexc: unexpected subgraph from torch.compile; expected {n_numbers} torch.full nodes "
                           f"after the detach nodes:\n{gm.code}")
    output = nodes[-1].args[0]  # (op outputs..., score_mod value (a call only), mask_mod value)
    outs = {MASK_MOD: output[-1], SCORE_MOD: output[-2] if n_mod_args == 5 else None}
    return Plan(tuple(position[a] for a in stack.args[0]), tuple(position[n.args[0]] for n in detaches), outs,
                 {}, {}, {}, tuple(n.args[1] for n in fulls))
