"""Heads and batches whose block tables list the same blocks run as one group
(flexc.backends.cpu.block_plan.merged_tables); the mask_mod still sees each head's own index."""
import torch

import flexc
from flexc.backends.cpu import block_plan
from reference import dense_attention

L, H = 96, 4


def _tables(mask_mod, B=2):
    bm = flexc.create_block_mask(mask_mod, B, H, L, L, device="cpu", BLOCK_SIZE=32)
    return bm, block_plan.read_tables(bm, L, L)


def test_heads_and_batches_listing_the_same_blocks_fold_into_one_entry():
    _, tables = _tables(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    merged = block_plan.merged_tables(tables)
    assert (tables.batch, tables.heads) == (2, H) and (merged.batch, merged.heads) == (1, 1)
    assert merged.kv_num == [[tables.kv_num[0][0]]]


def test_heads_listing_different_blocks_stay_apart():
    _, tables = _tables(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 32 * h))
    merged = block_plan.merged_tables(tables)
    assert (merged.batch, merged.heads) == (1, H)


def test_a_folded_per_head_mask_keeps_each_heads_own_pairs():
    # windows of 3 to 12 keys: every head lists the same (diagonal and previous) blocks, and the
    # pairs inside them differ by head
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 3 * h + 3)
    bm, tables = _tables(window)
    assert block_plan.merged_tables(tables).heads == 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, L, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    ref = dense_attention(q, k, v, mask_mod=window)[0]
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(ref.sum(), (q, k, v)))
