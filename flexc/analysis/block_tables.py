"""Ordered block tables from tile occupancy in linear time (no sort of the rows).

torch's BlockMask lists, per row of tiles, the occupied columns in ascending order followed by the
free ones in ascending order: what a stable descending argsort of the 0/1 row gives. A sort costs
``O(cols log cols)`` per row and, at a million tokens (8192 x 8192 tiles), dominated the time of
building a block mask.

Each row is a concatenation of runs of consecutive columns: its occupied runs, then its free runs,
each in column order. So ``indices[r, p] = p + offset``, where the offset is constant over each run
placed in the output. The offsets are written as jumps at the output position where each run
begins and summed along the row: one zero fill, a scatter of a few values per row, a cumulative
sum and an add, whatever the pattern. Only the runs (a handful per row) are sorted. Rows are
handled in chunks small enough to stay in cache.
"""
from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 19


def ordered_tables(occupancy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks [..., rows], indices [..., rows, cols])``, both int32, from a 0/1 or bool
    occupancy ``[..., rows, cols]``: equal to a stable descending argsort of each row."""
    cols = occupancy.shape[-1]
    lead = occupancy.shape[:-1]
    occupied = occupancy.reshape(-1, cols)
    if occupied.dtype != torch.bool:
        occupied = occupied != 0
    rows = occupied.shape[0]
    num = torch.empty(rows, dtype=torch.int32, device=occupancy.device)
    indices = torch.empty(rows, cols, dtype=torch.int32, device=occupancy.device)
    columns = torch.arange(cols, dtype=torch.int32, device=occupancy.device).view(1, cols)
    step = max(1, _CHUNK_ELEMENTS // max(1, cols))
    for r0 in range(0, rows, step):
        _order_rows(occupied[r0:r0 + step], columns, num[r0:r0 + step], indices[r0:r0 + step])
    return num.view(lead), indices.view(*lead, cols)


def _order_rows(occupied: torch.Tensor, p: torch.Tensor, num: torch.Tensor, out: torch.Tensor) -> None:
    rows, cols = occupied.shape
    torch.sum(occupied.view(torch.uint8), dim=-1, dtype=torch.int32, out=num)
    # runs begin at column 0 and wherever the occupancy changes; nonzero lists them row by row
    starts = torch.empty_like(occupied)
    starts[:, 0] = True
    torch.ne(occupied[:, 1:], occupied[:, :-1], out=starts[:, 1:])
    run_row, run_col = starts.nonzero().unbind(1)
    last_in_row = torch.ones_like(run_row, dtype=torch.bool)
    last_in_row[:-1] = run_row[1:] != run_row[:-1]
    run_end = torch.where(last_in_row, cols, torch.roll(run_col, -1))
    is_free = ~occupied[run_row, run_col]
    # output order: per row, occupied runs then free runs, each in column order
    order = torch.argsort((run_row * 2 + is_free) * cols + run_col)
    run_row, run_col, run_end = run_row[order], run_col[order], run_end[order]
    length = run_end - run_col
    # every row's runs add up to `cols`, so the flat exclusive sum of lengths is row * cols + position
    position = torch.cumsum(length, 0) - length - run_row * cols
    offset = run_col - position
    jump = offset.clone()
    same_row = run_row[1:] == run_row[:-1]
    jump[1:] -= torch.where(same_row, offset[:-1], 0)
    out.zero_()
    out[run_row, position] = jump.to(torch.int32)
    out.cumsum_(dim=-1)
    out.add_(p)
