"""The form of a traced mod that readers of one value at a time (range analysis, code generation)
consume: reductions over a small captured axis written out term by term
(:func:`flexc.mods.reductions.unroll`), and each ``torch.autograd.Function`` replaced by its traced
forward. Evaluation keeps both as they are: a reduction runs vectorised, and a Function is called
through ``apply`` so that autograd uses its own backward.
"""
from __future__ import annotations

import functools

from . import ir
from .reductions import unroll

AUTOGRAD_FUNCTION = "autograd_function"


def autograd_function(fn_class: type, forward: ir.Node, inputs: tuple) -> ir.Node:
    """``fn_class.apply(*inputs)``, whose traced forward is ``forward`` (an expression of ``inputs``)."""
    return ir.make(AUTOGRAD_FUNCTION, (forward, *inputs), fn_class, forward.kind)


def inline_functions(root: ir.Node) -> ir.Node:
    """``root`` with every autograd Function node replaced by its traced forward."""
    if not any(n.op == AUTOGRAD_FUNCTION for n in root.walk()):
        return root
    memo: dict[int, ir.Node] = {}
    for n in root.walk():  # operands first
        if n.op == AUTOGRAD_FUNCTION:
            memo[id(n)] = memo[id(n.args[0])]
        elif n.args:
            args = tuple(memo[id(a)] for a in n.args)
            memo[id(n)] = n if all(a is b for a, b in zip(args, n.args)) else ir.make(n.op, args, n.attr, n.kind)
        else:
            memo[id(n)] = n
    return memo[id(root)]


@functools.lru_cache(maxsize=1024)
def scalar_form(root: ir.Node) -> ir.Node:
    """``root`` without reductions or autograd Function nodes (see the module docstring)."""
    return unroll(inline_functions(root))
