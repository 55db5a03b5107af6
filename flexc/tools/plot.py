"""Pictures of masks and score_mods: :func:`plot` (matplotlib, the ``flexc[plot]`` extra).

A picture is a raster of at most ``max_pixels`` x ``max_pixels`` cells over the ``Q_LEN x KV_LEN``
attention matrix. Each cell shows the element at its centre (every element when the lengths fit),
coloured by what flexc's ``BlockMask`` does with its tile:

- **full tile**: every element allowed; the kernel skips the mask_mod,
- **partial tile**: the kernel runs the mask_mod; its allowed and masked elements get two colours,
- **empty tile**: never visited.

The mask_mod is evaluated only at the cells' centres (and read only inside partial tiles), so a
65536 x 65536 mask costs a few megabytes, never the ``L x S`` matrix. A score_mod is drawn as a heat map of
``score_mod(0, b, h, q_idx, kv_idx)`` (the bias it adds; another ``score`` may be given) with
masked elements left blank.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..masks.block_mask import BlockMask
from ..masks.create import create_block_mask
from ..mods.evaluate import evaluate
from ..analysis.tiles import cdiv
from ..mods.trace import MASK_MOD, SCORE_MOD, TraceError, trace

# Cell codes of a raster and their colours (RGB hex), in legend order.
FULL, PARTIAL_ALLOWED, PARTIAL_MASKED, EMPTY = 3, 2, 1, 0
COLORS = {FULL: "#2b6cb0", PARTIAL_ALLOWED: "#ed8936", PARTIAL_MASKED: "#fbd38d", EMPTY: "#f2f2f2"}
LABELS = {FULL: "full tile (mask_mod skipped)", PARTIAL_ALLOWED: "partial tile: allowed",
          PARTIAL_MASKED: "partial tile: masked", EMPTY: "empty tile (never visited)"}
_GRID_COLOR = "#7f7f7f"
_MAX_GRID_LINES = 64  # more tile boundaries than this per side would hide the picture


@dataclasses.dataclass
class Raster:
    """What :func:`plot` draws, without matplotlib.

    ``codes`` is uint8 ``[rows, cols]`` (``EMPTY``, ``PARTIAL_MASKED``, ``PARTIAL_ALLOWED``,
    ``FULL``); cell ``(i, j)`` shows element ``(q_pos[i], kv_pos[j])``. ``values`` holds the
    score_mod's float64 values there (NaN where masked), or None.
    """

    codes: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    values: torch.Tensor | None = None


def _positions(length: int, cells: int) -> torch.Tensor:
    """The element at the centre of each of ``cells`` equal slices of ``range(length)``."""
    if cells >= length:
        return torch.arange(length)
    return ((torch.arange(cells, dtype=torch.float64) + 0.5) * (length / cells)).floor().to(torch.int64)


def _select(table: torch.Tensor, batch: int, head: int) -> torch.Tensor:
    """The ``[nQ, nKV]`` tile classes of one (batch, head); size-1 dims broadcast as in flex_attention."""
    while table.dim() > 4:  # extra leading dims (rare): take the first
        table = table[0]
    while table.dim() < 4:
        table = table.unsqueeze(0)
    for dim, (name, index) in enumerate((("batch", batch), ("head", head))):
        size = table.shape[dim]
        if size != 1 and not 0 <= index < size:
            raise ValueError(f"plot: {name}={index} is out of range for a BlockMask with {size} "
                             f"{'batches' if dim == 0 else 'heads'}. Fix: pass 0 <= {name} < {size}.")
    return table[batch if table.shape[0] > 1 else 0, head if table.shape[1] > 1 else 0]


def _mask_of(block_mask: BlockMask) -> Any:
    """The block mask's traced mask_mod, or None when it cannot be evaluated (a sliced mask's mod)."""
    try:
        traced = trace(block_mask.mask_mod)
    except (TraceError, TypeError, RuntimeError):
        return None
    return traced if traced.kind == MASK_MOD else None


def _score_input(score: float | torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                 seq_lengths: tuple[int, int]) -> torch.Tensor:
    """The ``score`` a score_mod sees at the sampled cells: a number, or a tensor broadcasting to [Q_LEN, KV_LEN]."""
    if isinstance(score, torch.Tensor):
        try:
            full = score.to(torch.float64).broadcast_to(seq_lengths)  # a view: nothing L x S is allocated
        except RuntimeError:
            raise ValueError(f"plot: score must broadcast to [Q_LEN, KV_LEN] = {list(seq_lengths)}, got shape "
                             f"{list(score.shape)}. Fix: pass a number, or a [Q_LEN, KV_LEN], [1, KV_LEN] or "
                             f"[Q_LEN, 1] tensor.") from None
        return full[q_pos][:, kv_pos]
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise TypeError(f"plot: score must be a number or a tensor, got {type(score).__name__}.")
    return torch.tensor(float(score), dtype=torch.float64)


def raster(block_mask: BlockMask, *, score_mod: Callable | None = None, score: float | torch.Tensor = 0.0,
           batch: int = 0, head: int = 0, max_pixels: int = 1024) -> Raster:
    """The cells :func:`plot` colours for one (batch, head) of ``block_mask`` (see the module docstring).

    With a ``score_mod``, ``values`` holds ``score_mod(score, b, h, q_idx, kv_idx)`` at each cell.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"raster: block_mask must be a flexc BlockMask, got {type(block_mask).__name__}. "
                        f"Fix: build one with flexc.create_block_mask or BlockMask.from_torch.")
    for name, value in (("batch", batch), ("head", head), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "max_pixels" else 0):
            raise ValueError(f"plot: {name} must be an int >= {1 if name == 'max_pixels' else 0}, got {value!r}.")
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    q_block, kv_block = (int(n) for n in block_mask.BLOCK_SIZE)
    classes = _select(block_mask._tile_classes().cpu(), batch, head)  # 0 empty, 1 partial, 2 full
    q_pos, kv_pos = _positions(q_len, max_pixels), _positions(kv_len, max_pixels)
    tile = classes[(q_pos // q_block).clamp(max=classes.shape[0] - 1)][:, (kv_pos // kv_block).clamp(
        max=classes.shape[1] - 1)]
    codes = torch.full(tile.shape, EMPTY, dtype=torch.uint8)
    codes[tile == 2] = FULL
    partial = tile == 1
    b, h = torch.tensor(batch), torch.tensor(head)
    mask = _mask_of(block_mask)
    if mask is not None and bool(partial.any()):
        allowed = evaluate(mask, b=b, h=h, q_idx=q_pos[:, None], kv_idx=kv_pos[None, :]).expand(tile.shape)
        codes[partial & allowed] = PARTIAL_ALLOWED
        codes[partial & ~allowed] = PARTIAL_MASKED
    else:  # no mod to look inside partial tiles: draw them as computed
        codes[partial] = PARTIAL_ALLOWED
    values = None
    if score_mod is not None:
        traced = trace(score_mod)
        if traced.kind != SCORE_MOD:
            raise TypeError(f"plot: score_mod must take (score, b, h, q_idx, kv_idx), got a {traced.kind}.")
        values = evaluate(traced, score=_score_input(score, q_pos, kv_pos, (q_len, kv_len)), b=b, h=h,
                          q_idx=q_pos[:, None],
                          kv_idx=kv_pos[None, :]).to(torch.float64).expand(tile.shape).clone()
        values[(codes == EMPTY) | (codes == PARTIAL_MASKED)] = float("nan")
    return Raster(codes, q_pos, kv_pos, (q_len, kv_len), (q_block, kv_block), values)


def _as_block_mask(target: Any, mask_mod: Any, B: int | None, H: int | None, Q_LEN: int | None,
                   KV_LEN: int | None, BLOCK_SIZE: Any) -> tuple[BlockMask, Callable | None]:
    """``(block_mask, score_mod)`` for what :func:`plot` was given."""
    if isinstance(target, BlockMask):
        if mask_mod is not None:
            raise ValueError("plot: got a BlockMask and a mask_mod; the BlockMask already carries its mask_mod. "
                             "Fix: pass one of them.")
        return target, None
    if type(target).__name__ == "BlockMask" and hasattr(target, "as_tuple"):  # torch's own BlockMask
        return BlockMask.from_torch(target), None
    if not callable(target):
        raise TypeError(f"plot: expected a BlockMask, a mask_mod or a score_mod, got {type(target).__name__}. "
                        f"Fix: pass e.g. flexc.plot(causal, Q_LEN=1024).")
    kind = trace(target).kind
    score_mod = target if kind == SCORE_MOD else None
    if kind == MASK_MOD:
        if mask_mod is not None:
            raise ValueError("plot: got two mask_mods. Fix: combine them with flexc.and_masks(...) first.")
        mask_mod = target
    if isinstance(mask_mod, BlockMask):
        return mask_mod, score_mod
    Q_LEN = 256 if Q_LEN is None else Q_LEN
    KV_LEN = Q_LEN if KV_LEN is None else KV_LEN
    if mask_mod is None:
        mask_mod = _allow_all
    return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=BLOCK_SIZE), score_mod


def _allow_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _length(upper: str, upper_value: int | None, lower: str, lower_value: int | None) -> int | None:
    """``Q_LEN``/``KV_LEN`` given in either spelling (create_block_mask's, or the CLI's ``q_len``/``kv_len``)."""
    if upper_value is not None and lower_value is not None:
        raise ValueError(f"plot: got both {upper}={upper_value!r} and {lower}={lower_value!r}; they are one "
                         f"argument in two spellings. Fix: pass only one of them.")
    return upper_value if upper_value is not None else lower_value


def sampling_note(r: Raster) -> str:
    """The title's note on a downsampled picture: how many elements each cell stands for (it shows
    the one at its centre); empty when every element has a cell."""
    (q_len, kv_len), (rows, cols) = r.seq_lengths, r.codes.shape
    if rows >= q_len and cols >= kv_len:
        return ""
    return f"\nsampled: each cell shows 1 of {q_len / max(rows, 1):.3g} x {kv_len / max(cols, 1):.3g} elements"


def plot(target: Any, B: int | None = None, H: int | None = None, Q_LEN: int | None = None,
         KV_LEN: int | None = None, *, mask_mod: Callable | BlockMask | None = None, batch: int = 0,
         head: int = 0, BLOCK_SIZE: int | tuple[int, int] = 128, max_pixels: int = 1024,
         score: float | torch.Tensor = 0.0,
         title: str | None = None, ax: Any = None, path: str | None = None, dpi: int = 100,
         q_len: int | None = None, kv_len: int | None = None) -> Any:
    """Draw a BlockMask, a mask_mod or a score_mod; return the matplotlib ``Figure``.

    - ``target`` a :class:`BlockMask` (flexc's or torch's): its tiles, and inside partial tiles the
      elements its mask_mod allows.
    - ``target`` a mask_mod: the BlockMask ``create_block_mask(target, B, H, Q_LEN, KV_LEN,
      BLOCK_SIZE=BLOCK_SIZE)`` builds (``Q_LEN`` defaults to 256, ``KV_LEN`` to ``Q_LEN``).
      ``q_len``/``kv_len`` (the spelling of ``flexc draw --q-len/--kv-len``) are the same
      arguments; pass one spelling of each.
    - ``target`` a score_mod: a heat map of ``score_mod(score, b, h, q_idx, kv_idx)``, blank where
      ``mask_mod`` (a mask_mod or a BlockMask, optional) masks. ``score`` is 0 by default (the
      picture shows the bias the mod adds), or a number, or a tensor broadcasting to
      ``[Q_LEN, KV_LEN]`` (e.g. a ramp, to show a soft-cap).

    ``batch``/``head`` choose the picture; ``max_pixels`` caps cells per side (longer sequences
    show the element at each cell's centre). Pass ``ax`` to draw into your own axes, ``path`` to
    save the figure (e.g. ``"mask.png"``).
    """
    Q_LEN, KV_LEN = _length("Q_LEN", Q_LEN, "q_len", q_len), _length("KV_LEN", KV_LEN, "kv_len", kv_len)
    try:
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("flexc.plot needs matplotlib. Fix: pip install 'flexc[plot]' "
                          "(or pip install matplotlib).") from e
    block_mask, score_mod = _as_block_mask(target, mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
    r = raster(block_mask, score_mod=score_mod, score=score, batch=batch, head=head, max_pixels=max_pixels)
    if ax is None:
        size = (6.4, 5.6) if score_mod is None else (7.4, 5.6)
        if path is not None:  # a file only: a standalone Figure, no pyplot state, no display needed
            from matplotlib.figure import Figure

            fig = Figure(figsize=size, dpi=dpi)
            ax = fig.add_subplot()
        else:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=size, dpi=dpi)
    else:
        fig = ax.figure
    (q_len, kv_len), (q_block, kv_block) = r.seq_lengths, r.block_size
    extent = (0, kv_len, q_len, 0)  # data coordinates are element indices, queries downwards
    cmap = ListedColormap([COLORS[c] for c in (EMPTY, PARTIAL_MASKED, PARTIAL_ALLOWED, FULL)])
    # nearest-neighbour drawing: a cell is one colour, never blended with its neighbours
    ax.imshow(r.codes.numpy(), cmap=cmap, vmin=-0.5, vmax=3.5, extent=extent, interpolation="nearest",
              aspect="auto")
    handles = [Patch(facecolor=COLORS[c], edgecolor=_GRID_COLOR, label=LABELS[c])
               for c in (FULL, PARTIAL_ALLOWED, PARTIAL_MASKED, EMPTY)]
    if r.values is not None:
        finite = r.values[~r.values.isnan()]
        image = ax.imshow(r.values.numpy(), cmap="viridis", extent=extent, interpolation="nearest", aspect="auto",
                          vmin=float(finite.min()) if finite.numel() else None,
                          vmax=float(finite.max()) if finite.numel() else None)
        score_name = "0" if isinstance(score, (int, float)) and score == 0 else "score"
        fig.colorbar(image, ax=ax, label=f"score_mod({score_name}, b, h, q_idx, kv_idx)")
        handles = [handles[-2], handles[-1]]  # masked / empty show through the NaN cells
    n_q, n_kv = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
    if n_q <= _MAX_GRID_LINES and n_kv <= _MAX_GRID_LINES:
        ax.hlines([i * q_block for i in range(1, n_q)], 0, kv_len, colors=_GRID_COLOR, linewidth=0.5)
        ax.vlines([j * kv_block for j in range(1, n_kv)], 0, q_len, colors=_GRID_COLOR, linewidth=0.5)
    ax.set_xlim(0, kv_len)
    ax.set_ylim(q_len, 0)
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    name = getattr(score_mod or block_mask.mask_mod, "__name__", "mask")
    ax.set_title(title if title is not None else
                 f"{name}  (b={batch}, h={head}, {q_len}x{kv_len}, tiles {q_block}x{kv_block}, "
                 f"sparsity {block_mask.sparsity():.1f}%){sampling_note(r)}", fontsize=9)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


__all__ = ["COLORS", "EMPTY", "FULL", "LABELS", "PARTIAL_ALLOWED", "PARTIAL_MASKED", "Raster", "plot", "raster",
           "sampling_note"]
