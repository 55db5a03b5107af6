"""The CPU backend's fused-kernel forward (flexc/backends/fused_cpu.py) against a float64 dense
reference: it must be taken where supported, agree with the plain-torch path's semantics (full and
partial blocks, non-contiguous spans, head-dependent masks with GQA, bias score_mods, fully masked
rows), and fall back when the kernel is missing or the call is not of a supported form."""
import math

import pytest
import torch

import flexc
from flexc.backends.cpu import band_calls, causal_call, dense_tile, fused_cpu
from flexc.call import plans
from reference import dense_attention

B, H, L, S, E = 2, 4, 300, 260, 16  # ragged: neither length a multiple of the blocks
BLOCK = (64, 32)


def _qkv(Hq=H, Hkv=H, Bkv=B, Ev=E, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return make(B, Hq, L, E), make(Bkv, Hkv, S, E), make(Bkv, Hkv, S, Ev)


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 70)


def _window_per_head(b, h, q, kv):  # relative (kv - q only) but head- and batch-dependent
    return (q >= kv) & (q - kv <= 30 * (h + 1) + 20 * b)


def _documents(b, h, q, kv):  # many separate partial blocks per row, varying by batch
    return (q // (37 + 11 * b)) == (kv // (37 + 11 * b))


def _per_head(b, h, q, kv):  # head-dependent, and rows below 40 see no key at all for odd heads
    return (kv <= q + 20 * h) & ((h % 2 == 0) | (q >= 40))


_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def _alibi(score, b, h, q, kv):
    return score + _SLOPES[h] * (kv - q)


def _minus_distance(score, b, h, q, kv):
    return score - (q - kv).abs() * 0.01


def _absolute_positions(score, b, h, q, kv):  # a bias, but not of kv - q alone
    return score + (0.003 * q - 0.002 * kv * (h + 1))


@pytest.fixture
def calls(monkeypatch):
    """Count fused tasks (and those covering several rows, and batched bands of narrow rows), so
    each test knows which path ran. Causal masks run here on the block calls too, not as one causal
    call (test_causal_call.py), nor as one dense tile (test_dense_tile.py)."""
    count = {"tasks": 0, "tall": 0, "bands": 0}
    real = fused_cpu.forward_rows
    real_band = band_calls.forward
    monkeypatch.setattr(causal_call, "applies", lambda *args: None)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)

    def spy(query, key, value, out, lse, g, rows, mods, scale, sinks=None):
        count["tasks"] += 1
        count["tall"] += len(rows) > 1
        return real(query, key, value, out, lse, g, rows, mods, scale, sinks)

    def band_spy(*args):
        count["tasks"] += 1
        count["bands"] += 1
        return real_band(*args)

    monkeypatch.setattr(fused_cpu, "forward_rows", spy)
    monkeypatch.setattr(band_calls, "forward", band_spy)
    return count


def _check(q, k, v, mask_mod, score_mod=None, gqa=False, atol=2e-5, block=BLOCK, mask_heads=None):
    heads = q.shape[1] if mask_heads is None else mask_heads
    bm = flexc.create_block_mask(mask_mod, B, heads, L, S, device="cpu", BLOCK_SIZE=block)
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out.double(), ref_out.to(torch.float64), atol=atol, rtol=0)
    # lse is float32 (float64 for float64 inputs); -inf matches -inf only
    torch.testing.assert_close(lse.double(), ref_lse, atol=max(atol, 2e-5), rtol=0)
    return out, lse


@pytest.mark.parametrize("mask_mod", [_causal, _window, _window_per_head, _documents, _per_head])
@pytest.mark.parametrize("score_mod", [None, _alibi, _minus_distance, _absolute_positions])
def test_fused_forward_matches_dense_reference(calls, mask_mod, score_mod):
    _check(*_qkv(), mask_mod, score_mod)
    assert calls["tasks"] > 0


@pytest.mark.parametrize("mask_mod, mask_heads", [(_causal, 1), (_window, 1), (_per_head, H)])
@pytest.mark.parametrize("score_mod", [None, _alibi])
def test_fused_forward_with_gqa_and_broadcast_key_batch(calls, mask_mod, mask_heads, score_mod):
    # one block-mask head: the two query heads of a key head are stacked as rows of one call
    _check(*_qkv(Hq=H, Hkv=2, Bkv=1), mask_mod, score_mod, gqa=True, mask_heads=mask_heads)
    assert calls["tasks"] > 0


@pytest.mark.parametrize("mask_mod", [_causal, _window, _window_per_head, _documents, _per_head])
@pytest.mark.parametrize("score_mod", [None, _alibi, _absolute_positions])
def test_tall_calls_over_consecutive_rows_match_dense_reference(calls, mask_mod, score_mod):
    # small blocks give many rows, which are grouped so shared full spans are attended once
    _check(*_qkv(), mask_mod, score_mod, block=(16, 16))
    assert calls["tall"] > 0 or score_mod is _absolute_positions


def test_fused_forward_in_float64_keeps_float64_accuracy(calls):
    _check(*_qkv(dtype=torch.float64), _documents, _alibi, atol=1e-12)
    assert calls["tasks"] > 0


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse(calls):
    out, lse = _check(*_qkv(), _per_head)
    assert calls["tasks"] > 0
    dead = torch.isneginf(lse)
    assert dead[:, 1::2, :40].all() and not dead[:, 0::2].any()
    assert (out[dead] == 0).all()


def test_a_bias_that_is_minus_inf_everywhere_on_a_row_gives_a_dead_row(calls):
    # the kernel reports lse 0 for such rows; the fix-up must turn that into -inf
    drop_first_rows = lambda score, b, h, q, kv: score + torch.where(q < 10, -math.inf, 0.0)
    out, lse = _check(*_qkv(), _causal, drop_first_rows)
    assert calls["tasks"] > 0 and torch.isneginf(lse[..., :10]).all() and (out[..., :10, :] == 0).all()


@pytest.mark.parametrize("case", ["no kernel", "value dim differs", "general score_mod", "half precision"])
def test_unsupported_calls_fall_back_to_the_plain_torch_path(calls, monkeypatch, case):
    score_mod, Ev, dtype, atol = None, E, torch.float32, 2e-5
    if case == "no kernel":
        monkeypatch.setattr(fused_cpu, "FLASH", None)
    elif case == "value dim differs":
        Ev = 8
    elif case == "general score_mod":
        score_mod = lambda score, b, h, q, kv: 5.0 * torch.tanh(score / 5.0)
    else:
        dtype, atol = torch.bfloat16, 3e-2
    _check(*_qkv(Ev=Ev, dtype=dtype), _window, score_mod, atol=atol)
    assert calls["tasks"] == 0


@pytest.mark.parametrize("score_mod, relative", [
    (_alibi, True), (_minus_distance, True), (_absolute_positions, False),
    (lambda score, b, h, q, kv: score + ((q - kv) * 0.1 + q * 0.5), False),
    (lambda score, b, h, q, kv: score - _SLOPES[h] * ((kv - q) // 3), True),
])
def test_relative_bias_detection_accepts_only_functions_of_kv_minus_q(score_mod, relative):
    traced = flexc.trace(score_mod)
    left, right = traced.root.args
    bias = right if left.op == "input" and left.attr == "score" else left
    assert fused_cpu._relative_only(bias) is relative


def test_blocks_listed_full_between_partial_ones_skip_the_mask_mod(calls):
    """One query block whose keys are [partial, full, partial]: fused as one masked call, the full
    block must stay allowed even where the mask_mod (causal) says no, as in torch's kernels."""
    from torch.nn.attention import flex_attention as torch_flex
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for n in (64, 192, 192))
    num, idx = torch.tensor([[[2]]], dtype=torch.int32), torch.tensor([[[[0, 2, 1]]]], dtype=torch.int32)
    full_num, full_idx = torch.tensor([[[1]]], dtype=torch.int32), torch.tensor([[[[1, 0, 2]]]], dtype=torch.int32)
    tbm = torch_flex.BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=64, mask_mod=_causal,
                                              seq_lengths=(64, 192))
    out, lse = flexc.flex_attention(q, k, v, block_mask=tbm, return_lse=True)
    effective = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | ((kv_idx >= 64) & (kv_idx < 128))
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=effective)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    assert calls["tasks"] > 0


@pytest.mark.parametrize("copy_ratio", [0.0, math.inf])
@pytest.mark.parametrize("mask_mod, score_mod", [(_window, None), (_window_per_head, None), (_causal, _alibi),
                                                  (_window, _minus_distance), (_window_per_head, _alibi)])
@pytest.mark.parametrize("block", [BLOCK, (16, 16)])
def test_relative_tiles_copied_or_viewed_match_dense_reference(calls, monkeypatch, copy_ratio, mask_mod, score_mod,
                                                               block):
    # a kv - q tile is either a strided view of its vector over reversed query rows, or a copy in row
    # order (always where full columns must be unmasked); force each, and check which the kernel got
    monkeypatch.setattr(fused_cpu, "TILE_COPY_RATIO", copy_ratio)
    seen = {"view": 0, "copy": 0}
    real = fused_cpu.FLASH

    def spy(q, k, v, attn_mask=None, scale=None):
        if attn_mask is not None and attn_mask.shape[-1] > 1 and attn_mask.shape[-2] > 1:
            seen["view" if attn_mask.stride(-2) == attn_mask.stride(-1) == 1 else "copy"] += 1
        return real(q, k, v, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(fused_cpu, "FLASH", spy)
    _check(*_qkv(), mask_mod, score_mod, block=block)
    assert calls["tasks"] > 0
    if copy_ratio == 0.0:
        assert seen["view"] > 0
    else:
        assert seen["copy"] > 0 and seen["view"] == 0


# ---- the fused backward (fused_cpu.backward_row) ---------------------------------------------

@pytest.mark.parametrize("mask_mod, score_mod, kv_heads, kv_batch, with_sinks", [
    (_per_head, None, H, B, False),  # rows that see no key: zero gradients, no NaN
    (_window_per_head, _alibi, H, B, False),  # a relative tile laid out for reversed rows
    (_documents, _absolute_positions, 2, 1, False),  # a general bias, GQA, one key batch for all
    (_causal, None, H, B, True),  # sinks: part of lse, not of out
])
def test_fused_backward_takes_the_forwards_calls_and_matches_float64(monkeypatch, mask_mod, score_mod, kv_heads,
                                                                     kv_batch, with_sinks):
    rows = []
    real = fused_cpu.backward_row
    monkeypatch.setattr(causal_call, "applies", lambda *args: None)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)  # (a call this small would be one dense tile)
    monkeypatch.setattr(fused_cpu, "backward_row", lambda *a: rows.append(1) or real(*a))
    q, k, v = (t.requires_grad_() for t in _qkv(Hq=H, Hkv=kv_heads, Bkv=kv_batch, dtype=torch.float64, seed=3))
    sinks = torch.linspace(-1.0, 2.0, H, dtype=torch.float64, requires_grad=True) if with_sinks else None
    bm = flexc.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                               **({"sinks": sinks} if with_sinks else {}))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    wrt = (q, k, v) + ((sinks,) if with_sinks else ())
    mine = torch.autograd.grad(out, wrt, grad_out)
    assert rows, "the fused backward was not taken"
    ref = _dense_with_sinks(q, k, v, score_mod, mask_mod, sinks)
    for a, b in zip(mine, torch.autograd.grad(ref, wrt, grad_out)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mask_mod, score_mod", [(_causal, None), (_causal, _alibi), (_window, _minus_distance),
                                                  (_documents, None)])
def test_fused_backward_over_runs_of_rows_takes_tall_calls_and_matches_float64(monkeypatch, mask_mod, score_mod):
    # small blocks give many rows; runs of them share tall calls over their common full key spans
    tall = []
    real = fused_cpu.backward_rows
    monkeypatch.setattr(causal_call, "applies", lambda *args: None)
    monkeypatch.setattr(plans, "prepare_recorded", lambda *args: None)  # (nor torch's own node for causal)
    monkeypatch.setattr(dense_tile, "MAX_PAIRS", 0)  # (nor one dense tile)
    monkeypatch.setattr(fused_cpu, "backward_rows", lambda *a: tall.append(len(a[10]) > 1) or real(*a))
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float64, seed=6))
    bm = flexc.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=(16, 16))
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    mine = torch.autograd.grad(out, (q, k, v), grad_out)
    assert any(tall), "no run of rows took tall backward calls"
    ref = dense_attention(q, k, v, score_mod, mask_mod)[0]
    for a, b in zip(mine, torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def _dense_with_sinks(q, k, v, score_mod, mask_mod, sinks):
    """The dense float64 output, with each head's sink logit as one more key of value 0."""
    if sinks is None:
        return dense_attention(q, k, v, score_mod, mask_mod)[0]
    out, lse, _ = dense_attention(q, k, v, score_mod, mask_mod)
    total = torch.logaddexp(lse, sinks.view(1, -1, 1).expand_as(lse))
    return out * torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1)


def test_a_gradient_into_the_logsumexp_takes_the_row_loop(monkeypatch):
    monkeypatch.setattr(fused_cpu, "backward_row", lambda *a: pytest.fail("fused backward with a gradient into lse"))
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float64, seed=5))
    bm = flexc.create_block_mask(_window, B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    mine = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    ref_out, ref_lse, _ = dense_attention(q, k, v, None, _window)
    for a, b in zip(mine, torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_a_simulated_gpu_takes_the_gpus_path_not_the_cpu_kernels():
    # torch's fused CPU kernel (and the causal calls built on it) exist for CPU tensors only: a
    # simulated GPU's calls take the path a GPU's take, where the counted host reads are the GPU's
    q = torch.randn(1, 2, 64, 16)
    if fused_cpu.FLASH is None:
        pytest.skip("torch has no fused CPU kernel here")
    assert fused_cpu.supported(q, q, None, False)
    with flexc.device.simulate("sm_90"):
        assert not fused_cpu.supported(q, q, None, False)


def test_the_fused_backward_flushes_subnormals_only_while_it_runs():
    assert not fused_cpu._flushing()
    with fused_cpu.denormals_flushed():
        assert fused_cpu._flushing()
    assert not fused_cpu._flushing()
    torch.set_flush_denormal(True)  # a caller's own setting is left as it was
    try:
        with fused_cpu.denormals_flushed():
            pass
        assert fused_cpu._flushing()
    finally:
        torch.set_flush_denormal(False)


def test_a_steep_bias_with_far_keys_below_exps_range_keeps_float32_gradients(monkeypatch):
    # slopes of 1 and 2 per position: most pairs' probabilities are far below fp32's smallest
    # normal, which the fused backward flushes to 0 (fused_cpu.denormals_flushed)
    monkeypatch.setattr(causal_call, "applies", lambda *args: None)
    steep = lambda score, b, h, q, kv: score + (h % 2 + 1.0) * (kv - q)
    q, k, v = (t.requires_grad_() for t in _qkv(seed=5))
    bm = flexc.create_block_mask(_causal, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out = flexc.flex_attention(q, k, v, score_mod=steep, block_mask=bm)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    mine = torch.autograd.grad(out, (q, k, v), grad_out)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(dense_attention(*wide, steep, _causal)[0], wide, grad_out.double())
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b.float(), atol=2e-5, rtol=1e-4)
