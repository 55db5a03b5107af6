"""``flex_attention`` inside ``torch.compile``: the mods pass through dynamo to flexc's tracer.

A mod is a Python function whose captured tensors (ALiBi slopes, document ids, a bias table) must
become inputs of the compiled graph: otherwise they are baked in as constants, receive no
gradients, and a new value recompiles. flexc's tracer cannot run under dynamo (it swaps in proxy
objects and a TorchFunctionMode), and a custom op cannot take a function. The bridge is torch's
``dynamo_bypassing_wrapper`` higher-order op:

1. dynamo *speculates* an inner function that calls the mods on 0-d tensors, so it records their
   arithmetic as a subgraph and lifts every tensor they capture (closures of functions created
   inside the compiled region included) to an explicit input of that subgraph. While it does,
   lookups by 0-d index tensors run as ``aten.index`` on the fake tensors (:class:`_LookupsAsIndex`,
   as torch's own mods are speculated), so a lookup has the shape an eager call sees (a row
   ``q_rope[b, h, q_idx]`` is a vector ``torch.dot`` takes) without reading an index's value; the
   score requires grad, so a ``torch.autograd.Function`` the mod calls is recorded with its
   backward (``autograd_function_apply``) instead of inlined;
2. the op then calls ``wrapper(subgraph)(*inputs)`` outside dynamo, both when AOT autograd traces
   the graph (fake tensors) and when a graph runs without AOT (real tensors). :func:`_wrapper`
   replays the subgraph's mod nodes on flexc's proxies (:func:`flexc.trace`), so the captured
   tensors become the traced mods' buffers, and calls ``flexc::flex_attention`` with them. A
   recorded Function is replayed as a Function whose forward and backward run its recorded
   graphs (:func:`_graph_function`), so eager and compiled calls train through the same backward.

The compiled graph therefore holds one custom-op node per call (and its backward op), whatever the
mods; dynamo never enters the tracer, the analysis or a backend. See docs/torch_compile.md.
"""
from __future__ import annotations

import functools
import operator
import re
import weakref
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch._functorch.autograd_function import autograd_function_apply
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper

from .. import device as gpu
from ..errors import warn_once
from ..masks import block_mask
from . import custom_ops
from ..masks.block_mask import DERIVED, BlockMask
from ..masks.kv_tables import kv_tables
from ..backends.layout import empty_like_reference
from ..mods.mod_key import mod_key
from ..mods.trace import MASK_MOD, SCORE_MOD, trace


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
    score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    spec = CallSpec(_name(score_mod, "score_mod") if score_mod is not None else None,
                    _name(mask_mod, "mask_mod") if mask_mod is not None else None,
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

    comptime(_enter_lookups_as_index)
    out, lse, row_max, _, _ = dynamo_bypassing_wrapper(functools.partial(_wrapper, spec), inner,
                                                       score0, b0, h0, q0, kv0, query, key, value, *present)
    comptime(_leave_lookups_as_index)
    return out, lse, row_max


def _name(fn: Any, default: str) -> str:
    return getattr(fn, "__name__", None) or default


class _LookupsAsIndex(TorchFunctionMode):
    """``tensor[key]`` with 0-d integer index tensors in ``key`` as ``aten.index``, while dynamo
    speculates the mods (torch's ``TransformGetItemToIndex`` does this for its own mods).

    Python indexing reads a 0-d index tensor's value (``item()``), which a fake tensor does not have:
    data-dependent, dynamo cannot speculate it. ``aten.index`` gives the same shape without the
    value: the rest of the dimensions, so ``q_rope[b, h, q_idx]`` is the row an eager call reads.
    Full slices stay free, other slices are taken first, integers become 0-d indices. The mode acts
    on the fake tensors dynamo runs each recorded operation on, not on what it records: the subgraph
    keeps the lookups as written, which the replay traces."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            out = _lookup_as_index(*args)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))


def _lookup_as_index(x: torch.Tensor, key: Any) -> torch.Tensor | None:
    keys = list(key) if isinstance(key, tuple) else [key]
    index_tensor = lambda k: isinstance(k, torch.Tensor) and not k.is_floating_point() and k.dtype != torch.bool
    if not any(index_tensor(k) and k.dim() == 0 for k in keys):
        return None  # no 0-d index: Python indexing reads no value
    if not all(index_tensor(k) or k is Ellipsis or isinstance(k, slice) or
               (isinstance(k, int) and not isinstance(k, bool)) for k in keys):
        return None  # None (a new axis), bool or float keys: as written
    ellipses = [i for i, k in enumerate(keys) if k is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses:
        keys[ellipses[0]:ellipses[0] + 1] = [slice(None)] * (x.dim() - (len(keys) - 1))
    if len(keys) > x.dim():
        return None
    indices: list = []
    for dim, k in enumerate(keys):
        if isinstance(k, slice):
            if k != slice(None):
                x = x[(slice(None),) * dim + (k,)]
            indices.append(None)
        elif isinstance(k, int):
            indices.append(torch.tensor(k, dtype=torch.int64, device=x.device))
        else:
            indices.append(k)
    while indices[-1] is None:
        indices.pop()
    return torch.ops.aten.index(x, indices)


# the mode while dynamo speculates a call's mods (pushed and popped at compile time, by comptime)
_lookup_modes: list = []


def _enter_lookups_as_index(ctx) -> None:
    mode = _LookupsAsIndex()
    mode.__enter__()
    _lookup_modes.append(mode)
    # popped after the speculation, and in any case when dynamo finishes this frame (a failed one too)
    ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.add_cleanup_hook(_leave_lookups_as_index)


def _leave_lookups_as_index(ctx=None) -> None:
    while _lookup_modes:
        mode = _lookup_modes.pop()
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)


def _output_meta(query: torch.Tensor, value: torch.Tensor, need_max: bool, need_lse: bool):
    """Empty tensors shaped like the op's outputs (what dynamo records as the call's result)."""
    B, Hq, L, _ = query.shape
    out = empty_like_reference((B, Hq, L, value.shape[-1]), query)  # strided as the op's result
    lse = query.new_empty((B, Hq, L) if need_lse else (0,), dtype=custom_ops.lse_dtype(query))
    row_max = query.new_empty((B, Hq, L) if need_max else (0,), dtype=torch.float32)
    return out, lse, row_max


# ---- outside dynamo: from the speculated subgraph to the custom op ---------------------------

class _Plan(NamedTuple):
    """Where the wrapper finds things among the subgraph's inputs."""

    mod_args: tuple[int, ...]  # input positions of score, b, h, q_idx, kv_idx
    tensors: tuple[int, ...]  # input positions of query, key, value and the present tables
    mod_outs: dict  # kind -> the subgraph node of that mod's value
    traced: dict  # kind -> (mod_key, input positions of its buffers) once traced
    numbers: dict  # "nodes" -> the subgraph's number nodes (see _with_numbers), found on the first call
    functions: dict  # autograd_function_apply node -> its Function class (see _graph_function)
    call_numbers: tuple = ()  # a call's scale, dropout_p and block size: each a constant or its subgraph node


_plans: "weakref.WeakKeyDictionary[torch.fx.GraphModule, _Plan]" = weakref.WeakKeyDictionary()


def _wrapper(spec: CallSpec, gm: torch.fx.GraphModule) -> Callable:
    if not isinstance(gm, torch.fx.GraphModule):
        # dynamo could not speculate the mods (a graph break in one) and calls the op eagerly with the
        # inner function itself, which then runs the call (its first lines)
        return gm
    plan = _plans.get(gm)
    if plan is None:
        plan = _plans[gm] = _read_plan(gm, 5, 3 + sum(spec.tables) + spec.dropout + spec.sinks, 2 + spec.block_dims)

    def run(*inputs):
        query, key, value, *present = (inputs[i] for i in plan.tensors)
        sinks = present.pop() if spec.sinks else None
        seed = present.pop() if spec.dropout else None
        scale, dropout_p, *block_size = (_number_value(gm, arg, inputs) for arg in plan.call_numbers)
        inputs = _with_numbers(gm, plan, inputs, query.device)
        tables = iter(present)
        tables = [next(tables) if p else None for p in spec.tables]
        score = _mod(gm, plan, inputs, SCORE_MOD, spec.score_name)
        mask = _mod(gm, plan, inputs, MASK_MOD, spec.mask_name)
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
    _warn_call_runs_eagerly()
    traced = [trace(fn, kind) if fn is not None else None for fn, kind in ((score_mod, SCORE_MOD), (mask_mod, MASK_MOD))]
    score, mask = (("", []) if t is None else (mod_key(t), list(t.buffers)) for t in traced)
    return _call_op(spec, query, key, value, tables, score, mask, block_size, scale, dropout_p, seed, sinks)


def _warn_call_runs_eagerly() -> None:
    warn_once("compiled call runs eagerly",
              "flexc: torch.compile could not trace a score_mod or mask_mod (a graph break in it, reported by "
              "dynamo): its flex_attention or create_block_mask call runs eagerly, outside the compiled graph, "
              "with the same result. Fix: compile with fullgraph=True to see the break, and keep the mod to tensor "
              "arithmetic dynamo traces.")


def _with_numbers(gm: torch.fx.GraphModule, plan: _Plan, inputs: tuple, device: torch.device) -> tuple:
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
            env[node] = _run_node(gm, node, env)
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


def _mod(gm: torch.fx.GraphModule, plan: _Plan, inputs: tuple, kind: str, name: str | None) -> tuple[str, list]:
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


def _number_value(gm: torch.fx.GraphModule, arg: Any, inputs: tuple) -> Any:
    """A call number read off its node's argument: a constant as it is, else this call's value of
    the subgraph node (an input, or number arithmetic on inputs): a float, or a SymFloat while AOT
    autograd traces, which the custom op takes as it is."""
    if not isinstance(arg, torch.fx.Node):
        return arg
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, inputs))
    needed = _ancestors(arg)
    for node in gm.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = _run_node(gm, node, env)
    return env[arg]


def _read_plan(gm: torch.fx.GraphModule, n_mod_args: int, n_tensors: int, n_numbers: int = 0) -> _Plan:
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
    return _Plan(tuple(position[a] for a in stack.args[0]), tuple(position[n.args[0]] for n in detaches), outs,
                 {}, {}, {}, tuple(n.args[1] for n in fulls))


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


def _trace_output(gm: torch.fx.GraphModule, plan: _Plan, root: torch.fx.Node, inputs: tuple, kind: str, name: str):
    """Trace the subgraph nodes that compute ``root`` as a ``kind`` mod of flexc's tracer."""
    needed = _ancestors(root)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    arg_slots = plan.mod_args if kind == SCORE_MOD else plan.mod_args[-4:]

    computed, boundary = plan.numbers.get("nodes", ((), ()))
    numbers = dict(zip(boundary, inputs[len(placeholders):]))  # number nodes -> this call's 0-d tensors
    skip = set(computed) | set(numbers)  # number arithmetic: done by _with_numbers, read from `numbers`

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
                             else _run_node(gm, node, env, plan.functions))
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


def _ancestors(root: torch.fx.Node) -> set:
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict, functions: dict | None = None) -> Any:
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
            env[node] = _run_node(gm, node, env, {})
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


# ---- create_block_mask inside a compiled region ----------------------------------------------

@functools.wraps(block_mask.create_block_mask)
def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device: Any = None,
                      BLOCK_SIZE: Any = block_mask.DEFAULT_BLOCK_SIZE, _compile: bool = False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True, *, _analytic: bool = True) -> BlockMask:
    # flexc.create_block_mask: inside torch.compile one custom-op node, eagerly the block-mask builder
    if torch.compiler.is_compiling():
        return _compiled_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full_blocks)
    return block_mask.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                        separate_full_blocks, compute_dq_write_order, dq_kv_order,
                                        _analytic=_analytic)


def _compiled_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device: Any,
                         BLOCK_SIZE: Any, separate_full_blocks: bool):
    """:func:`flexc.create_block_mask` as one ``flexc::create_block_mask`` node (same bridge as above)."""
    block = tuple(BLOCK_SIZE) if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
    # eager's rule (flexc.device.default_device) where dynamo can read it: the captured tensors are
    # not known before the mod is speculated, so unnamed, the device is a usable accelerator, else the CPU
    device = gpu.usable(device, "create_block_mask") if device is not None else gpu.default_device()
    from torch._dynamo.comptime import comptime  # (here, not at import: dynamo imports sympy)

    comptime(_warn_if_sizes_are_symbolic)
    # the node takes its sizes as constants (the tables' shapes follow from them): operator.index
    # makes a symbolic size (dynamic=True, or a length made dynamic after a recompile) this call's
    # value under a guard, so each new length compiles its own graph
    sizes = (*(operator.index(n) for n in (B or 1, H or 1, Q_LEN, KV_LEN)), int(block[0]), int(block[1]))
    b0, h0, q0, kv0 = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]

    def inner(b, h, q_idx, kv_idx):
        if not torch.compiler.is_compiling():  # dynamo could not trace the mod (_mask_wrapper, as above)
            _warn_call_runs_eagerly()
            traced = trace(mask_mod, MASK_MOD)
            return (*custom_ops.create_block_mask_op(list(traced.buffers), mod_key(traced), *sizes, device), None)
        torch.stack([b, h, q_idx, kv_idx])  # finds the mod arguments for the wrapper, as above
        return (*_tables_meta(sizes, device), mask_mod(b, h, q_idx, kv_idx))

    spec = (_name(mask_mod, "mask_mod"), sizes, device)
    comptime(_enter_lookups_as_index)
    num, indices, full_num, full_indices, _ = dynamo_bypassing_wrapper(
        functools.partial(_mask_wrapper, spec), inner, b0, h0, q0, kv0)
    comptime(_leave_lookups_as_index)
    full = (full_num, full_indices) if separate_full_blocks else (None, None)
    return BlockMask((Q_LEN, KV_LEN), num, indices, *full, DERIVED, DERIVED, DERIVED, DERIVED,
                     BLOCK_SIZE=(sizes[4], sizes[5]), mask_mod=mask_mod)


def _warn_if_sizes_are_symbolic(ctx) -> None:
    """At trace time (dynamo reads a symbolic size as an int in the traced code; only its own view
    of the locals tells): say once that the graph is specialized to each length."""
    if any(ctx.get_local(name).is_dynamic() for name in ("B", "H", "Q_LEN", "KV_LEN")):
        _warn_symbolic_sizes()


def _warn_symbolic_sizes() -> None:
    warn_once("create_block_mask at symbolic sizes",
              "flexc: create_block_mask inside torch.compile at symbolic (dynamic) sizes specializes the graph "
              "to each call's sizes: every new length compiles anew, up to torch._dynamo's recompile limit. "
              "Fix: build the mask outside the compiled region and pass it in to keep one dynamic graph.")


def _tables_meta(sizes: tuple, device: torch.device):
    B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK = sizes
    nq, nkv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    num = torch.empty((B, H, nq), dtype=torch.int32, device=device)
    indices = torch.empty((B, H, nq, nkv), dtype=torch.int32, device=device)
    return num, indices, torch.empty_like(num), torch.empty_like(indices)


def _mask_wrapper(spec: tuple, gm: torch.fx.GraphModule) -> Callable:
    if not isinstance(gm, torch.fx.GraphModule):  # the inner function, run eagerly (see _wrapper)
        return gm
    name, sizes, device = spec
    plan = _plans.get(gm)
    if plan is None:
        plan = _plans[gm] = _read_plan(gm, 4, 0)

    def run(*inputs):
        key, buffers = _mod(gm, plan, _with_numbers(gm, plan, inputs, device), MASK_MOD, name)
        tables = custom_ops.create_block_mask_op(buffers, key, *sizes, device)
        meta = plan.mod_outs[MASK_MOD].meta["example_value"]
        return (*tables, torch.zeros(meta.shape, dtype=meta.dtype, device=device))

    return run

