"""The CPU backend remembers its row plans per block mask (flexc.backends.cpu.block_plan.memo_by_tables):
a remembered plan must never outlive a change to the tables it was made from."""
import torch
import torch.nn.functional as F

import flexc
from flexc.backends.cpu import block_plan

L = 96


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _everything(b, h, q_idx, kv_idx):
    return q_idx >= 0


def test_tables_changed_in_place_are_planned_anew():
    q, k, v = _inputs()
    bm = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    causal_out = flexc.flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(causal_out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    every_block = flexc.create_block_mask(_everything, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(every_block, name))  # every block full now: no mask_mod runs
    torch.testing.assert_close(flexc.flex_attention(q, k, v, block_mask=bm), F.scaled_dot_product_attention(q, k, v))


def test_a_plan_is_remembered_for_the_same_tables_and_not_for_new_ones():
    bm = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    built = []
    build = lambda: built.append(1) or len(built)
    assert block_plan.memo_by_tables(bm, ("shape",), build) == 1
    assert block_plan.memo_by_tables(bm, ("shape",), build) == 1  # remembered
    assert block_plan.memo_by_tables(bm, ("other shape",), build) == 2
    same_pattern = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    assert block_plan.memo_by_tables(same_pattern, ("shape",), build) == 3  # other tensors: planned anew
    with torch.inference_mode():
        frozen = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    assert block_plan.memo_by_tables(frozen, ("shape",), build) == 4
    assert block_plan.memo_by_tables(frozen, ("shape",), build) == 5  # no version counter: never remembered
