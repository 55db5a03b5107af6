"""Tile-level work behind block masks: exact tile classification and block-table layout.

A block mask cuts the ``[Q_LEN, KV_LEN]`` grid of every ``(b, h)`` into tiles of
``Q_BLOCK x KV_BLOCK`` elements. This module evaluates a traced mask_mod on chosen tiles in bounded
memory (never the dense ``[B, H, Q_LEN, KV_LEN]`` grid) and converts per-tile occupancy into torch's
ordered block tables (``num_blocks`` + ``indices`` with the valid entries first).
"""
from __future__ import annotations

from typing import Any

import torch

from .. import workers
from ..mods import ir
from ..mods.evaluate import evaluate
from ..mods.traced_mod import SCORE_MOD, TracedMod

# Tile classes, the one definition: what analysis (flexc.analysis.ranges) proved, or what exact
# evaluation found.
EMPTY, UNDECIDED, FULL = 0, 1, 2
PARTIAL = 1  # after exact evaluation no tile is undecided; 1 then means "mixed"
MIXED = 3  # set by ranges.mark_mixed_tiles: proven to hold both allowed and masked elements (PARTIAL)

# Elements evaluated per batch of tiles. The largest intermediates are int64 index differences,
# about 8 MiB per batch at this size: small against the 1 GiB goal at L=16384, and small enough
# that the allocator reuses its memory between batches (larger batches were slower here, paying
# for fresh pages each time) while Python overhead per batch stays negligible.
DEFAULT_MAX_ELEMENTS = 1 << 20
# Elements per batch of exact tile evaluation: half the above, so a batch's int64 intermediates
# (4 MiB) stay in a core's L2 cache. With 1 << 20 a hash-like mask (`(q * 7919 + kv * 104729) % 13`,
# int64 temporaries) took 1.9x the CPU time; a mask of bool lookups was 5-10% faster there (fewer
# batches), and at 1 << 18 per-batch overhead began to show (2-core Xeon, 4 MiB L2 a core).
TILE_BATCH_ELEMENTS = 1 << 19
# Fewer batches than this per worker run on the calling thread (with torch's own threads): workers
# do not pay for a few batches.
MIN_BATCHES_PER_WORKER = 4


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def reads_input(traced: TracedMod, name: str) -> bool:
    """Whether the traced mod reads the input ``name`` ("b", "h", "q_idx", "kv_idx", "score")."""
    return name in ir.inputs_read(traced.root)


def ragged_tiles(Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int, device: Any = None) -> torch.Tensor:
    """Bool ``[nQ, nKV]``: tiles that stick out past the sequence end in q or kv.

    torch pads the mask with False to whole tiles before counting, so such a tile is never FULL.
    """
    nq, nkv = cdiv(Q_LEN, Q_BLOCK), cdiv(KV_LEN, KV_BLOCK)
    rows = torch.arange(1, nq + 1, device=device) * Q_BLOCK > Q_LEN
    cols = torch.arange(1, nkv + 1, device=device) * KV_BLOCK > KV_LEN
    return rows[:, None] | cols[None, :]


def evaluate_tiles(traced: TracedMod, coords: torch.Tensor, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
                   KV_BLOCK: int, max_elements: int = TILE_BATCH_ELEMENTS,
                   n_workers: int | None = None) -> torch.Tensor:
    """Classify the tiles at ``coords`` (int64 ``[N, 4]`` rows of ``b, h, q_block, kv_block``) exactly.

    Returns int8 ``[N]``: EMPTY (no allowed element), FULL (every element allowed and the tile lies
    wholly inside both lengths) or PARTIAL. Tiles are evaluated in batches of about
    ``max_elements`` elements, each as a ``[n, Q_BLOCK, KV_BLOCK]`` grid. On the CPU the batches run
    on ``n_workers`` worker threads (:mod:`flexc.workers`; default: torch's thread count, one
    thread for a few batches), each writing its own slice of the result, so the result does not
    depend on the thread count. A run past :data:`flexc.workers.PROGRESS_AFTER_S` seconds reports
    its progress on stderr (``FLEXC_PROGRESS=0`` turns that off).
    """
    device = coords.device
    total = coords.shape[0]
    out = torch.empty(total, dtype=torch.int8, device=device)
    # A tile holds at most min(BLOCK, LEN) real positions along each axis, so a grid that wide sees
    # them all (the clamp below repeats the last one): a block far longer than the sequence (torch's
    # 1 << 30) costs no more than the sequence itself. Raggedness still uses the whole block.
    q_extent, kv_extent = min(Q_BLOCK, Q_LEN), min(KV_BLOCK, KV_LEN)
    per_batch = max(1, max_elements // (q_extent * kv_extent))
    q_offsets = torch.arange(q_extent, device=device)
    kv_offsets = torch.arange(kv_extent, device=device)
    starts = range(0, total, per_batch)
    if n_workers is None:
        n_workers = (workers.worker_count(len(starts), len(starts), MIN_BATCHES_PER_WORKER)
                     if device.type == "cpu" else 1)  # a GPU runs each batch's ops in parallel already
    progress = workers.Progress(f"create_block_mask: evaluating {traced.name} tile by tile", total)

    def one_batch(start: int, worker: int) -> None:
        c = coords[start:start + per_batch]
        n = c.shape[0]
        q_first = c[:, 2] * Q_BLOCK
        kv_first = c[:, 3] * KV_BLOCK
        # Positions past the end of a ragged tile are clamped onto the last real index: they repeat
        # an in-range value, so any()/all() over the clamped grid equal any()/all() over the real
        # elements, and captured tensors are never indexed out of range.
        q = (q_first[:, None] + q_offsets).clamp_(max=Q_LEN - 1).view(n, q_extent, 1)
        kv = (kv_first[:, None] + kv_offsets).clamp_(max=KV_LEN - 1).view(n, 1, kv_extent)
        allowed = evaluate(traced, b=c[:, 0].view(n, 1, 1), h=c[:, 1].view(n, 1, 1), q_idx=q, kv_idx=kv)
        any_allowed, all_allowed = _any_all(allowed.to(torch.bool), n)
        ragged = (q_first + Q_BLOCK > Q_LEN) | (kv_first + KV_BLOCK > KV_LEN)
        cls = torch.where(all_allowed & ~ragged, FULL, PARTIAL)
        out[start:start + n] = torch.where(any_allowed, cls, EMPTY)
        progress.advance(n)

    with progress:
        workers.run(starts, [min(per_batch, total - s) for s in starts], one_batch, n_workers, dynamic=True)
    return out


# 0x0101010101010101: eight True bools read as one int64 (each byte 0 or 1, so the order of bytes
# does not matter)
_EIGHT_TRUE = int.from_bytes(b"\x01" * 8, "little")


def _any_all(allowed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[n]`` pair: whether any, and whether every, element of each tile (the first dim) is True.

    A contiguous bool tile is read as int64 words of eight elements and reduced once with
    ``aminmax``: some word nonzero means some element is True, the smallest word ``0x0101...01``
    means all are. That is one pass over an eighth of the elements, where ``any()`` and ``all()``
    over the bools took two full passes (about 15x the time, L=32K, 64 tiles of 128 x 128).
    """
    per_tile = allowed.numel() // max(1, n)
    if (allowed.is_contiguous() and per_tile % 8 == 0 and allowed.storage_offset() % 8 == 0
            and allowed.numel() == n * per_tile and n > 0):
        low, high = torch.aminmax(allowed.view(n, per_tile).view(torch.int64), dim=1)
        return high != 0, low == _EIGHT_TRUE
    flat = allowed.reshape(n, -1)  # broadcast results (a mod that ignores q or kv) and odd sizes
    return flat.any(dim=1), flat.all(dim=1)


def dense_mask(traced: TracedMod, B: int, H: int, Q_LEN: int, KV_LEN: int, device: Any,
               max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
    """The dense bool ``[B, H, Q_LEN, KV_LEN]`` mask of a mask_mod, or of a score_mod where the
    score_mod of a zero score is not -inf (torch's create_mask rule). Computed in query chunks so
    only the output is dense."""
    out = torch.empty(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    # Evaluate over batch or head only where the mod reads it; broadcasting fills the rest.
    eb = B if reads_input(traced, "b") else 1
    eh = H if reads_input(traced, "h") else 1
    rows = max(1, min(Q_LEN, max_elements // max(1, eb * eh * KV_LEN)))
    b = torch.arange(eb, device=device).view(eb, 1, 1, 1)
    h = torch.arange(eh, device=device).view(1, eh, 1, 1)
    kv = torch.arange(KV_LEN, device=device).view(1, 1, 1, KV_LEN)
    score = torch.zeros((), dtype=torch.float32, device=device) if traced.kind == SCORE_MOD else None
    for q0 in range(0, Q_LEN, rows):
        q = torch.arange(q0, min(Q_LEN, q0 + rows), device=device).view(1, 1, -1, 1)
        value = evaluate(traced, score=score, b=b, h=h, q_idx=q, kv_idx=kv)
        out[:, :, q0:q0 + q.shape[2]] = ~torch.isneginf(value) if score is not None else value.to(torch.bool)
    return out


# ---- block tables ---------------------------------------------------------------------------

def dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Occupancy ``[..., rows, cols]`` (0/1) to ``(num_blocks [..., rows], indices [..., rows, cols])``.

    Matches torch's layout exactly: a stable descending argsort, so each row lists its occupied
    columns in ascending order, then the unoccupied ones in ascending order. Both int32, contiguous.
    """
    # Built in linear time by flexc.analysis.block_tables (a sort dominated the time at long lengths).
    from .block_tables import ordered_tables

    num, indices = ordered_tables(dense)
    return num.contiguous(), indices.contiguous()


def ordered_to_dense(num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of :func:`dense_to_ordered`: int32 occupancy ``[..., rows, num_cols]``.

    Entries past ``num_blocks`` in a row are ignored, as torch documents them as undefined; a
    negative entry inside the count is an empty block, as every call reads it (torch's
    ``PagedAttention`` maps the pages of a batch row with none reserved to -1).
    """
    width = indices.shape[-1]
    valid = (torch.arange(width, device=indices.device) < num_blocks.unsqueeze(-1)) & (indices >= 0)
    # Invalid entries write into one spare column that is cut off afterwards.
    target = torch.where(valid, indices.long(), num_cols)
    dense = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.int32, device=indices.device)
    dense.scatter_(-1, target, 1)
    return dense[..., :num_cols].contiguous()


def transpose_ordered(num_blocks: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-major (q-block) tables of a row-major (kv-block) table pair, as torch builds them."""
    dense = ordered_to_dense(num_blocks, indices, indices.shape[-1])
    return dense_to_ordered(dense.transpose(-2, -1))
