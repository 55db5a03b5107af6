"""torch's commonly imported FlexAttention names, with the same meaning, so code written against
``torch.nn.attention.flex_attention`` runs with only its import line changed.

Besides the public API (exported from :mod:`flexc` itself), libraries written for torch import
type aliases (``_mask_mod_signature``, ``_score_mod_signature``), constants
(``_DEFAULT_SPARSE_BLOCK_SIZE``), helpers (``_identity``, ``_vmap_for_bhqkv``, ``_get_mod_type``,
the block-table converters) and the ``FlexKernelOptions`` type. This module defines each of them
in flexc's terms; ``create_nested_block_mask`` (from older torch releases) builds the BlockMask of
packed jagged sequences.
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, TypedDict, TypeVar

import torch
from torch import Tensor

from ..masks.block_mask import DEFAULT_BLOCK_SIZE, BlockMask
from ..torch_compile.compiled_block_mask import create_block_mask  # (one custom-op node inside torch.compile)
from ..analysis.tiles import dense_to_ordered, ordered_to_dense, transpose_ordered
from ..mods.trace import MASK_MOD, SCORE_MOD, mod_kind

_R = TypeVar("_R")

# A score_mod: (score, b, h, q_idx, kv_idx) -> score. A mask_mod: (b, h, q_idx, kv_idx) -> bool.
_score_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
_mask_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

# The backends kernel_options["BACKEND"] may name in flexc: TORCH is flexc's CPU block-sparse path;
# torch's FLASH/TRITON_DECODE (its own kernels) are accepted and run as AUTO.
_Backend = Literal["AUTO", "TORCH", "TRITON", "FLASH", "TRITON_DECODE"]

_DEFAULT_SPARSE_BLOCK_SIZE = DEFAULT_BLOCK_SIZE
# A block size larger than any sequence: one block covers everything.
_LARGE_SPARSE_BLOCK_SIZE = 1 << 30


class FlexKernelOptions(TypedDict, total=False):
    """The keys ``kernel_options`` accepts: torch's (each also with a ``fwd_``/``bwd_`` prefix) and
    ``BACKEND``. Tuning keys that have no meaning for a flexc backend are accepted and ignored."""

    num_warps: int
    num_stages: int
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    PRESCALE_QK: bool
    ROWS_GUARANTEED_SAFE: bool
    BLOCKS_ARE_CONTIGUOUS: bool
    WRITE_DQ: bool
    FORCE_USE_FLEX_ATTENTION: bool
    USE_TMA: bool
    kpack: int
    matrix_instr_nonkdim: int
    waves_per_eu: int
    BACKEND: _Backend


class _ModificationType(Enum):
    """Whether a function is a score_mod or a mask_mod (torch's enum, same members and values)."""

    SCORE_MOD = 1
    MASK_MOD = 2
    UNKNOWN = 3


def _get_mod_type(fn: Callable[..., Any]) -> _ModificationType:
    """SCORE_MOD for 5 positional parameters without defaults, MASK_MOD for 4.

    Raises :class:`flexc.TraceError` (a TypeError) for any other arity, naming the function.
    """
    return _ModificationType.SCORE_MOD if mod_kind(fn) == SCORE_MOD else _ModificationType.MASK_MOD


def _identity(score: Tensor, batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """The score_mod that changes nothing."""
    return score


def _vmap_for_bhqkv(fn: Callable[..., _R], prefix: tuple, suffix: tuple = (), out_dims: Any = 0,
                    group_dim: bool = False) -> Callable[..., _R]:
    """``fn`` mapped over 1-D ``b``, ``h`` (and a group axis), ``q_idx`` and ``kv_idx`` tensors.

    The result takes the same arguments as ``fn``; the arguments named by ``prefix`` (``(0,)`` for a
    score_mod's score, ``()`` for a mask_mod) and ``suffix`` use those vmap ``in_dims``, and it
    returns ``[B, H, (G,) Q, KV]``. Index arguments are mapped innermost first (kv, q, h, b), so
    the outermost output dimension is the batch.
    """
    # One index argument is mapped per level; the others are passed through unchanged.
    levels = [3, 2, 1] + ([1] if group_dim else []) + [0]
    mapped = fn
    for position in levels:
        dims = tuple(0 if i == position else None for i in range(4))
        mapped = torch.vmap(mapped, in_dims=tuple(prefix) + dims + tuple(suffix), out_dims=out_dims)
    return mapped


def _ordered_to_dense(num_blocks_in_row: Tensor, col_indices: Tensor, num_cols: int | None = None) -> Tensor:
    """int32 block occupancy ``[..., rows, num_cols]`` from a ``(num_blocks, indices)`` table pair.
    ``num_cols`` defaults to the table's width, as torch 2.11's two-argument form reads it."""
    return ordered_to_dense(num_blocks_in_row, col_indices, col_indices.shape[-1] if num_cols is None else num_cols)


def _dense_to_ordered(dense_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` int32 tables from a 0/1 block occupancy, occupied columns first."""
    return dense_to_ordered(dense_mask.to(torch.int32))


def _transpose_ordered(num_blocks_in_row: Tensor, col_indices: Tensor) -> tuple[Tensor, Tensor]:
    """The transposed (column-major) table pair of a row-major one."""
    return transpose_ordered(num_blocks_in_row, col_indices)


def _create_empty_block_mask(query: Tensor, key: Tensor) -> BlockMask:
    """The BlockMask that allows everything: one tile of ``_LARGE_SPARSE_BLOCK_SIZE`` covering the whole
    ``(L, S)`` (torch's default mask). Its ``seq_lengths`` are the inputs' (torch records ``(1, 1)`` and
    skips its length check for this block size)."""
    one = torch.ones(1, 1, 1, dtype=torch.int32, device=query.device)
    return BlockMask.from_kv_blocks(one, torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=query.device),
                                    BLOCK_SIZE=_LARGE_SPARSE_BLOCK_SIZE,
                                    seq_lengths=(query.shape[-2], key.shape[-2]))


# torch's own plumbing, re-exported (not reimplemented) so test suites and libraries that import
# them from the flex_attention module import them from flexc unchanged: the option defaults torch's
# kernels get, the set of warnings torch's eager path has shown, and torch's higher-order op.
# flexc's own options are checked by flexc.call.validate.check_kernel_options. _MaskModWrapper is the
# wrapper torch's BlockMask puts around its mask_mod in pytree contexts; torch's compiler imports it
# from the module path and checks isinstance against torch's objects, so it must be torch's class
# (with sys.modules["torch.nn.attention.flex_attention"] = flexc, dynamo imports it from here).
from torch.nn.attention.flex_attention import _MaskModWrapper, _WARNINGS_SHOWN, _apply_kernel_options  # noqa: E402
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop  # noqa: E402


def _round_up_to_multiple(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``x``."""
    return -(-x // multiple) * multiple


# ---- packed jagged sequences ----------------------------------------------------------------

def _sequence_of_token(offsets: Tensor, total: int) -> Tensor:
    """For each packed position ``0..total-1``, the index of the sequence it belongs to."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths.long(), output_size=total)


def _jagged_offsets(nt: Any, name: str) -> tuple[Tensor, int]:
    if not (isinstance(nt, Tensor) and nt.is_nested and nt.layout == torch.jagged):
        raise ValueError(f"create_nested_block_mask: `{name}` must be a nested tensor with layout=torch.jagged, got "
                         f"{type(nt).__name__}{' with layout ' + str(nt.layout) if isinstance(nt, Tensor) else ''}. "
                         f"Fix: build it with torch.nested.nested_tensor([...], layout=torch.jagged).")
    if nt._ragged_idx != 1:
        raise ValueError(f"create_nested_block_mask: `{name}` must be ragged in dimension 1 ([B, j, H, D]), got "
                         f"ragged dimension {nt._ragged_idx}. Fix: pass the tensor before transposing heads forward.")
    offsets = nt.offsets()
    return offsets, int(offsets[-1])


def create_nested_block_mask(mask_mod: _mask_mod_signature, B: int | None, H: int | None, q_nt: Tensor,
                             kv_nt: Tensor | None = None, BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_SPARSE_BLOCK_SIZE,
                             _compile: bool = False) -> BlockMask:
    """The BlockMask of jagged sequences packed end to end (the layout of a jagged nested tensor).

    ``q_nt``/``kv_nt`` are jagged nested tensors ``[B, j, H, D]`` (``kv_nt`` defaults to ``q_nt``).
    The mask covers ``[1, H, total_q, total_kv]``: a query attends a key only inside its own
    sequence, where ``mask_mod`` is called with the sequence index as ``b`` and positions local to
    that sequence. ``B`` is ignored (the packed batch is 1), as in torch. Run attention on the
    packed values, e.g. ``q_nt.values().transpose(0, 1).unsqueeze(0)`` (``[1, H, total, D]``).
    """
    kv_nt = q_nt if kv_nt is None else kv_nt
    q_offsets, total_q = _jagged_offsets(q_nt, "q_nt")
    kv_offsets, total_kv = _jagged_offsets(kv_nt, "kv_nt")
    if q_offsets.shape != kv_offsets.shape:
        raise ValueError(f"create_nested_block_mask: q_nt has {q_offsets.numel() - 1} sequences but kv_nt has "
                         f"{kv_offsets.numel() - 1}. Fix: pass nested tensors with the same number of sequences.")
    if mod_kind(mask_mod) != MASK_MOD:
        raise TypeError("create_nested_block_mask: `mask_mod` must be a mask_mod (b, h, q_idx, kv_idx), got a "
                        "score_mod. Fix: pass a function of four arguments returning a bool.")
    q_seq = _sequence_of_token(q_offsets, total_q)
    kv_seq = _sequence_of_token(kv_offsets, total_kv)
    q_start, kv_start = q_offsets.long(), kv_offsets.long()

    def nested_mask(b, h, q_idx, kv_idx):
        seq = q_seq[q_idx]
        local = mask_mod(seq, h, q_idx - q_start[seq], kv_idx - kv_start[kv_seq[kv_idx]])
        return (seq == kv_seq[kv_idx]) & local

    nested_mask.__name__ = f"nested({getattr(mask_mod, '__name__', type(mask_mod).__name__)})"
    return create_block_mask(nested_mask, 1, H, total_q, total_kv, device=q_nt.device, BLOCK_SIZE=BLOCK_SIZE,
                             _compile=_compile)


# The drop-in names (flexc/__init__.py re-exports them), torch's re-exported plumbing included.
__all__ = ["FlexKernelOptions", "_Backend", "_DEFAULT_SPARSE_BLOCK_SIZE", "_LARGE_SPARSE_BLOCK_SIZE", "_MaskModWrapper",
           "_WARNINGS_SHOWN",
           "_apply_kernel_options", "_create_empty_block_mask", "flex_attention_hop", "_ModificationType",
           "_dense_to_ordered", "_get_mod_type", "_identity", "_mask_mod_signature", "_ordered_to_dense",
           "_round_up_to_multiple", "_score_mod_signature", "_transpose_ordered", "_vmap_for_bhqkv",
           "create_nested_block_mask"]
