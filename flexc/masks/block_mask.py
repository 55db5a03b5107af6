"""``BlockMask``: a block-sparse mask's tables, read, sliced, moved, converted to torch's and printed.

The layout is torch 2.13's, name for name, so tensors and habits move between the two libraries:
per ``(b, h, q_block)`` row, ``kv_num_blocks`` counts the partial tiles (the kernel runs the mask_mod
there) and ``kv_indices`` lists their kv-block columns, valid entries first; ``full_kv_*`` do the
same for tiles where every element is allowed (the kernel skips the mask_mod); the ``q_*`` tables
are the transposes that backward passes walk. Tiles in neither table are never visited.

The BlockMask's builders live beside it: :mod:`flexc.masks.create` (``create_block_mask``,
``create_mask``), with their argument checks in :mod:`flexc.masks.mask_arguments`; its pictures in
:mod:`flexc.masks.pictures`, read from the ordered rows of :mod:`flexc.masks.ordered_rows`.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import torch

from ..device import is_gpu
from ..errors import AssertedValueError, InvalidValueError
from .gathered_rows import GatheredRow, gather, one_row_index
from .kv_tables import KV_TABLE_NAMES
from .mask_arguments import block_sizes, positive_int
from .mask_mods import noop_mask
from .ordered_rows import ascending_rows, disjoint, lower_bound
from .pictures import TEXT_LEGEND, cells_note, draw_classes, draw_counts, draw_pictures, grid_steps
from ..analysis.tiles import cdiv, dense_to_ordered, ordered_to_dense, transpose_ordered
from .table_lists import TableContents, row_contents
from ..versions import pinned, table_states

DEFAULT_BLOCK_SIZE = 128

_TABLE_NAMES = KV_TABLE_NAMES + ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
TENSOR_ATTRS = _TABLE_NAMES + ("dq_write_order", "dq_write_order_full", "dq_kv_order")


class _Derived:
    """Marks q-direction tables that are derived from the kv tables on first use."""

    def __repr__(self) -> str:
        return "DERIVED"


DERIVED = _Derived()


def _sliced_mask_mod_error(b, h, q_idx, kv_idx):
    """Stands in for the mask_mod of a sliced BlockMask, whose block rows no longer start at 0."""
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask: this mask_mod belongs to a sliced BlockMask: slicing with [] renumbers batches, heads or "
        "query blocks, so the original mask_mod no longer describes it. Fix: set "
        "`sliced.mask_mod` from the original BlockMask's mask_mod, adjusted for the slice "
        "(for example with a q_idx offset).")


# the fields every one-row slice starts with (BlockMask._bare_slice): no tables yet, lazy q tables
# (derived when asked for), no dQ orders, and a mask_mod that raises (its rows are renumbered)
_BARE_SLICE = {"_kv_tables": None, "lazy_rows": None, "_gathered": None, "_sliced_from": None, "_q_tables": None,
               "dq_write_order": None, "dq_write_order_full": None, "dq_kv_order": None,
               "mask_mod": _sliced_mask_mod_error}


def _table_property(direction: str, slot: int, doc: str) -> property:
    """Table ``slot`` of the ``direction`` ("kv" or "q") tables, read and set through them."""
    built, build, setter = f"_{direction}_tables", f"_{direction}", f"_set_{direction}"

    def read(self) -> torch.Tensor | None:  # (read several times a call: built tables without a method call)
        tables = getattr(self, built)
        return (tables if tables is not None else getattr(self, build)())[slot]
    return property(read, lambda self, value: getattr(self, setter)(slot, value), doc=doc)


class BlockMask:
    """A block-sparse attention mask in torch 2.13's layout (see the module docstring).

    Build one with :func:`create_block_mask`, :meth:`from_kv_blocks` or :meth:`from_torch`. All
    tables are int32 with leading batch dims ``[B, H]``; ``BLOCK_SIZE`` is ``(Q_BLOCK, KV_BLOCK)``
    and ``seq_lengths`` is ``(Q_LEN, KV_LEN)``. ``full_*`` tables are None when full tiles are not
    kept apart; ``q_*`` tables are None when not computed.

    The ``q_*`` tables (the transposes that backward walks) are built lazily: masks from
    :func:`create_block_mask`, :meth:`from_kv_blocks` and slicing derive them from the kv tables on
    first access (``block_mask.q_indices``, backward, :meth:`to_torch`), so decoding, which slices a
    mask every step and never needs them, does not pay for them. Pass :data:`DERIVED` as the four
    q tables to the constructor for the same behaviour.
    """

    def __init__(self, seq_lengths: tuple[int, int], kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 full_kv_num_blocks: torch.Tensor | None, full_kv_indices: torch.Tensor | None,
                 q_num_blocks: torch.Tensor | None, q_indices: torch.Tensor | None,
                 full_q_num_blocks: torch.Tensor | None, full_q_indices: torch.Tensor | None,
                 BLOCK_SIZE: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE),
                 mask_mod: Callable = noop_mask, *, dq_write_order: torch.Tensor | None = None,
                 dq_write_order_full: torch.Tensor | None = None, dq_kv_order: torch.Tensor | None = None,
                 dq_kv_order_spt: bool | None = None) -> None:
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() < 2:
            raise InvalidValueError(f"BlockMask must have at least 2 dimensions: kv_indices must be a tensor with at "
                                    f"least 2 dims [..., nQ, nKV], "
                                    f"got {kv_indices if not isinstance(kv_indices, torch.Tensor) else list(kv_indices.shape)}.")
        if not isinstance(kv_num_blocks, torch.Tensor):
            raise TypeError(f"BlockMask: kv_num_blocks must be a tensor, got {type(kv_num_blocks).__name__}.")
        q_tables = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
        derived = [t is DERIVED for t in q_tables]
        if any(derived) and not all(derived):
            raise ValueError("BlockMask: pass DERIVED for all four q tables (q_num_blocks, q_indices, "
                             "full_q_num_blocks, full_q_indices) or for none of them.")
        pairs = {"full_kv": (full_kv_num_blocks, full_kv_indices), "full_q": (full_q_num_blocks, full_q_indices)}
        for prefix, (num, idx) in pairs.items():
            if (num is None) != (idx is None):
                raise AssertedValueError(f"BlockMask: {prefix}_num_blocks and {prefix}_indices must be both "
                                         f"provided or omitted (given together or both None).")
        if dq_write_order_full is not None and dq_write_order is None:
            raise ValueError("BlockMask: dq_write_order_full requires dq_write_order.")
        self.seq_lengths = tuple(seq_lengths)
        self._kv_tables: tuple | None = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        # a one-row slice's tables as Python lists, its tables built from them on first access (see _row_slice)
        self.lazy_rows: TableContents | None = None
        # a one-row slice gathered on the device, its tables views of it made on first access (see _gathered_slice)
        self._gathered: GatheredRow | None = None
        self._sliced_from: tuple | None = None  # (see the property sliced_from)
        # None: derive from the kv tables on first access (see the class docstring)
        self._q_tables: tuple | None = None if all(derived) else q_tables
        self.dq_write_order, self.dq_write_order_full = dq_write_order, dq_write_order_full
        self.dq_kv_order, self.dq_kv_order_spt = dq_kv_order, dq_kv_order_spt
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod

    # -- the kv tables (a one-row slice builds them from its lists on first access) --
    def _kv(self) -> tuple:
        tables = self._kv_tables
        if tables is None and self._gathered is not None:
            # (no attribute of the mask changes: torch.compile may have guarded on them, and torch 2.11's
            # dynamo reads properties eagerly while it traces; a traced function makes the views again)
            return self._gathered.views() if torch.compiler.is_compiling() else self._gathered.tables()
        if tables is None:
            rows = self.lazy_rows
            tables = self._kv_tables = tuple(
                torch.tensor(values, dtype=dtype).view(shape) if values is not None else None
                for values, (shape, dtype) in zip((rows.counts, rows.indices, rows.full_counts, rows.full_indices),
                                                  (layout or ((), None) for layout in rows.layout)))
            # once built, the tensors are the truth (they may be edited in place): the lists are dropped
            self.lazy_rows = None
        return tables

    def _set_kv(self, slot: int, value: torch.Tensor | None) -> None:
        tables = list(self._kv())
        tables[slot] = value
        self._kv_tables = tuple(tables)
        self._sliced_from = None  # a table of other provenance

    @property
    def sliced_from(self) -> tuple | None:
        """A slice's provenance, ``(the parent's kv tables, their states then (pinned), this mask's
        tables' states then (pinned))``, None for a mask that is not an unedited slice: rows of tables
        found valid are valid, so validation needs no look at the contents (a gathered row's tables
        are made to say it)."""
        if self._kv_tables is None and self._gathered is not None:
            self._gathered.tables()
            return self._gathered.provenance
        return self._sliced_from

    @property
    def gathered_row(self) -> GatheredRow | None:
        """A one-row slice's row gathered on the device (:mod:`flexc.masks.gathered_rows`) while its
        tables were not asked for (so not edited: the decode launch reads the row itself); else None."""
        gathered = self._gathered
        return gathered if gathered is not None and self._kv_tables is None and gathered.made is None else None

    kv_num_blocks = _table_property("kv", 0, "int32 ``[B, H, nQ]``: partial kv blocks per query-block row.")
    kv_indices = _table_property("kv", 1, "int32 ``[B, H, nQ, nKV]``: their kv-block columns, valid entries first.")
    full_kv_num_blocks = _table_property("kv", 2, "int32 ``[B, H, nQ]``: full kv blocks per row, or None.")
    full_kv_indices = _table_property("kv", 3, "int32 ``[B, H, nQ, nKV]``: their columns, or None.")

    # -- the q-direction tables, derived on first use --
    def _q(self) -> tuple:
        if self._q_tables is None:
            q = transpose_ordered(self.kv_num_blocks, self.kv_indices)
            full = (transpose_ordered(self.full_kv_num_blocks, self.full_kv_indices)
                    if self.full_kv_num_blocks is not None else (None, None))
            self._q_tables = (*q, *full)
        return self._q_tables

    def _set_q(self, slot: int, value: torch.Tensor | None) -> None:
        tables = list(self._q())
        tables[slot] = value
        self._q_tables = tuple(tables)

    def _has_q_tables(self) -> bool:
        """Whether q tables exist (built or still to be derived), without building them."""
        return self._q_tables is None or self._q_tables[1] is not None

    q_num_blocks = _table_property("q", 0, "int32 ``[..., nKV]``: partial q blocks per kv block (derived on first use).")
    q_indices = _table_property("q", 1, "int32 ``[..., nKV, nQ]``: their q-block rows, valid entries first.")
    full_q_num_blocks = _table_property("q", 2, "int32 ``[..., nKV]``: full q blocks per kv block, or None.")
    full_q_indices = _table_property("q", 3, "int32 ``[..., nKV, nQ]``: their q-block rows, or None.")

    # -- construction --
    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                       full_kv_num_blocks: torch.Tensor | None = None, full_kv_indices: torch.Tensor | None = None,
                       BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE, mask_mod: Callable | None = None,
                       seq_lengths: tuple[int, int] | None = None, compute_q_blocks: bool = True, *,
                       dq_write_order: torch.Tensor | None = None, dq_write_order_full: torch.Tensor | None = None,
                       dq_kv_order: torch.Tensor | bool | None = None) -> "BlockMask":
        """A BlockMask from kv tables you computed; the q tables are derived (as torch does).

        ``seq_lengths`` defaults to the tables' extent in blocks times the block size.
        """
        where = "BlockMask.from_kv_blocks"
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() < 2:
            raise InvalidValueError(f"{where}: BlockMask must have at least 2 dimensions: kv_indices must be a "
                                    f"tensor with at least 2 dims [..., nQ, nKV].")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise AssertedValueError(f"{where}: full_kv_num_blocks and full_kv_indices must be given together or "
                                     f"both be None.")
        if kv_num_blocks.shape != kv_indices.shape[:-1]:
            raise ValueError(f"{where}: kv_num_blocks has shape {list(kv_num_blocks.shape)} but kv_indices "
                             f"{list(kv_indices.shape)}; expected kv_num_blocks to be kv_indices.shape[:-1].")
        block = block_sizes(where, BLOCK_SIZE)
        if dq_kv_order is not None and not isinstance(dq_kv_order, (bool, torch.Tensor)):
            raise TypeError(f"{where}: dq_kv_order must be a bool, a tensor or None, got {type(dq_kv_order).__name__}.")
        q_tables = (DERIVED,) * 4 if compute_q_blocks else (None,) * 4
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block[0], kv_indices.shape[-1] * block[1])
        return cls(tuple(seq_lengths), kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   *q_tables, BLOCK_SIZE=block, mask_mod=mask_mod if mask_mod is not None else noop_mask,
                   dq_write_order=dq_write_order, dq_write_order_full=dq_write_order_full,
                   dq_kv_order=dq_kv_order if isinstance(dq_kv_order, torch.Tensor) else None,
                   dq_kv_order_spt=dq_kv_order if isinstance(dq_kv_order, bool) else None)

    @classmethod
    def from_torch(cls, block_mask: Any) -> "BlockMask":
        """The same mask as flexc's BlockMask; tables are shared, not copied. The dQ order tables
        (``dq_write_order``, ``dq_kv_order``, ...) are read where the torch version has them (2.13; not 2.11)."""
        if not all(hasattr(block_mask, name) for name in _TABLE_NAMES + ("seq_lengths", "BLOCK_SIZE", "mask_mod")):
            raise TypeError(f"BlockMask.from_torch: expected a torch.nn.attention.flex_attention.BlockMask, "
                            f"got {type(block_mask).__name__}.")
        tables = {name: getattr(block_mask, name, None) for name in TENSOR_ATTRS}
        return cls(block_mask.seq_lengths, **tables, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                   mask_mod=_mask_mod_from_torch(block_mask.mask_mod),
                   dq_kv_order_spt=getattr(block_mask, "dq_kv_order_spt", None))

    def to_torch(self) -> Any:
        """The same mask as torch's BlockMask (needs torch's FlexAttention); tables are shared.

        The dQ order tables and ``dq_kv_order_spt`` (metadata for torch 2.13's FLASH backward) go
        along where the installed torch's BlockMask takes them; torch 2.11's has no such fields and
        no kernel that reads them, so there they are left out and the mask is the same."""
        try:
            from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
        except ImportError as e:  # pragma: no cover - torch without FlexAttention
            raise RuntimeError(f"BlockMask.to_torch needs torch.nn.attention.flex_attention: {e}") from None
        extras = {name: getattr(self, name) for name in _DQ_ORDER_FIELDS if _torch_has_dq_orders()}
        return TorchBlockMask(self.seq_lengths, *(getattr(self, name) for name in _TABLE_NAMES),
                              BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=_mask_mod_to_torch(self.mask_mod), **extras)

    # -- views --
    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch_dims, Q_LEN, KV_LEN)``, e.g. ``(B, H, Q_LEN, KV_LEN)``."""
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    def numel(self) -> int:
        """Elements of the logical mask, ignoring sparsity."""
        return math.prod(self.shape)

    def to_dense(self) -> torch.Tensor:
        """int32 ``[..., nQ, nKV]``: 1 for every tile that is computed (partial or full)."""
        dense = ordered_to_dense(self.kv_num_blocks, self.kv_indices, self.kv_indices.shape[-1])
        if self.full_kv_num_blocks is not None:
            dense = dense | ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices,
                                             self.full_kv_indices.shape[-1])
        return dense

    def _tile_classes(self) -> torch.Tensor:
        """int64 ``[..., nQ, nKV]``: 0 empty, 1 partial (runs the mask_mod), 2 full."""
        classes = ordered_to_dense(self.kv_num_blocks, self.kv_indices, self.kv_indices.shape[-1]).to(torch.int64)
        if self.full_kv_num_blocks is not None:
            full = ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, self.full_kv_indices.shape[-1])
            classes = classes + 2 * full.to(torch.int64)
        return classes

    def sparsity(self) -> float:
        """Percentage of the mask's elements that lie in skipped tiles.

        Exact for any lengths: a ragged edge tile counts only its in-range elements, so the result
        stays in [0, 100] (torch counts whole tiles and goes negative for ragged lengths). Read from
        the tables' counts, never a dense tile grid, for the ordered tables that create_block_mask,
        from_kv_blocks and torch build; other tables (repeated or unsorted columns, a tile both
        partial and full) are counted on the dense grid, tile by tile as their union.
        """
        total = self.numel()
        if total == 0:
            return 0.0
        computed = self._computed_elements()
        if computed is None:
            computed = self._computed_elements_dense()
        return 100.0 * (1.0 - computed / total)

    def _ordered_tables(self, index: tuple = ...) -> list | None:
        """``[(entries, counts)]`` (see :func:`ascending_rows`) of the partial and, if kept apart,
        the full table at ``index`` of the batch dims; None unless the tables are ordered (every row's
        valid entries ascending columns in range, no tile in both tables, the two tables one shape)."""
        tables = [(self.kv_num_blocks, self.kv_indices)]
        if self.full_kv_num_blocks is not None:
            tables.append((self.full_kv_num_blocks, self.full_kv_indices))
            if tables[1][0].shape != tables[0][0].shape or tables[1][1].shape != tables[0][1].shape:
                return None
        ordered = [ascending_rows(num[index], idx[index]) for num, idx in tables]
        if any(rows is None for rows in ordered):
            return None
        if len(ordered) == 2 and not disjoint(*ordered, tables[0][1].shape[-1]):
            return None
        return ordered

    def _computed_elements(self) -> int | None:
        """Elements inside computed tiles, from the counts; None when the tables are not ordered."""
        ordered = self._ordered_tables()
        if ordered is None:
            return None
        (q_block, kv_block), (q_len, kv_len) = self.BLOCK_SIZE, self.seq_lengths
        nq, width = self.kv_indices.shape[-2:]
        if nq == 0 or ordered[0][1].numel() == 0:
            return 0
        short = kv_len // kv_block  # columns from here on hold fewer than kv_block in-range elements
        per_row = 0
        for entries, counts in ordered:
            elements = counts * kv_block
            if short < width:
                # entries ascend: the ragged column `short` and those past kv_len are the last ones
                below = lower_bound(entries, counts, torch.tensor([short, short + 1], device=entries.device))
                at_short, past = below[:, 1] - below[:, 0], counts - below[:, 1]
                elements = elements - at_short * (kv_block - (kv_len - short * kv_block)) - past * kv_block
            per_row = per_row + elements
        starts_q = torch.arange(nq, device=per_row.device) * q_block
        rows = (q_len - starts_q).clamp(0, q_block)
        return int((per_row.view(-1, nq) * rows).sum())

    def _computed_elements_dense(self) -> int:
        dense = self.to_dense().to(torch.int64)
        (q_block, kv_block), (q_len, kv_len) = self.BLOCK_SIZE, self.seq_lengths
        starts_q = torch.arange(dense.shape[-2], device=dense.device) * q_block
        starts_kv = torch.arange(dense.shape[-1], device=dense.device) * kv_block
        rows = (q_len - starts_q).clamp(0, q_block)
        cols = (kv_len - starts_kv).clamp(0, kv_block)
        return int((dense * rows[:, None] * cols[None, :]).sum())

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4, *, legend: bool = False) -> str:
        """An ASCII picture per (batch, head) that tells full, partial and empty tiles apart.

        Each cell covers a group of tiles: ``██`` all full (mask_mod skipped), two spaces all empty
        (never visited), ``░░`` anything else (some tile runs the mask_mod, or the group is mixed).
        torch draws computed tiles as ``██`` whether full or partial; flexc shows which pay for the
        mask_mod. ``grid_size`` caps the cells per side (-1: one cell per tile); ``limit`` caps the
        pictures. Cells are counted from the tables of the pictures drawn, without a dense tile grid
        (the grid is used for tables that are not ordered; see :meth:`sparsity`). ``legend=True``
        adds the key to the glyphs (:data:`TEXT_LEGEND`) as a last line; by default the text has
        torch's lines, in number and order, so tools and tests that read torch's text read flexc's.
        When a cell covers several tiles, ``legend=True`` also draws ``▓▓`` for a cell that holds
        full tiles among others (``░░`` in torch's layout, where a full tile would not show) and
        says how many tiles a cell covers (:func:`cells_note`).
        """
        text = self._pictures_text(grid_size, limit, mark_full=legend)
        if not legend:
            return text
        steps = grid_steps(*self.kv_indices.shape[-2:], grid_size)
        return f"{text.rstrip()}\n{TEXT_LEGEND}\n" + (f"{cells_note(*steps)}\n" if steps != (1, 1) else "")

    def _pictures_text(self, grid_size: int | tuple[int, int], limit: int, mark_full: bool = False) -> str:
        *batch_dims, rows, cols = self.kv_indices.shape
        if self.full_kv_indices is not None and self.full_kv_indices.shape != self.kv_indices.shape:
            return self._to_string_dense(grid_size, limit, mark_full)
        row_step, col_step = grid_steps(rows, cols, grid_size)

        def draw(index):
            ordered = self._ordered_tables(index) if rows and cols else None
            return None if ordered is None else draw_counts(ordered, rows, cols, row_step, col_step, mark_full)
        pictures = draw_pictures(batch_dims, limit, draw)
        return self._to_string_dense(grid_size, limit, mark_full) if pictures is None else pictures

    def _to_string_dense(self, grid_size: int | tuple[int, int], limit: int, mark_full: bool = False) -> str:
        dense = self._tile_classes().cpu()
        *batch_dims, rows, cols = dense.shape
        row_step, col_step = grid_steps(rows, cols, grid_size)
        return draw_pictures(batch_dims, limit, lambda index: draw_classes(dense[index], row_step, col_step, mark_full))

    def __str__(self) -> str:
        # torch's layout line for line (torch's own tests count them); to_string(legend=True) and
        # flexc.plot carry the key to the glyphs
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self) -> str:
        def shape_of(t):
            return t.shape if t is not None else None

        shapes = {name: shape_of(getattr(self, name)) for name in _TABLE_NAMES[:4]}
        if self._q_tables is None:  # the shapes the derived tables will have, without deriving them
            *batch, nq, nkv = self.kv_indices.shape
            for prefix in ("", "full_"):
                present = shapes[f"{prefix}kv_num_blocks"] is not None
                shapes[f"{prefix}q_num_blocks"] = torch.Size([*batch, nkv]) if present else None
                shapes[f"{prefix}q_indices"] = torch.Size([*batch, nkv, nq]) if present else None
        else:
            shapes.update({name: shape_of(getattr(self, name)) for name in _TABLE_NAMES[4:]})
        lines = [f"    {name}={shapes[name]}," for name in _TABLE_NAMES]
        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        return ("BlockMask(\n" + "\n".join(lines) + f"\n    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},"
                f"\n    sparsity={self.sparsity():.2f}%,\n    mask_mod={name}\n)")

    def as_tuple(self, flatten: bool = True) -> tuple:
        """The installed torch's tuple: in 2.13 17 fields (lengths, 8 tables, 4 dQ-order fields, block
        sizes, mask_mod), in 2.11 13 (no dQ-order fields); with ``flatten=False`` the lengths and
        block sizes stay pairs (15 or 11 fields)."""
        lengths = tuple(self.seq_lengths) if flatten else (tuple(self.seq_lengths),)
        blocks = tuple(self.BLOCK_SIZE) if flatten else (tuple(self.BLOCK_SIZE),)
        orders = tuple(getattr(self, name) for name in _DQ_ORDER_FIELDS) if _torch_has_dq_orders() else ()
        return (*lengths, *(getattr(self, n) for n in _TABLE_NAMES), *orders, *blocks, self.mask_mod)

    # -- derived masks --
    def __getitem__(self, index: Any) -> "BlockMask":
        """Select batches, heads and query-block rows; integer indices keep their dim (as torch).

        The result's mask_mod raises when called: its rows are renumbered, so the original mod no
        longer describes it. Reattach an adjusted mod if the kernel needs one.
        """
        if (type(index) is tuple and len(index) == 3 and self.dq_kv_order is None
                and not torch.compiler.is_compiling()):
            t = one_row_index(index)
            if t is not None:  # decoding's block_mask[:, :, pos // 128], every step: straight to the row
                tables = self._kv_tables
                if tables is None:
                    tables = self._kv()
                # (an index on a GPU stays there: _row_of reads none)
                row = _row_of(t, tables[0].shape[2]) if t.is_cpu else None
                sliced = self._row_slice(row) if row is not None else None
                if sliced is None:  # (an index on a GPU, or rows too large for lists)
                    sliced = self._gathered_slice(t, tables)
                if sliced is not None:
                    return sliced
        if self.dq_kv_order is not None:
            raise NotImplementedError("BlockMask.__getitem__: slicing a mask with a tensor dq_kv_order is not "
                                      "supported; build the sliced mask with from_kv_blocks instead.")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask.__getitem__: at most 3 indices (batch, head, q-block row), got {len(index)}.")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kv_num_blocks.shape[:3]
        index = tuple(_keep_dim(i, n) for i, n in zip(padded, sizes))
        t = one_row_index(index) if not torch.compiler.is_compiling() else None
        row = _row_of(t, sizes[2]) if t is not None else None
        if row is not None:  # decoding's block_mask[:, :, pos // 128]
            sliced = self._row_slice(row)
            if sliced is not None:
                return sliced
            take = lambda table: table.index_select(2, index[2])  # noqa: E731
        else:
            take = lambda table: table[index]  # noqa: E731
        full = ((take(self.full_kv_num_blocks), take(self.full_kv_indices))
                if self.full_kv_num_blocks is not None else (None, None))
        # (from_kv_blocks' argument checks hold for slices of a BlockMask's tables)
        sliced = BlockMask(self.seq_lengths, take(self.kv_num_blocks), take(self.kv_indices), *full,
                           *(((DERIVED,) * 4) if self._has_q_tables() else ((None,) * 4)), BLOCK_SIZE=self.BLOCK_SIZE,
                           mask_mod=_sliced_mask_mod_error, dq_kv_order_spt=self.dq_kv_order_spt)
        if not torch.compiler.is_compiling():  # (eager caches' provenance: no tensor identities in a graph,
            parent = self._kv()                # and dynamo 2.11 cannot take id() of a tensor made in one)
            own = sliced._kv()
            sliced._sliced_from = (parent, self._pinned_states(parent), pinned(table_states(own), own))
        return sliced

    def _pinned_states(self, tables: tuple) -> tuple:
        """``pinned(table_states(tables))`` of this mask's kv ``tables``, made once per state: a
        decoding loop slices the same unchanged tables every step."""
        states = table_states(tables)
        kept = getattr(self, "_kept_states", None)
        if kept is None or kept[0] is not tables or kept[1] != states:
            kept = self._kept_states = (tables, pinned(states, tables))
        return kept[1]

    def _row_slice(self, row: int) -> "BlockMask | None":
        """``self[:, :, row]`` of a CPU mask with small rows, as lists read once per row and table state.

        A decoding loop slices the same row for every token of a query block; the slice is then
        a few attribute writes, and the tables of the result (the lists in ``lazy_rows``, which
        validation and the decode path read directly) become tensors only when someone asks for
        them. The lists are a copy, as slicing with a tensor index is in torch. None when the
        tables are on another device or the rows too large (the caller slices the tensors).
        """
        if self.dq_kv_order is not None:
            return None
        rows = row_contents(self._kv(), row)
        if rows is None:
            return None
        sliced = self._bare_slice()
        sliced.lazy_rows = rows
        return sliced

    def _gathered_slice(self, index: torch.Tensor, tables: tuple) -> "BlockMask | None":
        """``self[:, :, index]`` (``index`` a one-element tensor) gathered in one device op
        (:mod:`flexc.masks.gathered_rows`), no host read of ``index``: decoding's step on a GPU. The
        result's tables are views of its own copy of the row, made when someone asks for them (the
        decode kernel reads them directly). None for tables that path does not serve. ``tables``: this
        mask's kv tables."""
        row, self._stacked_rows = gather(tables, getattr(self, "_stacked_rows", None), index)
        if row is None:
            return None
        sliced = self._bare_slice()
        sliced._gathered = row  # (its provenance is made with its tables: see _kv)
        return sliced

    def _bare_slice(self) -> "BlockMask":
        """A one-row slice of this mask without its tables yet (the caller sets ``lazy_rows`` or
        ``_gathered``), made field by field: a decoding step makes one, and its tables are rows of
        tables already checked."""
        sliced = BlockMask.__new__(BlockMask)
        sliced.__dict__.update(_BARE_SLICE)
        sliced.seq_lengths, sliced.BLOCK_SIZE, sliced.dq_kv_order_spt = (self.seq_lengths, self.BLOCK_SIZE,
                                                                         self.dq_kv_order_spt)
        if not self._has_q_tables():
            sliced._q_tables = (None,) * 4
        return sliced

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The upper-left ``new_q_len x new_kv_len`` corner, keeping the mask_mod (torch's private helper).

        Tiles outside the new extent are dropped from every row. (torch 2.13 only crops the tables
        and recounts, which can keep a dropped tile valid when a row has blocks past the new edge.)
        """
        new_q_len = positive_int("BlockMask._adjust", "new_q_len", new_q_len)
        new_kv_len = positive_int("BlockMask._adjust", "new_kv_len", new_kv_len)
        if self.dq_kv_order is not None:
            raise NotImplementedError("BlockMask._adjust: masks with a tensor dq_kv_order are not supported.")
        rows, cols = cdiv(new_q_len, self.BLOCK_SIZE[0]), cdiv(new_kv_len, self.BLOCK_SIZE[1])

        def crop(num, idx):
            if num is None:
                return None, None
            dense = ordered_to_dense(num, idx, idx.shape[-1])[..., :rows, :cols]
            return dense_to_ordered(dense)

        adjusted = BlockMask.from_kv_blocks(*crop(self.kv_num_blocks, self.kv_indices),
                                            *crop(self.full_kv_num_blocks, self.full_kv_indices),
                                            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                                            seq_lengths=(new_q_len, new_kv_len),
                                            compute_q_blocks=self._has_q_tables())
        adjusted.dq_kv_order_spt = self.dq_kv_order_spt
        return adjusted

    def to(self, device: torch.device | str) -> "BlockMask":
        """A new BlockMask with every table on ``device``."""
        # still-lazy q tables stay lazy on the new device; a meta device cannot derive them (the
        # derivation reads values), so they are built here first
        lazy = self._q_tables is None and torch.device(device).type != "meta"
        moved = {n: DERIVED if lazy and n.startswith(("q_", "full_q_")) else
                 (t.to(device) if isinstance(t, torch.Tensor) else t)
                 for n, t in ((n, None if lazy and n.startswith(("q_", "full_q_")) else getattr(self, n))
                              for n in TENSOR_ATTRS)}
        return BlockMask(self.seq_lengths, **moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                         dq_kv_order_spt=self.dq_kv_order_spt)


def _row_of(i: torch.Tensor, rows: int) -> int | None:
    """The row a one-element integer tensor ``i`` holds if it is on the CPU and in ``[0, rows)``, else None
    (negative or out-of-range values are left to advanced indexing, which wraps or raises IndexError)."""
    # (a GPU's index stays on the device: reading it would be a sync; simulated GPUs take that path too)
    if i.is_cpu and not is_gpu(i.device):
        row = int(i)
        return row if 0 <= row < rows else None
    return None


def _keep_dim(i: Any, n: int) -> Any:
    """An int index as a length-1 slice, so indexing keeps the dim (torch's BlockMask rule)."""
    if isinstance(i, bool) or not isinstance(i, int):
        return i
    if not -n <= i < n:
        raise IndexError(f"BlockMask index {i} is out of range for a dimension of size {n}.")
    i = i + n if i < 0 else i
    return slice(i, i + 1)


# torch 2.13's BlockMask fields for its FLASH backward, which torch 2.11's BlockMask does not have
_DQ_ORDER_FIELDS = ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")


@functools.lru_cache(maxsize=None)
def _torch_has_dq_orders() -> bool:
    """Whether the installed torch's BlockMask takes the dQ-order fields (read from its signature)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return False
    return set(_DQ_ORDER_FIELDS) <= set(inspect.signature(TorchBlockMask.__init__).parameters)


def _mask_mod_to_torch(mod: Callable) -> Callable:
    from torch.nn.attention import flex_attention as tfa

    return {noop_mask: tfa.noop_mask, _sliced_mask_mod_error: tfa._sliced_mask_mod_error}.get(mod, mod)


def _mask_mod_from_torch(mod: Callable) -> Callable:
    try:
        from torch.nn.attention import flex_attention as tfa
    except ImportError:  # pragma: no cover
        return mod
    return {tfa.noop_mask: noop_mask, tfa._sliced_mask_mod_error: _sliced_mask_mod_error}.get(mod, mod)
