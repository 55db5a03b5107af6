"""Attention dropout (flexc's ``dropout_p=``): p = 0 is the call without it; a seed fixes the mask, the
mask is the counter-based one of flexc.backends.dropout (Philox 4x32-10, checked bit for bit against an
independent integer implementation), outputs and gradients equal a float64 dense reference that
uses the same mask, the mean over seeds approaches the undropped output, masked rows stay 0."""
from __future__ import annotations

import math

import pytest
import torch

import flexc
from flexc.backends import dropout
from reference import index_tensors, random_qkv

B, HQ, HKV, L, S, E = 2, 4, 2, 40, 56, 16


def _philox_python(seed: int, counters: tuple) -> int:
    """Philox 4x32-10 on Python integers (Random123's definition), the first output word."""
    m = 0xFFFFFFFF
    k0, k1 = seed & m, (seed >> 32) & m
    c0, c1, c2, c3 = counters
    for _ in range(10):
        p_b, p_a = 0xCD9E8D57 * c2, 0xD2511F53 * c0
        c0, c1, c2, c3 = (p_b >> 32) ^ c1 ^ k0, p_b & m, (p_a >> 32) ^ c3 ^ k1, p_a & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c0


def test_philox_equals_its_definition_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 2 ** 32, (4, 64), generator=g, dtype=torch.int64)
    counters[:, :4] = torch.tensor([0, 0xFFFFFFFF, 1, 0x80000000]).view(1, 4)  # the edges of 32 bits
    for seed in (0, 1, 0x1234_5678_9ABC_DEF0, 2 ** 62 - 1):
        got = dropout.philox(seed, *counters)
        want = [_philox_python(seed, tuple(int(c) for c in counters[:, j])) for j in range(counters.shape[1])]
        assert got.tolist() == want


def _mask(b, h, q_idx, kv_idx):  # causal from the end, with dead rows (q % 7 == 3)
    return (q_idx + (S - L) >= kv_idx) & (q_idx % 7 != 3)


def _dense(q, k, v, drop: dropout.Dropout, score_mod=None):
    """Dropout attention in float64 with flexc.backends.dropout's mask on the whole [B, Hq, L, S] grid."""
    G = HQ // HKV
    kk, vv = (t.double().repeat_interleave(G, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(E)
    b, h, qi, kv = index_tensors(B, HQ, L, S)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, kv)
    s = torch.where(_mask(b, h, qi, kv), s, -math.inf)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, s), -1))
    return (p * dropout.keep_scale(drop, HQ, b, h, qi, kv, torch.float64)) @ vv


def _call(q, k, v, p, seed, backend="TORCH", **kwargs):
    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=16)
    return flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, dropout_p=p,
                                generator=torch.Generator().manual_seed(seed) if seed is not None else None,
                                kernel_options={"BACKEND": backend}, **kwargs)


def test_zero_dropout_is_the_call_without_it():
    q, k, v = random_qkv(B, HQ, HKV, L, S, E)
    for backend in ("TORCH", "TRITON"):
        assert torch.equal(_call(q, k, v, 0.0, 1, backend), _call(q, k, v, 0.0, None, backend))


def test_dropout_output_and_gradients_equal_dense_with_the_same_mask():
    q, k, v = (t.requires_grad_() for t in random_qkv(B, HQ, HKV, L, S, E, seed=2))
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() * 0.1
    seed = 7
    expected = dropout.draw(0.3, torch.Generator().manual_seed(seed))
    out = _call(q, k, v, 0.3, seed, score_mod=alibi)
    ref = _dense(q, k, v, expected, alibi)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    assert torch.equal(out, _call(q, k, v, 0.3, seed, score_mod=alibi))  # the seed fixes the mask
    assert not torch.equal(out, _call(q, k, v, 0.3, seed + 1, score_mod=alibi))
    dead = torch.tensor([i % 7 == 3 for i in range(L)])
    assert (out[:, :, dead] == 0).all()  # masked rows stay 0
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    leaves = [q, k, v, slopes]
    got = torch.autograd.grad((out * d_out).sum(), leaves)
    want = torch.autograd.grad((ref * d_out.double()).sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "slopes"], got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_the_mean_over_seeds_approaches_the_undropped_output():
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=4)
    plain = _call(q, k, v, 0.0, None).double()
    n = 300
    mean = sum(_call(q, k, v, 0.5, seed).double() for seed in range(n)) / n
    # each output element is a sum of kept terms with variance <= sum p_i^2 v_i^2 (p/(1-p) = 1);
    # the mean of n draws has standard deviation at most sqrt(that / n): allow 5 of them
    G = HQ // HKV
    b, h, qi, kv = index_tensors(B, HQ, L, S)
    s = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(E)
    s = torch.where(_mask(b, h, qi, kv), s, -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1))
    std = ((p ** 2) @ v.double().repeat_interleave(G, 1) ** 2).sqrt() / math.sqrt(n)
    assert ((mean - plain).abs() <= 5 * std + 1e-6).all()
    assert (mean - plain).abs().max() > 0  # it does drop


def test_triton_backend_warns_and_draws_the_same_mask():
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=5)
    with pytest.warns(UserWarning, match="dropout_p > 0 runs on the TORCH backend"):
        triton = _call(q, k, v, 0.2, 9, "TRITON")
    assert torch.equal(triton, _call(q, k, v, 0.2, 9, "TORCH"))


def test_bad_dropout_arguments_name_the_fix():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match=r"dropout_p must be a float.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p="0.1")
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p=0.1, generator=3)
    # (dynamo reports the error raised while tracing as its own Unsupported, message included)
    with pytest.raises((NotImplementedError, torch._dynamo.exc.Unsupported), match="dropout_p > 0 under torch.compile"):
        torch.compile(lambda q: flexc.flex_attention(q, q, q, dropout_p=0.1), fullgraph=True)(q)


def test_kernel_source_says_a_dropout_call_runs_no_generated_kernel():
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=6)
    text = flexc.kernel_source(q, k, v, enable_gqa=True, kernel_options={"BACKEND": "TRITON"}, dropout_p=0.1)
    assert "TORCH" in text and "@triton.jit" not in text
