"""flexc.mods.derivative: the IR of d score_mod / d score and d / d gathered element, evaluated on index
grids in float64, against torch.autograd through a direct (untraced) call of the same score_mod:
every catalogue score_mod, hand-picked rules at their kinks, and hypothesis over random expressions."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from catalogue import score_catalogue
from flexc.mods import ir
from flexc.mods.derivative import differentiate
from derivative_check import B, H, L, S, autograd_gradients, check_derivative, ir_gradients
from reference import index_tensors
from strategies import DIFFERENTIABLE, compile_mod, examples



@pytest.mark.parametrize("name", sorted(score_catalogue(B, H, L, S)))
def test_every_catalogue_score_mod_derivative_matches_autograd(name):
    check_derivative(score_catalogue(B, H, L, S)[name])


def test_simplified_forms_are_short():
    soft_cap = flexc.trace(lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0))
    assert str(differentiate(soft_cap).d_score) == "1.0 - tanh(score / 20.0) * tanh(score / 20.0)"
    checker = flexc.trace(lambda s, b, h, q, kv: torch.where(q >= kv, s * 0.5, s * 2.0))
    assert str(differentiate(checker).d_score) == "where(q_idx >= kv_idx, 0.5, 2.0)"
    bias = torch.randn(H)
    d = differentiate(flexc.trace(lambda s, b, h, q, kv: s + bias[h]))
    assert str(d.d_score) == "1.0" and [str(g.grad) for g in d.gathers] == ["1.0"]


def test_a_tensor_gathered_twice_gives_two_gathers_and_the_same_element_one():
    table = torch.randn(L + S)
    twice = lambda s, b, h, q, kv: s * table[q] + table[kv] * table[kv]
    d = differentiate(flexc.trace(twice))
    assert sorted(ir.format_expr(g.load) for g in d.gathers) == ["buf0[kv_idx]", "buf0[q_idx]"]
    check_derivative(twice)


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: torch.clamp(s, min=-1.0, max=1.0),
    lambda s, b, h, q, kv: torch.clamp(s, min=0.0),
    lambda s, b, h, q, kv: torch.minimum(s, s * 0.0),          # a tie at s == 0 splits the gradient
    lambda s, b, h, q, kv: torch.maximum(s, (q - kv) * 1.0),   # ties where s == q - kv
    lambda s, b, h, q, kv: torch.abs(s),
    lambda s, b, h, q, kv: s ** 2 + torch.abs(s) ** 0.5 + 2.0 ** s,
    lambda s, b, h, q, kv: torch.abs(s) ** (q % 3 * 1.0),      # exponent 0 rows: gradient 0
    lambda s, b, h, q, kv: torch.floor(s) + torch.sign(s) * s + torch.remainder(s, 1.5),
    lambda s, b, h, q, kv: torch.sqrt(torch.abs(s) + 1) + torch.rsqrt(torch.abs(s) + 1) + torch.log2(torch.abs(s) + 1),
    lambda s, b, h, q, kv: torch.exp2(torch.sin(s)) * torch.cos(s) + torch.sigmoid(s).double().float(),
    lambda s, b, h, q, kv: s / (q + 1) - (kv + 1) / (s * s + 1),
    lambda s, b, h, q, kv: torch.tan(s * 0.3) + torch.atan(s) + torch.asin(s * 0.1) + torch.acos(s * 0.1)
    + torch.sinh(s * 0.5) + torch.cosh(s * 0.5) + torch.asinh(s) + torch.acosh(s * s + 1.5) + torch.atanh(s * 0.1),
    lambda s, b, h, q, kv: torch.erf(s) + torch.erfc(s * 0.5) + torch.expm1(s * 0.3) + torch.log1p(s * s)
    + torch.log10(s * s + 1) + torch.trunc(s) + torch.round(s * 0.7),
    lambda s, b, h, q, kv: torch.fmod(s, 1.25) + torch.fmod(2.0 + q * 0.0, s * s + 0.5) + torch.atan2(s, kv + 1.0)
    + torch.atan2(q * 0.5 - 3.0, s),
], ids=["clamp", "clamp_min", "min_tie", "max_tie", "abs", "pow", "pow_int_exponent", "piecewise", "roots",
        "trig_cast", "division", "inverse_trig_hyperbolic", "erf_log", "fmod_atan2"])
def test_rules_at_their_kinks_match_autograd(fn):
    b, h, q, kv = index_tensors(B, H, L, S)
    gen = torch.Generator().manual_seed(3)
    # scores on a coarse lattice, so the kinks (0, +-1, ties) are hit exactly
    score = (torch.randint(-6, 7, (B, H, L, S), generator=gen).double() / 2).requires_grad_()
    w = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64)
    (want,) = autograd_gradients(fn, score, w, [])
    d_score, _ = ir_gradients(fn, score, w)
    torch.testing.assert_close(d_score, want, rtol=1e-6, atol=1e-9, equal_nan=True)  # 0 ** -0.5 * sign(0)


def test_score_mod_that_ignores_the_score_has_zero_score_derivative():
    d = differentiate(flexc.trace(lambda s, b, h, q, kv: (q - kv) * 0.5))
    assert d.d_score.op == "const" and d.d_score.attr == 0.0 and d.gathers == ()


# ---- random expressions ----------------------------------------------------------------------

_BIAS = torch.randn(H, generator=torch.Generator().manual_seed(5))
_TABLE = torch.randn(S, generator=torch.Generator().manual_seed(6))


def _mod(body: str):
    # the root always reads the score, so the score derivative is exercised
    return compile_mod(f"lambda s, b, h, q, kv: ({body}) + s * 0.25", {"bias": _BIAS, "table": _TABLE})


@examples(60)
@given(DIFFERENTIABLE.expressions("float"), st.integers(0, 1000))
def test_random_expressions_match_autograd(body, seed):
    check_derivative(_mod(body), seed)
