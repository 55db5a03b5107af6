"""A traced mod's structure as a string, and back: the non-tensor argument of flexc's custom ops.

A compiled graph holds each custom-op call with its constant arguments baked in, and torch may
cache that graph on disk and load it in another process. So the constant that names a mod must
carry the whole graph, not an id into this process's memory: :func:`mod_key` writes the IR as
JSON (nodes in operand-first order, operands by position), :func:`traced_from_key` rebuilds the
identical hash-consed nodes. Captured tensors are not in the key: they travel as tensor arguments.
"""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from typing import Sequence

import torch

from . import ir
from .trace import TracedMod


def mod_key(traced: TracedMod) -> str:
    """The structure of ``traced`` (kind, graph, buffer names, name) as a JSON string."""
    order = list(traced.root.walk())
    position = {id(n): i for i, n in enumerate(order)}
    nodes = [[n.op, [position[id(a)] for a in n.args], n.attr, n.kind] for n in order]
    return json.dumps([traced.kind, traced.name, list(traced.buffer_names), nodes], separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def _template(key: str) -> TracedMod:
    kind, name, buffer_names, nodes = json.loads(key)
    built: list[ir.Node] = []
    for op, args, attr, node_kind in nodes:
        if isinstance(attr, list):  # JSON turned the buffer's (slot, dtype, ndim) into a list
            attr = tuple(attr)
        built.append(ir.make(op, tuple(built[i] for i in args), attr, node_kind))
    return TracedMod(kind, built[-1], (), tuple(buffer_names), name, _untraceable(name))


def traced_from_key(key: str, buffers: Sequence[torch.Tensor]) -> TracedMod:
    """The :class:`TracedMod` that :func:`mod_key` described, with ``buffers`` as its captured tensors."""
    return replace(_template(key), buffers=tuple(buffers))


def _untraceable(name: str):
    def fn(*args):
        raise RuntimeError(f"{name} was rebuilt from a compiled graph; only its traced form is available")
    fn.__name__ = name
    return fn
