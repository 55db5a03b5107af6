"""Small training calls as one fused-kernel call over the whole score tile with a dense additive mask
(flexc/backends/cpu/dense_tile.py): recorded by autograd (torch's C++ backward node), the BlockMask
read as the block path reads it (full blocks allowed, unlisted blocks never), a captured tensor's
new values seen, and equal to a float64 dense reference forward and backward."""
import pytest
import torch

import flexc
from flexc.backends.cpu import dense_tile, fused_cpu
from flexc.call import plans
from reference import autograd_node_names, dense_attention, random_qkv

B, H, L, E, BLOCK = 2, 4, 96, 16, 32
SLOPES = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float64))


def _alibi(score, b, h, q, kv):
    return score + SLOPES[h] * (kv - q)


def _minus_distance(score, b, h, q, kv):
    return score - 0.1 * (q - kv).abs()


def _window(b, h, q, kv):
    return (q - kv).abs() <= 20


def _causal(b, h, q, kv):
    return q >= kv


def _per_head_prefix(b, h, q, kv):  # reads h; rows of head 3 before key 40 see nothing
    return (kv <= q) & (kv >= 10 * h) | (h == 0)


def _path(out) -> str:
    nodes = autograd_node_names(out)
    return "recorded" if any("FlashAttentionForCpuBackward" in n for n in nodes) else (
        "function" if any("FlexAttentionFunction" in n for n in nodes) else str(nodes))


def _qkv(seed=0):
    return tuple(t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float64, seed=seed))


def _assert_matches(out, ref, wrt, seed=1):
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    for a, b, t in zip(torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out), wrt):
        assert a.stride() == t.stride()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("score_mod, mask_mod", [(_alibi, _causal), (_minus_distance, _window), (None, _window),
                                                 (_alibi, _per_head_prefix), (_alibi, None)])
def test_a_small_training_call_with_a_bias_or_a_mask_records_one_kernel_call_and_matches_float64(score_mod,
                                                                                                 mask_mod):
    q, k, v = _qkv()
    bm = flexc.create_block_mask(mask_mod, None, H, L, L, device="cpu", BLOCK_SIZE=BLOCK) if mask_mod else None
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    assert _path(out) == "recorded"
    _assert_matches(out, dense_attention(q, k, v, score_mod, mask_mod)[0], (q, k, v))


def test_the_dense_mask_reads_the_blockmask_as_the_block_path_does(monkeypatch):
    # tables made for a window of 20, then the captured width changed: blocks listed full stay fully
    # allowed (the mask_mod is not asked there), blocks not listed stay blocked though it now allows them
    width = torch.tensor(20)

    def window(b, h, q, kv):
        return (q - kv).abs() <= width

    q, k, v = _qkv(seed=2)
    bm = flexc.create_block_mask(window, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    for new_width in (5, 60):
        width.fill_(new_width)
        out = flexc.flex_attention(q, k, v, score_mod=_alibi, block_mask=bm)
        assert _path(out) == "recorded"
        with monkeypatch.context() as m:
            m.setattr(dense_tile, "MAX_PAIRS", 0)  # the block path, whose reading of the tables is the contract
            plans.clear()  # (planned again, without the dense tile)
            ref = flexc.flex_attention(q, k, v, score_mod=_alibi, block_mask=bm)
            assert _path(ref) == "function"
        plans.clear()
        _assert_matches(out, ref, (q, k, v), seed=new_width)


def test_a_captured_bias_changed_in_place_or_wanting_a_gradient_is_followed():
    slopes = SLOPES.clone()

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    q, k, v = _qkv(seed=3)
    bm = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)  # (its mask kept)
    slopes.mul_(4.0)
    out = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    assert _path(out) == "recorded"
    _assert_matches(out, dense_attention(q, k, v, alibi, _causal)[0], (q, k, v))
    slopes.requires_grad_()  # the kernel's backward has no gradient for its mask: flexc's Function
    out = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    assert _path(out) == "function"
    _assert_matches(out, dense_attention(q, k, v, alibi, _causal)[0], (q, k, v, slopes))


def test_calls_past_the_dense_sizes_keep_the_block_path():
    assert dense_tile.fits(B, H, L, L)
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 1, 1, 512, 512, E, dtype=torch.float64))
    assert not dense_tile.fits(1, 1, 512, 512)
    bm = flexc.create_block_mask(_window, None, None, 512, 512, device="cpu")
    assert _path(flexc.flex_attention(q, k, v, score_mod=_minus_distance, block_mask=bm)) == "function"


def test_small_calls_off_the_recorded_path_run_one_kernel_call_each_way(monkeypatch):
    # the logsumexp asked for (flexc's Function trains it), GQA with one key batch for every query
    # batch, rows that see nothing (head 3's first 30): one call forward, one backward
    counts = {"forward": 0, "backward": 0}
    forward, backward = fused_cpu.FLASH, fused_cpu.FLASH_BACKWARD
    monkeypatch.setattr(fused_cpu, "FLASH", lambda *a, **kw: counts.__setitem__("forward", counts["forward"] + 1)
                        or forward(*a, **kw))
    monkeypatch.setattr(fused_cpu, "FLASH_BACKWARD", lambda *a, **kw: counts.__setitem__(
        "backward", counts["backward"] + 1) or backward(*a, **kw))
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, 2, L, L, E, dtype=torch.float64, Bkv=1, seed=4))
    bm = flexc.create_block_mask(_per_head_prefix, None, H, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, score_mod=_alibi, block_mask=bm, enable_gqa=True, return_lse=True)
    assert _path(out) == "function" and counts == {"forward": 1, "backward": 0}
    ref, ref_lse, _ = dense_attention(q, k, v, _alibi, _per_head_prefix)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), atol=1e-12, rtol=0)
    assert torch.isneginf(lse[:, 3, :30]).all() and (out[:, 3, :30] == 0).all()
    _assert_matches(out, ref, (q, k, v))
    assert counts == {"forward": 1, "backward": 1}
    with torch.no_grad():  # inference: the same call
        torch.testing.assert_close(flexc.flex_attention(q, k, v, score_mod=_alibi, block_mask=bm, enable_gqa=True),
                                   ref, atol=1e-12, rtol=0)
    assert counts["forward"] == 2
