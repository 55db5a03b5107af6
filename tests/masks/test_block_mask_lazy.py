"""The q-direction tables are derived on first use and then equal torch's, bit for bit.

The reference is torch's own create_block_mask (which builds the q tables eagerly) and torch's
BlockMask slicing.
"""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue
from torch_api import takes

Q_TABLES = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _built(bm) -> bool:
    return bm._q_tables is not None


def _assert_q_tables_equal(ours, ref):
    for name in Q_TABLES:
        a, r = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (r is None), name
        if r is not None:
            assert a.dtype == r.dtype and a.shape == r.shape and torch.equal(a, r), name


def test_create_and_slice_do_not_build_q_tables_and_access_builds_torchs():
    B, H, L, S = 2, 2, 300, 520
    mods = mask_catalogue(B, H, L, S)
    for name in ("causal", "document_causal", "per_head_window", "prefix_lm"):
        ours = flexc.create_block_mask(mods[name], B, H, L, S, device="cpu", BLOCK_SIZE=(64, 128))
        ref = tfa.create_block_mask(mods[name], B, H, L, S, device="cpu", BLOCK_SIZE=(64, 128))
        sliced, ref_sliced = ours[:, 1, 2], ref[:, 1, 2]
        assert not _built(ours) and not _built(sliced)
        assert "q_indices=torch.Size" in repr(sliced) and not _built(sliced)  # repr does not build them
        _assert_q_tables_equal(sliced, ref_sliced)
        _assert_q_tables_equal(ours, ref)
        assert _built(ours)


@pytest.mark.skipif(not takes(tfa.create_block_mask, "separate_full_blocks"),
                    reason="the installed torch's create_block_mask has no separate_full_blocks (2.11)")
def test_separate_full_blocks_false_and_no_q_tables():
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    ours = flexc.create_block_mask(causal, None, None, 256, 256, BLOCK_SIZE=64, separate_full_blocks=False)
    ref = tfa.create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=64,
                                separate_full_blocks=False)
    _assert_q_tables_equal(ours, ref)
    bare = flexc.BlockMask.from_kv_blocks(ref.kv_num_blocks, ref.kv_indices, compute_q_blocks=False)
    assert bare.q_indices is None and bare[:, :, 0].q_indices is None


def test_assigning_a_q_table_and_moving_keep_the_rest():
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    ours = flexc.create_block_mask(causal, None, None, 256, 256, BLOCK_SIZE=64)
    ref = tfa.create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    moved = ours.to("cpu")
    assert not _built(moved)
    _assert_q_tables_equal(moved, ref)
    replacement = torch.zeros_like(ref.q_num_blocks)
    ours.q_num_blocks = replacement
    assert ours.q_num_blocks is replacement and torch.equal(ours.q_indices, ref.q_indices)
