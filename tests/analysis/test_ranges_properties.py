"""Property tests of analytic tile classification over random mask expressions.

Soundness: a tile classified FULL is all-True and a tile classified EMPTY all-False in a dense
evaluation of the mask (flexc.evaluate_grid), for random expressions built from affine comparisons,
``//``, ``%``, min/max/abs, where, lookups of captured tensors and combinators, at random lengths and
block sizes. Exactness: single comparisons of affine forms leave no tile undecided that is not
really mixed. And create_block_mask gives the same tables with and without the analysis.
"""
import torch
from hypothesis import given, settings, strategies as st

import flexc
from reference import exact_classes
from flexc.analysis.ranges import EMPTY, FULL, MIXED, UNDECIDED, classify_tiles, mark_mixed_tiles

INPUTS = ("b", "h", "q_idx", "kv_idx")


# ---- random expressions, built as trees and turned into ordinary Python mask_mods ----------------

def int_exprs(tables):
    leaves = st.one_of(st.sampled_from([("input", n) for n in INPUTS]), st.tuples(st.just("const"), st.integers(-40, 40)))

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["add", "sub"]), children, children),
            st.tuples(st.just("mulc"), children, st.integers(-3, 3)),
            st.tuples(st.sampled_from(["floordiv", "mod"]), children, st.sampled_from([1, 2, 3, 7, 16, -5])),
            st.tuples(st.sampled_from(["min", "max"]), children, children),
            st.tuples(st.just("abs"), children),
            st.tuples(st.just("where"), bool_leaf_comparisons(children), children, children),
            st.tuples(st.just("lookup"), st.integers(0, len(tables) - 1), children),
        )
    return st.recursive(leaves, extend, max_leaves=6)


def bool_leaf_comparisons(ints):
    return st.tuples(st.sampled_from(["ge", "gt", "le", "lt", "eq", "ne"]), ints, ints)


def bool_exprs(tables, bool_tables):
    ints = int_exprs(tables)
    leaves = st.one_of(bool_leaf_comparisons(ints),
                       st.tuples(st.just("blookup"), st.integers(0, len(bool_tables) - 1), ints))

    def extend(children):
        return st.one_of(st.tuples(st.sampled_from(["and", "or", "xor"]), children, children),
                         st.tuples(st.just("not"), children))
    return st.recursive(leaves, extend, max_leaves=4)


def build(tree, tables, bool_tables):
    """A mask_mod (closure over the captured tables) computing ``tree``."""
    def ev(node, env):
        op = node[0]
        if op == "input":
            return env[node[1]]
        if op == "const":
            return node[1]
        if op == "add":
            return ev(node[1], env) + ev(node[2], env)
        if op == "sub":
            return ev(node[1], env) - ev(node[2], env)
        if op == "mulc":
            return ev(node[1], env) * node[2]
        if op == "floordiv":
            return ev(node[1], env) // node[2]
        if op == "mod":
            return ev(node[1], env) % node[2]
        if op in ("min", "max"):
            x, y = ev(node[1], env), ev(node[2], env)
            x = torch.tensor(x) if isinstance(x, int) else x
            y = torch.tensor(y) if isinstance(y, int) else y
            return torch.minimum(x, y) if op == "min" else torch.maximum(x, y)
        if op == "abs":
            x = ev(node[1], env)
            return abs(x)
        if op == "where":
            cond = ev(node[1], env)
            x, y = ev(node[2], env), ev(node[3], env)
            return torch.where(cond, x, y)
        if op == "lookup":  # any index lands in range: wrap it into the table by % len
            t = tables[node[1]]
            return t[ev(node[2], env) % t.shape[0]]
        if op == "blookup":
            t = bool_tables[node[1]]
            return t[ev(node[2], env) % t.shape[0]]
        if op in ("ge", "gt", "le", "lt", "eq", "ne"):
            x, y = ev(node[1], env), ev(node[2], env)
            return getattr(torch.tensor(x) if isinstance(x, int) else x, op)(y)
        if op == "and":
            return ev(node[1], env) & ev(node[2], env)
        if op == "or":
            return ev(node[1], env) | ev(node[2], env)
        if op == "xor":
            return ev(node[1], env) ^ ev(node[2], env)
        if op == "not":
            return ~ev(node[1], env)
        raise AssertionError(op)

    def mask_mod(b, h, q_idx, kv_idx):
        return ev(tree, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx})
    return mask_mod


def make_tables(seed):
    g = torch.Generator().manual_seed(seed)
    sorted_ids = torch.sort(torch.randint(0, 6, (50,), generator=g)).values
    return ([sorted_ids, torch.randint(-20, 20, (9,), generator=g), torch.arange(64) // 8],
            [torch.rand(40, generator=g) < 0.5, torch.ones(5, dtype=torch.bool)])


sizes = dict(B=st.integers(1, 2), H=st.integers(1, 3), Q_LEN=st.integers(1, 80), KV_LEN=st.integers(1, 80),
             Q_BLOCK=st.sampled_from([1, 4, 8, 16, 32]), KV_BLOCK=st.sampled_from([1, 3, 8, 16, 64]))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), seed=st.integers(0, 3), **sizes)
def test_full_tiles_are_all_true_and_empty_tiles_all_false(data, seed, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    tables, bool_tables = make_tables(seed)
    tree = data.draw(bool_exprs(tables, bool_tables))
    traced = flexc.trace(build(tree, tables, bool_tables))
    classes = classify_tiles(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    exact = exact_classes(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    assert classes.shape == exact.shape and classes.dtype == torch.int8
    assert not ((classes == FULL) & (exact != FULL)).any(), str(traced)
    assert not ((classes == EMPTY) & (exact != EMPTY)).any(), str(traced)
    marked = mark_mixed_tiles(traced, classes.clone(), Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    assert not ((marked == MIXED) & (exact != UNDECIDED)).any(), str(traced)
    assert torch.equal(marked == MIXED, (classes == UNDECIDED) & (marked != UNDECIDED))


def affine(data, unit_steps):
    coef = st.integers(-1, 1) if unit_steps else st.integers(-3, 3)
    return {name: data.draw(coef if name in ("q_idx", "kv_idx") else st.integers(-3, 3)) for name in INPUTS}


@settings(max_examples=100, deadline=None)
@given(data=st.data(), op=st.sampled_from(["ge", "gt", "le", "lt", "eq", "ne"]), d=st.integers(-60, 60), **sizes)
def test_affine_comparisons_are_decided_exactly(data, op, d, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    # eq/ne are exact when the form lhs - rhs moves in unit steps along q and kv (no gaps between its
    # min and max), so for them only lhs reads q_idx and kv_idx
    unit = op in ("eq", "ne")
    lhs, rhs = affine(data, unit), affine(data, unit)
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


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 3), **sizes)
def test_block_mask_with_analysis_equals_the_dense_one(data, seed, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    tables, bool_tables = make_tables(seed)
    mod = build(data.draw(bool_exprs(tables, bool_tables)), tables, bool_tables)
    block = (Q_BLOCK, KV_BLOCK)
    ours = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block)
    dense = flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block, _analytic=False)
    for table in TABLES:
        assert torch.equal(getattr(ours, table), getattr(dense, table)), table
