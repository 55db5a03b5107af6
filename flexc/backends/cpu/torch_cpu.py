"""The block-sparse torch backend: forward and backward of flex attention with plain torch ops.

For each query block row it visits only the key blocks the BlockMask lists, scores them with one
batched matmul over every head that shares the row's block list, applies the score_mod
everywhere and the mask_mod only on partial blocks (both evaluated from the traced IR on index
tensors for exactly those positions), and merges chunks of keys with an online softmax. Working
memory is a few chunks of scores, never ``L x S``.

GQA runs without copying keys: the ``G`` query heads that share a key head are stacked as rows,
so ``q [B, Hkv, G*r, E] @ k^T [B, Hkv, E, c]`` scores all of them at once, and the same memory
read as ``[B, Hq, r, c]`` is what the mods see.

Forwards without a score_mod or with a bias-form one (``score +/- X``), in fp32/fp64 with equal
query and value head dims, run on torch's fused CPU flash kernel instead
(:mod:`flexc.backends.cpu.fused_cpu`); this module's row loop serves the rest and ``max_scores``.

Learned attention sinks (flexc's ``sinks=``) start each row's online softmax: its max is the sink
logit and its sum 1, as for a key already seen with no value row (the fused and decode paths, which
end in torch's kernel, join the sink as one more merged part). The logsumexp then includes the sink;
the backward's probabilities ``exp(s - lse)`` are right as they are, and its per-row renormalisation
counts the sink's share ``exp(sink - lse)``.

The backward recomputes each row's scores, forms ``dS`` from the saved logsumexp, and lets
autograd carry ``dS`` through the score_mod to the raw scores and the captured tensors. Large
jobs spread their rows over single-threaded workers (:mod:`flexc.workers`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..dropout import Dropout, keep_scale
from ...constants import LN2, LOG2E
from ...dtypes import work_dtype
from ...mods import ir
from ...mods.evaluate import evaluate
from ...mods.trace import TracedMod
from ... import workers
from . import band_calls, band_plain, causal_call, decode_cpu, dense_tile, fused_cpu
from .score_mod_passes import FIXED_MAX_SPAN, log2_form, tanh_cap, value_bounds
from ..nonfinite import all_finite, matmul_skipping_zeros
from .block_plan import (Chunk, Row, add_chunk_rows, all_full, chunk_kv_index, chunk_rows, memo_by_tables,
                         merged_tables, read_tables, row_plan, trimmed_rows, TRIM_ELEMENTS)

# Scores of one chunk hold at most this many elements (2 MiB in fp32): small enough to stay in
# cache and keep peak memory near SDPA's, large enough that matmuls are not tiny. Small problems
# use chunks of a quarter of the output's size (but not under a quarter of this), so the working
# memory stays a fraction of the output's.
CHUNK_ELEMENTS = 1 << 19
MAX_ROWS = 128
# Above this many partial spans in one chunk the mask is evaluated once over the whole chunk.
_MAX_PARTIAL_SPANS = 4
_NEG_INF = float("-inf")
# Softmax runs in base 2: torch's exp2 on CPU is several times faster than exp, and exp is ~30x
# slower still on inputs below -88 (masked and far-away scores), which exp2 handles at full speed.
# The backward's natural exp keeps its argument above a floor instead (_exp_floored_).
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}  # exp of each is still a normal number


@functools.lru_cache(maxsize=None)
def _exp_floor(dtype: torch.dtype) -> tuple[float, float]:
    """``(floor, exp(floor))`` for ``dtype``, exp taken by the same vectorised kernel as the scores'."""
    floor = _EXP_FLOOR[dtype]
    return floor, torch.full((64,), floor, dtype=dtype).exp_()[0].item()


def _exp_floored_(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in place, off the slow path torch's CPU exp takes on -inf (~5x) and on underflow
    (~100x below -87 in fp32): the argument is floored where exp is still a normal number and
    exp(floor) taken off again, so arguments at or below the floor give exactly 0 and every result
    above ~2^-100 is bit-identical to exp's."""
    floor, at_floor = _exp_floor(x.dtype)
    return x.clamp_(min=floor).exp_().sub_(at_floor)


# ---- groups of heads that share one block-mask table -------------------------------------

@dataclass(frozen=True)
class _Group:
    """Query batches/heads that read the same BlockMask entry ``(bm, hm)``, and their key batches/heads.

    Within a group, query head ``j`` uses key head ``j // G`` (all slices, so tensors are views).
    """

    b: slice
    kb: slice
    qh: slice
    kvh: slice
    G: int
    bm: int
    hm: int


def _groups(B: int, Bkv: int, Hq: int, Hkv: int, Bm: int, Hm: int) -> list[_Group]:
    G = Hq // Hkv
    batches = [(slice(0, B), 0)] if Bm == 1 else [(slice(bm, B, Bm), bm) for bm in range(Bm)]
    if Hm == 1:
        heads = [(slice(0, Hq), slice(0, Hkv), G, 0)]
    else:  # the table differs per head: one query head per group (broadcast by modulo like torch)
        heads = [(slice(h, h + 1), slice(h // G, h // G + 1), 1, h % Hm) for h in range(Hq)]
    out = []
    for b, bm in batches:
        kb = slice(0, 1) if Bkv == 1 else b
        for qh, kvh, g, hm in heads:
            out.append(_Group(b, kb, qh, kvh, g, bm, hm))
    return out


def _tasks(block_mask: Any, query: torch.Tensor, value: torch.Tensor, Hkv: int, score_mod, mask_mod,
           dropout: Dropout | None = None):
    """Every (group, mods, row) to compute, their estimated costs, how many workers to use, and the groups."""
    B, Hq, L, _ = query.shape
    Bkv, _, S, Ev = value.shape
    tasks, costs, groups = [], [], []
    for g, rows in _plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev, None if _is_true(mask_mod) else mask_mod):
        groups.append(g)
        mods = _Mods(score_mod, mask_mod, g, B, Hq, L, S, query.device, dropout)
        heads = len(range(B)[g.b]) * len(range(Hq)[g.qh])
        for row in rows:
            tasks.append((g, mods, row))
            costs.append(float(heads * (row.q1 - row.q0) * sum(c.n_cols for c in row.chunks)))
    return tasks, costs, workers.worker_count(len(tasks), sum(costs)), groups


def _plan(block_mask: Any, B: int, Bkv: int, Hq: int, Hkv: int, L: int, S: int, Ev: int,
          mask_mod: TracedMod | None = None) -> list[tuple[_Group, list[Row]]]:
    """Each group of heads and its rows of chunks (remembered per block mask, call shape and mask_mod),
    partial blocks trimmed to the mask_mod's allowed columns (:func:`block_plan.trimmed_rows`)."""
    key = (getattr(block_mask, "BLOCK_SIZE", None), B, Bkv, Hq, Hkv, L, S, Ev, torch.get_num_threads())
    plain = lambda: _new_plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev)
    if mask_mod is None or block_mask is None:
        return memo_by_tables(block_mask, key, plain)
    # the trim reads the mask_mod: remembered with its graph and captured tensors, and skipped where
    # those cannot be remembered (it pays only once per mask)
    return memo_by_tables(block_mask, key + (mask_mod.root,),
                          lambda: _new_plan(block_mask, B, Bkv, Hq, Hkv, L, S, Ev, mask_mod),
                          [t for t in mask_mod.buffers if isinstance(t, torch.Tensor)], unversioned=plain)


def _new_plan(block_mask: Any, B: int, Bkv: int, Hq: int, Hkv: int, L: int, S: int, Ev: int,
              mask_mod: TracedMod | None = None) -> list[tuple[_Group, list[Row]]]:
    tables = merged_tables(read_tables(block_mask, L, S))
    plans = []
    trim_budget = [TRIM_ELEMENTS]
    cache: dict[tuple, list[Row]] = {}
    budget = min(CHUNK_ELEMENTS, max(CHUNK_ELEMENTS // 4, B * Hq * L * Ev // 4))
    budget //= max(1, torch.get_num_threads())  # each worker thread holds its own chunk
    for g in _groups(B, Bkv, Hq, Hkv, tables.batch, tables.heads):
        n_heads = len(range(Hq)[g.qh]) * len(range(B)[g.b])
        rows = min(MAX_ROWS, max(tables.block_size[0], 1))
        # at least one key block's worth of columns, even for many heads
        cols = max(budget // (n_heads * rows), min(tables.block_size[1], 128), 16)
        key = (g.bm, g.hm, rows, cols)
        if key not in cache:
            cache[key] = row_plan(tables, g.bm, g.hm, L, S, rows, cols)
        plan = cache[key]
        if mask_mod is not None:
            plan = trimmed_rows(plan, _allowed_tile(mask_mod, g, B, Hq, L, S), cols, trim_budget)
        plans.append((g, plan))
    return plans


def _allowed_tile(mask_mod: TracedMod, g: _Group, B: int, Hq: int, L: int, S: int):
    """``(q0, q1, start, end) -> [q1 - q0, end - start]`` booleans: pairs some head of ``g`` allows."""
    mods = _Mods(None, mask_mod, g, B, Hq, L, S, torch.device("cpu"))

    def allowed(q0: int, q1: int, start: int, end: int) -> torch.Tensor:
        tile = evaluate(mask_mod, clamp_lookups=True, **mods._index(mods.mask_reads, q0, q1, mods.kv_pos[start:end]))
        tile = tile.reshape((1,) * (4 - tile.dim()) + tuple(tile.shape)).any(0).any(0)
        return tile.expand(q1 - q0, end - start)
    return allowed


# ---- the mods ----------------------------------------------------------------------------

def _is_true(mod: TracedMod | None) -> bool:
    return mod is None or (mod.root.op == "const" and mod.root.attr is True)


def _score_bias(mod: TracedMod | None):
    """``(X, sign)`` when the score_mod is ``score + X`` (sign 1) or ``score - X`` (sign -1) with ``X``
    not reading ``score`` (ALiBi, relative and learned biases), else ``(None, 0)``.

    Such a mod is applied as one in-place ``add_`` of ``X`` onto the scores.
    """
    if mod is None or mod.root.op not in ("add", "sub"):
        return None, 0
    reads_score = lambda node: "score" in ir.inputs_read(node)
    left, right = mod.root.args
    is_score = lambda node: node.op == "input" and node.attr == "score"
    if is_score(left) and not reads_score(right):
        return right, (1 if mod.root.op == "add" else -1)
    if mod.root.op == "add" and is_score(right) and not reads_score(left):
        return left, 1
    return None, 0


class _Mods:
    """Evaluates the traced mods for one group on index tensors of exactly the visited positions."""

    def __init__(self, score_mod: TracedMod | None, mask_mod: TracedMod | None, g: _Group,
                 B: int, Hq: int, L: int, S: int, device: torch.device, dropout: Dropout | None = None):
        self.score_mod = score_mod
        self.dropout, self.Hq = dropout, Hq
        self.mask_mod = None if _is_true(mask_mod) else mask_mod
        self.score_reads = ir.inputs_read(score_mod.root) if score_mod is not None else frozenset()
        self.bias_node, self.bias_sign = _score_bias(score_mod)
        self.bias_reads = ir.inputs_read(self.bias_node) if self.bias_node is not None else frozenset()
        # the forward's general score_mod, rewritten for base-2 scores (see score_mod_passes.log2_form)
        self.log2_mod, self.pre_scale, self.log2_folded = None, 1.0, False
        if score_mod is not None and self.bias_node is None:
            root, self.pre_scale, self.log2_folded = log2_form(score_mod.root)
            self.log2_mod = dataclasses.replace(score_mod, root=root)
        # a bounded score_mod (soft-capping): the softmax offset is its bound, base 2 (see _forward_row)
        self.fixed_max = None
        bounds = value_bounds(score_mod.root) if self.log2_mod is not None else None
        if bounds is not None and bounds[1] - bounds[0] <= FIXED_MAX_SPAN:
            self.fixed_max = bounds[1] * LOG2E
        self.mask_reads = ir.inputs_read(self.mask_mod.root) if self.mask_mod is not None else frozenset()
        # soft-capping's (pre, cap): the backward's slope in place (see score_mod_passes.tanh_cap)
        self.tanh_cap = tanh_cap(score_mod.root) if score_mod is not None else None
        self.b = torch.arange(B, device=device)[g.b].view(-1, 1, 1, 1)
        self.h = torch.arange(Hq, device=device)[g.qh].view(1, -1, 1, 1)
        self.q_pos = torch.arange(L, device=device)
        self.kv_pos = torch.arange(S, device=device)

    def _index(self, reads: frozenset, q0: int, q1: int, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        values = {"b": self.b, "h": self.h, "q_idx": self.q_pos[q0:q1].view(1, 1, -1, 1), "kv_idx": kv.view(1, 1, 1, -1)}
        return {name: values[name] for name in reads if name in values}

    def score(self, s4: torch.Tensor, q0: int, q1: int, kv: torch.Tensor, buffers: Sequence | None = None,
              overwrite: bool = False, mod: TracedMod | None = None) -> torch.Tensor:
        """The score_mod applied to raw scores ``s4 [b, h, r, c]`` (result may broadcast); with
        ``overwrite`` its elementwise steps may compute into ``s4`` (:func:`flexc.mods.evaluate.evaluate`)."""
        args = self._index(self.score_reads, q0, q1, kv)
        if "score" in self.score_reads:
            args["score"] = s4
        return evaluate(mod or self.score_mod, clamp_lookups=True, buffers=buffers, overwrite_score=overwrite, **args)

    def bias(self, q0: int, q1: int, kv: torch.Tensor) -> torch.Tensor:
        """``X`` of a ``score +/- X`` score_mod at these positions (broadcastable to the scores)."""
        return evaluate(self.bias_node, clamp_lookups=True, buffers=self.score_mod.buffers,
                        **self._index(self.bias_reads, q0, q1, kv))

    def kept(self, q0: int, q1: int, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dropout's ``1 / (1 - p)`` or 0 per pair of these rows and keys (:mod:`flexc.backends.dropout`)."""
        return keep_scale(self.dropout, self.Hq, self.b, self.h, self.q_pos[q0:q1].view(1, 1, -1, 1),
                          kv.view(1, 1, 1, -1), dtype)

    def blocked(self, chunk: Chunk, q0: int, q1: int, kv: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """``(offset, length, not_allowed)`` for the chunk's partial columns; empty when none need masking."""
        if self.mask_mod is None or not chunk.partial:
            return []
        if len(chunk.partial) <= _MAX_PARTIAL_SPANS:
            out = []
            for off, n in chunk.partial:
                allowed = evaluate(self.mask_mod, clamp_lookups=True,
                                   **self._index(self.mask_reads, q0, q1, kv[off:off + n]))
                out.append((off, n, allowed.logical_not()))
            return out
        allowed = evaluate(self.mask_mod, clamp_lookups=True, **self._index(self.mask_reads, q0, q1, kv))
        full_cols = torch.ones(chunk.n_cols, dtype=torch.bool, device=kv.device)
        for off, n in chunk.partial:
            full_cols[off:off + n] = False
        return [(0, chunk.n_cols, (allowed | full_cols).logical_not())]


def _fill(t: torch.Tensor, blocked: list, value: float) -> None:
    for off, n, not_allowed in blocked:
        t[..., off:off + n].masked_fill_(not_allowed, value)


def _zero_blocked(t: torch.Tensor, blocked: list) -> None:
    """Zero the blocked pairs of ``t``: a product with a 0/1 tile (a broadcast masked_fill_ is ~10x
    slower), then, only if that left a NaN (NaN or inf times 0), the exact fill."""
    for off, n, not_allowed in blocked:
        part = t[..., off:off + n]
        part.mul_(torch.logical_not(not_allowed).to(t.dtype))
        if bool(part.isnan().any()):
            part.masked_fill_(not_allowed, 0.0)


def _add_minus_inf(t: torch.Tensor, blocked: list) -> None:
    """Mask finite scores by adding a 0/-inf bias: several times faster than a broadcast
    masked_fill_, but only right when no score can be NaN or +inf (so not after a score_mod)."""
    for off, n, not_allowed in blocked:
        t[..., off:off + n].add_(torch.where(not_allowed, _NEG_INF, 0.0).to(t.dtype))


# ---- forward -----------------------------------------------------------------------------

def torch_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any,
                  scale: float, kernel_options: dict | None = None, need_lse: bool = True,
                  dropout: Dropout | None = None, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention forward: ``(out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] fp32 or None)``;
    ``sinks`` ``[B or 1, Hq, 1]`` (:func:`flexc.call.sinks.check_sinks`) folded into every row's softmax."""
    out, lse, _ = forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale, need_max=False,
                                   need_lse=need_lse, dropout=dropout, sinks=sinks)
    return out, (lse if need_lse else None)


def _causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout) -> causal_call.Starts | None:
    """The causal sequences' starts when the call runs as the fused kernel's causal calls
    (:func:`causal_call.applies`): no score_mod, no dropout and finite inputs (the kernel's own
    masking multiplies a NaN value row by 0 and keeps the NaN); else None."""
    if score_mod is not None or dropout is not None:
        return None
    starts = causal_call.applies(query, key, value, mask_mod, block_mask)
    return starts if starts is not None and all_finite(query, key, value) else None


def _unmasked(block_mask: Any, L: int, S: int) -> bool:
    """No block mask, or one whose blocks are all full (:func:`block_plan.all_full`): plain attention."""
    if block_mask is None:
        return True
    return memo_by_tables(block_mask, ("all full", L, S), lambda: all_full(read_tables(block_mask, L, S), L, S),
                          unversioned=lambda: False)


def prepare_recorded(query, key, value, score_mod, mask_mod, block_mask, scale) -> Callable | None:
    """For training calls of one signature (a plan's: the same shapes, strides, dtypes, block-mask
    tables and mods), the function ``(query, key, value) -> output or None`` that computes a call's
    output by ops autograd records itself, or None when no such call can (then flexc's autograd
    Function trains it). With no dropout, sinks, logsumexp or max asked for (the caller's checks)
    and finite inputs, it is one call of the fused kernel, whose backward torch registers in C++: a
    training step then runs no Python after the forward, which is most of a small layer's step
    (B=2, H=4, L=256, D=32). The call is, in this order:

    * with no score_mod, plain causal attention (one sequence per batch) or attention with no block
      mask (or one whose blocks are all full): the kernel's causal or unmasked mode
      (:func:`causal_call.recorder`);
    * with no score_mod or a ``score +/- X`` one, a small call (:func:`dense_tile.fits`) other than
      several causal sequences: the kernel with the whole tile's additive mask
      (:mod:`flexc.backends.cpu.dense_tile`), while no captured tensor of the score_mod wants a gradient.

    What the signature fixes is decided here, once; a call checks only its thread count (where it
    can matter), the mods' captured tensors (their values are not in a signature) and its
    inputs' finiteness. A warm call's Python costs several times its own time inside a training
    step (the kernel's data and the interpreter's evict each other from the caches): deciding it
    all per call cost ~50 us of that step, the checks left ~25 us."""
    if not causal_call.recordable(query, key, value) or not causal_call.kernel_takes(query, value):
        return None
    if score_mod is None and _unmasked(block_mask, L=query.shape[2], S=key.shape[2]):
        return _finite_only(causal_call.recorder(query, key, value, scale, causal=False))
    # (made on first need: a causal mask's plan has no use for it)
    dense = functools.cache(lambda: _dense_recorded(query, key, value, score_mod, mask_mod, block_mask, scale))
    if score_mod is not None or mask_mod is None:
        return dense()
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    record = _finite_only(causal_call.recorder(query, key, value, scale))

    def by_starts(starts: causal_call.Starts | None) -> Callable | None:
        # several causal sequences: flexc's Function, whose kernel calls skip the pairs across them
        # (6 documents in L=256 cost 0.8x the dense tile's step)
        if starts == causal_call.ONE_SEQUENCE:
            return record
        return dense() if starts is None else None
    if mask_mod.buffers:  # their values may change what the mask allows: checked each call (a memo lookup)
        def checked(query, key, value):
            run = by_starts(causal_call.sequence_starts(block_mask, mask_mod, B, Hq, L, S))
            return run(query, key, value) if run is not None else None
        return _one_thread_worker(query, key, checked)
    run = by_starts(causal_call.sequence_starts(block_mask, mask_mod, B, Hq, L, S))
    return _one_thread_worker(query, key, run) if run is record else run


def _dense_recorded(query, key, value, score_mod, mask_mod, block_mask, scale) -> Callable | None:
    """:func:`prepare_recorded`'s dense tile (:mod:`flexc.backends.cpu.dense_tile`), or None where the
    tile or its mask is too large or the score_mod is not ``score +/- X``."""
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if not dense_tile.fits(B, Hq, L, S) or (score_mod is not None and _score_bias(score_mod)[0] is None):
        return None
    fold = causal_call.foldable(query, key, value)
    mask = lambda fold: _dense_mask(query, key, score_mod, mask_mod, block_mask, "folded" if fold else "plain")
    if dense_tile.kernel_mask_elements(tuple(mask(fold).shape), B, Hq, fold) > dense_tile.MAX_MASK_ELEMENTS:
        return None
    record = _finite_only(causal_call.recorder(query, key, value, scale, causal=False, mask=mask))
    if score_mod is not None and score_mod.buffers:
        # a captured tensor wanting a gradient needs flexc's backward (the kernel's has none for the mask)
        plain = record
        record = lambda query, key, value: (None if any(isinstance(t, torch.Tensor) and t.requires_grad
                                                        for t in score_mod.buffers) else plain(query, key, value))
    return _one_thread_worker(query, key, record)


def _dense_mask(query, key, score_mod, mask_mod, block_mask, layout: str) -> torch.Tensor:
    """The additive mask of a call as one dense tile (:func:`dense_tile.additive_mask`), laid out for
    the kernel's inputs: ``"plain"`` ``[b, h, L, S]``, ``"folded"`` (batch and heads one dimension,
    :func:`dense_tile.kernel_mask`) or ``"stacked"`` (a key head's query heads as rows,
    :func:`fused_cpu.stack_heads`). Remembered with the block tables and the mods' captured
    tensors (identity and version)."""
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, _ = key.shape
    mods_key = tuple((mod.root, mod.scalars) if mod is not None else None for mod in (score_mod, mask_mod))
    captured = [*(mask_mod.buffers if mask_mod is not None else ()), *(score_mod.buffers if score_mod is not None else ())]

    def build() -> torch.Tensor:
        group = _Group(slice(0, B), slice(0, Bkv), slice(0, Hq), slice(0, Hkv), Hq // Hkv, 0, 0)
        mods = _Mods(score_mod, mask_mod, group, B, Hq, L, S, query.device)
        allowed = bias = None
        if mods.mask_mod is not None:
            allowed = evaluate(mods.mask_mod, clamp_lookups=True, **mods._index(mods.mask_reads, 0, L, mods.kv_pos))
        if mods.bias_node is not None:
            bias = mods.bias(0, L, mods.kv_pos)
            bias = bias.neg() if mods.bias_sign < 0 else bias
        mask = dense_tile.additive_mask(dense_tile.block_classes(block_mask, B, Hq, L, S), allowed, bias, query.dtype)
        if layout == "stacked":
            return fused_cpu.stack_heads(mask, Hq // Hkv)
        return dense_tile.kernel_mask(mask, B, Hq, layout == "folded")
    return memo_by_tables(block_mask, ("dense tile", mods_key, B, Hq, Hkv, L, S, query.dtype, layout), build,
                          captured)


def _dense_applies(query, key, value, score_mod, dropout, sinks) -> bool:
    """Whether a forward, or its backward, runs as one dense tile (:func:`_dense_forward`): a small
    call (:func:`dense_tile.fits`) the fused kernel takes, with no score_mod or a ``score +/- X``
    one, no dropout or sinks, and finite inputs (the mask's -inf would turn NaN or inf into NaN)."""
    B, Hq, L, _ = query.shape
    return (dropout is None and sinks is None and dense_tile.fits(B, Hq, L, key.shape[2])
            and fused_cpu.supported(query, value, None, False)
            and (score_mod is None or _score_bias(score_mod)[0] is not None) and all_finite(query, key, value))


def _dense_shapes(query, key, value):
    """``(q, k, v)`` of one kernel call over the whole tile: a key head's query heads stacked as
    rows (``[B, Hkv, G*L, E]``), a key batch broadcast over the query's as a stride-0 view."""
    B, Hq, L, E = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, Hq // Hkv * L, E)
    k, v = (t.expand(B, *t.shape[1:]) if t.shape[0] != B else t for t in (key, value))
    return q, k, v


def _dense_forward(query, key, value, out, lse, score_mod, mask_mod, block_mask, scale) -> None:
    """:func:`forward_with_max`'s small calls (:func:`dense_tile.fits`): one kernel call over the
    whole tile with its dense mask, into ``out`` and ``lse``."""
    B, Hq, L, _ = query.shape
    mask = _dense_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
    o, l = fused_cpu.FLASH(*_dense_shapes(query, key, value), attn_mask=mask, scale=scale)
    fused_cpu.fix_dead_rows(l, mask)
    out.copy_(o.reshape(B, Hq, L, o.shape[-1]))
    l = l.reshape(B, Hq, L)
    # a +inf score (a +inf bias) gives the kernel's logsumexp +inf: NaN, as the other paths' (fused_cpu.forward_rows)
    lse.copy_(l.masked_fill(l.isposinf(), float("nan")))


def _dense_backward(query, key, value, out, lse_bw, grad_out, dq, dk, dv, score_mod, mask_mod, block_mask,
                    scale) -> None:
    """:func:`torch_backward`'s gradients of a :func:`_dense_forward` call, added into ``dq``, ``dk``
    and ``dv``: torch's fused backward with the same mask (``lse_bw``: the saved logsumexp with -inf
    made +inf, as :func:`fused_cpu.backward_row` takes it)."""
    B, Hq, L, E = query.shape
    Hkv = key.shape[1]
    mask = _dense_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
    q, k, v = _dense_shapes(query, key, value)
    o, go = (t.reshape(B, Hkv, -1, t.shape[-1]) for t in (out, grad_out))
    with fused_cpu.denormals_flushed() if score_mod is not None else contextlib.nullcontext():
        gq, gk, gv = fused_cpu.FLASH_BACKWARD(go, q, k, v, o, lse_bw.reshape(B, Hkv, -1), 0.0, False,
                                              attn_mask=mask, scale=scale)
    dq += gq.reshape(B, Hq, L, E)
    if key.shape[0] != B:  # (one key batch for every query batch)
        gk, gv = gk.sum(0, keepdim=True), gv.sum(0, keepdim=True)
    dk += gk
    dv += gv


def _finite_only(record: Callable) -> Callable:
    """``record`` for finite inputs, None for others (the kernel's masking multiplies a NaN value
    row by 0 and keeps the NaN; the block path leaves the rows before it finite)."""
    return lambda query, key, value: record(query, key, value) if all_finite(query, key, value) else None


def _one_thread_worker(query, key, record: Callable) -> Callable:
    """``record`` while the call takes one worker (:func:`causal_call.workers_for`), None when it
    is split over several (forward and backward, by flexc's Function): checked each call where the
    thread count can change it."""
    if causal_call.workers_for(query, key, threads=sys.maxsize) == 1:
        return record  # (one worker whatever the thread count: small calls)
    return lambda query, key, value: record(query, key, value) if causal_call.workers_for(query, key) == 1 else None


def forward_with_max(query, key, value, score_mod, mask_mod, block_mask, scale, need_max=True,
                     lse_dtype=torch.float32, need_lse=True, dropout: Dropout | None = None,
                     sinks: torch.Tensor | None = None):
    """:func:`torch_forward` that also returns the row maxima of the masked, modded scores (or None).

    ``lse_dtype`` lets the backward keep a float64 logsumexp for float64 inputs; ``need_lse=False``
    (the caller discards it) lets the decode path skip the logsumexp's fix-ups. With ``dropout``
    every call takes the row loop (the fused and decode paths cannot drop single pairs). ``sinks``
    (``[B or 1, Hq, 1]``) start every row's softmax; the row maxima stay the scores' own.
    """
    if dropout is None and decode_cpu.applies(query, key):  # short queries (decoding): a few batched ops, no row loop
        return decode_cpu.forward(query, key, value, score_mod, mask_mod, block_mask, scale, need_max, lse_dtype,
                                  need_lse, sinks)
    if (dropout is None and score_mod is None and query.numel() and key.shape[2]
            and fused_cpu.supported(query, value, None, need_max)
            and _unmasked(block_mask, query.shape[2], key.shape[2])):  # plain attention: torch's fused kernel
        out, lse = decode_cpu.flash(query, key, value, [], scale)
        if sinks is not None:  # the kernel's softmax has no state to start from: the sink joins after it
            out, lse = fused_cpu.fold_sink(out, lse, sinks)
        return out, lse.to(lse_dtype), None
    starts = _causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout) if not need_max else None
    if starts is not None:  # causal sequences: the kernel's causal mode
        out, lse = causal_call.forward(query, key, value, scale, starts)
        if sinks is not None:
            out, lse = fused_cpu.fold_sink(out, lse, sinks)
        return out, lse.to(lse_dtype), None
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, Ev = value.shape
    work = work_dtype(query.dtype)
    out = torch.empty(B, Hq, L, Ev, dtype=query.dtype, device=query.device)  # rows are written once
    lse = torch.full((B, Hq, L), _NEG_INF, dtype=lse_dtype, device=query.device)
    if sinks is not None:  # rows no task writes allow nothing: output 0, lse the sink
        lse.copy_(sinks.squeeze(-1).expand(B, Hq).unsqueeze(-1).expand(B, Hq, L))
    row_max = torch.full((B, Hq, L), _NEG_INF, dtype=torch.float32, device=query.device) if need_max else None
    if B * Hq * L == 0:
        return out, lse, row_max
    if not need_max and _dense_applies(query, key, value, score_mod, dropout, sinks):  # one call, its whole tile
        query, key, value = (fused_cpu.unit_last_stride(t) for t in (query, key, value))
        _dense_forward(query, key, value, out, lse, score_mod, mask_mod, block_mask, scale)
        return out, lse, row_max
    tasks, costs, n_workers, groups = _tasks(block_mask, query, value, Hkv, score_mod, mask_mod, dropout)
    _zero_rows_without_blocks(out, groups, tasks, L)
    # Masked pairs must contribute exactly 0 whatever q/k/v hold; the fast paths (an additive -inf
    # mask, torch's fused kernel) turn NaN or inf there into NaN, so they need finite inputs.
    masked = bool(tasks) and tasks[0][1].mask_mod is not None
    finite = not masked or all_finite(query, key, value)
    fused = bool(tasks) and finite and dropout is None and fused_cpu.supported(query, value, tasks[0][1], need_max)
    if fused:  # few, large kernel calls that release the GIL: workers pay off on smaller jobs
        query, key, value = (fused_cpu.unit_last_stride(t) for t in (query, key, value))
        n_workers = workers.worker_count(len(tasks), sum(costs), fused_cpu.MIN_COST_PER_WORKER)
        bands, tasks = _bands(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = fused_cpu.group_tasks(tasks, n_workers)
        tasks, costs = bands + tasks, [_band_cost(task) for task in bands] + costs

    elif tasks and _plain_bands(tasks[0][1], query, finite, dropout, sinks) and row_max is None:
        cost_of = {id(task): cost for task, cost in zip(tasks, costs)}
        bands, tasks = _bands(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = bands + tasks, [_band_cost(task) for task in bands] + [cost_of[id(task)] for task in tasks]

    def one_row(task, worker):
        g, mods, row = task
        if isinstance(row, band_calls.Band) and not fused:
            band_plain.forward(query, key, value, out, lse, g, row, mods, scale, work)
        elif isinstance(row, band_calls.Band):
            band_calls.forward(query, key, value, out, lse, g, row, mods, scale)
        elif fused:
            fused_cpu.forward_rows(query, key, value, out, lse, g, row, mods, scale, sinks)
        else:
            _forward_row(query, key, value, out, lse, row_max, g, row, mods, scale, work, finite, sinks)

    # rows write disjoint slices of out/lse; a single worker too runs with one torch thread (workers.run)
    workers.run(tasks, costs, one_row, n_workers, dynamic=True, torch_threads=False)
    return out, lse, row_max


def _bands(block_mask: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, Hkv: int, tasks: list,
           n_workers: int, sinks: torch.Tensor | None) -> tuple[list, list]:
    """``(bands, rest)``: the row tasks whose rows run as batched band calls
    (:mod:`flexc.backends.cpu.band_calls`, :mod:`flexc.backends.cpu.band_plain`), and the others. (Sinks join each row's merge: rows. A
    band's window may hold keys of blocks its row does not list, masked by -inf: finite inputs only.)"""
    if sinks is not None or not tasks or not all_finite(query, key, value):
        return [], tasks
    B, Hq, L, _ = query.shape
    Bkv, _, S, Ev = value.shape
    plan_key = (getattr(block_mask, "BLOCK_SIZE", None), B, Bkv, Hq, Hkv, L, S, Ev, torch.get_num_threads())
    mask_mod = tasks[0][1].mask_mod
    every = lambda q0, q1, start, end: torch.ones(q1 - q0, end - start, dtype=torch.bool)

    def allowed_for(g):
        return every if mask_mod is None else _allowed_tile(mask_mod, g, B, Hq, L, S)
    return band_calls.plan_bands(block_mask, plan_key, tasks, n_workers, S,
                                 lambda g: (len(range(B)[g.b]), len(range(Hq)[g.qh])), allowed_for, query.dtype,
                                 query.device)


def _plain_bands(mods: "_Mods", query: torch.Tensor, finite: bool, dropout, sinks) -> bool:
    """Whether the row loop's narrow rows may run as bands in plain torch ops
    (:mod:`flexc.backends.cpu.band_plain`): a general score_mod, float32/64, finite inputs (masks are
    an additive -inf), no dropout or sinks (the caller checks row maxima and gradient-wanting buffers)."""
    return (mods.log2_mod is not None and finite and dropout is None and sinks is None
            and query.dtype in (torch.float32, torch.float64))


def _band_cost(task) -> float:
    g, mods, band = task
    return float(mods.b.numel() * mods.h.numel() * band.n * band.r * band.c)


def _batched_view(t: torch.Tensor, shape: tuple) -> torch.Tensor | None:
    """``t`` viewed as ``shape`` without copying, or None when its strides do not allow it."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _batched(kv: torch.Tensor, Bg: int, batch: int) -> torch.Tensor:
    """Key/value rows ``[Bk, Hkv_g, c, D]`` as ``[batch, c, D]`` for bmm, broadcasting Bk == 1 over Bg."""
    if kv.shape[0] != Bg:
        kv = kv.expand(Bg, *kv.shape[1:])
    return kv.reshape(batch, kv.shape[-2], kv.shape[-1])


def _zero_rows_without_blocks(out: torch.Tensor, groups: list, tasks: list, L: int) -> None:
    """Zero the output rows no task writes (query rows whose block rows list no key block)."""
    spans: dict[int, list[tuple[int, int]]] = {id(g): [] for g in groups}
    for g, _, row in tasks:
        spans[id(g)].append((row.q0, row.q1))
    for g in groups:
        start = 0
        for q0, q1 in sorted(spans[id(g)]) + [(L, L)]:
            if q0 > start:
                out[g.b, g.qh, start:q0] = 0
            start = max(start, q1)


def _scaled_query_rows(query: torch.Tensor, g: _Group, q0: int, q1: int, scale: float, work: torch.dtype) -> torch.Tensor:
    """``q * scale`` for rows ``[q0, q1)`` of the group, as ``[Bg, Hkv_g, G*r, E]`` (a fresh tensor)."""
    q = query[g.b, g.qh, q0:q1]
    q = q.to(work) * scale
    Bg, Hg, r, E = q.shape
    return q.reshape(Bg, Hg // g.G, g.G * r, E)  # a copy only for non-contiguous queries


def _forward_row(query, key, value, out, lse, row_max, g: _Group, row: Row, mods: _Mods, scale: float, work,
                 finite: bool = True, sinks: torch.Tensor | None = None):
    """One query row range: scores in log2 units (``s * log2(e)``), online softmax over its chunks.

    ``finite=False`` (q/k/v may hold NaN or inf) masks by selection and keeps masked keys' values
    out of the product, so masked pairs contribute exactly 0. ``sinks`` start the softmax.
    """
    q0, q1 = row.q0, row.q1
    # unless a general score_mod needs natural-log scores, fold log2(e) into the query so the
    # matmul yields base-2 scores directly
    bias_mod = mods.bias_node is not None
    general_mod = mods.score_mod is not None and not bias_mod
    qb = _scaled_query_rows(query, g, q0, q1, scale * mods.pre_scale if general_mod else scale * LOG2E, work)
    Bg, Hkvg, Gr, _ = qb.shape
    Hqg, r = Hkvg * g.G, q1 - q0
    k_g, v_g = key[g.kb, g.kvh], value[g.kb, g.kvh]
    Ev = value.shape[-1]
    # accumulate P @ V with baddbmm_ into [Bg*Hkv_g, G*r, Ev]: straight into the (zeroed) output
    # rows when their layout allows, else into a scratch tensor; no temporary per chunk
    acc = out[g.b, g.qh, q0:q1]
    acc3 = _batched_view(acc, (Bg * Hkvg, Gr, Ev)) if out.dtype == work else None
    direct = acc3 is not None
    if not direct:
        acc = torch.empty(Bg, Hqg, r, Ev, dtype=work, device=out.device)
        acc3 = acc.view(Bg * Hkvg, Gr, Ev)
    m = l = top = None
    if sinks is not None:
        # the sink is a key already seen with no value row: the max starts at its logit (base 2) and
        # the sum at its exp2(sink - max) = 1 (0 for a -inf sink, which is no sink); acc holds nothing yet
        m = fused_cpu.group_sinks(sinks, g, Bg, r).to(work).unsqueeze(-1) * LOG2E
        l = (m != _NEG_INF).to(work)
    # bounded general score_mods: a fixed offset (not with sinks, which start the max, nor max_scores)
    fixed = mods.fixed_max if general_mod and sinks is None and row_max is None else None
    if fixed is not None:
        m = torch.full((Bg, Hqg, r, 1), fixed, dtype=work, device=out.device)
    first = True
    for chunk in row.chunks:
        kv = chunk_kv_index(chunk, mods.kv_pos)
        kc = chunk_rows(k_g, chunk).to(work)
        vc = chunk_rows(v_g, chunk).to(work)
        s = torch.matmul(qb, kc.transpose(-1, -2))  # [Bg, Hkv_g, G*r, c]
        s4 = s.view(Bg, Hqg, r, chunk.n_cols)
        blocked = mods.blocked(chunk, q0, q1, kv)
        if general_mod:
            # s4 is this chunk's own buffer: the mod's elementwise steps compute into it (soft-capping's
            # divide, tanh and multiply make no temporaries), and whatever they could not is copied in
            modded = mods.score(s4, q0, q1, kv, overwrite=True, mod=mods.log2_mod)
            if modded is not s4:
                s4.copy_(modded)  # broadcasts and casts into the buffer we own
            if not mods.log2_folded:
                s4.mul_(LOG2E)
            _fill(s4, blocked, _NEG_INF)
        elif bias_mod:
            s4.add_(mods.bias(q0, q1, kv), alpha=mods.bias_sign * LOG2E)
            _fill(s4, blocked, _NEG_INF)
        elif finite:
            _add_minus_inf(s4, blocked)
        else:
            _fill(s4, blocked, _NEG_INF)
        if fixed is not None:
            # every score is within FIXED_MAX_SPAN below the mod's bound: exp2(s - bound) neither
            # overflows nor underflows, the offset never changes, and no rescaling follows
            s4.sub_(fixed).exp2_()
            p_sum = s4.sum(-1, keepdim=True)
            if mods.dropout is not None:
                s4.mul_(mods.kept(q0, q1, kv, s4.dtype))
            l = p_sum if l is None else l.add_(p_sum)
            m_new = m
        else:
            m_new = s4.amax(-1, keepdim=True)
            if row_max is not None and sinks is not None:  # max_scores: the scores' own max, without the sink
                top = m_new if top is None else torch.maximum(top, m_new)
            if m is not None:
                m_new = torch.maximum(m, m_new)
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # a row masked so far: exp2(-inf - 0) = 0
            s4.sub_(m_safe).exp2_()
            p_sum = s4.sum(-1, keepdim=True)
            if mods.dropout is not None:  # the denominator keeps every pair; the values see the kept ones
                s4.mul_(mods.kept(q0, q1, kv, s4.dtype))
            if l is None:
                l = p_sum
            else:
                alpha = (m - m_safe).exp2_()
                l.mul_(alpha).add_(p_sum)
                if not first:  # (the first chunk's product below overwrites acc)
                    acc.mul_(alpha)
        if finite or not blocked:
            # the first chunk overwrites (beta=0 ignores whatever the rows held)
            acc3.baddbmm_(s.view(Bg * Hkvg, Gr, -1), _batched(vc, Bg, Bg * Hkvg), beta=0.0 if first else 1.0)
        else:
            part = matmul_skipping_zeros(s.view(Bg * Hkvg, Gr, -1), _batched(vc, Bg, Bg * Hkvg))
            acc3.copy_(part) if first else acc3.add_(part)
        first = False
        m = m_new
    acc.div_(torch.where(l == 0, 1.0, l))  # fully masked rows: acc is 0, output 0
    if not direct:
        out[g.b, g.qh, q0:q1] = acc
    m_safe = m.masked_fill(m == _NEG_INF, 0.0)
    # l is 0 only for rows with nothing allowed; NaN (a NaN or +inf score) stays NaN, as in torch
    lse[g.b, g.qh, q0:q1] = torch.where(l == 0, _NEG_INF, (m_safe + torch.log2(l)) * LN2).squeeze(-1)
    if row_max is not None:
        row_max[g.b, g.qh, q0:q1] = ((m if top is None else top) * LN2).squeeze(-1)


# ---- backward ----------------------------------------------------------------------------

def torch_backward(query, key, value, out, lse, grad_out, grad_lse, score_mod: TracedMod | None,
                   mask_mod: TracedMod | None, block_mask: Any, scale: float,
                   grad_slots: Sequence[int] = (), dropout: Dropout | None = None,
                   sinks: torch.Tensor | None = None):
    """Gradients ``(dq, dk, dv, buffer_grads)`` of block-sparse attention, recomputed per query row.

    ``grad_slots`` are the score_mod buffer slots that need gradients; ``buffer_grads`` follows
    their order. ``grad_lse`` may be None. Rows with ``lse == -inf`` (fully masked) get zero gradients.
    ``sinks`` (``[B or 1, Hq, 1]``): the forward's, whose ``lse`` includes them; the sinks' own
    gradient is the caller's (:func:`flexc.call.sinks.sink_grad`).
    """
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, _ = value.shape
    starts = (_causal_starts(query, key, value, score_mod, mask_mod, block_mask, dropout)
              if grad_lse is None or not bool(grad_lse.any()) else None)
    if starts is not None:  # as the forward ran
        dq, dk, dv = causal_call.backward(query, key, value, out, lse, grad_out, scale, starts)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), []
    work = work_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=work, device=query.device)
    dk = torch.zeros(key.shape, dtype=work, device=query.device)
    dv = torch.zeros(value.shape, dtype=work, device=query.device)
    buffers = list(score_mod.buffers) if score_mod is not None else []
    leaves, dtypes = [], []
    for slot in grad_slots:
        # a 16-bit captured tensor's gradient sums many small terms: the leaf is an exact fp32 copy,
        # so autograd accumulates in fp32 and the sum is rounded once at the end (the mod's values
        # are unchanged: the scores it meets are fp32 already)
        dtypes.append(buffers[slot].dtype)
        wide = torch.float32 if buffers[slot].dtype in (torch.float16, torch.bfloat16) else buffers[slot].dtype
        buffers[slot] = buffers[slot].detach().to(wide).requires_grad_()
        leaves.append(buffers[slot])
    buf_grads = [torch.zeros_like(t) for t in leaves]
    if B * Hq * L == 0:
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), [g.to(d) for g, d in zip(buf_grads, dtypes)]
    if (_dense_applies(query, key, value, score_mod, dropout, sinks) and fused_cpu.FLASH_BACKWARD is not None
            and not grad_slots and (grad_lse is None or not bool(grad_lse.any()))):  # as the forward ran (_dense_forward)
        lse_bw = lse.to(query.dtype).masked_fill(lse == _NEG_INF, float("inf"))
        q_, k_, v_, o_, go_ = (fused_cpu.unit_last_stride(t) for t in (query, key, value, out, grad_out))
        _dense_backward(q_, k_, v_, o_, lse_bw, go_, dq, dk, dv, score_mod, mask_mod, block_mask, scale)
        return _summed(query, key, value, dq, [(dk, dv, buf_grads)], buf_grads, dtypes)
    tasks, costs, n_workers, _ = _tasks(block_mask, query, value, Hkv, score_mod, mask_mod, dropout)
    finite = not (tasks and tasks[0][1].mask_mod is not None) or all_finite(query, key, value)
    fused = finite and tasks and fused_cpu.backward_supported(query, value, tasks[0][1], grad_lse, grad_slots)
    if fused:  # large C++ calls that release the GIL, each on a one-thread worker (fused_cpu.denormals_flushed)
        n_workers = workers.worker_count(len(tasks), sum(costs), fused_cpu.MIN_COST_PER_WORKER)
    # dq rows are disjoint; dk, dv and buffer gradients sum over rows, so each worker has its own
    sums = [(dk, dv, buf_grads)] + [(torch.zeros_like(dk), torch.zeros_like(dv), [torch.zeros_like(t) for t in leaves])
                                    for _ in range(n_workers - 1)]
    if fused:
        # the forward's own fused kernel calls, backward: a few large C++ calls per row instead of
        # the row loop's dozens of torch ops (fused_cpu.backward_row)
        lse_bw = lse.to(query.dtype).masked_fill(lse == _NEG_INF, float("inf"))
        q_, k_, v_, o_, go_ = (fused_cpu.unit_last_stride(t) for t in (query, key, value, out, grad_out))

        bands, tasks = _bands(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = fused_cpu.group_tasks(tasks, n_workers)  # runs of rows share tall calls, as forward
        tasks, costs = bands + tasks, [_band_cost(task) for task in bands] + costs

        def fused_row(task, worker):
            g, mods, rows = task
            if isinstance(rows, band_calls.Band):
                band_calls.backward(q_, k_, v_, o_, lse_bw, go_, dq, sums[worker][0], sums[worker][1], g, rows, mods,
                                    scale)
                return
            fused_cpu.backward_rows(q_, k_, v_, o_, lse_bw, go_, dq, sums[worker][0], sums[worker][1], g, rows, mods,
                                    scale)
        workers.run(tasks, costs, fused_row, n_workers, torch_threads=False)
        return _summed(query, key, value, dq, sums, buf_grads, dtypes)
    # the softmax Jacobian's correction delta = rowsum(dO * P * dP) - dLSE. With a score_mod,
    # _backward_row sums its dO part from its own probabilities (see there); without one, the
    # flash identity rowsum(dO * out) is as accurate (fp32 rmse within 1.2x of SDPA's) and saves
    # that first pass over the row
    own_delta = score_mod is not None
    delta = (-grad_lse.to(work).unsqueeze(-1) if grad_lse is not None
             else torch.zeros(B, Hq, L, 1, dtype=work, device=query.device))
    if not own_delta:
        delta = delta + (grad_out.to(work) * out.to(work)).sum(-1, keepdim=True)
    lse_safe = lse.to(work).masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)
    # each row's sink share exp(sink - lse): its probabilities sum to 1 with it (0 without sinks)
    sink_share = None
    if sinks is not None and own_delta:
        sink_share = (sinks.to(work).unsqueeze(-1) - lse_safe).exp().expand(B, Hq, L, 1)

    if tasks and _plain_bands(tasks[0][1], query, finite, dropout, sinks) and not leaves:
        cost_of = {id(task): cost for task, cost in zip(tasks, costs)}
        bands, tasks = _bands(block_mask, query, key, value, Hkv, tasks, n_workers, sinks)
        tasks, costs = bands + tasks, [_band_cost(task) for task in bands] + [cost_of[id(task)] for task in tasks]

    def one_row(task, worker):
        g, mods, row = task
        dk_w, dv_w, buf_w = sums[worker]
        if isinstance(row, band_calls.Band):
            band_plain.backward(query, key, value, grad_out, delta, lse_safe, dq, dk_w, dv_w, g, row, mods, scale,
                                work)
            return
        _backward_row(query, key, value, grad_out, delta, lse_safe, dq, dk_w, dv_w, buffers, leaves,
                      buf_w, g, row, mods, scale, work, Bkv == 1 and B > 1, finite, own_delta, sink_share)

    workers.run(tasks, costs, one_row, n_workers, torch_threads=False)
    return _summed(query, key, value, dq, sums, buf_grads, dtypes)


def _summed(query, key, value, dq, sums, buf_grads, dtypes):
    """``(dq, dk, dv, buffer_grads)`` in the inputs' dtypes, the workers' dk, dv and buffer sums added up."""
    dk, dv, _ = sums[0]
    for dk_w, dv_w, buf_w in sums[1:]:
        dk += dk_w
        dv += dv_w
        for total, part in zip(buf_grads, buf_w):
            total += part
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
            [g.to(d) for g, d in zip(buf_grads, dtypes)])


# Probabilities and dO @ V^T kept from the first pass of a row for its second pass, up to this
# many elements per row task (beyond it the second pass recomputes them).
_KEEP_ELEMENTS = 1 << 22


def _chunk_probs(qb, k_g, v_g, dob_g, lse_r, buffers, chunk: Chunk, mods: _Mods, q0: int, q1: int, Hqg: int,
                 work, grad: bool, finite: bool = True, grad_buffers: bool = False):
    """One chunk's ``(kc, s4, post, p, dp, blocked)``: scores, the score_mod's output (with its graph
    when ``grad``; soft-capping without captured tensors wanting gradients: None, and s4 its tanh), softmax probabilities from the saved logsumexp, and ``dO @ V^T`` (0 on masked
    pairs when ``finite`` is False: a masked NaN/inf value must not reach delta, dS or the buffers)."""
    Bg, r = qb.shape[0], q1 - q0
    kv = chunk_kv_index(chunk, mods.kv_pos)
    kc = chunk_rows(k_g, chunk).to(work)
    vc = chunk_rows(v_g, chunk).to(work)
    s4 = torch.matmul(qb, kc.transpose(-1, -2)).view(Bg, Hqg, r, chunk.n_cols)
    blocked = mods.blocked(chunk, q0, q1, kv)
    post = None
    if mods.tanh_cap is not None and not grad_buffers:
        # soft-capping: qb holds the query times the mod's pre-factor, so s4 = score * pre; its tanh,
        # in place, is kept in s4 for the slope (_backward_row), and p = exp(cap * tanh - lse), the
        # product and the logsumexp in one pass
        cap = mods.tanh_cap[1]
        p = torch.add(lse_r.neg(), s4.tanh_(), alpha=cap)
        if -abs(cap) - float(lse_r.max()) > _exp_floor(p.dtype)[0]:
            p.exp_()  # every argument is above exp's slow range: no floor needed
        else:
            _exp_floored_(p)
    else:
        if mods.score_mod is not None:
            if grad and "score" in mods.score_reads:
                s4.requires_grad_()
            with torch.set_grad_enabled(grad):
                post = mods.score(s4, q0, q1, kv, buffers).expand(s4.shape)
            p = torch.empty_like(s4).copy_(post.detach())
        else:
            p = s4
        # natural exp, as the softmax of the reference (exp2 of (s - lse) * log2(e) adds one rounding)
        _exp_floored_(p.sub_(lse_r))
    _zero_blocked(p, blocked)
    dp = torch.matmul(dob_g, vc.transpose(-1, -2)).view(Bg, Hqg, r, -1)
    if not finite:
        _fill(dp, blocked, 0.0)
    kept = None
    if mods.dropout is not None:  # d out / d p through the kept pairs only (the forward's mask, regenerated)
        kept = mods.kept(q0, q1, kv, dp.dtype)
        dp.mul_(kept)
    return kc, s4, post, p, dp, blocked, kept


def _mask_only_chunk(qb, k_g, v_g, dob_g, lse_r, delta_r, dq_r, dk_g, dv_g, chunk: Chunk, mods: _Mods,
                     q0: int, q1: int, scale: float, work, sum_kv_batch: bool) -> None:
    """One chunk's share of dq, dk and dv for a backward with neither score_mod nor dropout, on
    finite inputs, in few passes: blocked pairs enter ``s - lse`` as ``-inf`` (so ``p`` is exactly
    0 there, with no zeroing pass) and ``dS = P * (dP - delta)`` is formed in place. (``baddbmm``
    from the broadcast row terms was no faster: torch copies the broadcast input first.)"""
    Bg, Hkvg, Gr, E = qb.shape
    r, c = q1 - q0, chunk.n_cols
    batch = Bg * Hkvg
    kv = chunk_kv_index(chunk, mods.kv_pos)
    kc = _batched(chunk_rows(k_g, chunk).to(work), Bg, batch)
    vc = _batched(chunk_rows(v_g, chunk).to(work), Bg, batch)
    q3, do3 = qb.reshape(batch, Gr, E), dob_g.reshape(batch, Gr, -1)
    p = torch.bmm(q3, kc.transpose(-1, -2)).sub_(lse_r.reshape(batch, Gr, 1))
    _add_minus_inf(p.view(Bg, -1, r, c), mods.blocked(chunk, q0, q1, kv))
    _exp_floored_(p)
    ds = torch.bmm(do3, vc.transpose(-1, -2)).sub_(delta_r.reshape(batch, Gr, 1)).mul_(p)  # P * (dP - delta)
    dq_r.view(batch, Gr, E).add_(torch.bmm(ds, kc), alpha=scale)
    for grad, lhs, rhs in ((dk_g, ds, q3), (dv_g, p, do3)):
        _add_product(grad, chunk, lhs.transpose(-1, -2), rhs, Bg, sum_kv_batch)


def _add_product(grad_g: torch.Tensor, chunk: Chunk, lhs: torch.Tensor, rhs: torch.Tensor, Bg: int,
                 sum_kv_batch: bool) -> None:
    """``grad_g[..., chunk rows, :] += lhs @ rhs`` (``[batch, c, *]`` products of a group's key heads).
    A product into the rows' strided view would run batch by batch (torch splits a baddbmm_ whose
    output batches are not evenly strided into one addmm_ each), so it is formed apart and added."""
    update = torch.bmm(lhs, rhs).view(Bg, -1, chunk.n_cols, grad_g.shape[-1])
    add_chunk_rows(grad_g, chunk, update, sum_kv_batch)


def _backward_row(query, key, value, grad_out, delta, lse_safe, dq, dk, dv, buffers, leaves, buf_grads,
                  g: _Group, row: Row, mods: _Mods, scale: float, work, sum_kv_batch: bool, finite: bool = True,
                  own_delta: bool = True, sink_share: torch.Tensor | None = None):
    q0, q1 = row.q0, row.q1
    capped = mods.tanh_cap is not None and not leaves  # soft-capping's slope formed in place
    pre = mods.tanh_cap[0] if capped else 1.0
    qb = _scaled_query_rows(query, g, q0, q1, scale * pre, work)
    Bg, Hkvg, Gr, E = qb.shape
    Hqg, r = Hkvg * g.G, q1 - q0
    dob = grad_out[g.b, g.qh, q0:q1].to(work)
    dob_g = dob.reshape(Bg, Hkvg, Gr, -1)
    lse_r = lse_safe[g.b, g.qh, q0:q1]
    k_g, v_g = key[g.kb, g.kvh], value[g.kb, g.kvh]
    dk_g, dv_g = dk[g.kb, g.kvh], dv[g.kb, g.kvh]
    dq_r = torch.zeros(Bg, Hkvg, Gr, E, dtype=work, device=query.device)
    args = (qb, k_g, v_g, dob_g, lse_r, buffers)
    extra = {"finite": finite, "grad_buffers": bool(leaves)}
    # Pass 1: delta = rowsum(P * dP) - dLSE from this backward's own probabilities. The flash
    # identity rowsum(dO * out) equals it only up to the forward's rounding, and that mismatch
    # doubled dq/dk errors with learnable biases (fp32 rmse vs float64, L=256: dq 1.25x -> 1.12x
    # of SDPA's, dbias 1.35x -> 1.19x).
    # It also sums each row's probabilities: exp(s - lse) from the saved logsumexp sums to 1 only up
    # to the forward's rounding of lse and of the scores (one factor on a whole row), and that
    # factor, uncorrected, is a bias in every dS of the row. Pass 2 divides by the sum, so its
    # probabilities sum to 1 in this pass's own arithmetic (fp32 rmse vs float64, L=256, worst of
    # 20 seeds: dbias 1.27x -> 1.07x of SDPA's, dq 1.16x -> 1.03x).
    delta_r = delta[g.b, g.qh, q0:q1].clone()
    if not own_delta and mods.dropout is None and finite:
        for chunk in row.chunks:
            _mask_only_chunk(qb, k_g, v_g, dob_g, lse_r, delta_r, dq_r, dk_g, dv_g, chunk, mods, q0, q1, scale, work,
                             sum_kv_batch)
        dq[g.b, g.qh, q0:q1] = dq_r.view(Bg, Hqg, r, E)
        return
    if own_delta:
        # the row's probabilities sum to 1 with the sink's share (which has no value row, so no dP)
        p_dp = torch.zeros_like(delta_r)
        p_sum = sink_share[g.b, g.qh, q0:q1].clone() if sink_share is not None else torch.zeros_like(delta_r)
    kept, budget = [None] * len(row.chunks), _KEEP_ELEMENTS
    for i, chunk in enumerate(row.chunks if own_delta else ()):
        keep = budget >= Bg * Hqg * r * chunk.n_cols
        piece = _chunk_probs(*args, chunk, mods, q0, q1, Hqg, work, grad=keep, **extra)
        p_dp += (piece[3] * piece[4]).sum(-1, keepdim=True)
        p_sum += piece[3].sum(-1, keepdim=True)
        kept[i] = piece if keep else None
        budget -= Bg * Hqg * r * chunk.n_cols if keep else 0
    if own_delta:
        p_sum = torch.where(p_sum > 0, p_sum, 1.0)  # rows with nothing allowed: p is 0 there anyway
        delta_r += p_dp / p_sum
    for chunk, piece in zip(row.chunks, kept):
        kc, s4, post, p, dp, blocked, kept = piece or _chunk_probs(*args, chunk, mods, q0, q1, Hqg, work, grad=True,
                                                                   **extra)
        if own_delta:
            p.div_(p_sum)  # a kept chunk's p is pass 1's tensor, met here once
        p_g = (p if kept is None else p * kept).view(Bg, Hkvg, Gr, -1)
        dv_c = torch.matmul(p_g.transpose(-1, -2), dob_g)
        ds = dp.sub_(delta_r).mul_(p)  # gradient w.r.t. the post-mod score
        slope = 1.0  # a constant factor of dS left to the (smaller) products below
        if capped:  # times the slope over pre (pre is in qb): cap * (1 - tanh^2), from s4's tanh
            slope = mods.tanh_cap[1]
            ds.addcmul_(ds, s4.mul_(s4), value=-1.0)
        elif post is not None:
            wrt = ([s4] if s4.requires_grad else []) + leaves
            grads = torch.autograd.grad(post, wrt, ds, allow_unused=True) if post.requires_grad and wrt else [None] * len(wrt)
            for i, gb in enumerate(grads[len(wrt) - len(leaves):]):
                if gb is not None:
                    buf_grads[i] += gb
            ds = grads[0] if s4.requires_grad else None
        if ds is not None:
            ds = ds.contiguous()
            if post is not None or not finite:  # (else p, so dS, is 0 there already)
                _zero_blocked(ds, blocked)  # masked entries never reach the output, whatever the mod's slope
            ds_g = ds.view(Bg, Hkvg, Gr, -1)
            # a masked pair (dS = 0) must not bring a NaN or inf key into dq, or such a query into dk
            matmul = torch.matmul if finite or not blocked else matmul_skipping_zeros
            dq_r.add_(matmul(ds_g, kc), alpha=scale * pre * slope)
            dk_c = matmul(ds_g.transpose(-1, -2), qb)
            add_chunk_rows(dk_g, chunk, dk_c.mul_(slope) if slope != 1.0 else dk_c, sum_kv_batch)
        add_chunk_rows(dv_g, chunk, dv_c, sum_kv_batch)
    dq[g.b, g.qh, q0:q1] = dq_r.view(Bg, Hqg, r, E)
