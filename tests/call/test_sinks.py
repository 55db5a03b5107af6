"""Learned attention sinks (flexc's ``sinks=``): forward, logsumexp and gradients (q, k, v, the sinks,
captured tensors) equal a float64 dense softmax over the scores with the sink logit appended (its
column dropped), on both backends, with GQA, dead rows, decoding and torch.compile; and equal Hugging
Face transformers' rescaling of a sink-free call by its logsumexp."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from reference import dense_attention, random_qkv
from strategies import examples

B, HQ, HKV, L, S, E = 2, 4, 2, 72, 88, 16


def dense_with_sinks(q, k, v, sinks, score_mod=None, mask_mod=None):
    """``(out, lse)`` in float64: softmax over [scores..., sink] per row, the sink's column dropped."""
    return dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)[:2]


def _mask(b, h, q_idx, kv_idx):  # causal from the end, with rows q % 9 == 4 fully masked (dead rows)
    return (q_idx + (S - L) >= kv_idx) & (kv_idx < 80) & (q_idx % 9 != 4)


def _problem(seed: int, rows: int = L):
    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(B, HQ, HKV, rows, S, E, seed=seed)
    sinks = torch.randn(HQ, generator=g).requires_grad_()
    slopes = torch.rand(HQ, generator=g).requires_grad_()

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.1 * slopes[h] * (q_idx - kv_idx).abs()
    return q, k, v, sinks, slopes, alibi


def _check(got_out, got_lse, ref_out, ref_lse, what):
    torch.testing.assert_close(got_out.double(), ref_out, atol=3e-5, rtol=0, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(got_lse.double(), ref_lse, atol=3e-5, rtol=0, msg=lambda m: f"{what} lse: {m}")


def _check_grads(out, lse, ref_out, ref_lse, leaves, seed: int):
    """The gradients of q, k, v, the sinks and the slopes (``leaves``) under random dO and dlse equal the
    dense reference's."""
    g = torch.Generator().manual_seed(seed)
    d_out, d_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves)
    want = torch.autograd.grad((ref_out * d_out.double()).sum() + (ref_lse * d_lse.double()).sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "sinks", "slopes"], got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-4, rtol=2e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_sinks_forward_lse_and_gradients_equal_dense(backend):
    q, k, v, sinks, slopes, alibi = _problem(1)
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sinks, slopes]
    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=(32, 32))
    out, lse = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True,
                                    return_lse=True, sinks=sinks, kernel_options={"BACKEND": backend})
    ref_out, ref_lse = dense_with_sinks(q, k, v, sinks, alibi, _mask)
    _check(out, lse, ref_out, ref_lse, backend)
    dead = torch.tensor([qi % 9 == 4 for qi in range(L)])
    assert (out[:, :, dead] == 0).all()  # nothing allowed: output 0, lse the sink's logit
    torch.testing.assert_close(lse[:, :, dead], sinks.detach().view(1, HQ, 1).expand(B, HQ, int(dead.sum())))
    _check_grads(out, lse, ref_out, ref_lse, leaves, seed=2)


@pytest.mark.parametrize("rows", [1, 4])
def test_sinks_when_decoding_per_batch_sinks_equal_dense(rows):
    q, k, v, _, _, _ = _problem(3, rows)
    sinks = torch.randn(B, HQ, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float()
    offset = S - rows

    def shifted(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx < 40)
    for backend in ("TORCH", "TRITON"):
        out, lse = flexc.flex_attention(q, k, v, block_mask=flexc.create_block_mask(shifted, None, None, rows, S),
                                        enable_gqa=True, return_lse=True, sinks=sinks,
                                        kernel_options={"BACKEND": backend})
        _check(out, lse, *dense_with_sinks(q, k, v, sinks, mask_mod=shifted), f"{backend} rows={rows}")


def test_sinks_equal_transformers_rescaling_of_a_sink_free_call():
    """transformers' flex integration (gpt-oss): a call with return_lse, then
    out * exp(lse - logsumexp([lse, sink])); flexc's sinks= gives the same output in one call."""
    q, k, v, sinks, _, _ = _problem(5)
    out, lse = flexc.flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    lse_e = lse.unsqueeze(-1)
    combined = torch.logsumexp(torch.cat([lse_e, sinks.detach().view(1, -1, 1, 1).expand(B, HQ, L, 1)], -1), -1,
                               keepdim=True)
    rescaled = out * torch.exp(lse_e - combined)
    ours, ours_lse = flexc.flex_attention(q, k, v, enable_gqa=True, return_lse=True, sinks=sinks.detach())
    torch.testing.assert_close(ours, rescaled, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_lse, combined.squeeze(-1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_sinks_under_compile_equal_eager(backend):
    """The compiled call is one custom-op node that folds the sinks with eager's kernels: output, lse and
    gradients (the sinks' included) equal eager's bit for bit, with GQA, a captured tensor and fullgraph."""
    q, k, v, sinks, slopes, alibi = _problem(6)
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sinks, slopes]
    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=(32, 32))

    def call(q, k, v, sinks):
        return flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True, sinks=sinks,
                                    return_lse=True, kernel_options={"BACKEND": backend})
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    d_out, d_lse = torch.randn(B, HQ, L, E, generator=g), torch.randn(B, HQ, L, generator=g)
    results = []
    for fn in (call, torch.compile(call, fullgraph=True)):
        out, lse = fn(*leaves[:4])
        results.append((out, lse, *torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves)))
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv", "dsinks", "dslopes"], results[1], results[0]):
        assert torch.equal(got, want), f"{backend} {name}: {(got - want).abs().max()}"
    torch._dynamo.reset()


def test_sinks_under_compile_with_a_growing_kv_cache_equal_eager_without_recompiling():
    """Decoding steps with a longer cache each: one dynamic graph (per grad mode) after the first,
    outputs and the sinks' gradient equal to eager's bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(15)).requires_grad_()

    def step(q, k, v, sinks):
        return flexc.flex_attention(q, k, v, enable_gqa=True, sinks=sinks, return_lse=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for length in (40, 57, 90):
        q, k, v = random_qkv(B, HQ, HKV, 3, length, E, seed=length)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                got, want = compiled(q, k, v, sinks), step(q, k, v, sinks)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), length
            if grad:
                assert torch.equal(torch.autograd.grad(got[0].sum() + got[1].sum(), sinks)[0],
                                   torch.autograd.grad(want[0].sum() + want[1].sum(), sinks)[0]), length
    assert counter.frame_count == 4  # static, then dynamic, with and without gradients
    torch._dynamo.reset()


def test_custom_ops_with_sinks_pass_opcheck():
    """The ops take the sinks (``[B or 1, Hq, 1]``) as a tensor input: schema, fake implementations and
    autograd registration agree with the real kernels, and the backward op returns their gradient."""
    from flexc.mods.mod_key import mod_key
    from flexc.torch_compile import custom_ops

    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 32, 32, 8, seed=13))
    block_mask = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32,
                                         BLOCK_SIZE=16)
    mask = flexc.trace(block_mask.mask_mod)
    sinks = torch.tensor([[[0.5], [-1.0]]], requires_grad=True)
    common = ([getattr(block_mask, name) for name in custom_ops.TABLE_NAMES], [], list(mask.buffers), "",
              mod_key(mask), [16, 16], [32, 32], 0.3, custom_ops.options_key({"BACKEND": "TORCH"}), False)
    torch.library.opcheck(custom_ops.flex_attention_op, (q, k, v, *common, 0.0, None, sinks),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    plain = (q.detach(), k.detach(), v.detach(), *common, True, 0.0, None, sinks.detach())
    torch.library.opcheck(custom_ops.flex_attention_inference_op, plain, test_utils=("test_schema", "test_faketensor"))
    out, lse, _, stats = custom_ops.flex_attention_op(q, k, v, *common, 0.0, None, sinks)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(14))
    backward = (q, k, v, out, lse, stats, grad_out, None, *common[:-1], [], 0.0, None, sinks)
    torch.library.opcheck(custom_ops.flex_attention_backward_op, backward, test_utils=("test_schema", "test_faketensor"))
    d_sinks = custom_ops.flex_attention_backward_op(*backward)[-1]
    assert torch.equal(d_sinks, torch.autograd.grad(out, sinks, grad_out)[0])


# every shape that broadcasts to [B, Hq] = [2, 4]
BROADCAST_SHAPES = [(), (1,), (HQ,), (1, 1), (B, 1), (1, HQ), (B, HQ)]
SMALL_S = 40  # (keys of the broadcast-shape problems: the Triton interpreter runs them)


def _per_head_window(rows: int, S: int):
    def per_head_window(b, h, q_idx, kv_idx):  # differs per head: per-head block tables
        return (q_idx + (S - rows) >= kv_idx) & (kv_idx % (h + 2) != 0)
    return per_head_window


def _broadcast_sinks_problem(shape, rows: int, seed: int):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, HQ, HKV, rows, SMALL_S, E, seed=seed))
    sinks = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    return q, k, v, sinks


@pytest.mark.parametrize("backend,n", [("TORCH", 8), ("TRITON", 3)])
def test_sinks_of_any_shape_broadcasting_to_batch_and_heads_equal_dense(backend, n):
    """Sinks of shape [], [1], [B, 1], [1, 1] ... (one logit for several heads or batches): output,
    lse and gradients equal dense attention with each head's broadcast logit, and the sinks'
    gradient has their own shape (summed over the heads and batches they broadcast over), for the
    forward kernel and decoding, with per-head tables or not, and with the host decisions of an sm_90
    GPU (its decode kernel and launch choices)."""
    @examples(n)
    @given(shape=st.sampled_from(BROADCAST_SHAPES), rows=st.sampled_from([24, 2]), per_head=st.sampled_from([True, False]),
           simulated=st.sampled_from([None, "sm_90"]), seed=st.integers(0, 1 << 16))
    def check(shape, rows, per_head, simulated, seed):
        q, k, v, sinks = _broadcast_sinks_problem(shape, rows, seed)
        mask_mod = _per_head_window(rows, SMALL_S)
        block_mask = flexc.create_block_mask(mask_mod, None, HQ if per_head else None, rows, SMALL_S, BLOCK_SIZE=16)
        with flexc.device.simulate(simulated):
            out, lse = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True,
                                            sinks=sinks, kernel_options={"BACKEND": backend})
            ref_out, ref_lse = dense_with_sinks(q, k, v, sinks, mask_mod=mask_mod)
            _check(out, lse, ref_out, ref_lse, f"{backend} sinks {list(shape)}")
            _check_grads(out, lse, ref_out, ref_lse, [q, k, v, sinks], seed)
    check()


def test_sinks_broadcasting_over_heads_under_compile_equal_dense():
    """The compiled call takes them too, its backward summing the sinks' gradient to their shape [1]."""
    q, k, v, sinks = _broadcast_sinks_problem((1,), 24, seed=9)
    mask_mod = _per_head_window(24, SMALL_S)
    block_mask = flexc.create_block_mask(mask_mod, None, HQ, 24, SMALL_S, BLOCK_SIZE=16)
    torch._dynamo.reset()
    call = torch.compile(flexc.flex_attention, backend="aot_eager", fullgraph=True)
    out, lse = call(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True, sinks=sinks,
                    kernel_options={"BACKEND": "TORCH"})
    ref_out, ref_lse = dense_with_sinks(q, k, v, sinks, mask_mod=mask_mod)
    _check(out, lse, ref_out, ref_lse, "compiled sinks [1]")
    _check_grads(out, lse, ref_out, ref_lse, [q, k, v, sinks], seed=10)
    torch._dynamo.reset()


def test_bad_sinks_name_the_argument_and_the_fix():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\] = \[4\].*got \[3\].*Fix"):
        flexc.flex_attention(q, q, q, sinks=torch.zeros(3))
    for shape in [(2, 4), (1, 1, 4), (3, 1)]:  # (the query's batch is 1: none of these broadcasts to [1, 4])
        with pytest.raises(ValueError, match=r"sinks must have shape .*broadcast to \[B, Hq\] = \[1, 4\].*Fix"):
            flexc.flex_attention(q, q, q, sinks=torch.zeros(shape))
    with pytest.raises(TypeError, match=r"sinks must be a floating-point tensor.*Fix"):
        flexc.flex_attention(q, q, q, sinks=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"sinks must be a tensor"):
        flexc.flex_attention(q, q, q, sinks=[0.0] * 4)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("rows", [L, 2])  # the forward kernel (the row loop), and decoding (its merge)
def test_minus_inf_sinks_are_no_sinks(backend, rows):
    """A -inf sink weighs nothing: output and lse equal the sink-free call's, dead rows' lse -inf."""
    q, k, v, _, _, alibi = _problem(7, rows)
    block_mask = flexc.create_block_mask(_mask, None, None, rows, S, BLOCK_SIZE=(32, 32))
    call = dict(score_mod=alibi, block_mask=block_mask, enable_gqa=True, return_lse=True,
                kernel_options={"BACKEND": backend})
    out, lse = flexc.flex_attention(q, k, v, sinks=torch.full((HQ,), -math.inf), **call)
    plain_out, plain_lse = flexc.flex_attention(q, k, v, **call)
    torch.testing.assert_close(out, plain_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, plain_lse, atol=1e-6, rtol=0)


def test_triton_forward_source_folds_the_sinks_only_for_sink_calls():
    """The forward kernel of a call with sinks starts its softmax from them (and takes them as an
    argument); a sink-free call's kernel has no sink text at all. Decoding: its merge does."""
    for rows, needle in ((L, "m_i = tl.full((BLOCK_M,), 0.0, tl.float32) + sink *"), (2, "m = sink")):
        q, k, v, sinks, _, alibi = _problem(8, rows)
        block_mask = flexc.create_block_mask(_mask, None, None, rows, S, BLOCK_SIZE=(32, 32))
        call = dict(score_mod=alibi, block_mask=block_mask, enable_gqa=True, kernel_options={"BACKEND": "TRITON"})
        with torch.no_grad():  # (inference: short queries run the decode kernel and its merge)
            with_sinks = flexc.kernel_source(q, k, v, sinks=sinks, **call)
            assert needle in with_sinks and ("sinks_ptr" in with_sinks or "sinks, stride_nb" in with_sinks)
            assert "sink" not in flexc.kernel_source(q, k, v, **call)
            assert "sink" not in flexc.kernel_source(q, k, v, return_lse=True, **call)


def test_triton_training_with_sinks_runs_the_generated_backward_and_equals_dense(monkeypatch):
    """The training forward's statistics include the sinks, so the generated backward's dq, dk, dv
    (and the captured slopes') are right with no sink code; the sinks' gradient is the call's."""
    import flexc.call.training

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch row-loop backward ran")
    monkeypatch.setattr(flexc.call.training, "torch_backward", forbidden)
    q, k, v, _, slopes, alibi = _problem(9, 40)
    sinks = torch.randn(B, HQ, generator=torch.Generator().manual_seed(10)).requires_grad_()  # per batch
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sinks, slopes]
    block_mask = flexc.create_block_mask(_mask, None, None, 40, S, BLOCK_SIZE=(32, 32))
    out, lse = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True,
                                    return_lse=True, sinks=sinks, kernel_options={"BACKEND": "TRITON"})
    ref_out, ref_lse = dense_with_sinks(q, k, v, sinks, alibi, _mask)
    _check(out, lse, ref_out, ref_lse, "TRITON training")
    _check_grads(out, lse, ref_out, ref_lse, leaves, seed=11)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_with_no_keys_every_row_is_the_sink_alone(backend):
    """No keys (nothing launched on TRITON): output 0, lse the sink's logit, and the sink's gradient
    its rows' dlse (each row's whole probability is the sink's); with dropout too."""
    q = torch.randn(2, HQ, 5, E, requires_grad=True)
    k, v = torch.randn(2, HKV, 0, E), torch.randn(2, HKV, 0, E)
    sinks = torch.randn(HQ, requires_grad=True)
    for dropout_p in (0.0, 0.3):
        sinks.grad = None
        out, lse = flexc.flex_attention(q, k, v, enable_gqa=True, sinks=sinks, return_lse=True, dropout_p=dropout_p,
                                        kernel_options={"BACKEND": backend})
        (out.sum() + lse.sum()).backward()
        assert (out == 0).all()
        torch.testing.assert_close(lse, sinks.detach().view(1, HQ, 1).expand(2, HQ, 5))
        torch.testing.assert_close(sinks.grad, torch.full((HQ,), 10.0))
