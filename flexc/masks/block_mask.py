"""``BlockMask`` and the functions that build masks: ``create_block_mask`` and ``create_mask``.

The layout is torch 2.13's, name for name, so tensors and habits move between the two libraries:
per ``(b, h, q_block)`` row, ``kv_num_blocks`` counts the partial tiles (the kernel runs the mask_mod
there) and ``kv_indices`` lists their kv-block columns, valid entries first; ``full_kv_*`` do the
same for tiles where every element is allowed (the kernel skips the mask_mod); the ``q_*`` tables
are the transposes that backward passes walk. Tiles in neither table are never visited.

``create_block_mask`` never builds the dense ``[B, H, Q_LEN, KV_LEN]`` mask. It traces the
mask_mod, lets analysis decide what tiles it can (:func:`_classify_tiles`), and evaluates only the
remaining tiles exactly, a bounded batch at a time.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Sequence

import torch

from ..analysis import bounds
from .. import device as gpu
from ..device import is_gpu
from ..errors import AssertedValueError, InvalidValueError
from .kv_tables import KV_TABLE_NAMES
from .mask_mods import noop_mask
from ..analysis.tiles import (EMPTY, FULL, PARTIAL, UNDECIDED, cdiv, dense_mask, dense_to_ordered,
                    evaluate_tiles, ordered_to_dense, ragged_tiles, reads_input, transpose_ordered)
from ..analysis.ranges import MIXED
from ..mods.trace import MASK_MOD, TracedMod, mod_kind, trace
from ..mods.traced_mod import check_captured
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


# ---- argument checking ----------------------------------------------------------------------

def _positive_int(where: str, name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
            value = int(value)
        else:
            expected = "a positive int or None" if allow_none else "a positive int"
            raise TypeError(f"{where}: {name} must be {expected}, got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{where}: {name} must be positive, got {value}. Fix: pass a length or "
                         f"size of at least 1{' (or None to broadcast)' if allow_none else ''}.")
    return value


def _block_sizes(where: str, BLOCK_SIZE: Any) -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"{where}: BLOCK_SIZE must be an int or a (Q_BLOCK, KV_BLOCK) pair, got "
                             f"{len(BLOCK_SIZE)} values {tuple(BLOCK_SIZE)!r}.")
        return (_positive_int(where, "BLOCK_SIZE[0] (the q block)", BLOCK_SIZE[0]),
                _positive_int(where, "BLOCK_SIZE[1] (the kv block)", BLOCK_SIZE[1]))
    size = _positive_int(where, "BLOCK_SIZE", BLOCK_SIZE)
    return size, size


def _resolve_device(device: Any, traced: TracedMod, where: str = "create_block_mask") -> torch.device:
    """``device`` as torch means it (``"cuda"``: the current CUDA device), checked usable; None: the
    device of the tensors the mod captured, else a usable accelerator, else the CPU
    (:func:`flexc.device.default_device`, which the compiled ``create_block_mask`` follows too).
    (torch picks the accelerator even when the mod's tensors live elsewhere, which then fails;
    following the captured tensors builds the mask where its data is.)"""
    return gpu.default_device(traced.buffers) if device is None else gpu.usable(device, where)


def _check_captured_sizes(where: str, traced: TracedMod, extents: dict[str, tuple[str, int]]) -> None:
    """Reject sizes a captured tensor cannot serve, e.g. ``B=4`` with ``doc_ids[b, q_idx]`` of 2 rows.

    Only direct indexing by a mod argument is checked; computed indices are left to evaluation.
    """
    for node in traced.root.walk():
        if node.op != "load":
            continue
        slot = node.args[0].attr[0]
        tensor = traced.buffers[slot]
        for dim, index in enumerate(node.args[1:]):
            if index.op != "input" or index.attr not in extents:
                continue
            arg, extent = extents[index.attr]
            size = tensor.shape[dim]
            if extent > size:
                name = traced.buffer_names[slot] if slot < len(traced.buffer_names) else f"buf{slot}"
                raise ValueError(
                    f"{where}: {arg}={extent}, but {traced.name} indexes the captured tensor `{name}` "
                    f"(shape {list(tensor.shape)}) with `{index.attr}` in dimension {dim}, which has only "
                    f"{size} entries. Fix: pass {arg}={size} or less"
                    f"{' (None broadcasts as 1)' if arg in ('B', 'H') else ''}, or capture a tensor sized for "
                    f"{arg}={extent}.")


def _trace_as(where: str, mod: Callable, kinds: tuple[str, ...]) -> TracedMod:
    if isinstance(mod, TracedMod):
        traced = mod
    else:
        if not callable(mod):
            raise TypeError(f"{where}: expected a mask_mod function (b, h, q_idx, kv_idx), got "
                            f"{type(mod).__name__} {mod!r}.")
        kind = mod_kind(mod)
        if kind not in kinds:
            raise TypeError(
                f"{where}: mask_mod must be a mask_mod (b, h, q_idx, kv_idx) -> bool, but "
                f"{getattr(mod, '__name__', mod)!r} is a score_mod (score, b, h, q_idx, kv_idx). Fix: "
                f"write the condition as a mask_mod, or use create_mask(score_mod, ...) for a dense mask.")
        traced = trace(mod, kind=kind)
    if traced.kind not in kinds:
        raise TypeError(f"{where}: expected a mask_mod, got a traced {traced.kind} {traced.name}.")
    return traced


# ---- the BlockMask --------------------------------------------------------------------------

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
        # a slice's provenance, (parent's kv tables, their write counts, this mask's write counts) when
        # sliced: rows of tables found valid are valid, so validation needs no look at the contents
        self.sliced_from: tuple | None = None
        # None: derive from the kv tables on first access (see the class docstring)
        self._q_tables: tuple | None = None if all(derived) else q_tables
        self.dq_write_order, self.dq_write_order_full = dq_write_order, dq_write_order_full
        self.dq_kv_order, self.dq_kv_order_spt = dq_kv_order, dq_kv_order_spt
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod

    # -- the kv tables (a one-row slice builds them from its lists on first access) --
    def _kv(self) -> tuple:
        tables = self._kv_tables
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
        self.sliced_from = None  # a table of other provenance

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
        block = _block_sizes(where, BLOCK_SIZE)
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
        """``[(entries, counts)]`` (see :func:`_ascending_rows`) of the partial and, if kept apart,
        the full table at ``index`` of the batch dims; None unless the tables are ordered (every row's
        valid entries ascending columns in range, no tile in both tables, the two tables one shape)."""
        tables = [(self.kv_num_blocks, self.kv_indices)]
        if self.full_kv_num_blocks is not None:
            tables.append((self.full_kv_num_blocks, self.full_kv_indices))
            if tables[1][0].shape != tables[0][0].shape or tables[1][1].shape != tables[0][1].shape:
                return None
        ordered = [_ascending_rows(num[index], idx[index]) for num, idx in tables]
        if any(rows is None for rows in ordered):
            return None
        if len(ordered) == 2 and not _disjoint(*ordered, tables[0][1].shape[-1]):
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
                below = _lower_bound(entries, counts, torch.tensor([short, short + 1], device=entries.device))
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
        steps = _grid_steps(*self.kv_indices.shape[-2:], grid_size)
        return f"{text.rstrip()}\n{TEXT_LEGEND}\n" + (f"{cells_note(*steps)}\n" if steps != (1, 1) else "")

    def _pictures_text(self, grid_size: int | tuple[int, int], limit: int, mark_full: bool = False) -> str:
        *batch_dims, rows, cols = self.kv_indices.shape
        if self.full_kv_indices is not None and self.full_kv_indices.shape != self.kv_indices.shape:
            return self._to_string_dense(grid_size, limit, mark_full)
        row_step, col_step = _grid_steps(rows, cols, grid_size)

        def draw(index):
            ordered = self._ordered_tables(index) if rows and cols else None
            return None if ordered is None else _draw_counts(ordered, rows, cols, row_step, col_step, mark_full)
        pictures = _pictures(batch_dims, limit, draw)
        return self._to_string_dense(grid_size, limit, mark_full) if pictures is None else pictures

    def _to_string_dense(self, grid_size: int | tuple[int, int], limit: int, mark_full: bool = False) -> str:
        dense = self._tile_classes().cpu()
        *batch_dims, rows, cols = dense.shape
        row_step, col_step = _grid_steps(rows, cols, grid_size)
        return _pictures(batch_dims, limit, lambda index: _draw(dense[index], row_step, col_step, mark_full))

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
            # decoding's block_mask[:, :, pos // 128], every step: straight to the row
            row = _one_row(index, self._kv()[0].shape[2])
            sliced = self._row_slice(row) if row is not None else None
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
        row = _one_row(index, sizes[2]) if not torch.compiler.is_compiling() else None
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
            sliced.sliced_from = (parent, pinned(table_states(parent), parent), pinned(table_states(own), own))
        return sliced

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
        sliced = BlockMask.__new__(BlockMask)
        sliced.seq_lengths, sliced._kv_tables, sliced.lazy_rows = self.seq_lengths, None, rows
        sliced._q_tables = None if self._has_q_tables() else (None,) * 4
        sliced.dq_write_order = sliced.dq_write_order_full = sliced.dq_kv_order = None
        sliced.dq_kv_order_spt, sliced.BLOCK_SIZE = self.dq_kv_order_spt, self.BLOCK_SIZE
        sliced.mask_mod = _sliced_mask_mod_error
        return sliced

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The upper-left ``new_q_len x new_kv_len`` corner, keeping the mask_mod (torch's private helper).

        Tiles outside the new extent are dropped from every row. (torch 2.13 only crops the tables
        and recounts, which can keep a dropped tile valid when a row has blocks past the new edge.)
        """
        new_q_len = _positive_int("BlockMask._adjust", "new_q_len", new_q_len)
        new_kv_len = _positive_int("BlockMask._adjust", "new_kv_len", new_kv_len)
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


_ALL = slice(None)
_ROW_DTYPES = (torch.int64, torch.int32)


def _one_row(index: tuple, rows: int) -> int | None:
    """The row ``r`` when ``index`` is ``[:, :, t]`` with ``t`` a one-element CPU integer tensor
    holding ``r`` in ``[0, rows)``, else None (negative or out-of-range values are left to advanced
    indexing, which wraps or raises IndexError)."""
    i = index[2]
    # (a GPU's index stays on the device: reading it would be a sync; simulated GPUs take that path too)
    if (index[0] == index[1] == _ALL and type(i) is torch.Tensor and i.is_cpu and not is_gpu(i.device)
            and i.dim() == 1 and i.numel() == 1 and i.dtype in _ROW_DTYPES):
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


def _pictures(batch_dims: Sequence[int], limit: int, draw: Callable) -> str | None:
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


def _grid_steps(rows: int, cols: int, grid_size: int | tuple[int, int]) -> tuple[int, int]:
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


def _draw(classes: torch.Tensor, row_step: int, col_step: int, mark_full: bool = False) -> str:
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


def _draw_counts(ordered: list, rows: int, cols: int, row_step: int, col_step: int, mark_full: bool = False) -> str:
    """:func:`_draw` of one picture from its ordered tables (``[(entries, counts)]``, partial then
    full, ``rows`` rows each): the tiles of each table per cell, counted by searching the cells'
    column bounds in every row and summing the rows of each group. A cell is all full when the full
    table holds every one of its tiles."""
    r, c = cdiv(rows, row_step), cdiv(cols, col_step)
    device = ordered[0][0].device
    bounds = (torch.arange(c + 1, device=device) * col_step).clamp(max=cols)
    per_cell = []
    for entries, counts in ordered:
        per_row = _lower_bound(entries, counts, bounds).diff(dim=1)
        per_row = torch.nn.functional.pad(per_row, (0, 0, 0, r * row_step - rows))
        per_cell.append(per_row.view(r, row_step, c).sum(1))
    tiles_down = (rows - torch.arange(r, device=device) * row_step).clamp(max=row_step)
    tiles_across = (cols - torch.arange(c, device=device) * col_step).clamp(max=col_step)
    full = per_cell[1] if len(per_cell) == 2 else torch.zeros_like(per_cell[0])
    return _cells(per_cell[0] + full > 0, full == tiles_down[:, None] * tiles_across[None, :],
                  full > 0 if mark_full else None)


# rows of an ordered table checked per chunk of about this many entries (the temporaries stay in cache)
_CHUNK_ENTRIES = 1 << 19
_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _ascending_rows(num: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One table pair (``num [..., nQ]``, ``idx [..., nQ, W]``) as ``(entries [rows, n], counts
    [rows])``: a row per leading index and query block, ``n`` the longest count, counts clamped to
    ``[0, W]`` as :func:`~flexc.analysis.tiles.ordered_to_dense` reads them. ``entries`` is a view of ``idx``
    where it can be; only the first ``n`` entries of a row are read (a sliding window at a million
    tokens: a few of 8192).

    None unless every row's valid entries are distinct columns of ``[0, W)`` in ascending order, as
    create_block_mask, dense_to_ordered and torch write them.
    """
    if num.shape != idx.shape[:-1] or num.dtype not in _INDEX_DTYPES or idx.dtype not in _INDEX_DTYPES:
        return None
    width, rows = idx.shape[-1], num.numel()
    counts = num.reshape(rows).to(torch.int64).clamp(0, width)
    n = int(counts.max()) if rows else 0
    entries = idx[..., :n].reshape(rows, n)
    if n == 0:
        return entries, counts
    # ascending, so in range when the first entry is not negative and the last below W
    first, last = entries[:, 0], entries.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    if bool(((counts > 0) & ((first < 0) | (last >= width))).any()):
        return None
    step = max(1, _CHUNK_ENTRIES // n)
    for r0 in range(0, rows if n > 1 else 0, step):
        chunk = entries[r0:r0 + step]
        descent = chunk[:, 1:] <= chunk[:, :-1]
        # the first descent in each row must lie past the row's valid entries
        at = descent.view(torch.uint8).argmax(1)
        if bool((descent.gather(1, at[:, None])[:, 0] & (at < counts[r0:r0 + step] - 1)).any()):
            return None
    return entries, counts


def _lower_bound(entries: torch.Tensor, counts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows, m]``: per row, how many of its valid entries (the first ``counts``, ascending)
    are below each of ``values`` (``[rows, m]`` or ``[m]``); a binary search of all rows at once."""
    rows, n = entries.shape
    shape = (rows, values.shape[-1])
    lo = torch.zeros(shape, dtype=torch.int64, device=entries.device)
    hi = counts[:, None].expand(shape).clone()
    for _ in range(n.bit_length()):  # each step at least halves every row's interval
        mid = (lo + hi) >> 1
        active = lo < hi
        below = entries.gather(1, mid.clamp(max=n - 1)) < values
        lo = torch.where(active & below, mid + 1, lo)
        hi = torch.where(active & ~below, mid, hi)
    return lo


def _disjoint(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], width: int) -> bool:
    """Whether no row of two ordered tables (``(entries, counts)``, :func:`_ascending_rows`) holds
    one column in both."""
    (a, a_counts), (b, b_counts) = a, b
    if a.shape[1] == 0 or b.shape[1] == 0:
        return True
    if a.shape[1] > b.shape[1]:
        (a, a_counts), (b, b_counts) = (b, b_counts), (a, a_counts)
    a_valid = torch.arange(a.shape[1], device=a.device) < a_counts[:, None]
    if a.shape[1] * b.shape[1].bit_length() * 4 <= width:
        # few entries against many columns: search the narrower table's entries in the wider one
        at = _lower_bound(b, b_counts, a)
        found = (at < b_counts[:, None]) & (b.gather(1, at.clamp(max=b.shape[1] - 1)) == a)
        return not bool((found & a_valid).any())
    # both wide: mark one table's columns a chunk of rows at a time and look the other's up
    b_valid = torch.arange(b.shape[1], device=b.device) < b_counts[:, None]
    step = max(1, _CHUNK_ENTRIES // (width + 1))
    for r0 in range(0, a.shape[0], step):
        rows = slice(r0, r0 + step)
        marks = torch.zeros(a[rows].shape[0], width + 1, dtype=torch.uint8, device=a.device)
        marks.scatter_(1, torch.where(a_valid[rows], a[rows].long(), width), 1)
        marked = marks.gather(1, torch.where(b_valid[rows], b[rows].long(), width)).bool()
        if bool((marked & b_valid[rows]).any()):
            return False
    return True


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


# ---- building masks ---------------------------------------------------------------------------

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
    :func:`flexc.create_block_mask` (:func:`flexc.torch_compile.under_compile.create_block_mask`)
    builds the tables in one custom-op node and calls this outside the graph.

    >>> bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 256, 256)
    >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
    ([[[1, 1]]], [[[0, 1]]])
    """
    where = "create_block_mask"
    traced = _trace_as(where, mask_mod, (MASK_MOD,))
    B = _positive_int(where, "B", B, allow_none=True) or 1
    H = _positive_int(where, "H", H, allow_none=True) or 1
    Q_LEN = _positive_int(where, "Q_LEN", Q_LEN)
    KV_LEN = _positive_int(where, "KV_LEN", KV_LEN)
    Q_BLOCK, KV_BLOCK = _block_sizes(where, BLOCK_SIZE)
    if not isinstance(separate_full_blocks, bool):
        raise TypeError(f"{where}: separate_full_blocks must be a bool, got {separate_full_blocks!r}.")
    if not isinstance(dq_kv_order, bool):
        raise ValueError(f"{where}: dq_kv_order must be a bool, got {type(dq_kv_order).__name__}.")
    if compute_dq_write_order:
        raise NotImplementedError(f"{where}: compute_dq_write_order=True (deterministic dQ metadata for torch's "
                                  f"FLASH backend) is not supported by flexc; pass False.")
    _check_captured_sizes(where, traced, {"b": ("B", B), "h": ("H", H), "q_idx": ("Q_LEN", Q_LEN),
                                          "kv_idx": ("KV_LEN", KV_LEN)})
    device = _resolve_device(device, traced)
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
    B = _positive_int(where, "B", B, allow_none=True) or 1
    H = _positive_int(where, "H", H, allow_none=True) or 1
    Q_LEN = _positive_int(where, "Q_LEN", Q_LEN)
    KV_LEN = _positive_int(where, "KV_LEN", KV_LEN)
    _check_captured_sizes(where, traced, {"b": ("B", B), "h": ("H", H), "q_idx": ("Q_LEN", Q_LEN),
                                          "kv_idx": ("KV_LEN", KV_LEN)})
    device = _resolve_device(device, traced, where)
    check_captured(traced, device, where)  # before any analysis reads the captured tensors
    bounds.check_mod(traced, B, H, Q_LEN, KV_LEN, where)
    return dense_mask(traced, B, H, Q_LEN, KV_LEN, device)
