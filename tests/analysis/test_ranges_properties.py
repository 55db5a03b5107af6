"""Property tests of analytic tile classification over random mask expressions.

Soundness: a tile classified FULL is all-True and a tile classified EMPTY all-False in a dense
evaluation of the mask (flexc.evaluate_grid), for random expressions built from affine comparisons,
``//``, ``%``, min/max/abs, where, lookups of captured tensors and combinators, at random lengths and
block sizes. Exactness: single comparisons of affine forms leave no tile undecided that is not
really mixed. And create_block_mask gives the same tables with and without the analysis.
"""
import torch
from hypothesis import given, strategies as st

import flexc
from reference import exact_classes
from flexc.analysis.ranges import EMPTY, FULL, MIXED, UNDECIDED, classify_tiles, mark_mixed_tiles
from strategies import TILE_MASKS, affine_forms, compile_mod, examples, mask_source


def build(source, tables, bool_tables):
    """The mask_mod ``source`` defines, reading the captured tables t0.. and bt0.. (strategies.TILE_MASKS)."""
    names = {f"t{i}": t for i, t in enumerate(tables)} | {f"bt{i}": t for i, t in enumerate(bool_tables)}
    return compile_mod(mask_source(source), names)


def make_tables(seed):
    g = torch.Generator().manual_seed(seed)
    sorted_ids = torch.sort(torch.randint(0, 6, (50,), generator=g)).values
    return ([sorted_ids, torch.randint(-20, 20, (9,), generator=g), torch.arange(64) // 8],
            [torch.rand(40, generator=g) < 0.5, torch.ones(5, dtype=torch.bool)])


sizes = dict(B=st.integers(1, 2), H=st.integers(1, 3), Q_LEN=st.integers(1, 80), KV_LEN=st.integers(1, 80),
             Q_BLOCK=st.sampled_from([1, 4, 8, 16, 32]), KV_BLOCK=st.sampled_from([1, 3, 8, 16, 64]))


@examples(150)
@given(data=st.data(), seed=st.integers(0, 3), **sizes)
def test_full_tiles_are_all_true_and_empty_tiles_all_false(data, seed, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    tables, bool_tables = make_tables(seed)
    source = data.draw(TILE_MASKS.expressions("bool"))
    traced = flexc.trace(build(source, tables, bool_tables))
    classes = classify_tiles(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    exact = exact_classes(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    assert classes.shape == exact.shape and classes.dtype == torch.int8
    assert not ((classes == FULL) & (exact != FULL)).any(), str(traced)
    assert not ((classes == EMPTY) & (exact != EMPTY)).any(), str(traced)
    marked = mark_mixed_tiles(traced, classes.clone(), Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    assert not ((marked == MIXED) & (exact != UNDECIDED)).any(), str(traced)
    assert torch.equal(marked == MIXED, (classes == UNDECIDED) & (marked != UNDECIDED))


@examples(100)
@given(data=st.data(), op=st.sampled_from(["ge", "gt", "le", "lt", "eq", "ne"]), d=st.integers(-60, 60), **sizes)
def test_affine_comparisons_are_decided_exactly(data, op, d, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    # eq/ne are exact when the form lhs - rhs moves in unit steps along q and kv (no gaps between its
    # min and max), so for them only lhs reads q_idx and kv_idx
    unit = op in ("eq", "ne")
    lhs, rhs = data.draw(affine_forms(unit)), data.draw(affine_forms(unit))
    if unit:
        rhs.update(q_idx=0, kv_idx=0)

    def mask_mod(b, h, q_idx, kv_idx):
        env = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        left = sum(c * env[n] for n, c in lhs.items()) + d
        right = sum(c * env[n] for n, c in rhs.items())
        return getattr(left, op)(right)

    traced = flexc.trace(mask_mod)
    classes = classify_tiles(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    assert torch.equal(classes, exact_classes(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)), str(traced)


TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@examples(40)
@given(data=st.data(), seed=st.integers(0, 3), **sizes)
def test_block_mask_with_analysis_equals_the_dense_one(data, seed, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    tables, bool_tables = make_tables(seed)
    mod = build(data.draw(TILE_MASKS.expressions("bool")), tables, bool_tables)
    block = (Q_BLOCK, KV_BLOCK)
    ours = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
    dense = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block, _analytic=False)
    for table in TABLES:
        assert torch.equal(getattr(ours, table), getattr(dense, table)), table
