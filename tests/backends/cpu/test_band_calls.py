"""Narrow rows of the CPU paths as batched band calls (flexc/backends/cpu/band_calls.py, and
band_plain.py for general score_mods such as soft-capping): taken for windows a few dozen keys wide,
and equal to a float64 dense reference forward and backward for causal and bidirectional windows,
head- and batch-dependent masks and biases, keys broadcast over the batch, rows that allow nothing,
documents cutting the windows, non-square lengths and float64; the remembered masks follow a
captured tensor changed in place."""
import pytest
import torch
from hypothesis import given, strategies as st

import strategies

import flexc
from flexc import workers
from flexc.backends.cpu import band_calls, band_plain, causal_call, dense_tile, fused_cpu
from reference import dense_attention, random_qkv

B, H, E = 2, 2, 16
BLOCK = (32, 32)
_SLOPES = torch.tensor([0.5, 0.125])
_DOCS = torch.arange(256) // 90  # documents of 90 positions


def _sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 17)


def _bidirectional(b, h, q, kv):  # natten-like: a 7-key neighbourhood, shifted in at the edges
    return (torch.clamp(q, 3, 252) - kv).abs() <= 3


def _per_head_and_batch(b, h, q, kv):
    return (q >= kv) & (q - kv <= 9 + 12 * h + 5 * b)


def _dead_rows(b, h, q, kv):  # every 7th query sees nothing
    return (q % 7 != 3) & (q >= kv) & (q - kv <= 20)


def _window_in_documents(b, h, q, kv):
    return (_DOCS[q] == _DOCS[kv]) & (q >= kv) & (q - kv <= 17)


def _lower_right(b, h, q, kv):  # L=200 queries aligned to the end of S=256 keys
    diff = q + 56 - kv
    return (diff >= 0) & (diff <= 17)


def _alibi(score, b, h, q, kv):
    return score + _SLOPES[h] * (kv - q)


def _soft_cap(score, b, h, q, kv):
    return 20.0 * torch.tanh(score / 20.0)


def _gate(score, b, h, q, kv):  # a general score_mod (autograd carries dS through it), reading h
    return score * torch.sigmoid((q - kv) * 0.1 + h)


@pytest.fixture
def bands(monkeypatch):
    """The bands each forward ran (their row counts), with causal_call's own path and the dense tile
    (calls this small would be one) turned off."""
    seen = []
    real = band_calls.forward
    monkeypatch.setattr(causal_call, "applies", lambda *args: None)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)

    def spy(query, key, value, out, lse, g, band, mods, scale):
        seen.append(band.n)
        return real(query, key, value, out, lse, g, band, mods, scale)

    def plain_spy(query, key, value, out, lse, g, band, mods, scale, work):
        seen.append(band.n)
        return real_plain(query, key, value, out, lse, g, band, mods, scale, work)

    real_plain = band_plain.forward
    monkeypatch.setattr(band_calls, "forward", spy)
    monkeypatch.setattr(band_plain, "forward", plain_spy)
    return seen


def _check(mask_mod, score_mod=None, L=256, S=256, Bkv=B, dtype=torch.float32, atol=2e-5, block=BLOCK):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, S, E, dtype=dtype, Bkv=Bkv))
    block_mask = flexc.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = dense_attention(q64, k64, v64, score_mod, mask_mod)
    want = torch.autograd.grad(ref_out, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=0)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, atol=4 * atol, rtol=0, msg=f"d{name}")
    return out, lse


@pytest.mark.parametrize("mask_mod", [_sliding, _bidirectional, _per_head_and_batch, _dead_rows,
                                      _window_in_documents])
@pytest.mark.parametrize("score_mod", [None, _alibi, _soft_cap, _gate])
def test_narrow_windows_run_as_bands_and_match_dense_reference(bands, mask_mod, score_mod):
    _check(mask_mod, score_mod)
    assert max(bands) > 1  # several rows in one call


def test_rows_that_allow_nothing_in_a_band_give_zero_output_and_minus_inf_lse(bands):
    out, lse = _check(_dead_rows)
    assert max(bands) > 1
    dead = torch.arange(256) % 7 == 3
    assert torch.isneginf(lse[..., dead]).all() and (out[..., dead, :] == 0).all()


def test_bands_with_keys_broadcast_over_the_batch_and_non_square_lengths(bands):
    _check(_per_head_and_batch, _alibi, Bkv=1)
    _check(_lower_right, L=200, S=256)
    assert max(bands) > 1


@pytest.mark.parametrize("score_mod", [_alibi, _soft_cap])
def test_bands_in_float64_keep_float64_accuracy(bands, score_mod):
    _check(_bidirectional, score_mod, dtype=torch.float64, atol=1e-12)
    assert max(bands) > 1


def test_plain_bands_cut_their_tiles_to_the_score_budget(bands, monkeypatch):
    monkeypatch.setattr(band_plain, "TILE_ELEMENTS", 3000)  # a few tiles at a time
    _check(_sliding, _soft_cap)
    assert max(bands) > 1


def test_soft_capping_with_a_gradient_into_the_logsumexp_in_bands(bands):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, 256, 256, E))
    block_mask = flexc.create_block_mask(_sliding, B, H, 256, 256, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, score_mod=_soft_cap, block_mask=block_mask, return_lse=True)
    got = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = dense_attention(q64, k64, v64, _soft_cap, _sliding)
    want = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q64, k64, v64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=0)
    assert max(bands) > 1


def test_remembered_band_masks_follow_a_captured_tensor_changed_in_place(bands):
    widths = torch.tensor([5, 30])

    def per_head(b, h, q, kv):
        return (q >= kv) & (q - kv <= widths[h])
    _check(per_head)
    widths[0] = 12  # the same tensor, new values: the band's mask must be evaluated again
    _check(per_head)
    assert max(bands) > 1


@given(window=st.integers(0, 60), lead=st.integers(-8, 8), block=st.sampled_from([(32, 32), (64, 32), (32, 16)]),
       score_mod=st.sampled_from([None, _alibi, _soft_cap]))
@strategies.examples(12)
def test_any_window_matches_dense_reference(window, lead, block, score_mod):
    # windows of any width and offset (keys before and after the query), on any block shape
    def mask_mod(b, h, q, kv):
        diff = q + lead - kv
        return (diff >= 0) & (diff <= window)
    _check(mask_mod, score_mod, L=200, S=220, block=block)


@pytest.mark.parametrize("score_mod", [None, _soft_cap])
def test_bands_split_over_two_workers_match_dense_reference(bands, monkeypatch, score_mod):
    # small jobs run on one worker: lower the bar so two workers each take a band
    monkeypatch.setattr(fused_cpu, "MIN_COST_PER_WORKER", 1.0)
    monkeypatch.setattr(workers, "worker_count", lambda n_tasks, cost, min_cost=0: min(2, n_tasks))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(_sliding, score_mod)
    finally:
        torch.set_num_threads(threads)
    assert len(bands) >= 2 and max(bands) > 1


@pytest.mark.parametrize("score_mod", [_alibi, _soft_cap])
def test_bands_past_the_kept_mask_budget_build_their_masks_at_each_call(bands, monkeypatch, score_mod):
    monkeypatch.setattr(band_calls, "KEPT_MASK_ELEMENTS", 0)
    monkeypatch.setattr(band_calls, "BAND_MASK_ELEMENTS", 16 * 32 * 64)  # runs of a few rows (B*H mask rows)
    _check(_per_head_and_batch, score_mod)
    assert len(bands) >= 2 and max(bands) > 1
