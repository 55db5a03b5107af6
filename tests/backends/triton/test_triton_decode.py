"""The split-KV Triton decode kernel, run on CPU through Triton's interpreter, against the float64
dense reference (and torch's FlexAttention for a GQA case): catalogue masks and score_mods at an
offset into the cache, GQA packing with head-dependent mods, batch > 1 with ragged cache lengths
and an empty one, any number of splits, dtypes, and kernel_source showing the kernel."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc
from flexc.backends.triton import decode as triton_decode
from catalogue import mask_catalogue, score_catalogue
from reference import decoding_slice, dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

B, H, S, E = 2, 2, 150, 16  # 150: the last 32-key block is ragged
BLOCK = 32
OFFSET = 120  # the query rows sit at positions 120.. of the sequence (inside the 4th 32-row block)
MASKS = mask_catalogue(B, H, S, S)
SCORES = score_catalogue(B, H, S, S)
TRITON = {"BACKEND": "TRITON"}


def shifted(mod, score=False):
    if score:
        return lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + OFFSET, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + OFFSET, kv_idx)


def check(out, lse, ref_out, ref_lse, atol=2e-5):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    live = ~torch.isneginf(ref_lse)
    # lse is float32 except for float64 inputs, as torch returns it
    torch.testing.assert_close(lse[live].double(), ref_lse[live].double(), atol=max(atol, 1e-6), rtol=0)


def run(q, k, v, score_mod=None, block_mask=None):
    assert triton_decode.applies(q, k, block_mask)
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                enable_gqa=q.shape[1] != k.shape[1], kernel_options=TRITON)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_catalogue_mask(name):
    L = 2
    q, k, v = random_qkv(B, H, H, L, S, E, seed=1)
    mask_mod = shifted(MASKS[name])
    bm = flexc.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=BLOCK)
    out, lse = run(q, k, v, block_mask=bm)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("name", ["alibi_captured_slopes", "soft_capping_tanh", "full_4d_bias", "head_index_bias",
                                  "relative_position"])
def test_score_mods_see_packed_heads_and_rows(name):
    """GQA 8/2: the four query heads of a key head share a tile; head-dependent mods must see each row's head."""
    assert name in SCORES
    scores = score_catalogue(B, 8, S, S)
    q, k, v = random_qkv(B, 8, 2, 3, S, E, seed=2)
    score_mod = shifted(scores[name], score=True)
    mask_mod = shifted(MASKS["causal"])
    bm = flexc.create_block_mask(mask_mod, None, None, 3, S, BLOCK_SIZE=BLOCK)
    out, lse = run(q, k, v, score_mod=score_mod, block_mask=bm)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    check(out, lse, ref_out, ref_lse, atol=3e-5)
    if name == "alibi_captured_slopes":
        tbm = torch_flex.create_block_mask(mask_mod, None, None, 3, S, device="cpu", BLOCK_SIZE=BLOCK)
        t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm, enable_gqa=True,
                                                 return_lse=True)
        check(out, lse, t_out, t_lse, atol=3e-5)


def test_ragged_cache_lengths_empty_rows_and_any_split_count():
    lengths = torch.tensor([150, 47, 0])

    def in_cache(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    q, k, v = random_qkv(3, 4, 2, 1, S, E, seed=3, Bkv=1)  # key/value broadcast over the batch
    bm = flexc.create_block_mask(in_cache, 3, None, 1, S, BLOCK_SIZE=BLOCK)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=in_cache)
    traced = flexc.trace(in_cache)
    spec = triton_decode.make_spec(None, traced, q, k, v, bm)
    for splits in (1, 2, 3, 7):  # more splits than listed blocks leaves some splits empty
        out, lse = triton_decode.launch(spec, q, k, v, None, traced, bm, E ** -0.5, num_splits=splits)
        check(out, lse, ref_out, ref_lse)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))


def test_no_block_mask_and_dtypes():
    for dtype, atol in ((torch.float64, 1e-10), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)):
        q, k, v = random_qkv(1, 4, 4, 1, S, E, dtype=dtype, seed=4)
        out, lse = run(q, k, v)
        ref_out, ref_lse, _ = dense_attention(q, k, v)
        assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        check(out, lse.double(), ref_out, ref_lse, atol=atol)


def test_per_head_masks_with_gqa_fall_back_to_the_forward_kernel():
    """Packed heads need one shared mask row: a per-head mask under GQA runs the forward kernel."""
    heads = score_catalogue(1, 4, S, S)  # noqa: F841  (keeps the catalogue's RNG use comparable)
    windows = torch.tensor([4, 9, 30, 64])

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx + OFFSET >= kv_idx) & (q_idx + OFFSET - kv_idx < windows[h])

    q, k, v = random_qkv(1, 4, 2, 1, S, E, seed=5)
    bm = flexc.create_block_mask(per_head, None, 4, 1, S, BLOCK_SIZE=BLOCK)
    assert not triton_decode.applies(q, k, bm)
    src = flexc.kernel_source(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=TRITON)
    assert "flex_decode_split" not in src
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True, kernel_options=TRITON)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=per_head)
    check(out, lse, ref_out, ref_lse)


def test_kernel_source_shows_the_decode_kernel():
    q, k, v = random_qkv(1, 8, 2, 1, S, E, seed=6)
    bm = flexc.create_block_mask(shifted(MASKS["causal"]), None, None, 1, S, BLOCK_SIZE=BLOCK)
    src = flexc.kernel_source(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=TRITON)
    assert "def flex_decode_split(" in src and "split-KV decode kernel" in src
    assert "BLOCK_M=16 packed query rows" in src


def test_decode_takes_torchs_2_warps_and_1_stage_on_cuda():
    # torch's sm_90 flex_decode pick at every tile (64 keys, 2 warps, 1 stage); the H200 measured 2 against
    # 4 warps as a tie, and nothing measured a deeper ring (docs/kernels.md "Defaults")
    bm = flexc.create_block_mask(shifted(MASKS["causal"]), None, None, 16, S, BLOCK_SIZE=BLOCK)
    for Hq, rows, target, warps in [(8, 1, "cuda", 2), (2, 16, "cuda", 2), (8, 8, "cuda", 2),
                                    (8, 1, "interpreter", 4)]:
        q, k, v = random_qkv(1, Hq, 2, rows, S, E, seed=9)
        spec = triton_decode.make_spec(None, None, q, k, v, bm, target=target)
        assert (spec.block_m, spec.num_warps, spec.num_stages) == (max(16, Hq // 2 * rows), warps, 1), (Hq, rows)
    with flexc.device.simulate("sm_90"):  # the launch a GPU makes: 2 warps, the same results
        q, k, v = random_qkv(1, 8, 2, 1, S, E, seed=9)
        src = flexc.kernel_source(q, k, v, enable_gqa=True, kernel_options=TRITON)
        assert "BLOCK_M=16 packed query rows" in src and "num_warps=2" in src
        out, lse = run(q, k, v)
    check(out, lse, *dense_attention(q, k, v)[:2])


def test_a_new_python_offset_reuses_the_kernel():
    """Decoding with a Python-int position: each step's number is a kernel argument, not new source."""
    q, k, v = random_qkv(1, 4, 2, 1, S, E, seed=7)

    def at(offset):
        return lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx

    for step, offset in enumerate((100, 101, 140)):
        mask_mod = at(offset)
        bm = flexc.create_block_mask(mask_mod, None, None, 1, S, BLOCK_SIZE=BLOCK)
        out, lse = run(q, k, v, block_mask=bm)
        check(out, lse, *dense_attention(q, k, v, mask_mod=mask_mod)[:2])
        if step == 0:
            compiled = flexc.cache_info().misses
    assert flexc.cache_info().misses == compiled


def test_an_uninitialised_cache_tail_masked_out_does_not_reach_the_output():
    """Keys and values past each sequence's length hold NaN and inf (an uninitialised cache); the
    mask excludes them, so out and lse equal torch's eager FlexAttention on a cache whose tail is 0.
    (0 * NaN is NaN in p @ v: the kernel's value guard, compiled in for such CPU calls, keeps them out.)"""
    lengths = torch.tensor([100, 137])  # a partial block (96..127, 128..149) holds the tail's start

    def in_cache(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    q, k, v = random_qkv(B, 4, 2, 2, S, E, seed=8)
    tail = torch.arange(S).view(1, 1, S, 1) >= lengths.view(B, 1, 1, 1)
    k_bad, v_bad = k.masked_fill(tail, float("nan")), v.masked_fill(tail, float("nan"))
    v_bad[0, 1, 110, 3], v_bad[1, 0, 140, 0] = float("inf"), float("-inf")
    k_ok, v_ok = k.masked_fill(tail, 0.0), v.masked_fill(tail, 0.0)
    bm = flexc.create_block_mask(in_cache, B, None, 2, S, BLOCK_SIZE=BLOCK)
    tbm = torch_flex.create_block_mask(in_cache, B, None, 2, S, device="cpu", BLOCK_SIZE=BLOCK)
    for score_mod in (None, softcap):
        out, lse = run(q, k_bad, v_bad, score_mod=score_mod, block_mask=bm)
        t_out, t_lse = torch_flex.flex_attention(q, k_ok, v_ok, score_mod=score_mod, block_mask=tbm, enable_gqa=True,
                                                 return_lse=True)
        check(out, lse, t_out, t_lse)


def test_index_arithmetic_that_would_wrap_int32_runs_in_int64():
    """kv_idx * kv_idx passes 2**31 in a 50000-key cache: torch computes it in int64, so must the kernel."""
    S_long = 50000

    def wide(score, b, h, q_idx, kv_idx):
        return score + ((kv_idx * kv_idx) % 97).float() * 0.05

    def in_cache(b, h, q_idx, kv_idx):
        return kv_idx < 49500

    q, k, v = random_qkv(1, 2, 1, 1, S_long, E, seed=9)
    bm = flexc.create_block_mask(in_cache, None, None, 1, S_long, BLOCK_SIZE=1024)  # 1024-key tiles: few steps
    out, lse = run(q, k, v, score_mod=wide, block_mask=bm)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=wide, mask_mod=in_cache)
    check(out, lse, ref_out, ref_lse)
    source = flexc.kernel_source(q, k, v, score_mod=wide, block_mask=bm, enable_gqa=True, kernel_options=TRITON)
    assert "flex_decode_split" in source and "kv_idx = kv_idx.to(tl.int64)" in source


def test_a_query_row_with_a_nan_gives_nan_output_and_lse_as_the_forward_and_torch_do():
    """The merge of the split-KV partials keeps a NaN split's row NaN (its maxima propagate NaN):
    the other rows stay exact."""
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 2, 4, E, generator=g), torch.randn(1, 2, 64, E, generator=g), \
        torch.randn(1, 2, 64, E, generator=g)
    q[0, 0, 1, 3] = float("nan")
    out, lse = flexc.flex_attention(q, k, v, return_lse=True, kernel_options=TRITON)
    ref_out, ref_lse = torch_flex.flex_attention(q, k, v, return_lse=True)
    assert out[0, 0, 1].isnan().all() and lse[0, 0, 1].isnan()
    assert ref_out[0, 0, 1].isnan().all() and ref_lse[0, 0, 1].isnan()
    fine = ~ref_lse.isnan()
    torch.testing.assert_close(lse[fine], ref_lse[fine], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[fine], ref_out[fine], atol=1e-5, rtol=0)


def test_warm_decoding_steps_take_each_steps_own_tensors_sinks_and_row():
    """gpt-fast's loop on a simulated sm_90 with sinks: every step after the first launches with the
    arguments its plan read off once, filled in with the step's own query, cache (written in place),
    sinks (changed in place), position and gathered BlockMask row; each equals float64 dense."""
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, S2 = 4, 2, 160
    k, v = torch.randn(1, Hkv, S2, E, generator=g), torch.randn(1, Hkv, S2, E, generator=g)
    sinks = torch.randn(Hq, generator=g)
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 40)  # noqa: E731
    with flexc.device.simulate("sm_90"), torch.no_grad():
        parent = flexc.create_block_mask(window, None, None, S2, S2, BLOCK_SIZE=BLOCK)
        position = torch.tensor([0])
        for pos in (60, 61, 95, 159):
            mask = decoding_slice(parent, position, pos, window, S2)
            q = torch.randn(1, Hq, 1, E, generator=g)
            k[:, :, pos], v[:, :, pos] = torch.randn(2, Hkv, E, generator=g)  # the step's key and value
            sinks.add_(0.5)
            out, lse = flexc.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True, sinks=sinks,
                                            kernel_options=TRITON)
            at = lambda b, h, q_idx, kv_idx, p=pos: window(b, h, q_idx + p, kv_idx)  # noqa: E731
            check(out, lse, *dense_attention(q, k, v, mask_mod=at, sinks=sinks)[:2])
