"""``BlockMask`` as a pytree node, so it crosses ``torch.compile``/``torch.export`` boundaries.

The leaves are its tensors (the eight tables and the three dQ-order fields, ``None`` where a mask
does not keep one); the context holds what is fixed per graph: lengths, block sizes, the
``dq_kv_order_spt`` flag and the ``mask_mod``. Rebuilding from new leaves with the same context
gives the same mask over other tables, which is what ``tree_map`` and tracing need.
"""
from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from .block_mask import _TENSOR_ATTRS, BlockMask


def _flatten(bm: BlockMask) -> tuple[list, tuple]:
    return [getattr(bm, name) for name in _TENSOR_ATTRS], _context(bm)


def _flatten_with_keys(bm: BlockMask) -> tuple[list, tuple]:
    return [(pytree.GetAttrKey(name), getattr(bm, name)) for name in _TENSOR_ATTRS], _context(bm)


def _context(bm: BlockMask) -> tuple:
    return tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE), bm.dq_kv_order_spt, bm.mask_mod


def _unflatten(leaves: Any, context: tuple) -> BlockMask:
    seq_lengths, block_size, spt, mask_mod = context
    tensors = dict(zip(_TENSOR_ATTRS, leaves))
    return BlockMask(seq_lengths, *(tensors[name] for name in _TENSOR_ATTRS[:8]), BLOCK_SIZE=block_size,
                     mask_mod=mask_mod, dq_write_order=tensors["dq_write_order"],
                     dq_write_order_full=tensors["dq_write_order_full"], dq_kv_order=tensors["dq_kv_order"],
                     dq_kv_order_spt=spt)


if BlockMask not in pytree.SUPPORTED_NODES:
    pytree.register_pytree_node(BlockMask, _flatten, _unflatten, serialized_type_name="flexc.BlockMask",
                                flatten_with_keys_fn=_flatten_with_keys)
