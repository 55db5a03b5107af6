"""A torch.autograd.Function inside a score_mod: its forward is traced (forward against torch's
FlexAttention, TORCH and TRITON backends) and its own backward is what gradients use (against
float64 dense autograd through the same Function)."""
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexc
from catalogue import ScaledGrad, StraightThroughClamp
from reference import dense_attention, random_qkv

B, H, L, E = 1, 2, 48, 16
BACKENDS = ["TORCH", "TRITON"]


def clamp_mod(score, b, h, q_idx, kv_idx):
    return StraightThroughClamp.apply(score, 0.5) + (q_idx - kv_idx) * 0.01


def scaled_mod(score, b, h, q_idx, kv_idx):
    return ScaledGrad.apply(score) - score


def test_traced_with_the_function_and_hook_removed():
    assert str(flexc.trace(clamp_mod)) == "StraightThroughClamp.apply(score, 0.5) + (q_idx - kv_idx) * 0.01"
    assert torch.autograd.Function.__dict__["apply"].__func__.__name__ == "apply"  # torch's own again


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_torch(backend):
    q, k, v = random_qkv(B, H, H, L, L, E, seed=1)
    q = q * 4  # scores beyond the clamp
    out = flexc.flex_attention(q, k, v, score_mod=clamp_mod, kernel_options={"BACKEND": backend})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch_flex.flex_attention(q, k, v, score_mod=clamp_mod)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mod", [clamp_mod, scaled_mod], ids=lambda f: f.__name__)
def test_gradients_use_the_functions_backward(mod, backend):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, seed=2))
    scaled_q = q * 4
    out = flexc.flex_attention(scaled_q, k, v, score_mod=mod, kernel_options={"BACKEND": backend})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(q64 * 4, k64, v64, score_mod=mod)[0]  # autograd through the same Function
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    # and the Function's backward is not the derivative of its forward: plain clamp differs
    if mod is clamp_mod:
        plain = dense_attention(q64 * 4, k64, v64, score_mod=lambda s, b, h, qi, kv: torch.clamp(s, -0.5, 0.5)
                                + (qi - kv) * 0.01)[0]
        plain_dq = torch.autograd.grad(plain, q64, dout.double())[0]
        assert (plain_dq - ref_grads[0]).abs().max() > 1e-2


def test_kernel_prints_the_traced_forward():
    q, k, v = random_qkv(B, H, H, L, L, E)
    source = flexc.kernel_source(q, k, v, score_mod=clamp_mod, kernel_options={"BACKEND": "TRITON"})
    assert "tl.minimum(tl.maximum(score, -0.5), 0.5)" in source
