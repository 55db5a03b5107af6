"""Vector work inside mods: a captured row read as a vector and reduced (torch.dot, .sum(-1),
.any(-1), .all(-1)), traced as bounded loops over the small axis. Forward against torch's
FlexAttention, gradients against float64 dense autograd, TORCH and TRITON backends, and the interval
analysis deciding the tiles of vector masks."""
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexc
from flexc.analysis.ranges import classify_tiles
from flexc.analysis.tiles import UNDECIDED
from reference import dense_attention, random_qkv

B, H, L, E, R = 2, 2, 64, 16, 4
BACKENDS = ["TORCH", "TRITON"]
_g = torch.Generator().manual_seed(0)
Q_ROPE = torch.randn(B, H, L, R, generator=_g)
K_ROPE = torch.randn(B, 1, L, R, generator=_g)
MEANS = torch.randn(L, 3, generator=_g)
FRAMES = torch.randint(0, 8, (L // 8, 3), generator=_g)  # each query frame attends these 3 key frames
LEVEL = torch.randint(0, 4, (L // 8, 2), generator=_g)


def rope_dot(score, b, h, q_idx, kv_idx):
    return score + torch.dot(Q_ROPE[b, h, q_idx], K_ROPE[b, 0, kv_idx])


def rope_sum(score, b, h, q_idx, kv_idx):  # the same bias, written so dense broadcasting can run it
    return score + (Q_ROPE[b, h, q_idx] * K_ROPE[b, 0, kv_idx]).sum(-1)


def mean_distance(score, b, h, q_idx, kv_idx):
    return score - (MEANS[q_idx] - MEANS[kv_idx]).pow(2).sum(-1) * 0.5


def max_and_mean(score, b, h, q_idx, kv_idx):
    return score + Q_ROPE[b, h, q_idx].amax(-1) * 0.1 - K_ROPE[b, 0, kv_idx].mean(-1) * 0.2


def video_frames(b, h, q_idx, kv_idx):
    return ((kv_idx // 8).unsqueeze(-1) == FRAMES[q_idx // 8]).any(-1) | (q_idx // 8 == kv_idx // 8)


def level_all(b, h, q_idx, kv_idx):
    return (LEVEL[q_idx // 8] >= LEVEL[kv_idx // 8]).all(dim=-1)


def _torch_flex(q, k, v, score_mod=None, mask_mod=None):
    bm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=16) if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)


def test_traced_as_reductions():
    assert str(flexc.trace(rope_dot)) == "score + sum(Q_ROPE[b, h, q_idx, r] * K_ROPE[b, 0, kv_idx, r] for r in range(4))"
    assert flexc.trace(rope_dot).root is flexc.trace(rope_sum).root
    assert "any(kv_idx // 8 == FRAMES[q_idx // 8, r] for r in range(3))" in str(flexc.trace(video_frames))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mod", [rope_dot, mean_distance, max_and_mean], ids=lambda f: f.__name__)
def test_vector_score_mods_match_torch(mod, backend):
    q, k, v = random_qkv(B, H, H, L, L, E, seed=1)
    out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": backend})
    torch.testing.assert_close(out, _torch_flex(q, k, v, score_mod=mod), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", [video_frames, level_all], ids=lambda f: f.__name__)
def test_vector_masks_match_torch(mask, backend):
    ours = flexc.create_block_mask(mask, None, None, L, L, BLOCK_SIZE=16)
    ref = torch_flex.create_block_mask(mask, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    for table in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, table), getattr(ref, table))
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(flexc.create_mask(mask, 1, 1, L, L), torch_flex.create_mask(mask, 1, 1, L, L, device="cpu"))
    q, k, v = random_qkv(B, H, H, L, L, E, seed=2)
    out = flexc.flex_attention(q, k, v, block_mask=ours, kernel_options={"BACKEND": backend})
    torch.testing.assert_close(out, _torch_flex(q, k, v, mask_mod=mask), atol=2e-5, rtol=2e-5)


def test_interval_analysis_decides_any_of_lookups_exactly():
    # frames are constant over 8-token tiles: every 8x8 tile is all-True or all-False, and the
    # analysis must prove which without evaluating a single element
    classes = classify_tiles(flexc.trace(video_frames), 1, 1, L, L, 8, 8)
    assert not (classes == UNDECIDED).any()
    dense = flexc.create_mask(video_frames, 1, 1, L, L)[0, 0].view(L // 8, 8, L // 8, 8)
    assert torch.equal(classes[0, 0] == 2, dense.all(-1).all(1))
    assert torch.equal(classes[0, 0] == 0, ~dense.any(-1).any(1))


def test_vector_gradients_match_float64_including_captured_vectors():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, H, H, 32, 32, E, seed=3))
    qr = Q_ROPE[:1, :, :32].clone().requires_grad_()
    kr = K_ROPE[:1, :, :32].clone().requires_grad_()

    def learned_rope(score, b, h, q_idx, kv_idx):
        return score + (qr[b, h, q_idx] * kr[b, 0, kv_idx]).sum(-1)

    dout = torch.randn(1, H, 32, E, generator=torch.Generator().manual_seed(4))
    leaves = (q, k, v, qr, kr)
    for backend in BACKENDS:
        out = flexc.flex_attention(q, k, v, score_mod=learned_rope, kernel_options={"BACKEND": backend})
        grads = torch.autograd.grad(out, leaves, dout)
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        q64, k64, v64, qr64, kr64 = leaves64
        ref = dense_attention(q64, k64, v64, score_mod=lambda s, b, h, qi, kv: s + (qr64[b, h, qi] * kr64[b, 0, kv]).sum(-1))[0]
        ref_grads = torch.autograd.grad(ref, leaves64, dout.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


def test_vector_errors_name_the_fix():
    with pytest.raises(flexc.TraceError, match="returns a vector of 4 values"):
        flexc.trace(lambda s, b, h, q_idx, kv_idx: s + Q_ROPE[b, h, q_idx])
    with pytest.raises(flexc.TraceError, match="different lengths"):
        flexc.trace(lambda s, b, h, q_idx, kv_idx: s + (Q_ROPE[b, h, q_idx] * MEANS[kv_idx]).sum(-1))
    with pytest.raises(flexc.TraceError, match="unsqueeze"):
        flexc.trace(lambda b, h, q_idx, kv_idx: (FRAMES[q_idx // 8].unsqueeze(0) == kv_idx).any(-1))
