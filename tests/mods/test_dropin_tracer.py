"""Mods torch accepts and flexc's tracer used to reject: torch.nn.functional activations, the rest of
torch's elementwise math, and shifts. Forward against torch's FlexAttention, gradients against
float64 dense autograd, under the TORCH and TRITON backends."""
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.attention.flex_attention as torch_flex

import flexc
from reference import dense_attention, random_qkv

L = S = 64
B, H, E = 1, 2, 16
BACKENDS = ["TORCH", "TRITON"]


def _unit(score):
    return torch.tanh(score) * 0.9  # inside (-1, 1), for asin/acos/atanh


# Each mod combines a few functions, each term kept O(1) so no single one dominates the output.
SCORE_MODS = {
    "relu_gelu_silu": lambda s, b, h, q, kv: F.relu(s) + F.gelu(s) - F.silu(s) + F.gelu(s, approximate="tanh"),
    "softplus_mish_elu": lambda s, b, h, q, kv: F.softplus(s, beta=2.0) - F.mish(s) + F.elu(s) + F.celu(s, 0.5),
    "leaky_selu_hard": lambda s, b, h, q, kv: (F.leaky_relu(s, 0.2) + F.selu(s) + F.hardtanh(s, -0.5, 0.5)
                                               + F.relu6(s * 4) + F.hardswish(s) + F.hardsigmoid(s)),
    "shrink_sign_sigmoid": lambda s, b, h, q, kv: (F.softsign(s) + F.logsigmoid(s) + F.tanhshrink(s)
                                                   + F.softshrink(s, 0.3) + F.hardshrink(s, 0.3)
                                                   + F.threshold(s, 0.1, -0.5)),
    "trig": lambda s, b, h, q, kv: (torch.tan(s * 0.5) + torch.atan(s * 3) + torch.asin(_unit(s))
                                    + torch.acos(_unit(s)) + torch.atan2(s, (q - kv) * 0.1 + 0.05)),
    "hyperbolic": lambda s, b, h, q, kv: (torch.sinh(s) * 0.5 - torch.cosh(s * 0.5) + torch.asinh(s * 4)
                                          + torch.acosh(1 + s * s) + torch.atanh(_unit(s))),
    "exp_log_erf": lambda s, b, h, q, kv: (torch.expm1(s * 1e-3) * 100 + torch.log1p(s * s) + torch.erf(s)
                                           + torch.erfc(s) + torch.log10(1 + s.abs()) + torch.special.erf(s * 2)),
    "rounding": lambda s, b, h, q, kv: (torch.trunc(s * 3) + torch.round(s * 3) + s.round(decimals=1)
                                        + torch.fmod(s * 5, 1.5) + torch.frac(s * 2) + torch.fmod(q - kv, 3)),
}


def _causal_block_shift(b, h, q_idx, kv_idx):
    return ((q_idx >> 4) == (kv_idx >> 4)) | (q_idx >= kv_idx)


def _part1by1(n):
    """Spread the low 4 bits of n over even bit positions (Morton/Z-order), with shifts and masks."""
    n = n & 0x0F
    n = (n | (n << 2)) & 0x33
    return (n | (n << 1)) & 0x55


def _z_order(idx, width=8):
    return _part1by1(idx & (width - 1)) | (_part1by1(idx >> 3) << 1)


def _z_order_blocks(b, h, q_idx, kv_idx):
    # tokens on an 8x8 grid attend within their 4x4 Z-order block (a NATTEN-style tiling)
    return (_z_order(q_idx) >> 4) == (_z_order(kv_idx) >> 4)


def _variable_shift(b, h, q_idx, kv_idx):
    return (1 << (q_idx % 5)) >= (kv_idx % 9) + (kv_idx >> (h + 1))


MASK_MODS = {"block_shift": _causal_block_shift, "z_order": _z_order_blocks, "variable_shift": _variable_shift}


def _torch_reference(q, k, v, score_mod=None, mask_mod=None):
    bm = torch_flex.create_block_mask(mask_mod, None, None, L, S, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_elementwise_score_mods_match_torch(name, backend):
    q, k, v = random_qkv(B, H, H, L, S, E, seed=1)
    q = q * 3  # scores of a few units, so the functions see their interesting ranges
    mod = SCORE_MODS[name]
    out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": backend})
    torch.testing.assert_close(out, _torch_reference(q, k, v, score_mod=mod), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_shift_masks_match_torch(name, backend):
    mask = MASK_MODS[name]
    ours = flexc.create_block_mask(mask, None, H, L, S, BLOCK_SIZE=16)
    ref = torch_flex.create_block_mask(mask, None, H, L, S, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(flexc.create_mask(mask, 1, H, L, S), torch_flex.create_mask(mask, 1, H, L, S, device="cpu"))
    q, k, v = random_qkv(B, H, H, L, S, E, seed=2)
    out = flexc.flex_attention(q, k, v, block_mask=ours, kernel_options={"BACKEND": backend})
    torch.testing.assert_close(out, _torch_reference(q, k, v, mask_mod=mask), atol=2e-5, rtol=2e-5)


def test_constant_shifts_trace_as_exact_arithmetic():
    traced = flexc.trace(_causal_block_shift)
    assert str(traced) == "(q_idx // 16 == kv_idx // 16) | (q_idx >= kv_idx)"
    assert "<<" in str(flexc.trace(_variable_shift))
    with pytest.raises(flexc.TraceError, match="on a float value"):
        flexc.trace(lambda s, b, h, q_idx, kv_idx: s >> 1)


# well-conditioned variants for gradients (fp32 vs float64 autograd): no poles, kinks or |x| -> 1
GRAD_MODS = {
    "relu_gelu_silu": SCORE_MODS["relu_gelu_silu"],
    "softplus_mish_elu": SCORE_MODS["softplus_mish_elu"],
    "trig": lambda s, b, h, q, kv: (torch.tan(s * 0.2) + torch.atan(s) + torch.asin(_unit(s) * 0.5)
                                    + torch.acos(_unit(s) * 0.5) + torch.atan2(s, 1.0 + (q - kv).abs() * 0.01)),
    "hyperbolic": lambda s, b, h, q, kv: (torch.sinh(s * 0.5) + torch.cosh(s * 0.5) + torch.asinh(s)
                                          + torch.acosh(2 + s * s) + torch.atanh(_unit(s) * 0.5)),
    "exp_log_erf": lambda s, b, h, q, kv: torch.expm1(s * 0.5) + torch.log1p(s * s) * 0.5 + torch.erf(s) - torch.erfc(s),
}


# one TRITON case: its generated backward differentiates these ops through flexc.mods.derivative
@pytest.mark.parametrize("name,backend", [(name, "TORCH") for name in sorted(GRAD_MODS)] + [("trig", "TRITON")])
def test_elementwise_score_mod_gradients_match_float64(name, backend):
    mod = GRAD_MODS[name]
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, 32, 32, E, seed=3))
    out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": backend})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(q64, k64, v64, score_mod=mod)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


def test_activations_on_captured_tensors_and_indices():
    bias = torch.randn(H, L)

    def mod(score, b, h, q_idx, kv_idx):
        return score + F.gelu(bias[h, kv_idx]) + torch.atan2(q_idx, kv_idx + 1) + F.relu(q_idx - kv_idx) * 0.01

    q, k, v = random_qkv(B, H, H, L, S, E, seed=5)
    expected = dense_attention(q, k, v, score_mod=mod)[0]
    for backend in BACKENDS:
        out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": backend})
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_inplace_activation_is_rejected():
    with pytest.raises(flexc.TraceError, match="inplace=True"):
        flexc.trace(lambda s, b, h, q_idx, kv_idx: F.relu(s, inplace=True))
    with pytest.raises(flexc.TraceError, match="Python numbers"):
        flexc.trace(lambda s, b, h, q_idx, kv_idx: F.leaky_relu(s, s))


def test_generated_kernel_is_readable():
    q, k, v = random_qkv(B, H, H, L, S, E)
    source = flexc.kernel_source(q, k, v, score_mod=SCORE_MODS["trig"], kernel_options={"BACKEND": "TRITON"})
    assert "def atan(x):" in source and "def tan(x):" in source and "atan2(" in source
    compile(source, "<kernel>", "exec")
