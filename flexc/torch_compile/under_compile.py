"""``flex_attention`` inside ``torch.compile``: the mods pass through dynamo to flexc's tracer.

A mod is a Python function whose captured tensors (ALiBi slopes, document ids, a bias table) must
become inputs of the compiled graph: otherwise they are baked in as constants, receive no
gradients, and a new value recompiles. flexc's tracer cannot run under dynamo (it swaps in proxy
objects and a TorchFunctionMode), and a custom op cannot take a function. The bridge is torch's
``dynamo_bypassing_wrapper`` higher-order op:

1. dynamo *speculates* an inner function that calls the mods on 0-d tensors, so it records their
   arithmetic as a subgraph and lifts every tensor they capture (closures of functions created
   inside the compiled region included) to an explicit input of that subgraph. While it does,
   lookups by 0-d index tensors run as ``aten.index`` on the fake tensors (:mod:`~flexc.torch_compile.index_lookups`,
   as torch's own mods are speculated), so a lookup has the shape an eager call sees (a row
   ``q_rope[b, h, q_idx]`` is a vector ``torch.dot`` takes) without reading an index's value; the
   score requires grad, so a ``torch.autograd.Function`` the mod calls is recorded with its
   backward (``autograd_function_apply``) instead of inlined;
2. the op then calls ``wrapper(subgraph)(*inputs)`` outside dynamo, both when AOT autograd traces
   the graph (fake tensors) and when a graph runs without AOT (real tensors). :func:`_wrapper`
   replays the subgraph's mod nodes on flexc's proxies (:func:`flexc.trace`), so the captured
   tensors become the traced mods' buffers, and calls ``flexc::flex_attention`` with them. A
   recorded Function is replayed as a Function whose forward and backward run its recorded
   graphs (:mod:`~flexc.torch_compile.fx_replay`), so eager and compiled calls train through the same backward.

The compiled graph therefore holds one custom-op node per call (and its backward op), whatever the
mods; dynamo never enters the tracer, the analysis or a backend. See docs/torch_compile.md.

This module is the call's bridge; the subgraph is read back by :mod:`~flexc.torch_compile.subgraph_plan`,
its mods replayed by :mod:`~flexc.torch_compile.mod_replay` (its nodes run by
:mod:`~flexc.torch_compile.fx_replay`), and ``create_block_mask`` crosses the same bridge in
:mod:`~flexc.torch_compile.compiled_block_mask`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper

from ..masks.kv_tables import kv_tables
from ..backends.layout import empty_like_reference
from ..dtypes import work_dtype
from ..mods.mod_key import mod_key
from ..mods.trace import trace
from ..mods.traced_mod import MASK_MOD, SCORE_MOD
from . import custom_ops
from .compiled_block_mask import create_block_mask  # noqa: F401  (its home before the split)
from .index_lookups import enter_lookups_as_index, leave_lookups_as_index
from .mod_replay import name_of, replayed_mod, warn_call_runs_eagerly
from .subgraph_plan import plans, number_value, read_plan, with_numbers


class CallSpec(NamedTuple):
    """The constants of one call, fixed per compiled graph (dynamo guards on them)."""

    score_name: str | None  # None: no score_mod
    mask_name: str | None  # None: no mask_mod
    tables: tuple[bool, ...]  # which BlockMask tables are present
    block_dims: int  # len(BLOCK_SIZE): 0 without a BlockMask (its seq_lengths are the inputs' (L, S), checked)
    options: tuple  # kernel_options' sorted items (JSON is written outside dynamo)
    need_max: bool
    need_lse: bool  # (a call without gradients returns an empty logsumexp otherwise)
    dropout: bool  # dropout_p > 0: the seed is the op's tensor input after the tables
    sinks: bool  # the call has sinks: the op's last tensor input


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None,
                   block_mask: Any, scale: float, options: dict, need_max: bool, need_lse: bool = True,
                   dropout_p: float = 0.0, seed: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """``(out, lse, max_scores)`` of one call, as one ``flexc::flex_attention`` node of the compiled graph
    (``flexc::flex_attention_inference`` when no gradient is needed).

    ``options`` are the checked kernel_options with ``BACKEND`` resolved to a registered backend's name;
    ``lse`` is empty unless ``need_lse``. With ``dropout_p > 0``, ``seed`` is the call's 0-d int64
    seed tensor (drawn in the graph, as eager draws it), an input of the node; so are ``sinks``
    (``[B or 1, Hq, 1]``, :func:`flexc.call.sinks.check_sinks`), which the node folds into its softmax.

    Runs under dynamo: only code that dynamo traces cleanly belongs here (no flexc tracing).
    """
    mask_mod = None
    tables: list = []
    block_size: tuple = ()
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
        tables = list(kv_tables(block_mask))
        block_size = tuple(int(x) for x in block_mask.BLOCK_SIZE)
    dropout = True if dropout_p else False  # (a branch: dynamo guards on it, so a symbolic dropout_p gives a constant)
    present = [t for t in tables if t is not None] + ([seed] if dropout else []) + (
        [sinks] if sinks is not None else [])
    # torch scores in float32 (float64 for float64 inputs); indices are int32, as in torch
    score_dtype = work_dtype(query.dtype)
    spec = CallSpec(name_of(score_mod, "score_mod") if score_mod is not None else None,
                    name_of(mask_mod, "mask_mod") if mask_mod is not None else None,
                    tuple(t is not None for t in tables), len(block_size),
                    tuple(sorted(options.items())), need_max, need_lse, dropout, sinks is not None)
    # the mods' arguments: 0-d tensors, as the mods see in eager calls (see the module docstring)
    # the score requires grad where the query's or key's gradient flows through it, so dynamo records an
    # autograd.Function the mod calls with its backward (``autograd_function_apply``) rather than
    # inlining its forward (as torch's flex does for its own mods). Derived from the inputs (an empty
    # slice's sum: zero, O(1)), not made with ``requires_grad_()``: dynamo 2.11 refuses that in a subgraph.
    score0 = query.narrow(-1, 0, 0).sum(dtype=score_dtype) + key.narrow(-1, 0, 0).sum(dtype=score_dtype)
    b0, h0, q0, kv0 = [torch.zeros((), dtype=torch.int32, device=query.device) for _ in range(4)]

    def inner(score, b, h, q_idx, kv_idx, query, key, value, *present):
        if not torch.compiler.is_compiling():  # dynamo could not trace a mod and runs the call eagerly (_wrapper)
            return (*_eager_call(spec, score_mod, mask_mod, query, key, value, tables, block_size, scale,
                                 dropout_p, seed, sinks), None, None)
        # one node that reads the five mod arguments in order, so the wrapper can find them
        torch.stack([score, b, h, q_idx, kv_idx])
        # one node per tensor argument, in order, for the same reason
        for t in (query, key, value, *present):
            t.detach()
        # the call's numbers, one node each: constants of the graph, or inputs of this subgraph where
        # dynamo made them symbolic (dynamic=True, or a scale that changed between calls); the
        # wrapper reads them from these nodes' arguments (a spec constant cannot be symbolic)
        for number in (scale, dropout_p, *block_size):
            torch.full((), number, dtype=torch.float64)
        score_out = score_mod(score, b, h, q_idx, kv_idx) if score_mod is not None else score
        mask_out = mask_mod(b, h, q_idx, kv_idx) if mask_mod is not None else q_idx >= 0
        return (*_output_meta(query, value, need_max, need_lse), score_out, mask_out)

    from torch._dynamo.comptime import comptime  # (here, not at import: dynamo imports sympy)

    comptime(enter_lookups_as_index)
    out, lse, row_max, _, _ = dynamo_bypassing_wrapper(functools.partial(_wrapper, spec), inner,
                                                       score0, b0, h0, q0, kv0, query, key, value, *present)
    comptime(leave_lookups_as_index)
    return out, lse, row_max


def _output_meta(query: torch.Tensor, value: torch.Tensor, need_max: bool, need_lse: bool):
    """Empty tensors shaped like the op's outputs (what dynamo records as the call's result)."""
    B, Hq, L, _ = query.shape
    out = empty_like_reference((B, Hq, L, value.shape[-1]), query)  # strided as the op's result
    lse = query.new_empty((B, Hq, L) if need_lse else (0,), dtype=custom_ops.lse_dtype(query))
    row_max = query.new_empty((B, Hq, L) if need_max else (0,), dtype=torch.float32)
    return out, lse, row_max


# ---- outside dynamo: from the speculated subgraph to the custom op ---------------------------

def _wrapper(spec: CallSpec, gm: torch.fx.GraphModule) -> Callable:
    if not isinstance(gm, torch.fx.GraphModule):
        # dynamo could not speculate the mods (a graph break in one) and calls the op eagerly with the
        # inner function itself, which then runs the call (its first lines)
        return gm
    plan = plans.get(gm)
    if plan is None:
        plan = plans[gm] = read_plan(gm, 5, 3 + sum(spec.tables) + spec.dropout + spec.sinks, 2 + spec.block_dims)

    def run(*inputs):
        query, key, value, *present = (inputs[i] for i in plan.tensors)
        sinks = present.pop() if spec.sinks else None
        seed = present.pop() if spec.dropout else None
        scale, dropout_p, *block_size = (number_value(gm, arg, inputs) for arg in plan.call_numbers)
        inputs = with_numbers(gm, plan, inputs, query.device)
        tables = iter(present)
        tables = [next(tables) if p else None for p in spec.tables]
        score = replayed_mod(gm, plan, inputs, SCORE_MOD, spec.score_name)
        mask = replayed_mod(gm, plan, inputs, MASK_MOD, spec.mask_name)
        out, lse, row_max = _call_op(spec, query, key, value, tables, score, mask, block_size, scale, dropout_p,
                                     seed, sinks)
        # the subgraph also returned the mods' values (so its nodes were kept); stand-ins of
        # the same type, never read
        fill = lambda node: torch.zeros(node.meta["example_value"].shape, dtype=node.meta["example_value"].dtype,
                                        device=query.device)
        return out, lse, row_max, fill(plan.mod_outs[SCORE_MOD]), fill(plan.mod_outs[MASK_MOD])

    return run


def _call_op(spec: CallSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: list,
             score: tuple[str, list], mask: tuple[str, list], block_size: Sequence, scale: Any, dropout_p: Any,
             seed: torch.Tensor | None, sinks: torch.Tensor | None) -> tuple:
    """``(out, lse, row_max)`` from the op of one call; ``score`` and ``mask`` are ``(mod_key, buffers)``."""
    (score_key, score_buffers), (mask_key, mask_buffers) = score, mask
    # the BlockMask's lengths are the inputs' (checked before): symbolic under dynamic shapes (a
    # growing KV cache), so they come from the tensors, not the constant spec
    seq_lengths = [query.shape[-2], key.shape[-2]] if spec.block_dims else []
    # (decided while tracing: dynamo guards on grad mode and requires_grad, so it holds for the graph)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *score_buffers, *([sinks] if spec.sinks else [])))
    arguments = (query, key, value, tables, score_buffers, mask_buffers, score_key, mask_key,
                 list(block_size), seq_lengths, scale, custom_ops.options_key(dict(spec.options)), spec.need_max)
    if needs_grad:
        out, lse, row_max, _ = custom_ops.flex_attention_op(*arguments, dropout_p, seed, sinks)
        return out, lse if spec.need_lse else lse.new_empty((0,)), row_max
    return custom_ops.flex_attention_inference_op(*arguments, spec.need_lse, dropout_p, seed, sinks)


def _eager_call(spec: CallSpec, score_mod: Callable | None, mask_mod: Callable | None, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, tables: list, block_size: tuple, scale: float,
                dropout_p: float, seed: torch.Tensor | None, sinks: torch.Tensor | None) -> tuple:
    """The call dynamo hands back after a graph break in a mod: the same op, its mods traced eagerly."""
    warn_call_runs_eagerly()
    traced = [trace(fn, kind) if fn is not None else None for fn, kind in ((score_mod, SCORE_MOD), (mask_mod, MASK_MOD))]
    score, mask = (("", []) if t is None else (mod_key(t), list(t.buffers)) for t in traced)
    return _call_op(spec, query, key, value, tables, score, mask, block_size, scale, dropout_p, seed, sinks)
