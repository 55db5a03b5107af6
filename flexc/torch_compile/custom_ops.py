"""flexc's attention as torch custom operators, so ``torch.compile`` sees one opaque node per call.

``flexc::flex_attention`` (forward) and ``flexc::flex_attention_backward`` take only tensors and
constants: query/key/value, the BlockMask's tables, the tensors each mod captured, the mods'
structure as strings (:mod:`flexc.mods.mod_key`), a dropout call's seed and the call's sinks. Each has a fake implementation for tracing (shapes,
dtypes and the real one's strides: outputs and gradients laid out as eager calls return them, see
:mod:`flexc.backends.layout`), and the forward's autograd formula calls the backward op, so compiled
training runs flexc's own backward and captured tensors that require grad receive gradients.
:mod:`flexc.torch_compile.under_compile` is what calls these ops from inside a compiled region.
"""
from __future__ import annotations

import contextlib
import json
from typing import Optional

import torch

from ..backends.cpu.torch_cpu_backward import torch_backward
from ..masks.block_mask import DERIVED, BlockMask
from ..masks.create import create_block_mask
from ..codegen.printer import precise_math_for
from ..masks.kv_tables import KV_TABLE_NAMES
from ..backends.layout import empty_like_reference, laid_out_like
from ..mods.mod_key import traced_from_key
from ..mods.traced_mod import unless_identity
from ..call.plan import dropout_backend, generated_backward_applies, warn_fallback
from ..call.sinks import sink_grad
from ..backends.dropout import Dropout, from_seed
from ..dtypes import work_dtype
from .op_plans import OpPlan, op_plan, op_signature, options_of, training_pair

# The BlockMask tables the ops take, in this order (None for full tables a mask does not keep).
# The forward and the backward walk query rows, so the q-direction tables are never needed.
TABLE_NAMES = KV_TABLE_NAMES  # (the op's table arguments, in this order)


def lse_dtype(query: torch.Tensor) -> torch.dtype:
    """The logsumexp's dtype, as eager flex_attention's: the work dtype of ``query``."""
    return work_dtype(query.dtype)


def options_key(options: dict) -> str:
    """``kernel_options`` (``BACKEND`` resolved) as the ops' string argument."""
    return json.dumps(options, sort_keys=True)


def _block_mask(tables: list, block_size: list[int], seq_lengths: list[int], mask_mod) -> BlockMask | None:
    if not block_size:
        return None
    return BlockMask(tuple(seq_lengths), *tables, *(DERIVED,) * 4, BLOCK_SIZE=tuple(block_size),
                     mask_mod=mask_mod if mask_mod is not None else _noop)


def _noop(b, h, q_idx, kv_idx):
    return q_idx >= 0  # stands in only for the mask of a BlockMask rebuilt without a mask_mod


def _mods(score_key: str, score_buffers, mask_key: str, mask_buffers):
    score = unless_identity(traced_from_key(score_key, score_buffers)) if score_key else None
    mask = traced_from_key(mask_key, mask_buffers) if mask_key else None
    return score, mask


# A custom op's implementation runs with autograd's dispatch keys excluded; the backward needs them
# back to differentiate the score_mod (torch.autograd.grad over its recomputed scores).
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther)


@contextlib.contextmanager
def _autograd_enabled():
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    try:
        for k in _AUTOGRAD_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, excluded in zip(_AUTOGRAD_KEYS, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, excluded)


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             tables: list[Optional[torch.Tensor]], score_buffers: list[torch.Tensor],
             mask_buffers: list[torch.Tensor], score_mod: str, mask_mod: str,
             block_size: list[int], seq_lengths: list[int], scale: float, kernel_options: str,
             need_max: bool, dropout_p: float, seed: Optional[torch.Tensor],
             sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward: ``(out [B,Hq,L,Ev], lse [B,Hq,L], max_scores [B,Hq,L] or empty, stats)``, ``stats`` what
    the generated backward reads (:func:`_saves_stats`: the TRITON training forward's ``[2,B,Hq,L]``), else empty.

    ``score_mod``/``mask_mod`` are :func:`flexc.mods.mod_key.mod_key` strings ("" for none);
    ``block_size`` is empty when there is no BlockMask; ``kernel_options`` is :func:`options_key`'s JSON;
    ``seed`` is a dropout call's 0-d int64 seed (:func:`flexc.backends.dropout.seed_tensor`), None without;
    ``sinks`` the call's ``[B or 1, Hq, 1]`` sink logits (:func:`flexc.call.sinks.check_sinks`), None
    without, folded into the softmax as eager calls fold them (required arguments: a graph leaves out
    arguments equal to their defaults, which the autograd formula could not tell from the inputs it is given).
    """
    return _run_forward(query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size,
                        seq_lengths, scale, kernel_options, need_max, True, True, _dropout(dropout_p, seed), sinks)


def _forward_inference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       tables: list[Optional[torch.Tensor]], score_buffers: list[torch.Tensor],
                       mask_buffers: list[torch.Tensor], score_mod: str, mask_mod: str,
                       block_size: list[int], seq_lengths: list[int], scale: float, kernel_options: str,
                       need_max: bool, need_lse: bool, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
                       sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_forward` for calls without gradients; the logsumexp is empty unless ``need_lse``."""
    return _run_forward(query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size,
                        seq_lengths, scale, kernel_options, need_max, need_lse, False, _dropout(dropout_p, seed),
                        sinks)[:3]


def _dropout(dropout_p: float, seed: Optional[torch.Tensor]) -> Dropout | None:
    """The ops' dropout arguments as the row loop's :class:`~flexc.backends.dropout.Dropout` (None: none)."""
    return from_seed(dropout_p, seed) if dropout_p and seed is not None else None


def _saves_stats(kernel_options: str, dropout_p: float) -> bool:
    """Whether the training op's forward runs a backend's training forward (:data:`flexc.backends.registry.TRAINING`), which
    returns the generated backward's statistics (e.g. :func:`flexc.backends.triton.backward.forward_for_training`)."""
    return training_pair(dropout_backend(options_of(kernel_options)["BACKEND"], dropout_p)) is not None


def _run_forward(query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size,
                 seq_lengths, scale, kernel_options, need_max, need_lse, training, drop=None, sinks=None):
    """``training``: the op autograd records (its forward saves what the backward op reads)."""
    score, mask = _mods(score_mod, score_buffers, mask_mod, mask_buffers)
    block_mask = _block_mask(tables, block_size, seq_lengths, mask)
    constants = ("forward", score_mod, mask_mod, tuple(block_size), tuple(seq_lengths), scale, kernel_options,
                 need_max, need_lse, training, drop.p if drop is not None else 0.0)
    plan = op_plan(op_signature(query, key, value, tables, score_buffers, mask_buffers, constants, sinks),
                   lambda: OpPlan(query, key, value, score, mask, block_mask, scale, kernel_options,
                                  drop.p if drop is not None else 0.0, sinks, True, need_max, need_lse,
                                  training=training))
    out, lse, row_max, stats = plan.forward(query, key, value, score, mask, block_mask, drop, sinks)
    if row_max is None:
        row_max = query.new_empty((0,), dtype=torch.float32)
    # laid out as an eager call returns it (the query's dimension order, flexc.backends.layout) whatever a
    # backend chose, and the logsumexp contiguous: what the fake implementation promises
    lse = lse.to(lse_dtype(query)).contiguous() if need_lse else query.new_empty((0,), dtype=lse_dtype(query))
    if stats is None:
        stats = query.new_empty((0,), dtype=lse_dtype(query))
    return laid_out_like(out, query), lse, row_max, stats


flex_attention_op = torch.library.custom_op("flexc::flex_attention", _forward, mutates_args=())


@flex_attention_op.register_fake
def _forward_shapes(query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size,
                    seq_lengths, scale, kernel_options, need_max, dropout_p=0.0, seed=None, sinks=None):
    B, Hq, L, _ = query.shape
    Ev = value.shape[-1]
    out = empty_like_reference((B, Hq, L, Ev), query)  # the real implementation's strides
    lse = query.new_empty((B, Hq, L), dtype=lse_dtype(query))
    row_max = query.new_empty((B, Hq, L) if need_max else (0,), dtype=torch.float32)
    stats = query.new_empty((2, B, Hq, L) if _saves_stats(kernel_options, dropout_p) else (0,), dtype=lse_dtype(query))
    return out, lse, row_max, stats


@torch.library.custom_op("flexc::flex_attention_backward", mutates_args=())
def flex_attention_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                               lse: torch.Tensor, stats: torch.Tensor, grad_out: torch.Tensor,
                               grad_lse: Optional[torch.Tensor],
                               tables: list[Optional[torch.Tensor]], score_buffers: list[torch.Tensor],
                               mask_buffers: list[torch.Tensor], score_mod: str, mask_mod: str,
                               block_size: list[int], seq_lengths: list[int], scale: float, kernel_options: str,
                               grad_slots: list[int], dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
                               sinks: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Backward: ``(dq, dk, dv, gradients of score_buffers[i] for i in grad_slots, d_sinks)``; a dropout
    call's mask regenerated from ``seed``. ``stats`` is the forward's (read by the generated backward).
    ``d_sinks`` is :func:`flexc.call.sinks.sink_grad` (shaped like ``sinks``), empty without sinks:
    computed here, in the op, so it is eager's arithmetic whatever compiles the graph."""
    score, mask = _mods(score_mod, score_buffers, mask_mod, mask_buffers)
    raw_mask = _block_mask(tables, block_size, seq_lengths, mask)
    constants = ("backward", score_mod, mask_mod, tuple(block_size), tuple(seq_lengths), scale, kernel_options,
                 tuple(grad_slots), dropout_p)
    plan = op_plan(op_signature(query, key, value, tables, score_buffers, mask_buffers, constants, sinks),
                   lambda: OpPlan(query, key, value, score, mask, raw_mask, scale, kernel_options, dropout_p, sinks,
                                  forward=False, grad_slots=tuple(grad_slots)))
    block_mask = plan.block_mask(raw_mask)
    options = plan.options
    drop = _dropout(dropout_p, seed)
    # flex_attention's own rule for when the generated backward applies
    generated = plan.generated
    if generated is not None and generated_backward_applies(score):  # the generated kernels
        score, mask = plan.training_mods(score, mask)
        dq, dk, dv, buf_grads = generated[1](query, key, value, out, stats, grad_out, grad_lse, score, mask,
                                             block_mask, scale, tuple(grad_slots), options, dropout=drop, sinks=sinks)
    else:
        score, mask = precise_math_for(options, score, mask)
        if generated is not None:  # says so, once per score_mod, as eager calls do
            warn_fallback(score, options["BACKEND"])
        with _autograd_enabled():  # carries dS through the score_mod
            dq, dk, dv, buf_grads = torch_backward(query, key, value, out, lse, grad_out, grad_lse, score, mask,
                                                   block_mask, scale, tuple(grad_slots), dropout=drop, sinks=sinks)
    d_sinks = (sink_grad(sinks, out, grad_out, lse, grad_lse).contiguous() if sinks is not None
               else query.new_empty((0,)))
    # each gradient laid out like its input, as an eager call's (flexc.backends.layout), and the captured
    # tensors' contiguous: what the fake implementation promises
    return (laid_out_like(dq, query), laid_out_like(dk, key), laid_out_like(dv, value),
            [g.contiguous() for g in buf_grads], d_sinks)


@flex_attention_backward_op.register_fake
def _(query, key, value, out, lse, stats, grad_out, grad_lse, tables, score_buffers, mask_buffers, score_mod,
      mask_mod, block_size, seq_lengths, scale, kernel_options, grad_slots, dropout_p=0.0, seed=None, sinks=None):
    return (empty_like_reference(query.shape, query), empty_like_reference(key.shape, key),
            empty_like_reference(value.shape, value),
            [score_buffers[i].new_empty(score_buffers[i].shape) for i in grad_slots],
            sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    (query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size, seq_lengths,
     scale, kernel_options, need_max, ctx.dropout_p, seed, sinks) = inputs
    ctx.has_seed, ctx.has_sinks = seed is not None, sinks is not None
    out, lse, _, stats = output
    # captured float tensors that require grad (learnable biases, ALiBi slopes) get gradients
    ctx.grad_slots = [i for i, t in enumerate(score_buffers) if t.is_floating_point() and t.requires_grad]
    ctx.n_tables, ctx.n_score, ctx.n_mask = len(tables), len(score_buffers), len(mask_buffers)
    ctx.table_present = [t is not None for t in tables]
    ctx.constants = (score_mod, mask_mod, list(block_size), list(seq_lengths), scale, kernel_options)
    # the gradients mirror the inputs' pytree: a list of ints is a leaf (grad None), an empty list is not
    ctx.int_list_grads = [None if len(x) else [] for x in (block_size, seq_lengths)]
    ctx.save_for_backward(query, key, value, out, lse, stats, *[t for t in tables if t is not None],
                          *score_buffers, *mask_buffers, *([seed] if ctx.has_seed else []),
                          *([sinks] if ctx.has_sinks else []))


def _backward(ctx, grad_out, grad_lse, grad_max, grad_stats):
    saved = list(ctx.saved_tensors)
    query, key, value, out, lse, stats = saved[:6]
    rest = iter(saved[6:])
    tables = [next(rest) if present else None for present in ctx.table_present]
    score_buffers = [next(rest) for _ in range(ctx.n_score)]
    mask_buffers = [next(rest) for _ in range(ctx.n_mask)]
    seed = next(rest) if ctx.has_seed else None
    sinks = next(rest) if ctx.has_sinks else None
    score_mod, mask_mod, block_size, seq_lengths, scale, kernel_options = ctx.constants
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, buf_grads, d_sinks = flex_attention_backward_op(
        query, key, value, out, lse, stats, grad_out.contiguous(), grad_lse, tables, score_buffers, mask_buffers,
        score_mod, mask_mod, block_size, seq_lengths, scale, kernel_options, ctx.grad_slots, ctx.dropout_p, seed,
        sinks)
    score_grads: list = [None] * ctx.n_score
    for slot, g in zip(ctx.grad_slots, buf_grads):
        score_grads[slot] = g
    return (dq, dk, dv, [None] * ctx.n_tables, score_grads, [None] * ctx.n_mask, None, None,
            *ctx.int_list_grads, None, None, None, None, None, d_sinks if ctx.has_sinks else None)


flex_attention_op.register_autograd(_backward, setup_context=_setup_context)

# The same forward for compiled calls that need no gradients (inference, decoding): an operator
# without an autograd formula, so torch's dispatcher calls the kernel directly. Through the
# custom_op above, each call also runs torch's Python autograd layer and redispatch (about 40 us a
# call on a CPU, a fifth of a one-row decoding step's cost in a compiled loop).
_LIBRARY = torch.library.Library("flexc", "FRAGMENT")
_LIBRARY.define("flex_attention_inference" + torch.library.infer_schema(_forward_inference, mutates_args=()))
_LIBRARY.impl("flex_attention_inference", _forward_inference, "CompositeExplicitAutograd")


@torch.library.register_fake("flexc::flex_attention_inference", lib=_LIBRARY)
def _(query, key, value, tables, score_buffers, mask_buffers, score_mod, mask_mod, block_size, seq_lengths, scale,
      kernel_options, need_max, need_lse, dropout_p=0.0, seed=None, sinks=None):
    out, lse, row_max, _ = _forward_shapes(query, key, value, tables, score_buffers, mask_buffers, score_mod,
                                           mask_mod, block_size, seq_lengths, scale, kernel_options, need_max)
    return out, (lse if need_lse else lse.new_empty((0,))), row_max


flex_attention_inference_op = torch.ops.flexc.flex_attention_inference.default


@torch.library.custom_op("flexc::create_block_mask", mutates_args=())
def create_block_mask_op(mask_buffers: list[torch.Tensor], mask_mod: str, B: int, H: int, Q_LEN: int, KV_LEN: int,
                         Q_BLOCK: int, KV_BLOCK: int, device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kv tables ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` of
    :func:`flexc.create_block_mask` for a mask_mod given as a mod key and its captured tensors."""
    bm = create_block_mask(traced_from_key(mask_mod, mask_buffers), B, H, Q_LEN, KV_LEN, device=device,
                           BLOCK_SIZE=(Q_BLOCK, KV_BLOCK))
    return (bm.kv_num_blocks.contiguous(), bm.kv_indices.contiguous(), bm.full_kv_num_blocks.contiguous(),
            bm.full_kv_indices.contiguous())


@create_block_mask_op.register_fake
def _(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device):
    nq, nkv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    num = torch.empty((B, H, nq), dtype=torch.int32, device=device)
    indices = torch.empty((B, H, nq, nkv), dtype=torch.int32, device=device)
    return num, indices, torch.empty_like(num), torch.empty_like(indices)
