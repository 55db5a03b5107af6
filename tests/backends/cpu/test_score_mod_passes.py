"""The plain-torch CPU forward rewrites a general score_mod for base-2 scores in fewer passes
(flexc/backends/cpu/score_mod_passes.py, log2_form): a constant factor on every read of ``score`` moves
into the query's scale, and log2(e) joins a trailing product with a constant; a mod whose values
are provably bounded (value_bounds) takes its bound as a fixed softmax offset instead of a running row
max. Each must be taken where it applies, refused where it does not, and give the float64 dense
reference's output, lse and max_scores."""
import math

import pytest
import torch

import flexc
from flexc.backends.cpu import fused_cpu, head_groups, row_mods, score_mod_passes, torch_cpu_backward
from flexc.mods.trace import trace
from reference import dense_attention

B, H, L, S, E = 2, 3, 200, 170, 16
LOG2E = 1.0 / math.log(2.0)


def _softcap(score, b, h, q, kv):
    return 20.0 * torch.tanh(score / 20.0)


def _scaled_tanh(score, b, h, q, kv):  # factor read as score * K, trailing constant on the right
    return torch.tanh(score * 0.3) * 4


def _div_then_mul(score, b, h, q, kv):  # the root is the product; its operand is score / 4
    return score / 4 * 3


def _only_scaled(score, b, h, q, kv):  # the root itself reads score: moved whole into the query
    return score * 2.5


def _two_factors(score, b, h, q, kv):  # score read with two factors: neither rewrite applies
    return (score / 2) * (score / 3)


def _mixed_reads(score, b, h, q, kv):  # score also read outside a product: no pre-scaling
    return 3.0 * torch.tanh(score / 3.0) + 0.1 * torch.sin(score)


def _positional(score, b, h, q, kv):  # indices too: the factor still moves, the root is a sum
    return torch.tanh(score / 5.0) * 5.0 + 0.01 * (kv - q) * (h + 1)


CASES = [(_softcap, 1 / 20.0, True), (_scaled_tanh, 0.3, True), (_div_then_mul, 0.25, True),
         (_only_scaled, 2.5, False), (_two_factors, 1.0, False), (_mixed_reads, 1.0, False),
         (_positional, 1 / 5.0, False)]


def _window(b, h, q, kv):  # rows below 12 see no key at all
    return (q >= kv) & (q - kv <= 90) & (q >= 12)


def _sigmoid_gate(score, b, h, q, kv):  # bounded: [-4, 6]
    return 10.0 * torch.sigmoid(score) - 4.0


def _capped_or_negated(score, b, h, q, kv):  # bounded through where and neg: [-30, 30]
    return torch.where(kv > q - 50, 30.0 * torch.tanh(score / 30.0), -(7.0 * torch.tanh(score)))


def _wide_cap(score, b, h, q, kv):  # bounded, but too widely for a fixed offset: [-50, 50]
    return 50.0 * torch.tanh(score / 50.0)


BOUNDS = [(_softcap, (-20.0, 20.0), True), (_sigmoid_gate, (-4.0, 6.0), True),
          (_capped_or_negated, (-30.0, 30.0), True), (_wide_cap, (-50.0, 50.0), False),
          (_scaled_tanh, (-4.0, 4.0), True), (_mixed_reads, None, False), (_positional, None, False),
          (_div_then_mul, None, False)]


@pytest.mark.parametrize("score_mod, pre, folded", CASES)
def test_rewrite_is_taken_exactly_where_it_applies(score_mod, pre, folded):
    root, got_pre, got_folded = score_mod_passes.log2_form(trace(score_mod, "score_mod").root)
    assert got_pre == pytest.approx(pre, rel=1e-15) and got_folded is folded
    # the rewritten graph on scores * pre is the original (times log2 e when folded)
    s = torch.randn(4, 7, dtype=torch.float64) * 10
    idx = {"b": torch.zeros(1, 1), "h": torch.ones(1, 1), "q_idx": torch.arange(4).view(4, 1),
           "kv_idx": torch.arange(7).view(1, 7)}
    from flexc.mods.evaluate import evaluate
    want = evaluate(trace(score_mod, "score_mod"), score=s, **idx) * (LOG2E if folded else 1.0)
    torch.testing.assert_close(evaluate(root, score=s * got_pre, **idx), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score_mod, bounds, fixed", BOUNDS)
def test_bounds_and_fixed_offset_are_taken_exactly_where_they_apply(score_mod, bounds, fixed):
    traced = trace(score_mod, "score_mod")
    assert score_mod_passes.value_bounds(traced.root) == (None if bounds is None else pytest.approx(bounds))
    mods = row_mods.Mods(traced, None, head_groups._groups(1, 1, 1, 1, 1, 1)[0], 1, 1, 4, 4, torch.device("cpu"))
    assert (mods.fixed_max is not None) is fixed
    if bounds is not None and fixed:  # every value of the mod at most the offset (base 2)
        s = torch.linspace(-1e4, 1e4, 20001, dtype=torch.float64).view(1, 1, 1, -1)
        from flexc.mods.evaluate import evaluate
        values = evaluate(traced, score=s, b=torch.zeros(1, 1, 1, 1), h=torch.zeros(1, 1, 1, 1),
                          q_idx=torch.zeros(1, 1, 1, 1), kv_idx=torch.arange(20001).view(1, 1, 1, -1) % 100)
        assert (values * LOG2E <= mods.fixed_max + 1e-9).all()


@pytest.mark.parametrize("score_mod", [case[0] for case in CASES] + [_sigmoid_gate, _capped_or_negated, _wide_cap])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.float64, 1e-11)])
@pytest.mark.parametrize("with_max", [False, True])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_forward_with_rewritten_mods_matches_dense_reference(monkeypatch, score_mod, masked, dtype, atol, with_max,
                                                             small_chunks):
    if small_chunks:  # many key chunks per row: the softmax state carries across them
        monkeypatch.setattr(head_groups, "CHUNK_ELEMENTS", 1 << 12)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64).to(dtype) for n in (L, S, S))
    mask_mod = _window if masked else None
    bm = flexc.create_block_mask(mask_mod, B, 1, L, S, device="cpu", BLOCK_SIZE=(32, 32)) if masked else None
    # (max_scores needs the running max: the fixed offset is taken without it only)
    out, aux = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                    return_aux=flexc.AuxRequest(lse=True, max_scores=with_max))
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=0)
    torch.testing.assert_close(aux.lse.double(), ref_lse.double(), atol=atol * 10, rtol=0)
    if masked:  # rows that allow nothing: output 0, lse -inf
        assert (out[:, :, :12] == 0).all() and torch.isneginf(aux.lse[:, :, :12]).all()
    if not with_max:
        return
    # max_scores is float32 whatever the inputs
    torch.testing.assert_close(aux.max_scores.double(), ref_max.double(), atol=max(atol * 10, 1e-5), rtol=0)


@pytest.mark.parametrize("fn, expected", [
    (_softcap, (1 / 20.0, 20.0)),
    (_scaled_tanh, (0.3, 4.0)),
    (lambda score, b, h, q, kv: torch.tanh(score), (1.0, 1.0)),
    (_div_then_mul, None),
    (lambda score, b, h, q, kv: 20.0 * torch.tanh(score / 20.0) + 1.0, None),
    (lambda score, b, h, q, kv: 20.0 * torch.tanh(score / (q + 1.0)), None),
])
def test_tanh_cap_recognises_soft_capping_only(fn, expected):
    got = score_mod_passes.tanh_cap(trace(fn, "score_mod").root)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("fn", [_softcap, _scaled_tanh])
def test_soft_capping_gradients_with_the_slope_in_place_match_float64(monkeypatch, fn):
    monkeypatch.setattr(fused_cpu, "backward_supported", lambda *a: False)
    taken = []
    real = torch_cpu_backward._chunk_probs
    monkeypatch.setattr(torch_cpu_backward, "_chunk_probs", lambda *a, **k: taken.append(a[7].tanh_cap) or real(*a, **k))
    window = lambda b, h, q, kv: (q - kv <= 50) & (kv - q <= 20)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    bm = flexc.create_block_mask(window, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, score_mod=fn, block_mask=bm)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(out, (q, k, v), grad_out)
    assert taken and taken[0] is not None
    ref = torch.autograd.grad(dense_attention(q, k, v, fn, window)[0], (q, k, v), grad_out)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)
