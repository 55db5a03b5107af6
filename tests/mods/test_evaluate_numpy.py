"""Decoding's numpy evaluation of a mask_mod equals torch's evaluation, or declines.

The reference is flexc.evaluate (torch operations, itself checked against calling the mods on
index tensors), over every mask in the catalogue and random graphs of integer/boolean operations
(strategies.INTEGER_GRAPHS), on small index grids like a decoding step's partial blocks.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from catalogue import mask_catalogue
from flexc.mods.evaluate import evaluate
from flexc.mods.evaluate_numpy import evaluate_small
from flexc.mods.trace import MASK_MOD, trace
from strategies import COMPARISONS, INTEGER_GRAPHS, LOGIC, compile_mod, examples


def _grids(B, H, L, kv_positions):
    torch_grid = {"b": torch.arange(B).view(B, 1, 1, 1), "h": torch.arange(H).view(1, H, 1, 1),
                  "q_idx": torch.arange(L).view(1, 1, L, 1),
                  "kv_idx": torch.tensor(kv_positions).view(1, 1, 1, -1)}
    return torch_grid, {name: t.numpy() for name, t in torch_grid.items()}


def _assert_same(traced, B, H, L, kv_positions):
    torch_grid, numpy_grid = _grids(B, H, L, kv_positions)
    ours = evaluate_small(traced, numpy_grid)
    if ours is None:
        return False
    ref = evaluate(traced, **torch_grid)
    assert ours.ndim == 4
    shape = torch.broadcast_shapes(ref.shape, tuple(ours.shape))
    assert np.array_equal(np.broadcast_to(ours, shape), ref.expand(shape).numpy()), str(traced)
    assert ours.dtype == ref.numpy().dtype, (ours.dtype, ref.dtype)
    return True


def test_every_catalogue_mask_matches_torch_or_declines():
    B, H, L, S = 2, 3, 5, 300
    evaluated = 0
    for name, mod in mask_catalogue(B, H, L, S).items():
        traced = trace(mod, MASK_MOD)
        kv = list(range(120, 130)) + list(range(S - 40, S))
        evaluated += _assert_same(traced, B, H, L, kv)
    assert evaluated >= 15  # most masks are integer/boolean graphs


def test_floats_and_division_by_a_variable_decline():
    t = torch.tensor([3, 0, 2])
    floats = trace(lambda b, h, q, kv: (q.float() * 0.5) < kv, MASK_MOD)
    by_variable = trace(lambda b, h, q, kv: (kv // t[q % 3]) == 0, MASK_MOD)
    grid = _grids(1, 1, 2, [0, 1, 2])[1]
    assert evaluate_small(floats, grid) is None
    assert evaluate_small(by_variable, grid) is None


def test_a_captured_0d_tensor_reads_its_current_value_and_keeps_the_index_dtype():
    offset = torch.tensor(100)
    small = torch.tensor([7, 9], dtype=torch.int32)
    traced = trace(lambda b, h, q, kv: ((q + offset) >= kv) & (small[kv % 2] + q > 8), MASK_MOD)
    assert _assert_same(traced, 1, 1, 3, list(range(95, 110)))
    offset.fill_(50)  # the trace reads the tensor when evaluated, as torch's evaluation does
    assert _assert_same(traced, 1, 1, 3, list(range(45, 60)))


@examples(60)
@given(INTEGER_GRAPHS.expressions("int"), INTEGER_GRAPHS.expressions("int"), st.sampled_from(COMPARISONS),
       st.sampled_from(LOGIC), st.integers(-50, 400), st.booleans())
def test_random_integer_masks_match_torch(left, right, compare, logic, offset_value, negate):
    off = torch.tensor(offset_value)
    table = torch.tensor([5, -3, 200, 17, 0, 64, 9, 1], dtype=torch.int32)
    env = {"off": off, "table": table}
    comparison = f"((({left}) + q * 0) {compare} ({right}))"  # (a tensor, even for two constants)
    body = f"{'~' if negate else ''}{comparison} {logic} (kv <= q + off)"
    mod = compile_mod(f"lambda b, h, q, kv: {body}", env)
    traced = trace(mod, MASK_MOD)
    kv = list(range(0, 7)) + list(range(250, 262))
    assert _assert_same(traced, 1, 2, 3, kv)
    # one decoding row: b, h and q_idx as int64 scalars (as decode_cpu passes them)
    ours = evaluate_small(traced, {"b": np.int64(0), "h": np.int64(1), "q_idx": np.int64(2),
                                   "kv_idx": np.array(kv).reshape(1, 1, 1, -1)})
    ref = evaluate(traced, b=torch.zeros(1, 1, 1, 1, dtype=torch.long), h=torch.ones(1, 1, 1, 1, dtype=torch.long),
                   q_idx=torch.full((1, 1, 1, 1), 2), kv_idx=torch.tensor(kv).view(1, 1, 1, -1))
    shape = torch.broadcast_shapes(ref.shape, tuple(ours.shape))
    assert np.array_equal(np.broadcast_to(ours, shape), ref.expand(shape).numpy()), body
    assert ours.dtype == ref.numpy().dtype, (body, ours.dtype, ref.dtype)


@pytest.mark.parametrize("q_value", [0, 37, 299])
def test_one_element_indices_as_int64_scalars_match_torch(q_value):
    """Decoding passes b, h and q_idx of one row as int64 scalars (cheaper than 1-element arrays)."""
    S = 300
    kv = list(range(0, 20)) + list(range(S - 40, S))
    evaluated = 0
    for name, mod in mask_catalogue(1, 1, S, S).items():
        traced = trace(mod, MASK_MOD)
        scalars = {"b": np.int64(0), "h": np.int64(0), "q_idx": np.int64(q_value),
                   "kv_idx": np.array(kv).reshape(1, 1, 1, -1)}
        ours = evaluate_small(traced, scalars)
        if ours is None:
            continue
        ref = evaluate(traced, b=torch.zeros(1, 1, 1, 1, dtype=torch.long), h=torch.zeros(1, 1, 1, 1, dtype=torch.long),
                       q_idx=torch.full((1, 1, 1, 1), q_value), kv_idx=torch.tensor(kv).view(1, 1, 1, -1))
        shape = torch.broadcast_shapes(ref.shape, tuple(ours.shape))
        assert np.array_equal(np.broadcast_to(ours, shape), ref.expand(shape).numpy()), name
        assert ours.dtype == ref.numpy().dtype, (name, ours.dtype, ref.dtype)
        evaluated += 1
    assert evaluated >= 15


def test_not_of_a_comparison_of_two_numbers_is_logical():
    """``~(offset > 5)`` with a captured 0-d offset compares two Python numbers: True must become
    False (Python's ``~True`` is -2, which would allow every key)."""
    offset = torch.tensor(7)
    traced = trace(lambda b, h, q, kv: ~(offset > 5) | (kv < 3), MASK_MOD)
    ours = evaluate_small(traced, {"q_idx": np.int64(0), "kv_idx": np.arange(6).reshape(1, 1, 1, -1)})
    assert ours.tolist() == [[[[True, True, True, False, False, False]]]]
