"""A traced mod's structure as a string, and back: the non-tensor argument of flexc's custom ops.

A compiled graph holds each custom-op call with its constant arguments baked in, and torch may
cache that graph on disk and load it in another process. So the constant that names a mod must
carry the whole graph, not an id into this process's memory: :func:`mod_key` writes the IR as
JSON (nodes in operand-first order, operands by position), :func:`traced_from_key` rebuilds the
identical hash-consed nodes. Captured tensors are not in the key: they travel as tensor arguments.
A ``torch.autograd.Function`` the mod calls is written as its import path; one defined inside a
function has none, so its key names it in this process only.
"""
from __future__ import annotations

import functools
import importlib
import json
from typing import Sequence

import torch

from . import ir
from .trace import TracedMod


def mod_key(traced: TracedMod) -> str:
    """The structure of ``traced`` (kind, graph, buffer names, name) as a JSON string."""
    order = list(traced.root.walk())
    position = {id(n): i for i, n in enumerate(order)}
    nodes = [[n.op, [position[id(a)] for a in n.args], _encode(n.attr), n.kind] for n in order]
    return json.dumps([traced.kind, traced.name, list(traced.buffer_names), nodes], separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def _template(key: str) -> TracedMod:
    kind, name, buffer_names, nodes = json.loads(key)
    built: list[ir.Node] = []
    for op, args, attr, node_kind in nodes:
        if isinstance(attr, list):  # JSON turned tuples (a buffer's (slot, dtype, ndim)) into lists
            attr = tuple(attr)
        elif isinstance(attr, dict):
            attr = _decode_class(attr)
        built.append(ir.make(op, tuple(built[i] for i in args), attr, node_kind))
    return TracedMod(kind, built[-1], (), tuple(buffer_names), name, _untraceable(name))


def traced_from_key(key: str, buffers: Sequence[torch.Tensor]) -> TracedMod:
    """The :class:`TracedMod` that :func:`mod_key` described, with ``buffers`` as its captured tensors."""
    template = _template(key)
    # (built directly: dataclasses.replace costs several times as much, on every compiled call)
    return TracedMod(template.kind, template.root, tuple(buffers), template.buffer_names, template.name, template.fn)


# classes without an import path (defined inside a function), by the name their keys carry
_LOCAL_CLASSES: dict[str, type] = {}


def _encode(attr):
    if not isinstance(attr, type):
        return attr
    path = f"{attr.__module__}:{attr.__qualname__}"
    if "<locals>" not in attr.__qualname__:
        return {"class": path}
    name = f"{path}@{id(attr):x}"
    _LOCAL_CLASSES[name] = attr
    return {"local_class": name}


def _decode_class(attr: dict) -> type:
    if "class" in attr:
        module, qualname = attr["class"].split(":")
        return functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    cls = _LOCAL_CLASSES.get(attr["local_class"])
    if cls is None:
        raise RuntimeError(f"flexc: the compiled graph calls {attr['local_class']}, an autograd.Function defined "
                           f"inside a function in another process. Fix: define it at module level, or clear "
                           f"torch.compile's caches (TORCHINDUCTOR_CACHE_DIR) before compiling.")
    return cls


def _untraceable(name: str):
    def fn(*args):
        raise RuntimeError(f"{name} was rebuilt from a compiled graph; only its traced form is available")
    fn.__name__ = name
    return fn
