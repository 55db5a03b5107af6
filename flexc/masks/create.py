"""``create_block_mask`` and ``create_mask``: a mask_mod to a :class:`~flexc.masks.block_mask.BlockMask`'s
tables, or to the dense mask.

``create_block_mask`` never builds the dense ``[B, H, Q_LEN, KV_LEN]`` mask. It traces the
mask_mod, lets analysis decide what tiles it can (:func:`_classify_tiles`), and evaluates only the
remaining tiles exactly, a bounded batch at a time.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..analysis import bounds
from ..analysis.ranges import MIXED
from ..analysis.tiles import (EMPTY, FULL, PARTIAL, UNDECIDED, cdiv, dense_mask, dense_to_ordered, evaluate_tiles,
                              ragged_tiles, reads_input)
from ..mods.trace import trace
from ..mods.traced_mod import MASK_MOD, TracedMod, check_captured
from .block_mask import DEFAULT_BLOCK_SIZE, DERIVED, BlockMask
from .mask_arguments import block_sizes, check_captured_sizes, positive_int, resolve_device, trace_as


def _classify_tiles(traced: TracedMod, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int,
                    device: torch.device, analytic: bool) -> torch.Tensor:
    """Initial tile classes, int8 ``[B, H, nQ, nKV]`` (or broadcastable to it): EMPTY=0,
    UNDECIDED=1, FULL=2, MIXED=3.

    The single place where analysis plugs in: with ``analytic`` it may decide tiles without
    per-element work (a tile is FULL only if proven all-True over its in-range elements, EMPTY
    only if proven all-False, MIXED only if proven to hold both). UNDECIDED tiles are then
    evaluated exactly. Without analysis every tile is UNDECIDED.
    """
    nq, nkv = cdiv(Q_LEN, Q_BLOCK), cdiv(KV_LEN, KV_BLOCK)
    if analytic:
        from ..analysis.ranges import classify_tiles, mark_mixed_tiles

        # Analyse over b (or h) only where the mod reads it; the caller broadcasts the rest.
        B = B if reads_input(traced, "b") else 1
        H = H if reads_input(traced, "h") else 1
        classes = classify_tiles(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device)
        return mark_mixed_tiles(traced, classes, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    return torch.full((B, H, nq, nkv), UNDECIDED, dtype=torch.int8, device=device)


def _resolve_undecided(traced: TracedMod, classes: torch.Tensor, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
                       KV_BLOCK: int) -> torch.Tensor:
    """Final classes EMPTY/PARTIAL/FULL: exact evaluation of every UNDECIDED tile."""
    undecided = classes == UNDECIDED
    # A mod that ignores b (or h) gives the same tile for every b: evaluate it once.
    if not reads_input(traced, "b"):
        undecided = undecided.any(dim=0, keepdim=True)
    if not reads_input(traced, "h"):
        undecided = undecided.any(dim=1, keepdim=True)
    coords = undecided.nonzero()
    exact = torch.zeros(undecided.shape, dtype=torch.int8, device=classes.device)
    if coords.shape[0]:
        try:
            exact[tuple(coords.T)] = evaluate_tiles(traced, coords, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
        except IndexError as e:
            raise ValueError(
                f"create_block_mask: evaluating {traced.name} indexed a captured tensor out of range for "
                f"B={classes.shape[0]}, H={classes.shape[1]}, Q_LEN={Q_LEN}, KV_LEN={KV_LEN}: {e}. Fix: pass "
                f"sizes that match the tensors the mask_mod captures.") from e
    classes = torch.where(classes == UNDECIDED, exact.expand_as(classes), classes)
    # torch pads ragged edge tiles with False, so they are never FULL, whatever analysis proved;
    # tiles that analysis proved mixed (MIXED) are PARTIAL.
    ragged = ragged_tiles(Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, classes.device)
    demote = ((classes == FULL) & ragged) | (classes == MIXED)
    return torch.where(demote, torch.tensor(PARTIAL, dtype=torch.int8), classes)


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device: Any = None, BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                      _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True, *,
                      _analytic: bool = True) -> BlockMask:
    """Build the :class:`BlockMask` of ``mask_mod`` over ``[B, H, Q_LEN, KV_LEN]`` (torch's signature).

    ``B``/``H`` None broadcast (size 1). ``BLOCK_SIZE`` is an int or ``(Q_BLOCK, KV_BLOCK)``.
    ``device`` None means: the device of the tensors the mod captures, else the current accelerator,
    else the CPU. Tiles are EMPTY (skipped), FULL (every element allowed; kept in ``full_kv_*``
    when ``separate_full_blocks``) or partial; a ragged edge tile is never FULL, as in torch.
    Memory stays bounded: the dense mask is never built. ``_analytic=False`` turns off the tile
    analysis and evaluates every tile exactly (for testing the analysis). ``_compile`` is accepted
    for compatibility and ignored: flexc needs no compilation for this. Inside ``torch.compile``,
    :func:`flexc.create_block_mask` (:func:`flexc.torch_compile.compiled_block_mask.create_block_mask`)
    builds the tables in one custom-op node and calls this outside the graph.

    >>> bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 256, 256)
    >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
    ([[[1, 1]]], [[[0, 1]]])
    """
    where = "create_block_mask"
    traced = trace_as(where, mask_mod, (MASK_MOD,))
    B = positive_int(where, "B", B, allow_none=True) or 1
    H = positive_int(where, "H", H, allow_none=True) or 1
    Q_LEN = positive_int(where, "Q_LEN", Q_LEN)
    KV_LEN = positive_int(where, "KV_LEN", KV_LEN)
    Q_BLOCK, KV_BLOCK = block_sizes(where, BLOCK_SIZE)
    if not isinstance(separate_full_blocks, bool):
        raise TypeError(f"{where}: separate_full_blocks must be a bool, got {separate_full_blocks!r}.")
    if not isinstance(dq_kv_order, bool):
        raise ValueError(f"{where}: dq_kv_order must be a bool, got {type(dq_kv_order).__name__}.")
    if compute_dq_write_order:
        raise NotImplementedError(f"{where}: compute_dq_write_order=True (deterministic dQ metadata for torch's "
                                  f"FLASH backend) is not supported by flexc; pass False.")
    check_captured_sizes(where, traced, {"b": ("B", B), "h": ("H", H), "q_idx": ("Q_LEN", Q_LEN),
                                          "kv_idx": ("KV_LEN", KV_LEN)})
    device = resolve_device(device, traced)
    check_captured(traced, device, where)  # before any analysis reads the captured tensors
    if device.type == "meta":
        return _meta_block_mask(B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, separate_full_blocks, mask_mod)
    bounds.check_mod(traced, B, H, Q_LEN, KV_LEN, where)

    classes = _classify_tiles(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, _analytic)
    classes = classes.to(device=device, dtype=torch.int8).expand(B, H, *classes.shape[-2:])
    classes = _resolve_undecided(traced, classes, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)

    if separate_full_blocks:
        partial, full = classes == PARTIAL, classes == FULL
    else:
        partial, full = classes != EMPTY, None
    kv_tables = dense_to_ordered(partial)
    full_kv = dense_to_ordered(full) if full is not None else (None, None)
    return BlockMask((Q_LEN, KV_LEN), *kv_tables, *full_kv, *(DERIVED,) * 4,
                     BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod)


def _meta_block_mask(B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int,
                     separate_full_blocks: bool, mask_mod: Callable) -> BlockMask:
    """A BlockMask of meta tables with the shapes ``create_block_mask`` gives (as torch builds one
    on ``device="meta"``, e.g. while a model is built on meta): meta tensors hold no values, so the
    mask_mod is not evaluated, and the q tables are made here (deriving them reads values)."""
    n_q, n_kv = cdiv(Q_LEN, Q_BLOCK), cdiv(KV_LEN, KV_BLOCK)

    def tables(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty((B, H, rows), dtype=torch.int32, device="meta"),
                torch.empty((B, H, rows, columns), dtype=torch.int32, device="meta"))
    full_kv, full_q = (tables(n_q, n_kv), tables(n_kv, n_q)) if separate_full_blocks else ((None, None),) * 2
    return BlockMask((Q_LEN, KV_LEN), *tables(n_q, n_kv), *full_kv, *tables(n_kv, n_q), *full_q,
                     BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod)


def create_mask(mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                device: Any = None) -> torch.Tensor:
    """The dense bool ``[B, H, Q_LEN, KV_LEN]`` mask of a mask_mod, or of a score_mod (allowed where
    the score_mod of a zero score is not -inf), as torch's ``create_mask``.

    Evaluated in query chunks, so only the result itself is dense. ``device`` as in
    :func:`create_block_mask`.
    """
    where = "create_mask"
    if not callable(mod_fn):
        raise TypeError(f"{where}: mod_fn must be a mask_mod or score_mod function, got {type(mod_fn).__name__}.")
    traced = trace(mod_fn)
    B = positive_int(where, "B", B, allow_none=True) or 1
    H = positive_int(where, "H", H, allow_none=True) or 1
    Q_LEN = positive_int(where, "Q_LEN", Q_LEN)
    KV_LEN = positive_int(where, "KV_LEN", KV_LEN)
    check_captured_sizes(where, traced, {"b": ("B", B), "h": ("H", H), "q_idx": ("Q_LEN", Q_LEN),
                                          "kv_idx": ("KV_LEN", KV_LEN)})
    device = resolve_device(device, traced, where)
    check_captured(traced, device, where)  # before any analysis reads the captured tensors
    bounds.check_mod(traced, B, H, Q_LEN, KV_LEN, where)
    return dense_mask(traced, B, H, Q_LEN, KV_LEN, device)
