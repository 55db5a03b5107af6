"""flexc.flex_attention forward: against torch's FlexAttention (eager oracle) and a float64 dense
reference, over the mod catalogue, GQA, non-square and ragged lengths, B/H broadcast and dtypes."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch.nn.attention import flex_attention as torch_flex

import flexc
from strategies import examples
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]

B, H, L, S, E = 2, 2, 200, 170, 16  # non-square, and neither length a multiple of the blocks
BLOCK = (64, 32)
MASKS = mask_catalogue(B, H, L, S)
SCORES = score_catalogue(B, H, L, S)


def _qkv(B=B, Hq=H, Hkv=H, L=L, S=S, E=E, Ev=None, dtype=torch.float32, Bkv=None, seed=0):
    return random_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, Bkv, seed)


def _close(actual, expected, atol, rtol=0.0):
    """Compare allowing -inf to match -inf exactly."""
    expected = expected.to(actual.dtype) if actual.dtype == torch.float64 else expected.float()
    torch.testing.assert_close(actual.float() if actual.dtype != torch.float64 else actual,
                               expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_catalogue_mask_matches_torch_flex_attention_and_dense_reference(name):
    mask_mod = MASKS[name]
    q, k, v = _qkv()
    bm = flexc.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    _close(out, ref_out, atol=2e-5)
    _close(lse, ref_lse, atol=2e-5)
    # torch's own BlockMask is accepted and gives the same answer as torch's FlexAttention
    tbm = torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, block_mask=tbm, return_lse=True)
    out2, lse2 = flexc.flex_attention(q, k, v, block_mask=tbm, return_lse=True)
    _close(out2, t_out, atol=2e-5)
    _close(lse2, t_lse, atol=2e-5)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_every_catalogue_score_mod_matches_torch_flex_attention_and_dense_reference(name):
    score_mod = SCORES[name]
    q, k, v = _qkv(seed=1)
    causal = flexc.create_block_mask(MASKS["causal"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    for bm, mask_mod in ((None, None), (causal, MASKS["causal"])):
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
        ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        _close(out, ref_out, atol=3e-5)
        _close(lse, ref_lse, atol=3e-5, rtol=1e-6)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=causal.to_torch(),
                                             return_lse=True)
    _close(out, t_out, atol=3e-5)
    _close(lse, t_lse, atol=3e-5, rtol=1e-6)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("mask_h", [None, "per_head"])
def test_gqa_matches_torch_with_shared_and_per_head_masks(hq, hkv, mask_h):
    q, k, v = _qkv(Hq=hq, Hkv=hkv, Ev=24, seed=2)
    masks = mask_catalogue(B, hq, L, S)
    mask_mod = masks["per_head_window"] if mask_h else masks["sliding_window_17"]
    Hm = hq if mask_h else None
    bm = flexc.create_block_mask(mask_mod, None, Hm, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    score_mod = score_catalogue(B, hq, L, S)["alibi_captured_slopes"]
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm.to_torch(),
                                             enable_gqa=True, return_lse=True)
    assert out.shape == (B, hq, L, 24)
    _close(out, t_out, atol=2e-5)
    _close(lse, t_lse, atol=2e-5)


@pytest.mark.parametrize("mask_b,mask_h", [(None, None), (B, None), (None, 3), (B, 3)])
def test_block_mask_broadcast_over_batch_and_heads(mask_b, mask_h):
    Hq = 3
    q, k, v = _qkv(Hq=Hq, Hkv=Hq, seed=3)
    mask_mod = mask_catalogue(B, Hq, L, S)["batch_and_head_dependent" if mask_b and mask_h else "causal"]
    bm = flexc.create_block_mask(mask_mod, mask_b, mask_h, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    ref, _, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    _close(out, ref, atol=2e-5)


def test_key_value_batch_of_one_broadcasts_over_query_batch():
    q, k, v = _qkv(B=3, Bkv=1, seed=4)
    mask_mod = mask_catalogue(3, H, L, S)["padding_per_batch"]
    bm = flexc.create_block_mask(mask_mod, 3, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    _close(out, ref_out, atol=2e-5)
    _close(lse, ref_lse, atol=2e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-5),
                                        (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_every_dtype_matches_float64_reference_and_keeps_query_dtype(dtype, atol):
    q, k, v = _qkv(dtype=dtype, seed=5)
    mask_mod = MASKS["document_causal"]
    score_mod = SCORES["soft_capping_tanh"]
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # torch's rule
    assert out.dtype == dtype and lse.dtype == lse_dtype and lse.shape == (B, H, L)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    _close(out, ref_out, atol=atol)
    _close(lse, ref_lse, atol=max(atol, 1e-5) * 2)
    if dtype != torch.float64:
        t_out = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm.to_torch())
        _close(out, t_out, atol=atol * 2)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    q, k, v = _qkv(seed=6)
    mask_mod = MASKS["some_rows_fully_masked"]
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    dead = torch.arange(L) % 7 == 3
    assert torch.all(out[:, :, dead] == 0) and torch.all(torch.isneginf(lse[:, :, dead]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, ~dead]).all()
    # a score_mod that returns -inf for a whole row behaves the same
    kill = lambda score, b, h, q_idx, kv_idx: torch.where(q_idx == 5, -float("inf"), score)
    out, lse = flexc.flex_attention(q, k, v, score_mod=kill, return_lse=True)
    assert torch.all(out[:, :, 5] == 0) and torch.all(torch.isneginf(lse[:, :, 5]))


def test_return_aux_gives_lse_and_max_scores_like_the_reference():
    q, k, v = _qkv(seed=7)
    mask_mod, score_mod = MASKS["dilated_sliding_window"], SCORES["t5_bucketed_bias"]
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, aux = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                    return_aux=flexc.AuxRequest(lse=True, max_scores=True))
    assert isinstance(aux, flexc.AuxOutput)
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    _close(out, ref_out, atol=2e-5)
    _close(aux.lse, ref_lse, atol=2e-5)
    _close(aux.max_scores, ref_max, atol=2e-5)
    out_only, aux_none = flexc.flex_attention(q, k, v, block_mask=bm, return_aux=flexc.AuxRequest())
    assert aux_none.lse is None and aux_none.max_scores is None and out_only.shape == out.shape


def test_explicit_scale_and_value_head_dim_differ():
    q, k, v = _qkv(Ev=40, seed=8)
    out = flexc.flex_attention(q, k, v, scale=0.3, kernel_options={"BACKEND": "TORCH", "BLOCK_M": 64})
    ref, _, _ = dense_attention(q, k, v, scale=0.3)
    _close(out, ref, atol=2e-5)


def test_blocks_listed_as_full_skip_the_mask_mod_as_in_torchs_kernels():
    """Kernels never apply mask_mod on full blocks: a hand-built table that calls the causal
    diagonal blocks full must attend to all of them (torch's eager path ignores the tables)."""
    q, k, v = _qkv(B=1, Hq=1, Hkv=1, L=128, S=128, seed=9)
    num = torch.tensor([[[0, 0]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    full_num = torch.tensor([[[1, 2]]], dtype=torch.int32)  # blocks (0,0) and (1,1) called full
    tbm = torch_flex.BlockMask.from_kv_blocks(num, idx, full_num, idx, BLOCK_SIZE=64, mask_mod=MASKS["causal"])
    out = flexc.flex_attention(q, k, v, block_mask=tbm)
    effective = lambda b, h, q_idx, kv_idx: (kv_idx < 64) | (q_idx >= 64)
    ref, _, _ = dense_attention(q, k, v, mask_mod=effective)
    _close(out, ref, atol=2e-5)


@examples(25)
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 3),
    q_len=st.integers(1, 150), kv_len=st.integers(1, 150), e=st.sampled_from([4, 8, 16]),
    q_block=st.sampled_from([16, 32, 128]), kv_block=st.sampled_from([8, 32, 64]),
    window=st.integers(0, 60), use_score=st.booleans(), seed=st.integers(0, 2**16),
)
def test_random_shapes_and_windows_match_float64_reference(b, hkv, group, q_len, kv_len, e, q_block,
                                                           kv_block, window, use_score, seed):
    hq = hkv * group
    q, k, v = _qkv(B=b, Hq=hq, Hkv=hkv, L=q_len, S=kv_len, E=e, seed=seed, dtype=torch.float64)
    mask_mod = lambda b_, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= window + h
    score_mod = (lambda s, b_, h, q_idx, kv_idx: s * 0.5 + (q_idx - kv_idx) * 0.01) if use_score else None
    bm = flexc.create_block_mask(mask_mod, None, hq, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)  # float64 lse for float64 inputs


def test_long_causal_row_is_split_into_chunks_and_still_exact(monkeypatch):
    """Force tiny chunks so rows need the online-softmax merge across many chunks."""
    import flexc.backends.cpu.head_groups as groups

    monkeypatch.setattr(groups, "CHUNK_ELEMENTS", 64)
    q, k, v = _qkv(seed=10)
    mask_mod = MASKS["global_tokens_with_window"]
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=(32, 8))
    out, lse = flexc.flex_attention(q, k, v, score_mod=SCORES["alibi_exp2_formula"], block_mask=bm, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=SCORES["alibi_exp2_formula"], mask_mod=mask_mod)
    _close(out, ref_out, atol=2e-5)
    _close(lse, ref_lse, atol=2e-5)


@pytest.mark.parametrize("mask_h", [None, H])
def test_query_rows_and_heads_without_any_key_block_are_zero(mask_h):
    """Block rows (or whole heads) that list no key block are never visited and must read 0."""
    q, k, v = _qkv(seed=11)
    mask_mod = lambda b, h, q_idx, kv_idx: (h == 0) & (q_idx < 50) & (kv_idx <= q_idx) if mask_h else (
        (q_idx < 50) & (kv_idx <= q_idx))
    bm = flexc.create_block_mask(mask_mod, None, mask_h, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    for _ in range(2):  # a second call reuses freed memory that held the first call's values
        out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
        ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
        _close(out, ref_out, atol=2e-5)
        _close(lse, ref_lse, atol=2e-5)
        assert torch.all(out[:, :, 64:] == 0)


def test_a_score_mod_returning_the_score_unchanged_runs_as_the_call_without_one(monkeypatch):
    # Hugging Face's score_mod with nothing configured: Python branches on closure values that
    # are None, then `return score`. It must take the paths a call without a score_mod takes
    # (here the kernel's causal mode, recorded by autograd) and give that call's result.
    softcap = head_bias = None

    def hf_style(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if head_bias is not None:
            score = score + head_bias[h]
        return score

    from flexc.backends.cpu import causal_call
    seen = []
    monkeypatch.setattr(causal_call, "recorder",
                        lambda *args, _real=causal_call.recorder, **kw: seen.append(1) or _real(*args, **kw))
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 96, 96, 16, dtype=torch.float64, seed=11))
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 96, 96, BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, score_mod=hf_style, block_mask=bm)
    assert seen == [1]
    ref = dense_attention(q, k, v, None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    softcap = 20.0  # configured: a real score_mod, not the call without one
    out = flexc.flex_attention(q, k, v, score_mod=hf_style, block_mask=bm)
    assert seen == [1]
    torch.testing.assert_close(out, dense_attention(q, k, v, hf_style, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)[0],
                               atol=1e-10, rtol=0)
