"""The forward's ``USE_TMA`` variant: key and value tiles loaded through tensor descriptors.

torch's FlexAttention template has the same option (``USE_TMA``): the kernel builds a device-side
descriptor (``tl.make_tensor_descriptor``) over its program's key head and value head, and each
tile is one descriptor load (``desc.load([start_n, 0])``). On sm_90 Triton lowers that to TMA
copies: the copy engine computes the addresses, so the per-thread pointer arithmetic and the
bounds masks of the plain loads go away. The descriptor's shape is ``[KV_LEN, HEAD_DIM]``; rows past
``KV_LEN`` and the padded head dim read as zeros (its padding), exactly what the plain loads' masks
give, so the tile holding the end of the keys needs no load mask either.

The variant is the plain kernel with its key/value lines rewritten (:func:`use_descriptors`),
so without :attr:`flexc.codegen.forward.ForwardSpec.tma` the source is untouched. Each rewrite
names the exact line it replaces, computed by the same helpers that wrote it, and fails loudly
when the plain kernel no longer holds it (a changed generator must update this module too, never
silently fall back to plain loads).

Triton's interpreter runs descriptors (as masked loads of the descriptor's pointers), so the
variant also runs on CPU tensors. On CUDA a device-side descriptor lives in global scratch memory
that the launch allocates through ``triton.set_allocator``
(:func:`flexc.backends.triton.tma.ensure_allocator`).
"""
from __future__ import annotations

from .parts import KEY_TILE, KV_BASES, VALUE_TILE, tile_load, widen_suffix
from .spec import AttentionSpec

HEADER = ("#   USE_TMA: key and value tiles are loaded through tensor descriptors (TMA copies on sm_90); "
          "the descriptors zero-fill keys past KV_LEN and the padded head dims")

# the device functions take the descriptors where the plain kernel takes the key/value pointers
_PLAIN_OPERANDS = "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd,"
_DESCRIPTOR_OPERANDS = "key_desc, value_desc, stride_kn, stride_kd, stride_vn, stride_vd,"
_PLAIN_BASES = "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,"


def descriptors() -> list[str]:
    """The kernel's lines that make the key and value descriptors of its program's heads (after KV_BASES)."""
    return [
        "    # USE_TMA: one descriptor per key/value head; each tile is then one TMA copy, its addresses",
        "    # computed by the copy engine. Rows past KV_LEN and the head dim's padding read as zeros.",
        "    key_desc = tl.make_tensor_descriptor(key_base, shape=[KV_LEN, HEAD_DIM], strides=[stride_kn, 1],",
        "                                         block_shape=[BLOCK_N, HEAD_DIM_PAD])",
        "    value_desc = tl.make_tensor_descriptor(value_base, shape=[KV_LEN, V_HEAD_DIM], strides=[stride_vn, 1],",
        "                                           block_shape=[BLOCK_N, V_HEAD_DIM_PAD])",
    ]


def key_load(spec: AttentionSpec) -> str:
    """The key tile [HEAD_DIM_PAD, BLOCK_N] from its descriptor (which holds keys as rows)."""
    return f"tl.trans(key_desc.load([start_n, 0])){widen_suffix(spec)}  # zeros past KV_LEN: no mask"


def value_load(spec: AttentionSpec) -> str:
    """The value tile [BLOCK_N, V_HEAD_DIM_PAD] from its descriptor."""
    return f"value_desc.load([start_n, 0]){widen_suffix(spec)}  # zeros past KV_LEN: no mask"


def _replace(lines: list[str], old: str, new: str, count: int | None = None) -> list[str]:
    """``lines`` with each line whose text after its indent is ``old`` (or holds it, for a fragment)
    rewritten to ``new``; at least one must (``count``: exactly that many)."""
    out, hits = [], 0
    for line in lines:
        if old in line:
            line = line.replace(old, new)
            hits += 1
        out.append(line)
    if hits == 0 or (count is not None and hits != count):
        raise AssertionError(f"flexc.codegen.tma: expected {count or 'some'} line(s) holding {old!r} in the plain "
                             f"forward, found {hits}: update flexc/codegen/tma.py with the generator")
    return out


def tile_lines(spec: AttentionSpec, body: list[str]) -> list[str]:
    """``attend_tile`` (forward._attend_tile's lines) with descriptor loads of its key and value tiles."""
    body = _replace(body, _PLAIN_OPERANDS, _DESCRIPTOR_OPERANDS, 1)
    k_loads = (tile_load(spec, KEY_TILE, "kv_in_range[None, :]", "[:, None]"), tile_load(spec, KEY_TILE, None, "[:, None]"))
    v_loads = (tile_load(spec, VALUE_TILE, "kv_in_range[:, None]", "[None, :]", value=True),
               tile_load(spec, VALUE_TILE, None, "[None, :]", value=True))
    for old in k_loads:
        body = _replace(body, f"k = {old}", f"k = {key_load(spec)}", 1)
    for old in v_loads:
        body = _replace(body, f"v = {old}", f"v = {value_load(spec)}", 1)
    return body


def blocks_lines(body: list[str]) -> list[str]:
    """``attend_blocks`` passing the descriptors on to ``attend_tile``."""
    return _replace(body, _PLAIN_OPERANDS, _DESCRIPTOR_OPERANDS)


def kernel_lines(body: list[str]) -> list[str]:
    """The kernel making the descriptors after its key/value bases and passing them to ``attend_blocks``."""
    at = body.index(KV_BASES[-1]) + 1
    body = body[:at] + descriptors() + body[at:]
    return _replace(body, _PLAIN_BASES, _DESCRIPTOR_OPERANDS)


__all__ = ["HEADER", "blocks_lines", "descriptors", "key_load", "kernel_lines", "tile_lines", "value_load"]
