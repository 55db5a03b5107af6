"""The pictures of :meth:`BlockMask.to_string <flexc.masks.block_mask.BlockMask.to_string>`: a grid of
two-character cells per (batch, head) telling full, partial and empty tiles apart, and their legend."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..analysis.tiles import cdiv
from .ordered_rows import lower_bound


def draw_pictures(batch_dims: Sequence[int], limit: int, draw: Callable) -> str | None:
    """The pictures ``draw(index)`` of the first ``limit`` batch/head indices, each under its index;
    None as soon as ``draw`` gives None (the caller draws another way)."""
    pictures = []
    for count, index in enumerate(_product(batch_dims)):
        if count == limit:
            pictures += _MORE_PICTURES
            break
        picture = draw(index)
        if picture is None:
            return None
        pictures.append(f"{index}\n" + picture)
    return "\n".join(pictures)


def _product(dims: Sequence[int]):
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _product(dims[1:]):
            yield (i, *rest)


# The key to the pictures of BlockMask.to_string; to_string(legend=True) prints it under them.
TEXT_LEGEND = "legend: ██ full (mask_mod skipped)  ░░ partial or mixed (mask_mod runs)  blank: empty (never visited)"


def cells_note(row_step: int, col_step: int) -> str:
    """The legend's line for a picture whose cells cover ``row_step x col_step`` tiles each."""
    return (f"each cell covers {row_step} x {col_step} tiles (query x key blocks; the last row and column "
            f"may cover fewer): ██ all full, ▓▓ full tiles among others")


_MORE_PICTURES = ["...", "To print out more, set BlockMask.to_string(limit=N)",
                  "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]


def grid_steps(rows: int, cols: int, grid_size: int | tuple[int, int]) -> tuple[int, int]:
    """Tiles per picture cell down and across, for at most ``grid_size`` cells per side."""
    if grid_size == -1 or grid_size == (-1, -1):
        max_rows, max_cols = rows, cols
    elif isinstance(grid_size, int):
        max_rows = max_cols = grid_size
    else:
        max_rows, max_cols = grid_size
    return max(1, cdiv(rows, max(1, max_rows))), max(1, cdiv(cols, max(1, max_cols)))


def _cells(some: torch.Tensor, all_full: torch.Tensor, any_full: torch.Tensor | None = None) -> str:
    """The picture's text: ``██`` all full, ``░░`` some tile computed, blank none; with ``any_full``
    (the legend's picture), ``▓▓`` where a cell that is not all full holds a full tile."""
    mixed = (any_full & ~all_full).tolist() if any_full is not None else [[False] * len(r) for r in all_full.tolist()]
    chars = [["█" if full else ("▓" if mix else ("░" if s else " ")) for s, full, mix in zip(srow, frow, mrow)]
             for srow, frow, mrow in zip(some.tolist(), all_full.tolist(), mixed)]
    return "".join("".join(ch * 2 for ch in line) + "\n" for line in chars)


def draw_classes(classes: torch.Tensor, row_step: int, col_step: int, mark_full: bool = False) -> str:
    """Rows of 2-character cells; each cell summarises a row_step x col_step group of tile classes
    (0 empty, 1 partial, 2 full); ``mark_full``: see :func:`_cells`' ``any_full``."""
    rows, cols = classes.shape
    r, c = cdiv(rows, row_step), cdiv(cols, col_step)
    pad = (0, c * col_step - cols, 0, r * row_step - rows)
    # Pad with 0 (empty) to ask "anything computed?" and with 2 (full) to ask "all full?".
    grouped = lambda value: torch.nn.functional.pad(classes, pad, value=value).view(r, row_step, c, col_step)
    some = grouped(0).amax(dim=(1, 3))
    all_full = grouped(2).amin(dim=(1, 3)) == 2
    return _cells(some, all_full, some == 2 if mark_full else None)


def draw_counts(ordered: list, rows: int, cols: int, row_step: int, col_step: int, mark_full: bool = False) -> str:
    """:func:`draw_classes` of one picture from its ordered tables (``[(entries, counts)]``, partial then
    full, ``rows`` rows each): the tiles of each table per cell, counted by searching the cells'
    column bounds in every row and summing the rows of each group. A cell is all full when the full
    table holds every one of its tiles."""
    r, c = cdiv(rows, row_step), cdiv(cols, col_step)
    device = ordered[0][0].device
    bounds = (torch.arange(c + 1, device=device) * col_step).clamp(max=cols)
    per_cell = []
    for entries, counts in ordered:
        per_row = lower_bound(entries, counts, bounds).diff(dim=1)
        per_row = torch.nn.functional.pad(per_row, (0, 0, 0, r * row_step - rows))
        per_cell.append(per_row.view(r, row_step, c).sum(1))
    tiles_down = (rows - torch.arange(r, device=device) * row_step).clamp(max=row_step)
    tiles_across = (cols - torch.arange(c, device=device) * col_step).clamp(max=col_step)
    full = per_cell[1] if len(per_cell) == 2 else torch.zeros_like(per_cell[0])
    return _cells(per_cell[0] + full > 0, full == tiles_down[:, None] * tiles_across[None, :],
                  full > 0 if mark_full else None)
