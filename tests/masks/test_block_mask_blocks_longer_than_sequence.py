"""A BlockMask block far longer than the sequence (torch's 1 << 30 no-op block size, or a
``(Q_BLOCK, KV_BLOCK)`` pair with one huge side) is classified on a grid no larger than the
sequence: the tile holds at most ``min(BLOCK, LEN)`` real positions per axis.

Before, exact tile evaluation built a ``Q_BLOCK x KV_BLOCK`` index grid, so
``create_block_mask(mask, ..., BLOCK_SIZE=(16, 1 << 30))`` on 81 keys tried to allocate 8 GiB and
raised (the differential fuzzer's find; ``(1 << 30, 16)`` happened to be decided by the range
analysis and worked).
"""
from unittest import mock

import pytest
import torch

import flexc
from flexc.analysis import tiles
from reference import dense_attention


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < 9


def per_head(b, h, q_idx, kv_idx):
    return (kv_idx % (h + 2)) == 0


@pytest.mark.parametrize("mask_mod", [window, per_head])
@pytest.mark.parametrize("block", [(16, 1 << 20), (1 << 20, 16), 1 << 20])
@pytest.mark.parametrize("analytic", [True, False])
def test_tiles_longer_than_the_sequence_are_evaluated_on_the_sequence(mask_mod, block, analytic):
    L, S = 24, 81
    grids = []
    evaluate = tiles.evaluate

    def spy(traced, **index):
        grids.append((index["q_idx"].shape[-2], index["kv_idx"].shape[-1]))
        return evaluate(traced, **index)

    with mock.patch.object(tiles, "evaluate", spy):
        bm = flexc.create_block_mask(mask_mod, None, 2, L, S, device="cpu", BLOCK_SIZE=block, _analytic=analytic)
    assert all(q <= L and kv <= S for q, kv in grids), grids
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (L, S, S))
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": "TORCH"})
    torch.testing.assert_close(out, dense_attention(q, k, v, mask_mod=mask_mod)[0])
