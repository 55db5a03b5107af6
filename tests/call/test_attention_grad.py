"""flexc.flex_attention backward: gradients for q, k, v, lse and captured tensors against autograd
through a float64 dense reference, torch.autograd.gradcheck at tiny sizes, and the cases torch
2.13 cannot differentiate (0-d scalar, score-independent score_mod, one tensor gathered twice)."""
import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from flexc.backends.cpu import dense_tile
from strategies import examples
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention

B, HQ, HKV, L, S, E = 2, 4, 2, 70, 50, 8
BLOCK = (16, 16)


def _inputs(B=B, Hq=HQ, Hkv=HKV, L=L, S=S, E=E, Ev=None, Bkv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return make(B, Hq, L, E), make(Bkv or B, Hkv, S, E), make(Bkv or B, Hkv, S, Ev or E)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True)


def _flexc_and_reference_grads(q, k, v, score_mod=None, mask_mod=None, extra=(), mask_h=None, lse_weight=0.0,
                               dtype=torch.float64):
    """Gradients of ``sum(out * w) + lse_weight * sum(lse)`` from flexc and from the dense reference."""
    Bq, Hq, Lq, _ = q.shape
    Sk = k.shape[2]
    w = torch.randn(Bq, Hq, Lq, v.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bm = (flexc.create_block_mask(mask_mod, Bq, mask_h, Lq, Sk, device="cpu", BLOCK_SIZE=BLOCK)
          if mask_mod is not None else None)
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
    lse_term = torch.where(torch.isinf(lse), 0.0, lse).sum() * lse_weight
    mine = _grads((out.double() * w).sum() + lse_term, (q, k, v, *extra))
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    ref_lse_term = torch.where(torch.isinf(ref_lse), 0.0, ref_lse).sum() * lse_weight
    ref = _grads((ref_out * w).sum() + ref_lse_term, (q, k, v, *extra))
    return mine, ref


def _assert_grads_close(mine, ref, atol=1e-9):
    for a, b in zip(mine, ref):
        if b is None:
            assert a is None or torch.all(a == 0)
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype or a.dtype != torch.float64
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=1e-6)


MASKS = mask_catalogue(B, HQ, L, S)
SCORES = score_catalogue(B, HQ, L, S)
CASES = [
    ("causal", "identity"),
    ("sliding_window_17", "alibi_captured_slopes"),
    ("document_causal", "soft_capping_tanh"),
    ("per_head_window", "t5_bucketed_bias"),
    ("some_rows_fully_masked", "relative_position"),
    ("dilated_sliding_window", "causal_through_score"),
    ("global_tokens_with_window", "distance_only_ignores_score"),
    ("padding_per_batch", "checkerboard"),
    (None, "full_4d_bias"),
    ("block_sparse_lookup_4d", None),
]


@pytest.mark.parametrize("mask_name,score_name", CASES)
def test_gradients_match_float64_dense_autograd(mask_name, score_name):
    q, k, v = _inputs(seed=hash((mask_name, score_name)) % 1000)
    mask_mod = MASKS[mask_name] if mask_name else None
    score_mod = SCORES[score_name] if score_name else None
    mine, ref = _flexc_and_reference_grads(q, k, v, score_mod, mask_mod, lse_weight=0.25,
                                           mask_h=HQ if mask_name in ("per_head_window", "block_sparse_lookup_4d") else None)
    _assert_grads_close(mine, ref)


def test_learnable_relative_bias_gets_its_gradient():
    q, k, v = _inputs(seed=2)
    bias = torch.randn(HQ, L + S, dtype=torch.float64, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S]

    mine, ref = _flexc_and_reference_grads(q, k, v, rel_bias, MASKS["causal"], extra=(bias,))
    _assert_grads_close(mine, ref)
    assert mine[3].abs().sum() > 0


def test_zero_dim_learnable_scalar_gets_its_gradient():
    # torch 2.13 fails here ("vmap ... can not return a BatchedTensor when out_dim is None")
    q, k, v = _inputs(seed=3)
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    mine, ref = _flexc_and_reference_grads(q, k, v, lambda s, b, h, q_idx, kv_idx: s * temperature,
                                           MASKS["sliding_window_17"], extra=(temperature,))
    _assert_grads_close(mine, ref)
    assert mine[3].shape == () and mine[3] != 0


def test_score_mod_that_ignores_score_differentiates_its_buffer_and_gives_zero_dq_dk():
    # torch 2.13 fails here ("must only return Tensors, got NoneType")
    q, k, v = _inputs(seed=4)
    table = torch.randn(HQ, L, S, dtype=torch.float64, requires_grad=True)
    mine, ref = _flexc_and_reference_grads(q, k, v, lambda s, b, h, q_idx, kv_idx: table[h, q_idx, kv_idx],
                                           MASKS["causal"], extra=(table,))
    _assert_grads_close(mine, ref)
    assert torch.all(mine[0] == 0) and torch.all(mine[1] == 0)


def test_same_learnable_tensor_gathered_twice_accumulates_both_gradients():
    # torch 2.13's compiled path refuses this ("clone() the tensors" workaround)
    q, k, v = _inputs(seed=5)
    pos = torch.randn(max(L, S), dtype=torch.float64, requires_grad=True)
    mine, ref = _flexc_and_reference_grads(q, k, v, lambda s, b, h, q_idx, kv_idx: s + pos[q_idx] * pos[kv_idx],
                                           MASKS["document_causal"], extra=(pos,))
    _assert_grads_close(mine, ref)


def test_non_leaf_captured_tensor_passes_gradient_to_its_parameter():
    q, k, v = _inputs(seed=6)
    raw = torch.randn(HQ, dtype=torch.float64, requires_grad=True)
    slopes = raw.exp() * 0.1  # computed from a parameter, captured by the closure
    mine, ref = _flexc_and_reference_grads(
        q, k, v, lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), MASKS["causal"], extra=(raw,))
    _assert_grads_close(mine, ref)


def test_fully_masked_rows_have_zero_gradients_and_no_nan():
    q, k, v = _inputs(seed=7)
    dead_rows = lambda b, h, q_idx, kv_idx: (q_idx % 5 != 0) & (kv_idx <= q_idx)
    bm = flexc.create_block_mask(dead_rows, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    loss = out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:, :, ::5] == 0)
    assert dq[:, :, 1:5].abs().sum() > 0


def _minus_inf_on_every_third_pair(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx + 2 * kv_idx) % 3 == 0, -float("inf"), score)


def _nan_on_blocked_pairs(score, b, h, q_idx, kv_idx):
    return score + torch.sqrt((q_idx - kv_idx).float()) * 0.1  # NaN above the diagonal, which is blocked


@pytest.mark.parametrize("score_mod", [None, _minus_inf_on_every_third_pair, _nan_on_blocked_pairs])
def test_underflowing_probabilities_and_blocked_pairs_give_float64_gradients(score_mod):
    """Scores 40x larger than usual, so most probabilities underflow in fp32 (the backward floors
    exp's argument to stay on its fast path), -inf and NaN post-mod scores, and keys no query may
    see: fp32 gradients equal the float64 reference's, and the unseen keys' are exactly 0."""
    q64, k64, v64 = _inputs(seed=11)
    q64 = (q64.detach() * 40).requires_grad_()
    unseen = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (kv_idx % 7 != 3)
    q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    mine, _ = _flexc_and_reference_grads(q, k, v, score_mod, unseen)
    _, ref = _flexc_and_reference_grads(q64, k64, v64, score_mod, unseen)
    for a, b in zip(mine, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=1e-3)
    assert torch.all(mine[1][:, :, 3::7] == 0) and torch.all(mine[2][:, :, 3::7] == 0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15), (torch.float16, 2e-2)])
def test_low_precision_gradients_are_close_to_float64(dtype, atol):
    q64, k64, v64 = _inputs(seed=8)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
    mine, _ = _flexc_and_reference_grads(q, k, v, SCORES["alibi_exp2_formula"], MASKS["causal"])
    _, ref = _flexc_and_reference_grads(q64, k64, v64, SCORES["alibi_exp2_formula"], MASKS["causal"])
    for a, b in zip(mine, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=5e-2)


@pytest.mark.parametrize("score_name", ["soft_capping_tanh", None])
def test_key_value_batch_broadcast_sums_their_gradients_over_the_batch(score_name):
    q, k, v = _inputs(Bkv=1, Ev=12, seed=9)
    mine, ref = _flexc_and_reference_grads(q, k, v, SCORES.get(score_name), MASKS["prefix_lm"])
    _assert_grads_close(mine, ref)
    assert mine[1].shape == (1, HKV, S, E)


def test_gradcheck_at_tiny_sizes():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 17, generator=g, dtype=torch.float64, requires_grad=True)
    scalar = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    mask = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 4
    bm = flexc.create_block_mask(mask, None, None, 9, 7, device="cpu", BLOCK_SIZE=(4, 2))

    def fn(q, k, v, bias, scalar):
        mod = lambda s, b, h, q_idx, kv_idx: torch.tanh(s * scalar) * 2 + bias[h, q_idx - kv_idx + 8]
        # lse is float64 for float64 inputs, as torch's, so finite differences check it too
        return flexc.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, scalar), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("score_name,kv_heads", [("relative_position", HKV), (None, HQ)])
def test_transposed_blhe_inputs_and_non_contiguous_grad_output(score_name, kv_heads):
    """Inputs laid out [B, L, H, E] and transposed (the usual projection output) work both ways."""
    g = torch.Generator().manual_seed(11)
    make = lambda n, h, e: torch.randn(B, n, h, e, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    q, k, v = make(L, HQ, E), make(S, kv_heads, E), make(S, kv_heads, 6)
    mask_mod, score_mod = MASKS["sliding_window_17"], SCORES.get(score_name)
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    ref, _, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad_out = torch.randn(B, L, HQ, 6, generator=g, dtype=torch.float64).transpose(1, 2)
    _assert_grads_close(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out))


@examples(10)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 2), q_len=st.integers(1, 40),
       kv_len=st.integers(1, 40), q_block=st.sampled_from([4, 8, 128]), kv_block=st.sampled_from([4, 16]),
       window=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_random_shapes_gradients_match_float64_reference(b, hkv, group, q_len, kv_len, q_block, kv_block, window, seed):
    q, k, v = _inputs(B=b, Hq=hkv * group, Hkv=hkv, L=q_len, S=kv_len, E=4, seed=seed)
    bias = torch.randn(q_len + kv_len, dtype=torch.float64, requires_grad=True)
    mask_mod = lambda b_, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= window
    # with a bias, and without a score_mod (the backward's mask-only chunks)
    score_mod = (lambda s, b_, h, q_idx, kv_idx: s + bias[q_idx - kv_idx + kv_len]) if seed % 2 else None
    bm = flexc.create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    ref, _, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    grad_out = torch.randn_like(ref)
    wrt = (q, k, v, bias) if score_mod is not None else (q, k, v)
    _assert_grads_close(torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out))


def test_row_workers_give_the_reference_result_deterministically(monkeypatch):
    """Force several worker threads on a small problem: same result on every run, and correct."""
    import flexc.workers as workers

    monkeypatch.setattr(workers, "worker_count", lambda n_tasks, cost, *a: min(3, n_tasks))
    q, k, v = _inputs(seed=12)
    bias = torch.randn(HQ, L + S, dtype=torch.float64, requires_grad=True)
    score_mod = lambda s, b, h, q_idx, kv_idx: s + bias[h, q_idx - kv_idx + S]
    bm = flexc.create_block_mask(MASKS["document_causal"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)

    def run():
        out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v, bias)))

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref = dense_attention(q, k, v, score_mod=score_mod, mask_mod=MASKS["document_causal"])[0]
    torch.testing.assert_close(first[0], ref, atol=1e-12, rtol=0)
    _assert_grads_close(first[1:], torch.autograd.grad(ref.square().sum(), (q, k, v, bias)))


def test_row_workers_leave_torch_thread_settings_of_other_threads_alone(monkeypatch):
    import threading

    import flexc.workers as workers

    before = torch.get_num_threads()
    monkeypatch.setattr(workers, "_pools", {})  # make the call start a fresh pool
    monkeypatch.setattr(workers, "worker_count", lambda n_tasks, cost, *a: min(2, n_tasks))
    q, k, v = _inputs(seed=13)
    # (a causal mask is one kernel call, without row workers; so is a call this small: dense_tile)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)
    bm = flexc.create_block_mask(MASKS["document_causal"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True).sum().backward()
    assert len(workers._pools) == 1
    seen = []
    fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert torch.get_num_threads() == before and seen == [before]
    # and the workers themselves stay at one torch thread after running ops (no oversubscription)
    pool = next(iter(workers._pools.values()))
    assert pool.submit(lambda: (torch.randn(64, 4096).exp(), torch.get_num_threads())[1]).result() == 1


def test_row_workers_run_under_the_callers_inference_mode(monkeypatch):
    import flexc.workers as workers

    monkeypatch.setattr(workers, "worker_count", lambda n_tasks, cost, *a: min(2, n_tasks))
    q, k, v = (t.detach() for t in _inputs(seed=14))
    # (a causal mask is one kernel call, without row workers; so is a call this small: dense_tile)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)
    bm = flexc.create_block_mask(MASKS["document_causal"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    with torch.inference_mode():
        out = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert out.is_inference()
    ref, _, _ = dense_attention(q, k, v, mask_mod=MASKS["document_causal"])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
