"""What every consumer reads off a BlockMask, flexc's or torch's: its kv tables (by name, in the
order the kernels and validation take them) and its (query, key) block sizes."""
from __future__ import annotations

from typing import Any

KV_TABLE_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def kv_tables(block_mask: Any) -> tuple:
    """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``; the full tables None
    when the mask keeps no full blocks apart."""
    return (block_mask.kv_num_blocks, block_mask.kv_indices, getattr(block_mask, "full_kv_num_blocks", None),
            getattr(block_mask, "full_kv_indices", None))


def block_sizes_of(block_mask: Any) -> tuple[int, int]:
    """``(query block, key block)`` of a BlockMask (an int BLOCK_SIZE is both)."""
    size = block_mask.BLOCK_SIZE
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
