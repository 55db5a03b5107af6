"""Interval rules of flexc.analysis.ranges, one operator at a time: a known box in, the exact bounds out.

The expected bounds are found by brute force: the expression is evaluated at every point of the box
with flexc.evaluate and the min/max taken. Rules documented as exact must match it; rules that are
only sound (``%`` across a wrap) must contain it and equal the documented fallback.
"""
import math
import subprocess
import sys

import pytest
import torch

from flexc.mods import ir
from flexc.mods.evaluate import evaluate
from flexc.analysis.ranges import classify_tiles, range_over_box
import flexc
from repo import ROOT

q, k, b, h = ir.input_("q_idx"), ir.input_("kv_idx"), ir.input_("b"), ir.input_("h")
c = ir.const


def brute_force(expr, box, buffers=()):
    """(min, max) of an int expression, or (all, any) of a bool one, at every point of the box."""
    grids = {}
    names = ("b", "h", "q_idx", "kv_idx")
    for axis, name in enumerate(names):
        lo, hi = box.get(name, (0, 0))
        shape = [1, 1, 1, 1]
        shape[axis] = hi - lo + 1
        grids[name] = torch.arange(lo, hi + 1).view(shape)
    values = evaluate(expr, buffers=buffers, **grids)
    if expr.kind == ir.BOOL:
        return bool(values.all()), bool(values.any())
    return int(values.min()), int(values.max())


def binary(op, x, y):
    return ir.binary(op, x, y)


BOX = {"q_idx": (37, 52), "kv_idx": (3, 29)}

EXACT_INT_CASES = {
    "q - k": binary("sub", q, k),
    "k - q": binary("sub", k, q),
    "3q - 2k + 7": binary("add", binary("sub", binary("mul", c(3), q), binary("mul", k, c(2))), c(7)),
    "-q": ir.unary("neg", q),
    "(q + 5) - (k + 5)": binary("sub", binary("add", q, c(5)), binary("add", k, c(5))),
    "(q - k) + (k - q) cancels": binary("add", binary("sub", q, k), binary("sub", k, q)),
    "q // 8": binary("floordiv", q, c(8)),
    "q // -8": binary("floordiv", q, c(-8)),
    "(q - k) // 16": binary("floordiv", binary("sub", q, k), c(16)),
    "q % 64 without wrap": binary("mod", q, c(64)),
    "q % -64 without wrap": binary("mod", q, c(-64)),
    "min(q, k + 30)": binary("min", q, binary("add", k, c(30))),
    "max(q, k + 30)": binary("max", q, binary("add", k, c(30))),
    "abs(k - q) spanning 0": ir.unary("abs", binary("sub", k, binary("sub", q, c(20)))),
    "abs(k - q) negative": ir.unary("abs", binary("sub", k, q)),
    "clamp(q - k, 10, 30)": binary("min", binary("max", binary("sub", q, k), c(10)), c(30)),
    "q * k": binary("mul", q, k),
    "bitwise not q": ir.unary("not", q),
    "sign(q - 45)": ir.unary("sign", binary("sub", q, c(45))),
    "b and h affine": binary("add", binary("mul", c(4), h), b),
    "(k - 20) ** 2 spanning 0": binary("pow", binary("sub", k, c(20)), c(2)),
    "(k - q) ** 3": binary("pow", binary("sub", k, q), c(3)),
}


@pytest.mark.parametrize("name", list(EXACT_INT_CASES))
def test_integer_rule_gives_exact_bounds_on_a_known_box(name):
    expr = EXACT_INT_CASES[name]
    box = dict(BOX, b=(1, 3), h=(2, 5))
    assert range_over_box(expr, box) == brute_force(expr, box)


def test_modulo_across_a_wrap_gives_the_whole_residue_range():
    # q in [37, 52] crosses 48, so q % 16 takes 5..15 and 0..4: the hull is [0, 15]
    expr = binary("mod", q, c(16))
    assert brute_force(expr, BOX) == (0, 15)
    assert range_over_box(expr, BOX) == (0, 15)
    assert range_over_box(binary("mod", q, c(-16)), BOX) == (-15, 0)


def test_modulo_within_one_period_is_exact():
    assert range_over_box(binary("mod", q, c(16)), {"q_idx": (50, 60)}) == (2, 12)


def test_division_by_a_non_constant_is_unknown():
    assert range_over_box(binary("floordiv", q, binary("add", k, c(1))), BOX) == (-math.inf, math.inf)


COMPARISONS = ["ge", "gt", "le", "lt", "eq", "ne"]


@pytest.mark.parametrize("op", COMPARISONS)
@pytest.mark.parametrize("box", [
    {"q_idx": (100, 110), "kv_idx": (0, 50)},      # q above k everywhere
    {"q_idx": (0, 50), "kv_idx": (100, 110)},      # q below k everywhere
    {"q_idx": (40, 60), "kv_idx": (50, 70)},       # overlapping
    {"q_idx": (50, 60), "kv_idx": (60, 70)},       # touching at one point
    {"q_idx": (7, 7), "kv_idx": (7, 7)},           # a single equal point
])
def test_comparison_of_affine_forms_is_exact(op, box):
    expr = binary(op, q, k)
    assert range_over_box(expr, box) == brute_force(expr, box)


@pytest.mark.parametrize("op", COMPARISONS)
def test_comparison_sees_through_rearranged_affine_terms(op):
    # (q + 100) - k compared with 100 + (q - k) - ... : only a canonical form decides it
    lhs = binary("sub", binary("add", q, c(100)), k)
    rhs = binary("add", binary("sub", q, k), c(100))
    expr = binary(op, lhs, rhs)
    box = {"q_idx": (0, 63), "kv_idx": (0, 63)}
    assert range_over_box(expr, box) == brute_force(expr, box)


def test_products_that_cancel_to_an_affine_form_are_exact():
    # (q + 1) * (q + 1) - q * q == 2q + 1: only expanding the polynomial (sympy) sees it is affine
    square = lambda x: binary("mul", x, x)
    lhs = binary("sub", square(binary("add", q, c(1))), square(q))
    expr = binary("ge", lhs, binary("add", k, k))
    for box in ({"q_idx": (10, 20), "kv_idx": (0, 10)}, {"q_idx": (0, 5), "kv_idx": (20, 30)},
                {"q_idx": (10, 20), "kv_idx": (5, 25)}):
        assert range_over_box(expr, box) == brute_force(expr, box)


def test_equality_with_gaps_is_sound():
    # 2q - 2k == 1 never holds; the interval contains 1, so the rule may only say "possibly"
    expr = binary("eq", binary("sub", binary("mul", c(2), q), binary("mul", c(2), k)), c(1))
    must, may = range_over_box(expr, BOX)
    assert not must


def test_logic_rules_combine_must_and_may():
    causal = binary("ge", q, k)
    window = binary("le", binary("sub", q, k), c(16))
    for box in ({"q_idx": (64, 79), "kv_idx": (0, 15)}, {"q_idx": (16, 31), "kv_idx": (0, 15)},
                {"q_idx": (0, 15), "kv_idx": (0, 15)}, {"q_idx": (0, 15), "kv_idx": (32, 47)}):
        for expr in (binary("and", causal, window), binary("or", causal, window), ir.unary("not", causal),
                     binary("xor", causal, window)):
            assert range_over_box(expr, box) == brute_force(expr, box), (str(expr), box)


def test_where_picks_the_decided_branch_or_the_hull():
    cond = binary("lt", q, c(40))
    expr = ir.where(cond, binary("add", q, c(1000)), k)
    assert range_over_box(expr, {"q_idx": (0, 10), "kv_idx": (0, 5)}) == (1000, 1010)
    assert range_over_box(expr, {"q_idx": (50, 60), "kv_idx": (0, 5)}) == (0, 5)
    # undecided condition: the hull of both branches (sound; q < 40 is not carried into the branch)
    assert range_over_box(expr, {"q_idx": (30, 60), "kv_idx": (0, 5)}) == (0, 1060)
    assert brute_force(expr, {"q_idx": (30, 60), "kv_idx": (0, 5)}) == (0, 1039)
    bool_expr = ir.where(cond, binary("ge", q, c(0)), binary("lt", k, c(0)))
    box = {"q_idx": (30, 60), "kv_idx": (0, 5)}
    assert range_over_box(bool_expr, box) == brute_force(bool_expr, box)


def _buffer(t, slot=0):
    kind = ir.BOOL if t.dtype == torch.bool else ir.INT
    return ir.buffer(slot, str(t.dtype).removeprefix("torch."), t.dim(), kind)


def test_one_dimensional_lookup_gives_the_exact_min_and_max_of_the_range():
    table = torch.tensor([5, 3, 9, 9, 1, 7, 2, 8, 6, 4] * 13)
    expr = ir.load(_buffer(table), (q,))
    for lo, hi in [(0, 0), (1, 4), (3, 11), (0, 129), (17, 17), (60, 99)]:
        box = {"q_idx": (lo, hi)}
        assert range_over_box(expr, box, (table,), sizes={"q_idx": 130}) == brute_force(expr, box, (table,))


def test_lookup_indexed_by_head_and_query():
    table = torch.randint(-50, 50, (3, 40), generator=torch.Generator().manual_seed(0))
    expr = ir.load(_buffer(table), (h, binary("add", q, c(2))))
    box = {"h": (2, 2), "q_idx": (5, 20)}
    assert range_over_box(expr, box, (table,), sizes={"h": 3, "q_idx": 38}) == brute_force(expr, box, (table,))


def test_two_dimensional_lookup_over_a_small_box_is_exact():
    table = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    expr = ir.load(_buffer(table), (binary("floordiv", q, c(4)), binary("floordiv", k, c(4))))
    box = {"q_idx": (4, 11), "kv_idx": (8, 15)}
    assert range_over_box(expr, box, (table,), sizes={"q_idx": 32, "kv_idx": 32}) == brute_force(expr, box, (table,))


def test_lookup_with_a_possibly_negative_index_is_unknown():
    table = torch.arange(10)
    expr = ir.load(_buffer(table), (binary("sub", q, c(1)),))
    assert range_over_box(expr, {"q_idx": (0, 5)}, (table,), sizes={"q_idx": 10}) == (-math.inf, math.inf)
    # wholly negative indices count from the end, as in torch
    shifted = ir.load(_buffer(table), (binary("sub", q, c(10)),))
    box = {"q_idx": (2, 5)}
    assert range_over_box(shifted, box, (table,), sizes={"q_idx": 10}) == brute_force(shifted, box, (table,)) == (2, 5)


def test_equal_lookups_of_sorted_ids_decide_constant_and_disjoint_ranges():
    doc = torch.tensor([0] * 10 + [1] * 10 + [2] * 10)
    load = lambda i: ir.load(_buffer(doc), (i,))
    same = binary("eq", load(q), load(k))
    sizes = {"q_idx": 30, "kv_idx": 30}
    assert range_over_box(same, {"q_idx": (0, 9), "kv_idx": (2, 7)}, (doc,), sizes) == (True, True)
    assert range_over_box(same, {"q_idx": (0, 9), "kv_idx": (20, 29)}, (doc,), sizes) == (False, False)
    assert range_over_box(same, {"q_idx": (5, 14), "kv_idx": (8, 12)}, (doc,), sizes) == (False, True)


def test_int32_arithmetic_that_could_wrap_is_unknown():
    # an int32 table plus a large Python int is computed in int32 by torch and may wrap around
    table = torch.tensor([2 ** 31 - 10, 0, 5], dtype=torch.int32)
    expr = binary("add", ir.load(_buffer(table), (q,)), c(100))
    assert range_over_box(expr, {"q_idx": (1, 2)}, (table,), sizes={"q_idx": 3}) == (-math.inf, math.inf)
    small = binary("add", ir.load(_buffer(torch.tensor([0, 5], dtype=torch.int32)), (q,)), c(100))
    assert range_over_box(small, {"q_idx": (0, 1)}, (torch.tensor([0, 5], dtype=torch.int32),),
                          sizes={"q_idx": 2}) == (100, 105)


def test_float_expressions_are_not_analysed():
    expr = binary("lt", binary("truediv", q, c(2)), c(10.0))
    assert range_over_box(expr, {"q_idx": (0, 4)}) == (False, True)


def test_classify_tiles_rejects_bad_arguments_with_the_fix():
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises(TypeError, match="mask_mod"):
        classify_tiles(flexc.trace(lambda s, b, h, q_idx, kv_idx: s), 1, 1, 8, 8, 4, 4)
    with pytest.raises(TypeError, match="Q_BLOCK must be an int"):
        classify_tiles(traced, 1, 1, 8, 8, 4.0, 4)
    with pytest.raises(ValueError, match="KV_LEN must be >= 1, got 0"):
        classify_tiles(traced, 1, 1, 8, 0, 4, 4)


def test_block_mask_of_a_linear_mask_does_not_import_sympy():
    # importing sympy costs 0.3-1.5 s; linear masks (and flexc.evaluate) must not pay it on first use
    code = ("import sys, flexc\n"
            "flexc.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 9),"
            " None, None, 300, 300, device='cpu', BLOCK_SIZE=32)\n"
            "print('sympy' in sys.modules)\n")
    root = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "False"
