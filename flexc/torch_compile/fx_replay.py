"""Recorded fx nodes run outside dynamo: one node on this call's values, a recorded graph, and a
``torch.autograd.Function`` a mod calls, rebuilt as a Function running its recorded forward and backward."""
from __future__ import annotations

import operator
import re
from typing import Any, Sequence

import torch
import torch.fx
from torch._functorch.autograd_function import autograd_function_apply


def ancestors(root: torch.fx.Node) -> set:
    """``root`` and every node it reads, directly or not."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict, functions: dict | None = None) -> Any:
    """``node``'s value from its arguments' values in ``env``; ``functions`` keeps the Function rebuilt per
    ``autograd_function_apply`` node (see :func:`_graph_function`)."""
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    if node.target is autograd_function_apply:
        # a Function the mod calls: replayed as one Function node (its outputs as a tuple, as recorded)
        fn_class = functions.get(node) if functions is not None else None
        if fn_class is None:
            fn_class = _graph_function(args[0], args[1], _function_name(node))
            if functions is not None:
                functions[node] = fn_class
        return (fn_class.apply(*args[2:]),)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    raise RuntimeError(f"flexc: cannot replay subgraph node {node.format_node()}")


def _run_graph(gm: torch.fx.GraphModule, args: Sequence) -> Any:
    """The output of ``gm`` (a Function's recorded forward or backward) on ``args``; the grad-mode
    switches dynamo records around its body are left out (autograd sets the mode for a Function)."""
    env: dict = {}
    inputs = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "output":
            return torch.fx.node.map_arg(node.args[0], lambda n: env[n])
        elif node.target in _GRAD_MODE_SWITCHES:
            env[node] = None
        else:
            env[node] = run_node(gm, node, env, {})
    raise RuntimeError(f"flexc: a recorded autograd.Function graph has no output:\n{gm.code}")


_GRAD_MODE_SWITCHES = (torch._C._set_grad_enabled,)


def _function_name(node: torch.fx.Node) -> str:
    """The recorded Function's class name as the mod's source line calls it (``Clamp.apply(...)``),
    for messages and kernel headers; the node's name when the line does not say."""
    # the trace's last source line (a line of carets may follow it)
    lines = [line for line in node.meta.get("stack_trace", "").splitlines() if line.strip().strip("^~")]
    source = lines[-1] if lines and not lines[-1].lstrip().startswith("File ") else ""
    names = set(re.findall(r"([A-Za-z_]\w*)\.apply\(", source))
    return names.pop() if len(names) == 1 else node.name


def _graph_function(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, name: str) -> type:
    """A ``torch.autograd.Function`` that runs the forward and backward graphs dynamo recorded for
    one the mod calls: flexc's tracer traces its forward into the mod, evaluation (the torch
    backward) calls ``apply``, and :mod:`flexc.mods.derivative` traces its backward (the generated one)."""

    def forward_fn(ctx, *args):
        outputs, saved = _run_graph(forward, args)
        ctx.saved_values = tuple(saved)
        return outputs[0] if len(outputs) == 1 else outputs

    def backward_fn(ctx, *grads):
        return tuple(_run_graph(backward, (*grads, *ctx.saved_values)))

    # defined here (its qualified name says so): flexc.mods.mod_key names it in this process only
    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward_fn),
                                                  "backward": staticmethod(backward_fn)})
    cls.__qualname__ = f"_graph_function.<locals>.{name}"
    return cls
