"""create_block_mask and create_mask agree with torch's FlexAttention, table for table.

For every catalogue mask at several shapes (B/H broadcast and explicit, square, non-square and
ragged lengths, block sizes 64, 128 and (128, 64)): flexc's tables equal torch's exactly, and the
tile classes are sound against the mask evaluated element by element by calling the mod itself.
"""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue, score_catalogue
from torch_api import takes

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

# (B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
SHAPES = {
    "broadcast_square_64": (None, None, 256, 256, 64),
    "explicit_ragged_333x1000_128": (2, 3, 333, 1000, 128),
    "batch_only_512x384_128x64": (2, None, 512, 384, (128, 64)),
    "head_only_ragged_1000x333_64": (None, 2, 1000, 333, 64),
}


def _size(n):
    return 1 if n is None else n


def _catalogue(shape_name):
    B, H, Q_LEN, KV_LEN, _ = SHAPES[shape_name]
    return mask_catalogue(_size(B), _size(H), Q_LEN, KV_LEN)


def _reference_dense(mod, B, H, Q_LEN, KV_LEN):
    """The mask by calling the Python mod on broadcast index tensors: no tracing, no flexc."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(Q_LEN).view(1, 1, Q_LEN, 1)
    kv = torch.arange(KV_LEN).view(1, 1, 1, KV_LEN)
    return torch.as_tensor(mod(b, h, q, kv)).to(torch.bool).expand(B, H, Q_LEN, KV_LEN)


def _tile_counts(dense, q_block, kv_block):
    """Per tile: allowed elements, and in-range elements (ragged tiles have fewer)."""
    B, H, Q, KV = dense.shape
    pad = (0, -KV % kv_block, 0, -Q % q_block)
    allowed = torch.nn.functional.pad(dense.to(torch.int32), pad)
    inside = torch.nn.functional.pad(torch.ones(1, 1, Q, KV, dtype=torch.int32), pad)

    def per_tile(x):
        b, h, q, kv = x.shape
        return x.view(b, h, q // q_block, q_block, kv // kv_block, kv_block).sum(dim=(3, 5))

    return per_tile(allowed), per_tile(inside)


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_tables_equal_torch_create_block_mask_for_every_catalogue_mask(shape_name):
    B, H, Q_LEN, KV_LEN, block = SHAPES[shape_name]
    mismatches = []
    for name, mod in _catalogue(shape_name).items():
        ours = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
        ref = tfa.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
        if not torch.equal(ours.to_dense(), ref.to_dense()):
            mismatches.append(f"{name}: to_dense")
        for table in TABLES:
            a, r = getattr(ours, table), getattr(ref, table)
            if a.dtype != r.dtype or a.shape != r.shape or not torch.equal(a, r):
                mismatches.append(f"{name}: {table}")
        assert ours.BLOCK_SIZE == ref.BLOCK_SIZE and ours.seq_lengths == ref.seq_lengths and ours.shape == ref.shape
        assert ours.mask_mod is mod
    assert not mismatches, mismatches


@pytest.mark.parametrize("shape_name", ["explicit_ragged_333x1000_128", "head_only_ragged_1000x333_64"])
def test_tile_classes_are_sound_against_element_evaluation(shape_name):
    B, H, Q_LEN, KV_LEN, block = SHAPES[shape_name]
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    for name, mod in _catalogue(shape_name).items():
        bm = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
        dense = _reference_dense(mod, _size(B), _size(H), Q_LEN, KV_LEN)
        allowed, inside = _tile_counts(dense, q_block, kv_block)
        full = flexc.analysis.tiles.ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
        partial = flexc.analysis.tiles.ordered_to_dense(bm.kv_num_blocks, bm.kv_indices, bm.kv_indices.shape[-1])
        assert not (full & partial).any(), name
        whole_tile = q_block * kv_block
        # FULL: every element allowed, tile wholly in range. EMPTY: nothing allowed. Else PARTIAL.
        assert torch.equal(full.bool(), allowed == whole_tile), name
        assert torch.equal((full | partial).bool(), allowed > 0), name
        assert torch.equal(partial.bool(), (allowed > 0) & (allowed < whole_tile)), name
        assert (allowed <= inside).all()


@pytest.mark.skipif(not takes(tfa.create_block_mask, "separate_full_blocks"),
                    reason="the installed torch's create_block_mask has no separate_full_blocks (2.11)")
def test_separate_full_blocks_false_puts_every_computed_tile_in_the_partial_table():
    B, H, Q_LEN, KV_LEN, block = SHAPES["explicit_ragged_333x1000_128"]
    for name, mod in list(_catalogue("explicit_ragged_333x1000_128").items())[:12]:
        ours = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block,
                                       separate_full_blocks=False)
        ref = tfa.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block,
                                    separate_full_blocks=False)
        assert ours.full_kv_num_blocks is None and ours.full_q_indices is None
        for table in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"):
            assert torch.equal(getattr(ours, table), getattr(ref, table)), (name, table)


def test_without_analysis_the_tables_are_the_same():
    B, H, Q_LEN, KV_LEN, block = SHAPES["batch_only_512x384_128x64"]
    for name, mod in _catalogue("batch_only_512x384_128x64").items():
        with_analysis = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
        exact = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block, _analytic=False)
        for table in TABLES:
            assert torch.equal(getattr(with_analysis, table), getattr(exact, table)), (name, table)


def test_create_mask_equals_torch_for_mask_mods_and_score_mods():
    B, H, Q_LEN, KV_LEN = 2, 3, 70, 45
    for name, mod in mask_catalogue(B, H, Q_LEN, KV_LEN).items():
        for b, h in ((B, H), (None, None)):
            ours = flexc.create_mask(mod, b, h, Q_LEN, KV_LEN, device="cpu")
            ref = tfa.create_mask(mod, b, h, Q_LEN, KV_LEN, device="cpu")
            assert ours.dtype == torch.bool and torch.equal(ours, ref), name
    for name, mod in score_catalogue(B, H, Q_LEN, KV_LEN).items():
        ours = flexc.create_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu")
        ref = tfa.create_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu")
        assert ours.dtype == torch.bool and torch.equal(ours, ref), name


def test_create_mask_in_small_chunks_equals_one_chunk():
    mods = mask_catalogue(2, 2, 50, 61)
    traced = flexc.trace(mods["document_logical_causal"])
    whole = flexc.analysis.tiles.dense_mask(traced, 2, 2, 50, 61, "cpu")
    chunked = flexc.analysis.tiles.dense_mask(traced, 2, 2, 50, 61, "cpu", max_elements=100)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, _reference_dense(mods["document_logical_causal"], 2, 2, 50, 61))


def test_tile_batches_of_any_size_give_the_same_classes():
    mods = mask_catalogue(1, 2, 300, 200)
    mod = mods["per_head_window"]
    traced = flexc.trace(mod)
    coords = torch.ones(1, 2, 5, 4, dtype=torch.bool).nonzero()
    one_batch = flexc.analysis.tiles.evaluate_tiles(traced, coords, 300, 200, 64, 64)
    tiny_batches = flexc.analysis.tiles.evaluate_tiles(traced, coords, 300, 200, 64, 64, max_elements=64 * 64)
    assert torch.equal(one_batch, tiny_batches)
    ref = tfa.create_block_mask(mod, 1, 2, 300, 200, device="cpu", BLOCK_SIZE=64)
    full = flexc.analysis.tiles.ordered_to_dense(ref.full_kv_num_blocks, ref.full_kv_indices, 4)
    expected = ref.to_dense() + full  # 0 empty, 1 partial, 2 full
    assert torch.equal(one_batch.view(1, 2, 5, 4).to(torch.int32), expected)
