"""Attention dropout (flexc's ``dropout_p=``): p = 0 is the call without it; a seed fixes the mask, the
mask is the counter-based one of flexc.backends.dropout (Philox 4x32-10, checked bit for bit against an
independent integer implementation), outputs and gradients equal a float64 dense reference that
uses the same mask, the mean over seeds approaches the undropped output, masked rows stay 0;
torch.compile draws the same seed and mask as eager."""
from __future__ import annotations

import math
import warnings

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


def test_triton_backend_draws_the_same_mask_without_falling_back():
    # (outputs and gradients against TORCH's in depth: tests/backends/triton/test_triton_dropout.py)
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)
        triton = _call(q, k, v, 0.2, 9, "TRITON")
    torch.testing.assert_close(triton, _call(q, k, v, 0.2, 9, "TORCH"), rtol=1e-5, atol=1e-6)


def test_bad_dropout_arguments_name_the_fix():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match=r"dropout_p must be a float.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p="0.1")
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator.*Fix"):
        flexc.flex_attention(q, q, q, dropout_p=0.1, generator=3)


def test_kernel_source_shows_the_dropout_kernel():
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=6)
    text = flexc.kernel_source(q, k, v, enable_gqa=True, kernel_options={"BACKEND": "TRITON"}, dropout_p=0.1)
    assert text.startswith("# flexc forward attention kernel") and "def dropout_keep(" in text


# ---- torch.compile -------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _alibi_model(slopes, sinks=None):
    """Two dropout calls (two masks) and a sink call in one function, as a model's layers would make."""
    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=16)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() * 0.1

    def f(q, k, v):
        first = flexc.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True, dropout_p=0.3)
        second = flexc.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True, dropout_p=0.3, sinks=sinks)
        return first, second
    return f, alibi


def test_compiled_dropout_equals_eager_and_dense_with_the_same_mask(fresh_dynamo):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, HQ, HKV, L, S, E, seed=8))
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)
    f, alibi = _alibi_model(slopes)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    d_out = torch.randn(B, HQ, L, E, generator=torch.Generator().manual_seed(3))
    leaves = [q, k, v, slopes]

    def run(fn):
        torch.manual_seed(11)
        outs = fn(q, k, v)
        after = torch.randint(0, 2 ** 62, ())  # the generator advanced as eager advances it
        loss = sum((out * d_out * i).sum() for i, out in enumerate(outs, 1))
        return outs, torch.autograd.grad(loss, leaves), after

    (c_first, c_second), c_grads, c_after = run(compiled)
    (e_first, e_second), e_grads, e_after = run(f)
    assert torch.equal(c_first, e_first) and torch.equal(c_second, e_second) and torch.equal(c_after, e_after)
    for name, a, b in zip(["q", "k", "v", "slopes"], c_grads, e_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"d{name}: {m}")
    assert not torch.equal(c_first, c_second)  # each call draws its own seed (no CSE of the draws)

    # against the float64 dense reference with the masks of the seeds eager draws
    torch.manual_seed(11)
    drops = [dropout.draw(0.3, None), dropout.draw(0.3, None)]
    refs = [_dense(q, k, v, drop, alibi) for drop in drops]
    for got, ref in zip((c_first, c_second), refs):
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)
    loss = sum((ref * d_out.double() * i).sum() for i, ref in enumerate(refs, 1))
    for name, a, b in zip(["q", "k", "v", "slopes"], c_grads, torch.autograd.grad(loss, leaves)):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_compiled_dropout_with_sinks_and_without_gradients_equals_eager(fresh_dynamo):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=9)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    f, _ = _alibi_model(torch.tensor([0.1, 0.2, 0.3, 0.4]), sinks)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for grad in (True, False):  # the training op and the inference op
        with torch.set_grad_enabled(grad):
            torch.manual_seed(12)
            got = compiled(q, k, v)
            torch.manual_seed(12)
            want = f(q, k, v)
        # the same mask, and the sinks folded by the same kernels (an input of the op)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.manual_seed(12)
    g_eager = torch.autograd.grad(f(q, k, v)[1].sum(), sinks)[0]
    torch.manual_seed(12)
    g_compiled = torch.autograd.grad(compiled(q, k, v)[1].sum(), sinks)[0]
    assert torch.equal(g_compiled, g_eager)


def test_compiled_dropout_with_a_generator_breaks_the_graph_once_said(fresh_dynamo):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=10)

    def f(q, k, v, generator):
        return flexc.flex_attention(q, k, v, enable_gqa=True, dropout_p=0.2, generator=generator) * 2

    generator = torch.Generator().manual_seed(4)
    want = [f(q, k, v, generator) for _ in range(2)]
    generator.manual_seed(4)
    with pytest.warns(UserWarning, match="draws its seed outside the graph.*Fix: pass generator=None"):
        got = [torch.compile(f, backend="aot_eager")(q, k, v, generator) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch._dynamo.reset()
    # (torch's own message names the function that draws the seed eagerly: flexc cannot word it without
    # importing dynamo when flexc is imported, which costs seconds)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_generator_seed_outside_the_graph"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, generator)


def test_compiled_dropout_on_triton_draws_the_mask_eager_draws(fresh_dynamo):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, HQ, HKV, L, S, E, seed=11))

    def f(q, k, v, backend="TRITON"):
        return flexc.flex_attention(q, k, v, enable_gqa=True, dropout_p=0.2, kernel_options={"BACKEND": backend},
                                    return_aux=flexc.AuxRequest(lse=True))

    def run(fn, *args):
        torch.manual_seed(13)
        out, aux = fn(q, k, v, *args)
        return [out, aux.lse, *torch.autograd.grad(out.sum(), (q, k, v))]

    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)  # the TRITON kernels drop: no fallback
        got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
        want = run(f)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, run(f, "TORCH")):  # the same mask as the TORCH backend's
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_scores is supported by the TORCH backend only"):  # as without dropout
        flexc.flex_attention(q, k, v, enable_gqa=True, dropout_p=0.2, kernel_options={"BACKEND": "TRITON"},
                             return_aux=flexc.AuxRequest(max_scores=True))


def test_custom_ops_with_a_seed_pass_opcheck():
    from flexc.mods.mod_key import mod_key
    from flexc.torch_compile import custom_ops

    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 32, 32, 8, seed=12))
    block_mask = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32,
                                         BLOCK_SIZE=16)
    tables = [getattr(block_mask, name) for name in custom_ops.TABLE_NAMES]
    mask = flexc.trace(block_mask.mask_mod)
    seed = dropout.seed_tensor(torch.Generator().manual_seed(5))
    args = (q, k, v, tables, [], list(mask.buffers), "", mod_key(mask), [16, 16], [32, 32], 0.3,
            custom_ops.options_key({"BACKEND": "TORCH"}), False, 0.25, seed, None)
    torch.library.opcheck(custom_ops.flex_attention_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out = custom_ops.flex_attention_op(*args)[0]
    assert torch.equal(out, _call_plain(q, k, v, 0.25, int(seed), block_mask))


def _call_plain(q, k, v, p, seed, block_mask):
    """The eager call with this seed (its dropout drawn as flexc.backends.dropout.draw would)."""
    from flexc.call.attention import attend

    return attend(q, k, v, None, block_mask, 0.3, False, False, {"BACKEND": "TORCH"}, None, dropout.Dropout(p, seed))
