"""Ordered block tables from tile occupancy in linear time (no sort).

torch's BlockMask lists, per row of tiles, the occupied columns in ascending order followed by the
free ones in ascending order: what a stable descending argsort of the 0/1 row gives. A sort costs
``O(cols log cols)`` per row and, at a million tokens (8192 x 8192 tiles), most of the time of
building a block mask. The rows of real masks are simpler:

- one contiguous run of occupied columns ``[first, end)`` (causal, windows, full blocks of most
  masks): the row is ``first .. end-1, 0 .. first-1, end .. cols-1``, a formula;
- a few occupied columns (partial blocks): the ``j``-th free column is ``j`` bumped past each
  occupied column in turn;
- anything else falls back to the stable sort, for those rows only.

Rows are handled in chunks small enough to stay in cache (about 2 MiB of int32).
"""
from __future__ import annotations

import torch

_FEW_OCCUPIED = 4  # rows with at most this many occupied columns use the bumping rule
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
    as_bytes = occupied.view(torch.uint8)
    torch.sum(as_bytes, dim=-1, dtype=torch.int32, out=num)
    n = num.view(rows, 1)
    first = as_bytes.argmax(dim=-1).to(torch.int32).view(rows, 1)  # first occupied column (0 if none)
    last = (cols - 1) - as_bytes.flip(-1).argmax(dim=-1).to(torch.int32).view(rows, 1)
    end = first + n
    contiguous = ((last + 1 == end) | (n == 0)).view(rows)
    # The run formula for every row; rows where it does not apply are overwritten below.
    shifted = p + first
    torch.where(shifted < end, shifted, torch.where(p < end, p - n, p), out=out)
    others = (~contiguous).nonzero().view(-1)
    if others.numel() == 0:
        return
    sub, sub_n = occupied[others], num[others].view(-1, 1).long()
    most = int(sub_n.max())
    if most > _FEW_OCCUPIED:
        out[others] = torch.argsort(sub.view(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
        return
    # occupied columns c_1 < ... < c_k of each row, padded with a column past the end
    at = sub.nonzero()
    row_start = torch.cumsum(sub_n.view(-1), 0) - sub_n.view(-1)
    rank = torch.arange(at.shape[0], device=at.device) - row_start[at[:, 0]]
    occupied_cols = torch.full((others.numel(), most), 2 * cols + most, dtype=torch.int32, device=at.device)
    occupied_cols[at[:, 0], rank] = at[:, 1].to(torch.int32)
    free = p - sub_n.to(torch.int32)  # at position n + j: free column number j, before bumping
    for i in range(most):
        free += free >= occupied_cols[:, i:i + 1]
    free[:, :most] = torch.where(p[:, :most] < sub_n, occupied_cols, free[:, :most])
    out[others] = free
