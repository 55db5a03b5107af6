"""A small call as one fused-kernel call over its whole score tile, with a dense additive mask.

Where ``L x S`` is small, the block path's Python costs more than its kernels: a row plan's tasks,
their kernel calls, masks and logsumexp merges, and flexc's autograd Function around them (B=2,
H=4, L=256, D=32, causal + ALiBi training step, one thread: 4.7 ms against torch's 2.2 ms for the
same work in one kernel call). Such a call runs as one call of torch's fused CPU kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) with an additive mask ``[b, h, L, S]``
that holds, per pair, what the BlockMask and the mods say:

* the bias of a ``score +/- X`` score_mod (0 without a score_mod) on allowed pairs: those of the
  blocks listed full, and those the mask_mod allows in blocks listed partial;
* -inf on every other pair (blocks the BlockMask does not list are never read, whatever the mask_mod).

The kernel adds the mask after scaling, where a score_mod applies, so the scores are the block
path's. It scores every pair, allowed or not, so only calls of at most :data:`MAX_PAIRS` pairs in
tiles of at most :data:`MAX_TILE_PAIRS` run so: there the saved Python outweighs the masked pairs'
work (a causal mask wastes half the tile).
The mask is built once per BlockMask tables, mods and captured tensors (their versions) and kept
(:func:`flexc.backends.cpu.block_plan.memo_by_tables`). A training call is recorded by autograd,
whose backward is torch's C++ node for the kernel with the same mask
(:func:`flexc.backends.cpu.causal_call.recorder`, from
:func:`flexc.backends.cpu.torch_cpu.prepare_recorded`); a forward, and flexc's Function where it
trains (a logsumexp asked for, GQA in row-major memory), make one kernel call each way
(:func:`forward` and :func:`backward`, from :func:`flexc.backends.cpu.torch_cpu.forward_with_max` and
:func:`flexc.backends.cpu.torch_cpu_backward.torch_backward`; same shapes, forward only, one
thread: causal + ALiBi 1.71 -> 0.88 ms, window 1.45 -> 0.81 ms; SDPA with the mask 0.65).
"""
from __future__ import annotations

import contextlib

import torch

from ...masks.kv_tables import block_sizes_of, kv_tables
from ...mods.evaluate import evaluate
from ..nonfinite import all_finite
from . import fused_cpu
from .block_plan import memo_by_tables
from .head_groups import Group
from .row_mods import Mods, score_bias

# a call runs as one dense tile when it scores at most this many pairs, ``B * H * L * S`` (B=4,
# H=4, L=256: 1M), in tiles of at most MAX_TILE_PAIRS (L = S = 362). Past them the kernel's work on
# masked pairs outweighs the Python saved (training steps, one thread, D=64: L=512, H=8, window
# 129, 1.04x the block path's time at B=1 and 1.4x at B=4; L=512, H=4, B=1, causal + ALiBi 1.05x)
MAX_PAIRS = 1 << 20
MAX_TILE_PAIRS = 1 << 17
# elements of the mask a call passes the kernel, at most (4 MiB in fp32; a per-head bias with batch
# and heads folded into the kernel's batch is B * H tiles)
MAX_MASK_ELEMENTS = 1 << 20

NOT_LISTED, PARTIAL, FULL = 0, 1, 2
_NEG_INF = float("-inf")


def fits(B: int, H: int, L: int, S: int) -> bool:
    """Whether a call of ``B`` batches, ``H`` query heads, ``L`` queries and ``S`` keys runs as one dense tile."""
    return 0 < L * S <= MAX_TILE_PAIRS and B * H * L * S <= MAX_PAIRS


def block_classes(block_mask, B: int, H: int, L: int, S: int) -> torch.Tensor:
    """``[Bt, Ht, L, S]`` int8 (``Bt`` 1 or ``B``, ``Ht`` 1 or ``H``): per pair, whether its block is
    :data:`NOT_LISTED`, listed :data:`PARTIAL` or listed :data:`FULL` in the BlockMask's tables
    (entries broadcast over batch and heads by modulo, as torch reads them). No BlockMask: every
    pair full (``[1, 1, 1, 1]``)."""
    if block_mask is None:
        return torch.full((1, 1, 1, 1), FULL, dtype=torch.int8)
    q_block, kv_block = block_sizes_of(block_mask)
    kv_num, kv_idx, full_num, full_idx = (t.cpu() if t is not None else None for t in kv_tables(block_mask))
    n_rows, n_cols = -(-L // q_block), -(-S // kv_block)
    Bm, Hm = kv_num.shape[:2]
    classes = torch.zeros(Bm, Hm, n_rows, n_cols + 1, dtype=torch.int8)  # (a last column for what no block reads)
    for num, idx, kind in ((kv_num, kv_idx, PARTIAL), (full_num, full_idx, FULL)):
        if num is None:
            continue
        num, idx = num[..., :n_rows].long(), idx[..., :n_rows, :].long()
        listed = (torch.arange(idx.shape[-1]) < num.unsqueeze(-1)) & (idx >= 0) & (idx < n_cols)
        at = torch.where(listed, idx, n_cols)
        classes[:, :, :at.shape[2]].scatter_(-1, at, torch.full(at.shape, kind, dtype=torch.int8))
    # each pair reads its block's entry (blocks may be larger than the lengths: torch's no-op masks)
    classes = classes[:, :, torch.arange(L) // q_block][..., torch.arange(S) // kv_block]
    pick = lambda n, m: None if m in (1, n) else torch.arange(n) % m
    if (b := pick(B, Bm)) is not None:
        classes = classes[b]
    if (h := pick(H, Hm)) is not None:
        classes = classes[:, h]
    return classes


def additive_mask(classes: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The kernel's additive mask ``[b, h, L, S]``: ``bias`` (or 0) where ``classes`` lists the pair's
    block full, or partial and ``allowed`` (the mask_mod's answer, broadcastable; None: all) says
    so, -inf elsewhere."""
    keep = classes == FULL
    partial = classes == PARTIAL
    keep = keep | (partial & allowed) if allowed is not None else keep | partial
    value = torch.zeros((), dtype=dtype) if bias is None else bias.to(dtype)
    mask = torch.where(keep, value, torch.tensor(_NEG_INF, dtype=dtype))
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).contiguous()


def kernel_mask(mask: torch.Tensor, B: int, H: int, folded: bool) -> torch.Tensor:
    """``mask`` ``[b, h, L, S]`` for the kernel's inputs: as it is, or, with batch and heads folded
    into the kernel's batch (:func:`flexc.backends.cpu.causal_call.recorder`), ``[B * H or 1, 1, L, S]``
    (a copy when it differs by head or batch)."""
    if not folded:
        return mask
    b, h, L, S = mask.shape
    if b == 1 and h == 1:
        return mask
    return mask.expand(B, H, L, S).reshape(B * H, 1, L, S)


def kernel_mask_elements(mask_shape: tuple, B: int, H: int, folded: bool) -> int:
    """Elements :func:`kernel_mask` passes the kernel for a mask of ``mask_shape``."""
    b, h, L, S = mask_shape
    return (B * H if folded and (b, h) != (1, 1) else b * h) * L * S


def call_mask(query, key, score_mod, mask_mod, block_mask, layout: str) -> torch.Tensor:
    """The additive mask of a call as one dense tile (:func:`additive_mask`), laid out for
    the kernel's inputs: ``"plain"`` ``[b, h, L, S]``, ``"folded"`` (batch and heads one dimension,
    :func:`kernel_mask`) or ``"stacked"`` (a key head's query heads as rows,
    :func:`flexc.backends.cpu.fused_cpu.stack_heads`). Remembered with the block tables and the mods' captured
    tensors (identity and version)."""
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, _ = key.shape
    mods_key = tuple((mod.root, mod.scalars) if mod is not None else None for mod in (score_mod, mask_mod))
    captured = [*(mask_mod.buffers if mask_mod is not None else ()), *(score_mod.buffers if score_mod is not None else ())]

    def build() -> torch.Tensor:
        group = Group(slice(0, B), slice(0, Bkv), slice(0, Hq), slice(0, Hkv), Hq // Hkv, 0, 0)
        mods = Mods(score_mod, mask_mod, group, B, Hq, L, S, query.device)
        allowed = bias = None
        if mods.mask_mod is not None:
            allowed = evaluate(mods.mask_mod, clamp_lookups=True, **mods.indices(mods.mask_reads, 0, L, mods.kv_pos))
        if mods.bias_node is not None:
            bias = mods.bias(0, L, mods.kv_pos)
            bias = bias.neg() if mods.bias_sign < 0 else bias
        mask = additive_mask(block_classes(block_mask, B, Hq, L, S), allowed, bias, query.dtype)
        if layout == "stacked":
            return fused_cpu.stack_heads(mask, Hq // Hkv)
        return kernel_mask(mask, B, Hq, layout == "folded")
    return memo_by_tables(block_mask, ("dense tile", mods_key, B, Hq, Hkv, L, S, query.dtype, layout), build,
                          captured)


def applies(query, key, value, score_mod, dropout, sinks) -> bool:
    """Whether a forward, or its backward, runs as one dense tile (:func:`forward`): a small
    call (:func:`fits`) the fused kernel takes, with no score_mod or a ``score +/- X``
    one, no dropout or sinks, and finite inputs (the mask's -inf would turn NaN or inf into NaN)."""
    return dropout is None and sinks is None and takes(query, key, value, score_mod) and all_finite(query, key, value)


def takes(query, key, value, score_mod) -> bool:
    """:func:`applies` but for what a call signature leaves open (dropout, sinks, finiteness): a
    small call the fused kernel takes, with no score_mod or a ``score +/- X`` one."""
    B, Hq, L, _ = query.shape
    return (fits(B, Hq, L, key.shape[2]) and fused_cpu.supported(query, value, None, False)
            and (score_mod is None or score_bias(score_mod)[0] is not None))


def _shapes(query, key, value):
    """``(q, k, v)`` of one kernel call over the whole tile: a key head's query heads stacked as
    rows (``[B, Hkv, G*L, E]``), a key batch broadcast over the query's as a stride-0 view."""
    B, Hq, L, E = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, Hq // Hkv * L, E)
    k, v = (t.expand(B, *t.shape[1:]) if t.shape[0] != B else t for t in (key, value))
    return q, k, v


def forward(query, key, value, out, lse, score_mod, mask_mod, block_mask, scale) -> None:
    """:func:`flexc.backends.cpu.torch_cpu.forward_with_max`'s small calls (:func:`fits`): one kernel call over the
    whole tile with its dense mask, into ``out`` and ``lse``."""
    mask = call_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
    o, l = forward_tile(query, key, value, mask, scale, score_mod is not None)
    out.copy_(o)
    lse.copy_(l)


def forward_tile(query, key, value, mask: torch.Tensor, scale: float, bias: bool, dead_rows: bool = True,
                 folded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one kernel call over the whole tile with ``mask`` laid out for the
    kernel's inputs (:func:`call_mask`): ``"stacked"`` (:func:`_shapes`: the outputs come back
    ``[B, L, H, E]``-strided, views where they can be), or ``folded`` for row-major inputs whose
    batch and heads fold into the kernel's batch (:func:`flexc.backends.cpu.causal_call.foldable`:
    the outputs are row-major). ``bias``: the mask holds a score_mod's bias; ``dead_rows``: False
    when the caller knows no row of ``mask`` is all -inf (:func:`has_dead_rows`)."""
    B, Hq, L, _ = query.shape
    inputs = tuple(map(fused_cpu.heads_folded, (query, key, value))) if folded else _shapes(query, key, value)
    o, l = fused_cpu.FLASH(*inputs, attn_mask=mask, scale=scale)
    if dead_rows:
        fused_cpu.fix_dead_rows(l, mask)
    l = l.reshape(B, Hq, L)
    if bias:  # a +inf score (a +inf bias) gives the kernel's logsumexp +inf: NaN, as the other paths' (fused_cpu.forward_rows)
        l = l.masked_fill(l.isposinf(), float("nan"))
    return o.reshape(B, Hq, L, o.shape[-1]), l


def has_dead_rows(mask: torch.Tensor) -> bool:
    """Whether some row of an additive ``mask`` allows no key (all -inf): the kernel then reports
    logsumexp 0 for it (:func:`flexc.backends.cpu.fused_cpu.fix_dead_rows`)."""
    return bool(torch.isneginf(mask).all(-1).any())


def backward(query, key, value, out, lse_bw, grad_out, dq, dk, dv, score_mod, mask_mod, block_mask,
             scale) -> None:
    """:func:`flexc.backends.cpu.torch_cpu_backward.torch_backward`'s gradients of a :func:`forward`
    call, added into ``dq``, ``dk`` and ``dv``: torch's fused backward with the same mask (``lse_bw``:
    the saved logsumexp with -inf made +inf, as :func:`flexc.backends.cpu.fused_cpu.backward_row` takes it)."""
    B, Hq, L, E = query.shape
    Hkv = key.shape[1]
    mask = call_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
    q, k, v = _shapes(query, key, value)
    o, go = (t.reshape(B, Hkv, -1, t.shape[-1]) for t in (out, grad_out))
    with fused_cpu.denormals_flushed() if score_mod is not None else contextlib.nullcontext():
        gq, gk, gv = fused_cpu.FLASH_BACKWARD(go, q, k, v, o, lse_bw.reshape(B, Hkv, -1), 0.0, False,
                                              attn_mask=mask, scale=scale)
    dq += gq.reshape(B, Hq, L, E)
    if key.shape[0] != B:  # (one key batch for every query batch)
        gk, gv = gk.sum(0, keepdim=True), gv.sum(0, keepdim=True)
    dk += gk
    dv += gv
