"""The TORCH backend's forward decided once per call signature (:data:`flexc.backends.registry.PREPARE`).

:func:`flexc.backends.cpu.torch_cpu.forward_with_max` decides at every call which path computes it:
the decode path for short queries, one fused-kernel call for attention with nothing masked, the
kernel's causal mode for causal sequences, one call over a small call's dense tile, else the block
path. Those decisions read the inputs' shapes, strides and dtypes, the mods and the BlockMask's
tables, which a plan's signature fixes (:mod:`flexc.call.signature`), so for the calls of one
signature they are taken here, once. A warm call checks only what a signature leaves open: the
inputs' finiteness, the mods' captured tensors' values (the causal starts, the dense tile's mask:
memo lookups) and the thread count (:func:`causal_call.prepared_forward`). Warm CPU forwards, B=2,
H=4, L=256, D=32, one thread, host time besides the kernel: causal 88 -> 35 us, a sliding window
(one dense tile) 162 -> 47 us, causal ALiBi 210 -> 125 us. (Host code right after a kernel's call
runs several times slower than warm, its caches evicted: every step saved there counts more.)

Decoding's short queries on a one-row slice (gpt-fast's ``block_mask[:, :, pos // 128]`` every
step) keep the row's key range and the kernel's call, and per call read the mask_mod's allowed keys
for its captured values (:func:`decode_cpu.prepare_one_row`): gpt-fast's CPU step (B=1, H=8, 1024
keys, D=64, fp32, one thread) 1.26x -> 1.15x SDPA's with the boolean mask row (bench/host.py).

The decisions hold only for the tables and mods they were taken on: a call whose caller does not
vouch for the tables (``same_tables`` false: a slice, whose row differs between calls of its
signature), or a compiled call whose own mods capture tensors (or a decoding step's, whose path
reads them per call), runs :func:`torch_forward` as every call did before.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ...mods.trace import TracedMod
from ..nonfinite import all_finite
from . import causal_call, decode_cpu, dense_tile, fused_cpu
from .torch_cpu import torch_forward, unmasked

# what forward_with_max returns its logsumexp in when torch_forward calls it (the plan converts it)
_LSE_DTYPE = torch.float32


def prepare_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, scale: float, kernel_options: dict | None,
                    need_lse: bool, dropout: bool, sinks: bool) -> Callable:
    """:data:`flexc.backends.registry.PREPARE`'s callable for TORCH: ``(query, key, value, block_mask,
    dropout, sinks, mods=None, same_tables=False) -> (out, lse or None)``, what :func:`torch_forward`
    returns for the calls of this signature. Decided here: attention with nothing masked (no
    score_mod, every listed block full) is one fused-kernel call; plain causal attention and causal
    sequences (no score_mod) are the kernel's causal calls, after a per-call check of the inputs'
    finiteness (and of the causal starts, when the mask_mod captures tensors); a small call (no
    score_mod or a bias) is one call over its dense tile (:func:`_dense_tile`); decoding's short
    queries on one table row run the decode path's kernel call (:func:`_decode`); everything else
    (other short queries, the block path) runs :func:`torch_forward`."""
    def general(query, key, value, block_mask, dropout, sinks, score_mod=score_mod, mask_mod=mask_mod):
        return torch_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse,
                             dropout=dropout, sinks=sinks)
    decided = None if dropout else _decided(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse,
                                            general)
    if decided is None:
        def run(query, key, value, block_mask, dropout, sinks, mods=None, same_tables=False):
            return general(query, key, value, block_mask, dropout, sinks, *(mods or ()))
        return run

    # a compiled call passes its own mods, rebuilt per call: where neither they nor the plan's capture a
    # tensor and the path reads no mod per call (not decoding's), its signature
    # (flexc.torch_compile.op_plans: the mods' structures, the tables' states) makes them the plan's
    compiled_too = not decode_cpu.applies(query, key) and not _captures(score_mod, mask_mod)

    def run(query, key, value, block_mask, dropout, sinks, mods=None, same_tables=False):
        if (not same_tables or dropout is not None
                or (mods is not None and not (compiled_too and not _captures(*mods)))):
            return general(query, key, value, block_mask, dropout, sinks, *(mods or ()))
        return decided(query, key, value, block_mask, sinks)
    return run


def _captures(*mods: TracedMod | None) -> bool:
    """Whether a mod among ``mods`` captures a tensor."""
    return any(mod is not None and mod.buffers for mod in mods)


def _decided(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general) -> Callable | None:
    """``(query, key, value, block_mask, sinks) -> (out, lse or None)`` of the path
    :func:`flexc.backends.cpu.torch_cpu.forward_with_max` takes for this signature, where it is one
    of the fused kernel's; None where it is another (decided per call there)."""
    L, S = query.shape[2], key.shape[2]
    if decode_cpu.applies(query, key):
        return _decode(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general)
    if not query.numel() or not S:
        return None
    if score_mod is not None:  # (a score_mod leaves the dense tile, for a bias)
        return _dense_tile(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general)
    if fused_cpu.supported(query, value, None, False) and unmasked(block_mask, L, S):
        def plain(query, key, value, block_mask, sinks):
            out, lse = decode_cpu.flash(query, key, value, [], scale)
            return _finished(out, lse, sinks, need_lse)
        return plain
    starts = causal_call.applies(query, key, value, mask_mod, block_mask)
    if starts is None:
        return _dense_tile(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general)
    B, Hq = query.shape[:2]
    forward = causal_call.prepared_forward(query, key, value, scale, starts)
    if mask_mod.buffers:  # their values may change the sequences: read again each call (a memo lookup)
        def sequences(query, key, value, block_mask, sinks):
            now = causal_call.sequence_starts(block_mask, mask_mod, B, Hq, L, S)
            if now is None or not all_finite(query, key, value):
                return general(query, key, value, block_mask, None, sinks)
            run = forward if now == starts else (lambda q, k, v: causal_call.forward(q, k, v, scale, now))
            return _finished(*run(query, key, value), sinks, need_lse)
        return sequences

    # (where the kernel's causal mode masks every call, a non-finite query or key stays in the rows
    # that see it: only the values are checked, two sums fewer per call for inputs the memo has not seen)
    values_only = causal_call.fills_past_the_diagonal(starts, L, S)

    def causal(query, key, value, block_mask, sinks):
        if not (all_finite(value) if values_only else all_finite(query, key, value)):
            return general(query, key, value, block_mask, None, sinks)
        return _finished(*forward(query, key, value), sinks, need_lse)
    return causal


def _decode(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general) -> Callable | None:
    """:func:`_decided`'s decoding step on a one-row slice (:func:`decode_cpu.prepare_one_row`: the
    row's key range decided once, the allowed keys per call); None for other short queries."""
    return decode_cpu.prepare_one_row(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general,
                                      _finished)


def _dense_tile(query, key, value, score_mod, mask_mod, block_mask, scale, need_lse, general) -> Callable | None:
    """:func:`_decided`'s small calls (:func:`dense_tile.takes`): one kernel call over the whole
    tile, its outputs returned as the kernel gives them (forward_with_max copies its dense tile's
    into outputs it made first): row-major where batch and heads fold and the mask is the same
    for every batch and head, else the kernel's ``[B, L, H, E]`` layout, which the plan lays out
    (a mask by head folded would be copied for every batch and head, and the kernel reads B * H
    tiles: slower). None for other calls. Finite inputs only, checked per call (the mask's -inf
    would turn NaN or inf into NaN). Whether the mask leaves a row dead is worked out once per
    mask: the kernel's logsumexp check costs ~30 us after its call. With mods that capture no
    tensor the mask is the signature's own (its tables and mods) and kept here; else the memo
    gives it per call (:func:`dense_tile.call_mask`)."""
    if not dense_tile.takes(query, key, value, score_mod):
        return None
    # (the kernel's mask as forward_with_max's dense tile lays it out, one memo entry for both; with one
    # query head per key head a mask the same for every batch and head is also the folded call's)
    folded = (causal_call.foldable(query, key, value)
              and dense_tile.call_mask(query, key, score_mod, mask_mod, block_mask, "stacked").shape[:2] == (1, 1))
    bias = score_mod is not None
    # the kernel misreads a last dimension with another stride (channels_last, permuted, sliced): copied
    unit_stride = not any(t.stride()[-1] != 1 and t.shape[-1] > 1 for t in (query, key, value))
    if _captures(score_mod, mask_mod):
        # the last mask (weakly) and whether it leaves a row dead, as one tuple: read and replaced whole,
        # so a thread never pairs one mask with another's verdict
        last: list = [(lambda: None, True)]

        def mask_now(query, key, block_mask) -> tuple[torch.Tensor, bool]:
            mask = dense_tile.call_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
            seen = last[0]
            if seen[0]() is not mask:  # (the memo made it again: the captured tensors changed)
                seen = last[0] = (weakref.ref(mask), dense_tile.has_dead_rows(mask))
            return mask, seen[1]
    else:
        kept = dense_tile.call_mask(query, key, score_mod, mask_mod, block_mask, "stacked")
        kept_verdict = (kept, dense_tile.has_dead_rows(kept))
        mask_now = lambda query, key, block_mask: kept_verdict  # noqa: E731

    def tile(query, key, value, block_mask, sinks):
        if sinks is not None or not all_finite(query, key, value):
            return general(query, key, value, block_mask, None, sinks)
        mask, dead_rows = mask_now(query, key, block_mask)
        if not unit_stride:
            query, key, value = (fused_cpu.unit_last_stride(t) for t in (query, key, value))
        out, lse = dense_tile.forward_tile(query, key, value, mask, scale, bias, dead_rows, folded)
        return _finished(out, lse.contiguous(), None, need_lse)
    return tile


def _finished(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, need_lse: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` as :func:`torch_forward` returns a fused-kernel path's: the sinks
    joined (:func:`fused_cpu.fold_sink`), the logsumexp in float32 where it is wanted."""
    if sinks is not None:
        out, lse = fused_cpu.fold_sink(out, lse, sinks)
    return out, (lse.to(_LSE_DTYPE) if need_lse else None)
