"""``BlockMask`` as a pytree node, so it crosses ``torch.compile``/``torch.export`` boundaries.

The leaves are its tensors (the eight tables and the three dQ-order fields, ``None`` where a mask
does not keep one; q tables that are still to be derived stay unbuilt and are ``None`` leaves);
the context holds what is fixed per graph: lengths, block sizes, whether the q tables are derived
lazily, the ``dq_kv_order_spt`` flag and the ``mask_mod``. Rebuilding from new leaves with the same
context gives the same mask over other tables, which is what ``tree_map`` and tracing need.
"""
from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from .block_mask import TENSOR_ATTRS, DERIVED, BlockMask


_Q_NAMES = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _lazy_q(bm: BlockMask) -> bool:
    return getattr(bm, "_q_tables", ()) is None  # q tables not derived yet


def _leaves(bm: BlockMask) -> list:
    lazy = _lazy_q(bm)
    return [None if lazy and name in _Q_NAMES else getattr(bm, name) for name in TENSOR_ATTRS]


def _flatten(bm: BlockMask) -> tuple[list, tuple]:
    return _leaves(bm), _context(bm)


def _flatten_with_keys(bm: BlockMask) -> tuple[list, tuple]:
    return [(pytree.GetAttrKey(name), t) for name, t in zip(TENSOR_ATTRS, _leaves(bm))], _context(bm)


def _context(bm: BlockMask) -> tuple:
    return tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE), _lazy_q(bm), bm.dq_kv_order_spt, bm.mask_mod


def _unflatten(leaves: Any, context: tuple) -> BlockMask:
    seq_lengths, block_size, lazy_q, spt, mask_mod = context
    tensors = dict(zip(TENSOR_ATTRS, leaves))
    if lazy_q:
        tensors.update(dict.fromkeys(_Q_NAMES, DERIVED))
    return BlockMask(seq_lengths, *(tensors[name] for name in TENSOR_ATTRS[:8]), BLOCK_SIZE=block_size,
                     mask_mod=mask_mod, dq_write_order=tensors["dq_write_order"],
                     dq_write_order_full=tensors["dq_write_order_full"], dq_kv_order=tensors["dq_kv_order"],
                     dq_kv_order_spt=spt)


if BlockMask not in pytree.SUPPORTED_NODES:
    pytree.register_pytree_node(BlockMask, _flatten, _unflatten, serialized_type_name="flexc.BlockMask",
                                flatten_with_keys_fn=_flatten_with_keys)
