"""The tracer and evaluator reproduce what calling a mod directly on index tensors computes.

The reference is always the user's own function run by torch on broadcast int64 index tensors
(``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,L,1]``, ``kv_idx [1,1,1,S]``), or torch's
FlexAttention; never flexc's own output.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

import flexc
from flexc.mods.evaluate import index_grid
from catalogue import mask_catalogue, score_catalogue, generate_sliding_window

SIZES = [(1, 2, 37, 53), (2, 3, 64, 64), (1, 1, 130, 7)]
_NAMES_SIZE = SIZES[0]


# ---- helpers -------------------------------------------------------------------------------

def direct_call(mod, B, H, L, S, score=None):
    """The reference: the mod itself on broadcast index tensors, expanded to ``[B, H, L, S]``."""
    grid = index_grid(B, H, L, S)
    args = (grid["b"], grid["h"], grid["q_idx"], grid["kv_idx"])
    out = mod(score, *args) if score is not None else mod(*args)
    out = torch.as_tensor(out)
    # a one-element slice such as `bias[0:1, q_idx]` adds leading singleton dimensions
    while out.dim() > 4 and out.shape[0] == 1:
        out = out[0]
    return out.expand(B, H, L, S)


def assert_same(got: torch.Tensor, expected: torch.Tensor):
    """Bit-exact for bool/int, 1e-6 relative for floats (inf and NaN must match in place)."""
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype, f"dtype {got.dtype} != {expected.dtype}"
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)
    else:
        assert torch.equal(got, expected), f"{(got != expected).sum().item()} elements differ"


def check_mod(mod, B=1, H=2, L=37, S=53, seed=0, reference=None):
    """evaluate_grid(mod) equals the direct call of ``reference`` (default: the mod itself); a
    score_mod's int result is compared as float32."""
    traced = flexc.trace(mod)
    score = None
    if traced.kind == "score_mod":
        score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(seed))
    expected = direct_call(reference or mod, B, H, L, S, score)
    got = flexc.evaluate_grid(mod, B, H, L, S, score=score)
    if traced.kind == "score_mod" and not expected.dtype.is_floating_point:
        expected = expected.to(torch.float32)  # flexc's contract: a score_mod yields a float score
    assert_same(got, expected)
    return traced


# ---- the catalogue --------------------------------------------------------------------------

def test_catalogue_has_at_least_30_masks_and_12_score_mods():
    assert len(mask_catalogue(*_NAMES_SIZE)) >= 30
    assert len(score_catalogue(*_NAMES_SIZE)) >= 12


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(mask_catalogue(*_NAMES_SIZE)))
def test_catalogue_mask_evaluates_like_direct_call(name, size):
    mod = mask_catalogue(*size)[name]
    traced = check_mod(mod, *size)
    assert traced.kind == "mask_mod" and traced.root.kind == "bool"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(score_catalogue(*_NAMES_SIZE)))
def test_catalogue_score_mod_evaluates_like_direct_call(name, size):
    mod = score_catalogue(*size)[name]
    traced = check_mod(mod, *size)
    assert traced.kind == "score_mod" and traced.root.kind == "float"


@pytest.mark.parametrize("name", sorted(mask_catalogue(*_NAMES_SIZE)))
def test_catalogue_mask_matches_torch_create_mask(name):
    B, H, L, S = _NAMES_SIZE
    mod = mask_catalogue(B, H, L, S)[name]
    expected = create_mask(mod, B, H, L, S, device="cpu")
    assert torch.equal(flexc.evaluate_grid(mod, B, H, L, S), expected)


def test_catalogue_score_mods_match_torch_flex_attention():
    """Softmax over flexc-evaluated scores (float64) equals torch's FlexAttention for every score_mod."""
    B, H, L, S, E = 1, 2, 19, 23, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))
    for name, mod in score_catalogue(B, H, L, S).items():
        expected = flex_attention(q, k, v, score_mod=mod)
        raw = (q @ k.transpose(-1, -2)) / math.sqrt(E)
        scores = flexc.evaluate_grid(mod, B, H, L, S, score=raw).to(torch.float64)
        got = torch.softmax(scores, dim=-1) @ v
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


# ---- every supported operation ------------------------------------------------------------
# Each entry is a mod; the test compares evaluate_grid with the direct call.

_CAP = torch.arange(-3, 9, dtype=torch.float32)
_MASK_OPS = {
    # comparisons, operator and function forms
    "ge": lambda b, h, q, kv: q >= kv,
    "gt": lambda b, h, q, kv: q > kv,
    "le": lambda b, h, q, kv: q <= kv,
    "lt": lambda b, h, q, kv: q < kv,
    "eq": lambda b, h, q, kv: q == kv,
    "ne": lambda b, h, q, kv: q != kv,
    "reflected_compare_const": lambda b, h, q, kv: 5 < q,
    "torch_ge": lambda b, h, q, kv: torch.ge(q, kv),
    "torch_greater": lambda b, h, q, kv: torch.greater(q, kv),
    "torch_eq": lambda b, h, q, kv: torch.eq(q % 3, kv % 3),
    "method_le": lambda b, h, q, kv: q.le(kv),
    "method_ne": lambda b, h, q, kv: q.ne(kv + 1),
    # logic on bools
    "and": lambda b, h, q, kv: (q >= kv) & (q - kv < 9),
    "or": lambda b, h, q, kv: (q < 4) | (kv < 4),
    "xor": lambda b, h, q, kv: (q < 10) ^ (kv < 10),
    "invert": lambda b, h, q, kv: ~(q >= kv),
    "and_with_python_bool": lambda b, h, q, kv: (q >= kv) & True,
    "reflected_or_python_bool": lambda b, h, q, kv: False | (q >= kv),
    "torch_logical_and": lambda b, h, q, kv: torch.logical_and(q >= kv, kv > 2),
    "torch_logical_or": lambda b, h, q, kv: torch.logical_or(q == 0, kv == 0),
    "torch_logical_not": lambda b, h, q, kv: torch.logical_not(q > kv),
    "torch_bitwise_and": lambda b, h, q, kv: torch.bitwise_and(q >= kv, h == 1),
    "method_logical_xor": lambda b, h, q, kv: (q > 3).logical_xor(kv > 3),
    "where_bool": lambda b, h, q, kv: torch.where(q > 20, kv > 20, kv < 20),
    "where_python_bools": lambda b, h, q, kv: torch.where(q > kv, True, False),
    "bool_cast_of_int": lambda b, h, q, kv: ((q - kv) % 4).bool(),
    "to_bool": lambda b, h, q, kv: (q * kv % 3).to(torch.bool),
    "float_compare": lambda b, h, q, kv: torch.sin(q * 0.1) > torch.cos(kv * 0.1),
    "int_and_bits": lambda b, h, q, kv: (q & kv) == 0,
    "int_or_bits": lambda b, h, q, kv: (q | kv) > 40,
    "int_xor_bits": lambda b, h, q, kv: (q ^ kv) < 8,
    "bool_plus_bool_stays_bool": lambda b, h, q, kv: (q > 5) + (kv > 5),
    "bool_times_bool_stays_bool": lambda b, h, q, kv: (q > 5) * (kv > 5),
}

_VALUE_OPS = {
    # integer arithmetic (flexc returns it as a float32 score)
    "add": lambda s, b, h, q, kv: q + kv,
    "sub": lambda s, b, h, q, kv: q - kv,
    "mul": lambda s, b, h, q, kv: q * kv,
    "floordiv": lambda s, b, h, q, kv: (q - kv) // 5,
    "floordiv_by_traced": lambda s, b, h, q, kv: q // (kv + 1),
    "mod": lambda s, b, h, q, kv: (q - kv) % 7,
    "mod_by_traced": lambda s, b, h, q, kv: q % (kv + 1),
    "pow_int": lambda s, b, h, q, kv: (q - kv) ** 2,
    "neg": lambda s, b, h, q, kv: -q,
    "abs_builtin": lambda s, b, h, q, kv: abs(q - kv),
    "reflected_sub": lambda s, b, h, q, kv: 100 - q,
    "reflected_floordiv": lambda s, b, h, q, kv: 100 // (q + 1),
    "reflected_mod": lambda s, b, h, q, kv: 100 % (kv + 1),
    "reflected_pow": lambda s, b, h, q, kv: 2 ** (q % 5),
    "sign_int": lambda s, b, h, q, kv: torch.sign(q - kv),
    "torch_clamp_int": lambda s, b, h, q, kv: torch.clamp(q - kv, -3, 5),
    "clamp_min_kw": lambda s, b, h, q, kv: torch.clamp(q - kv, min=0),
    "clamp_max_method": lambda s, b, h, q, kv: (q - kv).clamp(max=2),
    "clamp_min_method": lambda s, b, h, q, kv: (q - kv).clamp_min(1),
    "minimum": lambda s, b, h, q, kv: torch.minimum(q, kv),
    "maximum": lambda s, b, h, q, kv: torch.maximum(q, kv),
    "method_abs": lambda s, b, h, q, kv: (q - kv).abs(),
    "torch_add_sub_mul": lambda s, b, h, q, kv: torch.mul(torch.add(q, 1), torch.sub(kv, 2)),
    "torch_remainder": lambda s, b, h, q, kv: torch.remainder(q - kv, 6),
    "torch_floor_divide": lambda s, b, h, q, kv: torch.floor_divide(q - kv, 4),
    "div_floor_mode": lambda s, b, h, q, kv: torch.div(q - kv, 3, rounding_mode="floor"),
    "where_int": lambda s, b, h, q, kv: torch.where(q > kv, q, kv),
    "bool_times_int": lambda s, b, h, q, kv: (q >= kv) * 3,
    "h_and_b": lambda s, b, h, q, kv: 10 * b + h,
    # float arithmetic on the score
    "score_add_const": lambda s, b, h, q, kv: s + 1.5,
    "score_truediv": lambda s, b, h, q, kv: s / 3.0,
    "int_truediv": lambda s, b, h, q, kv: q / (kv + 1),
    "reflected_truediv": lambda s, b, h, q, kv: 1.0 / (s + 10.0),
    "pow_float": lambda s, b, h, q, kv: (s * s + 1.0) ** 0.5,
    "score_floordiv": lambda s, b, h, q, kv: s // 0.5,
    "score_mod_const": lambda s, b, h, q, kv: s % 0.75,
    "neg_score": lambda s, b, h, q, kv: -s,
    "abs_score": lambda s, b, h, q, kv: abs(s),
    "torch_abs": lambda s, b, h, q, kv: torch.abs(s),
    "exp": lambda s, b, h, q, kv: torch.exp(s),
    "exp2": lambda s, b, h, q, kv: torch.exp2(s),
    "log": lambda s, b, h, q, kv: torch.log(s.abs() + 1.0),
    "log2": lambda s, b, h, q, kv: torch.log2(s * s + 0.5),
    "log_of_negative_is_nan": lambda s, b, h, q, kv: torch.log(s),
    "sqrt": lambda s, b, h, q, kv: torch.sqrt(s.abs()),
    "rsqrt": lambda s, b, h, q, kv: torch.rsqrt(q + 1.0),
    "tanh": lambda s, b, h, q, kv: torch.tanh(s),
    "sigmoid": lambda s, b, h, q, kv: torch.sigmoid(s),
    "sin": lambda s, b, h, q, kv: torch.sin(s),
    "cos": lambda s, b, h, q, kv: torch.cos(s),
    "floor": lambda s, b, h, q, kv: torch.floor(s * 4),
    "ceil": lambda s, b, h, q, kv: torch.ceil(s * 4),
    "sign_float": lambda s, b, h, q, kv: torch.sign(s),
    "clamp_float": lambda s, b, h, q, kv: torch.clamp(s, -0.5, 0.5),
    "minimum_float": lambda s, b, h, q, kv: torch.minimum(s, s * 0.5),
    "maximum_float_int": lambda s, b, h, q, kv: torch.maximum(s, q - kv),
    "method_tanh": lambda s, b, h, q, kv: s.tanh(),
    "method_exp_sigmoid": lambda s, b, h, q, kv: s.exp().sigmoid(),
    "method_sqrt_of_int": lambda s, b, h, q, kv: (q + 1).sqrt(),
    "method_floor_ceil": lambda s, b, h, q, kv: (s * 3).floor() + (s * 3).ceil(),
    "math_on_constants": lambda s, b, h, q, kv: s * math.sqrt(2.0) + math.log(3.0) * math.pi,
    "float_cast": lambda s, b, h, q, kv: s + (q - kv).float(),
    "long_cast_truncates": lambda s, b, h, q, kv: (s * 3).long(),
    "int_cast": lambda s, b, h, q, kv: (s * 3).int() + q,
    "to_dtype_float32": lambda s, b, h, q, kv: (q * 2).to(torch.float32) + s,
    "to_float64": lambda s, b, h, q, kv: s.to(torch.float64) * 0.1,
    "bool_to_float": lambda s, b, h, q, kv: s + (q >= kv).float(),
    "where_score_inf": lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    "where_score_float_const": lambda s, b, h, q, kv: torch.where(q >= kv, 0.0, s),
    "method_where": lambda s, b, h, q, kv: s.where(q >= kv, s * 2),
    "square_and_reciprocal": lambda s, b, h, q, kv: s.square() + (s.abs() + 1.0).reciprocal(),
    "ones_like": lambda s, b, h, q, kv: s * torch.ones_like(s),
    "full_like": lambda s, b, h, q, kv: torch.full_like(s, 2.5) - s,
    "zeros_like_int": lambda s, b, h, q, kv: torch.zeros_like(q) + kv,
    "masked_fill_method": lambda s, b, h, q, kv: s.masked_fill(q < kv, -float("inf")),
    "torch_masked_fill": lambda s, b, h, q, kv: torch.masked_fill(s, kv % 3 == 0, 0.0),
    "to_other_dtype": lambda s, b, h, q, kv: s + (q - kv).to(s),
    "type_as": lambda s, b, h, q, kv: (q - kv).type_as(s) * s,
    "negative_base_pow": lambda s, b, h, q, kv: (-2) ** (q % 4) + s,
    "torch_min_two_operands": lambda s, b, h, q, kv: torch.min(q - kv, torch.full_like(q - kv, 5)),
    "method_max_two_operands": lambda s, b, h, q, kv: s.max(q * 0.1),
    "full_like_int32": lambda s, b, h, q, kv: s + torch.full_like(q, 3, dtype=torch.int32),
    "full_like_float_on_int": lambda s, b, h, q, kv: torch.full_like(q, 2.7) * kv,
}


@pytest.mark.parametrize("name", sorted(_MASK_OPS))
def test_boolean_operation_evaluates_like_direct_call(name):
    check_mod(_MASK_OPS[name])


@pytest.mark.parametrize("name", sorted(_VALUE_OPS))
def test_value_operation_evaluates_like_direct_call(name):
    check_mod(_VALUE_OPS[name])


# ---- indexing captured tensors ------------------------------------------------------------

def _lookup_mods():
    g = torch.Generator().manual_seed(11)
    H, L, S = 2, 37, 53
    vec = torch.randn(64, generator=g)
    bias3 = torch.randn(H, L, S, generator=g)
    bias4 = torch.randn(2, H, L, S, generator=g)
    doc = torch.randint(0, 5, (64,), generator=g).sort().values
    offsets = torch.tensor([0, 9, 20, 33, 47])
    table = torch.randn(3, H, 64, generator=g)
    allowed = torch.rand(H, 64, generator=g) < 0.5
    int_table = torch.randint(-5, 5, (H, 64), generator=g, dtype=torch.int32)
    return {
        "one_dim": lambda s, b, h, q, kv: s + vec[kv],
        "one_dim_of_expression": lambda s, b, h, q, kv: s + vec[(q * 7 + kv) % 64],
        "multi_dim": lambda s, b, h, q, kv: s + bias3[h, q, kv],
        "four_dim_with_b": lambda s, b, h, q, kv: s + bias4[b, h, q, kv],
        "nested": lambda s, b, h, q, kv: s + offsets[doc[q]] - offsets[doc[kv]],
        "int_index_mixed": lambda s, b, h, q, kv: s + table[2, h, kv],
        "negative_int_index": lambda s, b, h, q, kv: s + table[-1, h, q],
        "one_element_slice": lambda s, b, h, q, kv: s + table[1:2, h, q],
        "tensor_int_index": lambda s, b, h, q, kv: s + table[torch.tensor(0), h, kv],
        "trailing_ellipsis": lambda s, b, h, q, kv: s + bias3[h, q, kv, ...],
        "bool_lookup_mask": lambda b, h, q, kv: allowed[h, kv] & (q >= kv),
        "int32_lookup": lambda s, b, h, q, kv: s * int_table[h, q],
        "int32_lookup_in_index": lambda s, b, h, q, kv: s + vec[int_table[h, kv] + 5],
        "lookup_in_where": lambda s, b, h, q, kv: torch.where(allowed[h, q], vec[kv], s),
        "same_tensor_twice": lambda s, b, h, q, kv: vec[q] * vec[kv] + s,
        "zero_dim_capture": (lambda c: lambda s, b, h, q, kv: s * c)(torch.tensor(1.5)),
        "zero_dim_capture_indexed_empty": (lambda c: lambda s, b, h, q, kv: s * c[()])(torch.tensor(0.25)),
    }


BIAS3 = torch.randn(2, 37, 53, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", sorted(_lookup_mods()))
def test_captured_tensor_indexing_evaluates_like_direct_call(name):
    check_mod(_lookup_mods()[name])


@pytest.mark.parametrize("chained", [
    lambda s, b, h, q, kv: s + BIAS3[h][q][kv],
    lambda s, b, h, q, kv: s + BIAS3[h, q][kv],
    lambda s, b, h, q, kv: s + BIAS3[h][q, kv],
    lambda s, b, h, q, kv: s + BIAS3[:, q][h, kv],
    lambda s, b, h, q, kv: s + BIAS3[..., kv][h, q],
    lambda s, b, h, q, kv: s + BIAS3[h, ..., kv][q],
    lambda s, b, h, q, kv: s + BIAS3[:, :, kv][h][q],
], ids=["one_at_a_time", "two_then_one", "one_then_two", "full_slice_first", "leading_ellipsis",
        "middle_ellipsis", "two_full_slices"])
def test_chained_indexing_equals_multi_dim_indexing(chained):
    # Chained indexing is a per-element (vmap) idiom: on broadcast index tensors it would index the
    # wrong dimension, so the reference is the equivalent multi-dimensional lookup.
    check_mod(chained, reference=lambda s, b, h, q, kv: s + BIAS3[h, q, kv])


ALLOWED = torch.rand(2, 37, 53, generator=torch.Generator().manual_seed(6)) < 0.5


@pytest.mark.parametrize("mod", [
    lambda b, h, q, kv: ALLOWED[h][q][kv],
    lambda b, h, q, kv: ALLOWED[:, q][h, kv],
    lambda b, h, q, kv: ALLOWED[..., kv][h, q],
    lambda b, h, q, kv: ALLOWED[h, :][:, kv][q],
], ids=["chained", "full_slice_first", "leading_ellipsis", "slices_in_two_steps"])
def test_per_element_indexing_matches_torch_create_mask(mod):
    # torch runs mods per element (vmap), where these forms are ordinary scalar lookups
    assert torch.equal(flexc.evaluate_grid(mod, 1, 2, 37, 53), create_mask(mod, 1, 2, 37, 53, device="cpu"))


def test_nested_lookup_prints_both_buffers():
    doc = torch.tensor([0, 0, 1, 1, 1])
    offsets = torch.tensor([0, 2])

    def logical_causal(b, h, q_idx, kv_idx):
        return q_idx - offsets[doc[q_idx]] >= kv_idx - offsets[doc[kv_idx]]

    traced = flexc.trace(logical_causal)
    assert str(traced) == "q_idx - offsets[doc[q_idx]] >= kv_idx - offsets[doc[kv_idx]]"
    assert {id(t) for t in traced.buffers} == {id(doc), id(offsets)}


# ---- how mods are written: closures, globals, defaults, partial, lambdas, factories --------

GLOBAL_WINDOW = 12
GLOBAL_BIAS = torch.linspace(-1, 1, 64)


def global_window_mask(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= GLOBAL_WINDOW


def global_bias_score(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_BIAS[kv_idx]


def mask_with_default(b, h, q_idx, kv_idx, window=5, bias=torch.ones(64, dtype=torch.bool)):
    return (q_idx - kv_idx <= window) & bias[q_idx]


def score_with_extra_params(score, b, h, q_idx, kv_idx, scale, table):
    return score * scale + table[h]


class CallableMask:
    """An object with __call__ is a mod too."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < self.limit


@pytest.mark.parametrize("mod", [
    global_window_mask,
    global_bias_score,
    mask_with_default,
    functools.partial(score_with_extra_params, scale=0.5, table=torch.tensor([1.0, -2.0])),
    functools.partial(functools.partial(score_with_extra_params, scale=2.0), table=torch.tensor([0.5, 3.0])),
    lambda b, h, q_idx, kv_idx: q_idx % 3 == kv_idx % 3,
    generate_sliding_window(4),
    CallableMask(9),
], ids=["global_constant", "global_tensor", "default_arguments", "partial", "nested_partial",
        "lambda", "factory", "callable_object"])
def test_ways_of_writing_a_mod_evaluate_like_direct_call(mod):
    check_mod(mod)


def test_arity_decides_the_kind():
    assert flexc.trace(lambda b, h, q, kv: q >= kv).kind == "mask_mod"
    assert flexc.trace(lambda s, b, h, q, kv: s).kind == "score_mod"
    assert flexc.trace(mask_with_default).kind == "mask_mod"  # parameters with defaults do not count


def test_captured_tensor_names_come_from_the_source():
    slopes = torch.ones(2)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    assert str(flexc.trace(alibi)) == "score + slopes[h] * (kv_idx - q_idx)"
    assert str(flexc.trace(global_bias_score)) == "score + GLOBAL_BIAS[kv_idx]"


# ---- structural keys and printing ---------------------------------------------------------

def _doc_mask_over(ids: torch.Tensor):
    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return document


def test_closures_differing_only_in_tensor_values_share_a_key():
    a = flexc.trace(_doc_mask_over(torch.tensor([0, 0, 1, 1])))
    b = flexc.trace(_doc_mask_over(torch.tensor([0, 1, 1, 2, 2, 2])))
    assert a.key == b.key
    assert hash(a.key) == hash(b.key)
    assert a.buffers[0] is not b.buffers[0]


def test_captured_tensor_dtype_and_rank_enter_the_key():
    ints = flexc.trace(_doc_mask_over(torch.tensor([0, 1])))
    int32 = flexc.trace(_doc_mask_over(torch.tensor([0, 1], dtype=torch.int32)))
    assert ints.key != int32.key


def test_different_python_constants_give_different_keys():
    keys = {flexc.trace(generate_sliding_window(w)).key for w in (16, 17, 256)}
    assert len(keys) == 3
    int_const = flexc.trace(lambda s, b, h, q, kv: s * 2)
    float_const = flexc.trace(lambda s, b, h, q, kv: s * 2.0)
    assert int_const.key != float_const.key


def test_same_mod_written_twice_gives_equal_keys():
    first = flexc.trace(lambda b, h, q, kv: (q >= kv) & (q - kv <= 8))
    second = flexc.trace(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 8))
    assert first.key == second.key
    assert first.root is second.root  # hash-consing


def test_score_and_mask_with_same_body_have_different_keys():
    mask = flexc.trace(lambda b, h, q, kv: q >= kv)
    score = flexc.trace(lambda s, b, h, q, kv: torch.where(q >= kv, s, 0.0))
    assert mask.key != score.key


@pytest.mark.parametrize("mod, text", [
    (generate_sliding_window(256), "(q_idx >= kv_idx) & (q_idx - kv_idx <= 256)"),
    (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, "q_idx >= kv_idx"),
    (lambda b, h, q_idx, kv_idx: (q_idx // 32 == kv_idx // 32) | ~(kv_idx < 4),
     "(q_idx // 32 == kv_idx // 32) | ~(kv_idx < 4)"),
    (lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0), "30.0 * tanh(score / 30.0)"),
    (lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf")),
     "where(q_idx >= kv_idx, score, -inf)"),
    (lambda score, b, h, q_idx, kv_idx: (score - (q_idx - kv_idx)) * 2, "(score - (q_idx - kv_idx)) * 2"),
    (lambda b, h, q_idx, kv_idx: torch.clamp(q_idx, 3, 60) - kv_idx > 0,
     "minimum(maximum(q_idx, 3), 60) - kv_idx > 0"),
    (lambda score, b, h, q_idx, kv_idx: score + torch.full_like(q_idx, 3, dtype=torch.int32),
     "score + (3).to(int32)"),
    (lambda score, b, h, q_idx, kv_idx: torch.min(score, torch.full_like(score, 2.0)), "minimum(score, 2.0)"),
])
def test_printing_gives_readable_python(mod, text):
    assert str(flexc.trace(mod)) == text


def test_noop_mask_written_like_torch_folds_to_true():
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: b.new_ones(size=(), dtype=torch.bool))
    assert str(traced) == "True" and traced.root.op == "const"


def test_negative_constant_base_keeps_its_parentheses():
    text = str(flexc.trace(lambda s, b, h, q_idx, kv_idx: (-2) ** q_idx + s))
    assert text == "(-2) ** q_idx + score"
    assert eval(text.replace("q_idx", "3").replace("score", "0")) == (-2) ** 3  # printed text is valid Python


def test_node_table_does_not_grow_with_discarded_traces():
    import gc
    from flexc.mods import ir

    gc.collect()
    before = len(ir._table)
    for window in range(300):
        flexc.trace(generate_sliding_window(10_000 + window))
    flexc.mods.trace_cache.clear()  # the trace cache keeps the latest traces of each mod on purpose
    gc.collect()
    assert len(ir._table) <= before + 10


def test_zero_dim_captured_tensor_prints_as_its_name():
    temperature = torch.tensor(0.5)
    assert str(flexc.trace(lambda score, b, h, q_idx, kv_idx: score * temperature)) == "score * temperature"


def test_integer_score_mod_prints_its_float_cast():
    assert str(flexc.trace(lambda s, b, h, q, kv: q - kv)) == "(q_idx - kv_idx).to(float32)"


# ---- evaluator contracts ------------------------------------------------------------------

def test_chunked_evaluation_equals_one_chunk():
    mod = mask_catalogue(2, 3, 64, 64)["document_logical_causal"]
    whole = flexc.evaluate_grid(mod, 2, 3, 64, 64)
    chunked = flexc.evaluate_grid(mod, 2, 3, 64, 64, max_elements=2 * 3 * 64 * 5)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, direct_call(mod, 2, 3, 64, 64))


@pytest.mark.parametrize("name", ["document_logical_causal", "natten_1d_7", "block_sparse_lookup_4d"])
def test_evaluating_an_offset_tile_equals_that_slice_of_the_grid(name):
    B, H, L, S = 2, 3, 64, 64
    mod = mask_catalogue(B, H, L, S)[name]
    tile = flexc.evaluate(flexc.trace(mod), **index_grid(B, H, 16, 32, q_start=40, kv_start=24))
    assert torch.equal(tile.expand(B, H, 16, 32), direct_call(mod, B, H, L, S)[:, :, 40:56, 24:56])


def test_replacing_buffers_evaluates_new_values_without_retracing():
    traced = flexc.trace(_doc_mask_over(torch.tensor([0, 0, 1, 1])))
    new_ids = torch.tensor([0, 1, 1, 2])
    grid = index_grid(1, 1, 4, 4)
    got = flexc.evaluate(traced, buffers=(new_ids,), **grid)
    assert torch.equal(got, direct_call(_doc_mask_over(new_ids), 1, 1, 4, 4))


def test_gradient_flows_to_captured_tensor():
    bias = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    mod = lambda s, b, h, q, kv: torch.tanh(s + bias[h, q, kv]) * 2.0
    score = torch.randn(1, 2, 5, 7, dtype=torch.float64)
    flexc.evaluate_grid(mod, 1, 2, 5, 7, score=score).sum().backward()
    expected = 2.0 * (1 - torch.tanh(score[0] + bias.detach()) ** 2)
    torch.testing.assert_close(bias.grad, expected)


@pytest.mark.parametrize("score", [torch.tensor(0.5), torch.randn(1, 1, 1, 9)], ids=["0d", "one_row"])
def test_evaluate_grid_broadcasts_a_score_without_query_rows(score):
    mod = lambda s, b, h, q, kv: s + q - kv
    got = flexc.evaluate_grid(mod, 1, 2, 6, 9, score=score, max_elements=2 * 9 * 2)  # 3 chunks
    assert_same(got, direct_call(mod, 1, 2, 6, 9, score))


def test_evaluate_names_a_missing_input():
    traced = flexc.trace(lambda s, b, h, q, kv: s + q)
    with pytest.raises(ValueError, match="score"):
        flexc.evaluate(traced, **index_grid(1, 1, 2, 2))


# ---- speed --------------------------------------------------------------------------------

def test_tracing_a_typical_mod_is_fast():
    doc = torch.zeros(128, dtype=torch.int64)

    def document_sliding_window(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)

    times = []
    for _ in range(50):
        start = time.perf_counter()
        flexc.trace(document_sliding_window)
        times.append(time.perf_counter() - start)
    median_ms = statistics.median(times) * 1e3
    print(f"\ntracing document_sliding_window: median {median_ms:.3f} ms over 50 runs")
    assert median_ms < 5.0
