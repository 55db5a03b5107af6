"""Compiled equals eager: a few catalogue score_mods, vector reductions (torch.dot, .sum(-1),
.any(-1)), torch.autograd.Function score_mods (old style and setup_context, one with a trainable
captured input) and elementwise activations, eager and under torch.compile(fullgraph=True), on the
TORCH and TRITON backends: forward and gradients (q, k, v and trainable captured tensors) equal.

All mods of a backend run in one compiled graph (one compile per backend). TRITON runs with the torch
row-loop backward disabled, so eager and compiled training both go through the generated backward.
Under compile, dynamo used to inline a Function's forward (gradients then followed the forward's
derivative, not the Function's backward) and a torch.dot of captured rows failed on fake tensors;
both are checked here, and a row lookup nested in another stays traceable."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexc
import flexc.call.training as training_module
import flexc.torch_compile.custom_ops as custom_ops_module
from catalogue import score_catalogue
from reference import random_qkv
from catalogue import ScaledGrad, StraightThroughClamp

B, H, L, E, R = 1, 2, 32, 16, 4
_g = torch.Generator().manual_seed(21)
Q_ROWS = torch.randn(B, H, L, R, generator=_g).requires_grad_()
K_ROWS = torch.randn(B, 1, L, R, generator=_g).requires_grad_()
FRAMES = torch.randint(0, L // 8, (L // 8, 3), generator=_g)
DOC = torch.randint(0, 3, (L,), generator=_g)
DOC_BIAS = torch.randn(3, generator=_g).requires_grad_()
HEAD_SCALE = (torch.rand(H, generator=_g) + 0.5).requires_grad_()
TRAINABLE = (Q_ROWS, K_ROWS, DOC_BIAS, HEAD_SCALE)
_CATALOGUE = score_catalogue(B, H, L, L)


def rope_dot(score, b, h, q_idx, kv_idx):
    return score + torch.dot(Q_ROWS[b, h, q_idx], K_ROWS[b, 0, kv_idx])


def rope_sum(score, b, h, q_idx, kv_idx):
    return score + (Q_ROWS[b, h, q_idx] * K_ROWS[b, 0, kv_idx]).sum(-1) * 0.5


def frames_any(score, b, h, q_idx, kv_idx):
    return torch.where((FRAMES[q_idx // 8] == kv_idx // 8).any(-1), score, score - 1.0)


def nested_gather(score, b, h, q_idx, kv_idx):
    return score + DOC_BIAS[DOC[kv_idx]] * (Q_ROWS[b, h, q_idx] > 0).sum(-1)


def scaled_grad(score, b, h, q_idx, kv_idx):  # old style: ctx in forward
    return ScaledGrad.apply(score) - score


def clamp_trainable_input(score, b, h, q_idx, kv_idx):  # setup_context, an input that trains
    return StraightThroughClamp.apply(score * HEAD_SCALE[h], 0.5) + (q_idx - kv_idx) * 0.01


def gelu(score, b, h, q_idx, kv_idx):
    return F.gelu(score)


def softplus_silu(score, b, h, q_idx, kv_idx):
    return F.softplus(score, beta=2.0) - F.silu(score) * 0.5


def leaky_mish(score, b, h, q_idx, kv_idx):
    return F.leaky_relu(score, 0.1) + F.mish(score) * 0.25


MODS = {name: _CATALOGUE[name] for name in ("alibi_captured_slopes", "t5_bucketed_bias", "soft_capping_tanh",
                                             "learned_relative_1d")}
MODS.update((f.__name__, f) for f in (rope_dot, rope_sum, frames_any, nested_gather, scaled_grad,
                                       clamp_trainable_input, gelu, softplus_silu, leaky_mish))


def _calls(backend):
    options = {"BACKEND": backend}

    def calls(qs, ks, vs):
        return [flexc.flex_attention(q, k, v, score_mod=mod, kernel_options=options)
                for q, k, v, mod in zip(qs, ks, vs, MODS.values())]
    return calls


def _run(calls):
    """Outputs and gradients (each mod's q, k, v, then the trainable captured tensors) of all mods."""
    base = random_qkv(B, H, H, L, L, E, seed=22)
    leaves = [[t.clone().requires_grad_() for _ in MODS] for t in base]
    outs = calls(*leaves)
    g = torch.Generator().manual_seed(23)
    loss = sum((out * torch.randn(out.shape, generator=g)).sum() for out in outs)
    grads = torch.autograd.grad(loss, [t for group in leaves for t in group] + list(TRAINABLE))
    n = len(MODS)
    per_mod = {name: (outs[i], grads[i], grads[n + i], grads[2 * n + i]) for i, name in enumerate(MODS)}
    return per_mod, grads[3 * n:]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_compiled_equals_eager(backend, fresh_dynamo, monkeypatch):
    if backend == "TRITON":  # the generated backward trains every one of these mods, eager and compiled
        def refuse(*args, **kwargs):
            raise AssertionError("the torch row-loop backward ran")
        monkeypatch.setattr(training_module, "torch_backward", refuse)
        monkeypatch.setattr(custom_ops_module, "torch_backward", refuse)
    eager, eager_captured = _run(_calls(backend))
    compiled, compiled_captured = _run(torch.compile(_calls(backend), backend="aot_eager", fullgraph=True))
    for name in MODS:
        for what, e, c in zip(("out", "dq", "dk", "dv"), eager[name], compiled[name]):
            torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {what}: {m}")
    for tensor, e, c in zip(("Q_ROWS", "K_ROWS", "DOC_BIAS", "HEAD_SCALE"), eager_captured, compiled_captured):
        assert e.abs().sum() > 0, tensor  # each trainable tensor receives a gradient
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-5, msg=lambda m: f"{tensor}: {m}")


def test_a_function_under_compile_keeps_its_backward(fresh_dynamo):
    """The Function's backward (gradient scaled by 0.25) is not its forward's derivative (2): eager
    and compiled dq must both follow the backward."""
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, seed=24))

    def call(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: ScaledGrad.apply(s))

    dq_eager = torch.autograd.grad(call(q, k, v).sum(), q)[0]
    dq_compiled = torch.autograd.grad(torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v).sum(), q)[0]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    inlined = flexc.flex_attention(q64, k64, v64, score_mod=lambda s, b, h, qi, kv: s * 2)
    dq_inlined = torch.autograd.grad(inlined.sum(), q64)[0]
    torch.testing.assert_close(dq_compiled, dq_eager, atol=1e-6, rtol=1e-5)
    assert (dq_eager.double() - dq_inlined).abs().max() > 1e-3
