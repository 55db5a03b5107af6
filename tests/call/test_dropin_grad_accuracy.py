"""Gradient accuracy against float64: flexc's dq/dk/dv (and a learnable bias's gradient) are no
further from a float64 reference than SDPA's with an explicit mask (fp32), or than torch's own
FlexAttention math done in torch's order (16-bit inputs)."""
import math

import pytest
import torch
import torch.nn.functional as F

import flexc
from flexc.backends.cpu import torch_cpu
from reference import random_qkv

B, H, L, D = 2, 2, 256, 64


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _rmse(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def _grads(fn, inputs, dout, dtype):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    fn(*leaves).backward(dout.to(dtype))
    return [t.grad for t in leaves]


def _flexc(learn_bias):
    block_mask = flexc.create_block_mask(causal, None, None, L, L)

    def run(q, k, v, bias):
        mod = (lambda score, b, h, q_idx, kv_idx: score + bias[h, q_idx, kv_idx]) if learn_bias else None
        return flexc.flex_attention(q, k, v, score_mod=mod, block_mask=block_mask)
    return run


def _sdpa(learn_bias):
    allowed = torch.ones(L, L, dtype=torch.bool).tril()

    def run(q, k, v, bias):
        mask = bias.masked_fill(~allowed, -math.inf) if learn_bias else allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


@pytest.mark.parametrize("learn_bias,keep", [(False, True), (True, True), (True, False)],
                         ids=["mask", "learnable_bias", "learnable_bias_recomputed"])
def test_fp32_gradients_within_1_2x_of_sdpa(learn_bias, keep, monkeypatch):
    if not keep:  # the second backward pass recomputes every chunk instead of keeping it
        monkeypatch.setattr(torch_cpu, "_KEEP_ELEMENTS", 0)
    q, k, v = random_qkv(B, H, H, L, L, D, dtype=torch.float64, seed=1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(H, L, L, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    inputs = (q, k, v, bias)
    gold = _grads(_sdpa(learn_bias), inputs, dout, torch.float64)
    ours = _grads(_flexc(learn_bias), inputs, dout, torch.float32)
    sdpa = _grads(_sdpa(learn_bias), inputs, dout, torch.float32)
    names = ["dq", "dk", "dv"] + (["dbias"] if learn_bias else [])
    ratios = {n: _rmse(a, gd) / _rmse(b, gd) for n, a, b, gd in zip(names, ours, sdpa, gold)}
    assert all(r <= 1.2 for r in ratios.values()), ratios


def _torch_order(score_mod):
    """torch's eager FlexAttention math: fp32 scores, mod and softmax; P cast to the input dtype
    before P @ V (its CPU backward does not exist, so autograd through this is the reference)."""
    def run(q, k, v):
        idx = [torch.arange(n).view([-1 if i == j else 1 for j in range(4)]) for i, n in enumerate((B, H, L, L))]
        s = (q.float() @ k.float().transpose(-1, -2)) * (1 / math.sqrt(D))
        s = torch.where(causal(*idx), score_mod(s, *idx), -math.inf)
        return torch.softmax(s, -1).to(q.dtype) @ v
    return run


def _gold(score_mod):
    def run(q, k, v):
        idx = [torch.arange(n).view([-1 if i == j else 1 for j in range(4)]) for i, n in enumerate((B, H, L, L))]
        s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D))
        return torch.softmax(torch.where(causal(*idx), score_mod(s, *idx), -math.inf), -1) @ v
    return run


_MODS = {
    "square": lambda score, b, h, q_idx, kv_idx: score * score,
    "relative": lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx) * 0.05,
}


@pytest.mark.parametrize("name", sorted(_MODS))
def test_bf16_gradients_within_1_1x_of_torch_order(name):
    mod = _MODS[name]
    q, k, v = random_qkv(B, H, H, L, L, D, dtype=torch.float64, seed=3)
    dout = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    block_mask = flexc.create_block_mask(causal, None, None, L, L)
    gold = _grads(_gold(mod), (q, k, v), dout, torch.float64)
    ref = _grads(_torch_order(mod), (q, k, v), dout, torch.bfloat16)
    ours = _grads(lambda q, k, v: flexc.flex_attention(q, k, v, score_mod=mod, block_mask=block_mask),
                  (q, k, v), dout, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ours)
    ratios = {n: _rmse(a, gd) / _rmse(b, gd) for n, a, b, gd in zip(["dq", "dk", "dv"], ours, ref, gold)}
    assert all(r <= 1.1 for r in ratios.values()), ratios


def _bias_mods(bias, which):
    """Learnable-bias mods of torch's TestLearnableBiases: a row of a 4-D table picked by a captured
    index (``weird_bias``) and a per-head relative bias."""
    return {
        "weird_bias": lambda score, b, h, q_idx, kv_idx: score + bias[b, h, which, q_idx],
        "head_relative": lambda score, b, h, q_idx, kv_idx: score + bias[b, h, 1, kv_idx] * (q_idx >= kv_idx),
    }


# (not weird_bias on TRITON: its exact gradient is 0, a cancellation the generated backward's delta,
# rowsum(out * dO) from the bf16 output as in torch's kernels, leaves ~1e-2 from; the TORCH
# backward sums delta from its own fp32 probabilities)
@pytest.mark.parametrize("backend, name", [("TORCH", "weird_bias"), ("TORCH", "head_relative"),
                                           ("TRITON", "head_relative")])
def test_bf16_captured_tensor_gradients_accumulate_wide_and_round_once(backend, name):
    """A captured tensor's gradient sums many small terms: it is summed in fp32 and rounded to bf16
    once, so it is no further from the exact sum (float64 on the same bf16 inputs) than that one
    rounding (torch's TestLearnableBiases measures the same against its eager math)."""
    Lb = 96 if backend == "TRITON" else L  # the interpreter is slow
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(B, H, Lb, D, generator=g).to(torch.bfloat16) for _ in range(4))
    table = torch.randn(B, H, 4, Lb, generator=g).to(torch.bfloat16)
    which = torch.tensor(0)
    grads = {}
    for label, dtype in (("exact", torch.float64), ("ours", torch.bfloat16)):
        bias = table.to(dtype).clone().requires_grad_()
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = flexc.flex_attention(*leaves, score_mod=_bias_mods(bias, which)[name], kernel_options={"BACKEND": backend})
        out.backward(dout.to(dtype))
        grads[label] = bias.grad
    assert grads["ours"].dtype == torch.bfloat16
    exact = grads["exact"]
    error = (grads["ours"].double() - exact).abs().max().item()
    # one bf16 rounding of the exact value, plus the fp32 summation's own error relative to the
    # terms (the weird bias's exact gradient is 0: a per-row constant cancels in the softmax)
    allowed = (exact.to(torch.bfloat16).double() - exact).abs().max().item() + 1e-5
    assert error <= allowed, (error, allowed)
