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

import collections

import pytest
import torch
import torch.nn.functional as F

import flexc
import flexc.call.forward_path as forward_path_module
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


def _path_cases(q, k, v, q64, k64, v64, sinks):
    """The calls whose forward eager and compiled rules used to choose apart, in one graph."""
    causal = flexc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device="cpu")
    torch_options = {"BACKEND": "TORCH"}
    both = flexc.AuxRequest(lse=True, max_scores=True)
    out, aux = flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki) * 0.1,
                                    block_mask=causal, kernel_options=torch_options, return_aux=both, sinks=sinks)
    return [
        flexc.flex_attention(q64, k64, v64, block_mask=causal, kernel_options=torch_options),  # no lse
        *flexc.flex_attention(q64, k64, v64, block_mask=causal, kernel_options=torch_options, return_lse=True),
        flexc.flex_attention(q, k, v, block_mask=causal, kernel_options=torch_options, dropout_p=0.25),  # training
        out, aux.lse, aux.max_scores,  # training with row maxima and sinks
        *flexc.flex_attention(q.detach(), k, v, block_mask=causal, kernel_options={"BACKEND": "TRITON"},
                              return_lse=True),  # inference
    ]


def test_eager_and_compiled_calls_ask_one_rule_for_their_forward_and_agree(fresh_dynamo, monkeypatch):
    """Eager calls, their training and the compiled ops ask one rule which forward runs
    (:func:`flexc.call.forward_path.forward_path`) and get the same answers where their own ladders
    differed: a float64 call without the logsumexp (compiled took the row loop), TRITON inference
    (compiled ran the training forward) and row maxima in training (eager ran a second forward for
    them, its output taken from the other). Outputs, float64 logsumexps, row maxima, sinks, dropout
    draws and gradients are identical."""
    asked = []

    def spy(*arguments):
        path = rule(*arguments)
        asked.append((*arguments, path))
        return path
    rule = forward_path_module.forward_path
    monkeypatch.setattr(forward_path_module, "forward_path", spy)
    q, k, v = random_qkv(B, H, H, L, L, E, seed=25)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    sinks = torch.linspace(-1.0, 1.0, H)
    results = {}
    for name, fn in (("eager", _path_cases), ("compiled", torch.compile(_path_cases, backend="aot_eager",
                                                                        fullgraph=True))):
        flexc.cache_clear()  # (every plan made now, asking the rule)
        asked.clear()
        trained = q.clone().requires_grad_()
        torch.manual_seed(26)  # (the dropout's seed, drawn in the graph as eagerly)
        outs = fn(trained, k, v, q64, k64, v64, sinks)
        grad = torch.autograd.grad(sum(o.sum() for o in outs[3:6]), trained)[0]
        results[name] = (outs, grad, collections.Counter(asked))
    (eager, eager_grad, eager_asked), (compiled, compiled_grad, compiled_asked) = results.values()
    assert compiled_asked == eager_asked
    assert sorted(path for *_, path in eager_asked.elements()) == sorted(
        ["forward", "rows", "rows", "rows", "forward"])
    assert [o.dtype for o in compiled] == [o.dtype for o in eager]
    assert compiled[2].dtype == torch.float64  # a float64 logsumexp for float64 inputs
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.equal(c, e), i
    assert torch.equal(compiled_grad, eager_grad)
