"""The generated Triton forward kernel, run on CPU through Triton's interpreter, against a float64
dense reference and torch's FlexAttention: the whole mod catalogue, ragged lengths, GQA, key/value
batch broadcast, head dims 16..256 (non-powers of two too), Ev != E, fp32/bf16/fp16/fp64, lse,
fully masked rows, and proof that partial blocks run the mask_mod, full blocks do not, and empty
blocks are never read."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]

B, H, L, S, E = 1, 2, 136, 100, 16  # non-square and ragged: neither length is a multiple of a block
BLOCK = (64, 32)
MASKS = mask_catalogue(B, H, L, S)
SCORES = score_catalogue(B, H, L, S)
TRITON = {"BACKEND": "TRITON"}


def qkv(B=B, Hq=H, Hkv=H, L=L, S=S, E=E, Ev=None, dtype=torch.float32, Bkv=None, seed=0):
    return random_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, Bkv, seed)


def triton_attention(q, k, v, score_mod=None, block_mask=None, **options):
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                enable_gqa=q.shape[1] != k.shape[1], kernel_options={**TRITON, **options})


def assert_matches(out, lse, ref_out, ref_lse, atol):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), atol=atol, rtol=0)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_catalogue_mask_matches_dense_reference(name):
    q, k, v = qkv()
    block_mask = flexc.create_block_mask(MASKS[name], B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = triton_attention(q, k, v, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=MASKS[name])
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_every_catalogue_score_mod_matches_dense_reference(name):
    q, k, v = qkv(seed=1)
    causal = flexc.create_block_mask(MASKS["causal"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    for block_mask, mask_mod in ((None, None), (causal, MASKS["causal"])):
        out, lse = triton_attention(q, k, v, score_mod=SCORES[name], block_mask=block_mask)
        ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=SCORES[name], mask_mod=mask_mod)
        assert_matches(out, lse, ref_out, ref_lse, atol=5e-5)


@pytest.mark.parametrize("mask_name,score_name", [("sliding_window_17", "alibi_captured_slopes"),
                                                   ("document", "t5_bucketed_bias"),
                                                   ("prefix_lm", "soft_capping_tanh")])
def test_matches_torch_flex_attention_with_torch_block_mask(mask_name, score_name):
    mask_mod = MASKS[mask_name]
    q, k, v = qkv(seed=2)
    torch_mask = torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    ref_out, ref_lse = torch_flex.flex_attention(q, k, v, score_mod=SCORES[score_name], block_mask=torch_mask,
                                                 return_lse=True)
    out, lse = triton_attention(q, k, v, score_mod=SCORES[score_name], block_mask=torch_mask)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1)])
def test_grouped_query_attention_uses_the_query_head_in_mods(Hq, Hkv):
    slopes = torch.linspace(0.1, 0.8, Hq)

    def head_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8 * (h + 1))

    q, k, v = qkv(Hq=Hq, Hkv=Hkv, L=96, S=96)
    block_mask = flexc.create_block_mask(head_window, 1, Hq, 96, 96, device="cpu", BLOCK_SIZE=32)
    out, lse = triton_attention(q, k, v, score_mod=head_alibi, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=head_alibi, mask_mod=head_window)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


def test_key_value_batch_of_one_broadcasts_and_block_mask_batch_broadcasts():
    lengths = torch.tensor([40, 77])

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    q, k, v = qkv(B=2, Bkv=1, L=64, S=80)
    block_mask = flexc.create_block_mask(padding, 2, None, 64, 80, device="cpu", BLOCK_SIZE=32)
    out, lse = triton_attention(q, k, v, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=padding)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


@pytest.mark.parametrize("E_qk,E_v", [(16, 16), (24, 40), (64, 32), (100, 128), (256, 256)])
def test_head_dims_including_non_powers_of_two_and_value_dim_differing(E_qk, E_v):
    q, k, v = qkv(L=48, S=72, E=E_qk, Ev=E_v, seed=3)
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 48, 72, device="cpu", BLOCK_SIZE=32)
    out, lse = triton_attention(q, k, v, score_mod=SCORES["relative_position"], block_mask=block_mask)
    assert out.shape == (1, H, 48, E_v)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=SCORES["relative_position"], mask_mod=MASKS["causal"])
    assert_matches(out, lse, ref_out, ref_lse, atol=5e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3), (torch.float64, 1e-10)])
def test_low_and_high_precision_dtypes(dtype, atol):
    q, k, v = qkv(dtype=dtype, seed=4)
    block_mask = flexc.create_block_mask(MASKS["sliding_window_17"], None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = triton_attention(q, k, v, score_mod=SCORES["alibi_captured_slopes"], block_mask=block_mask)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=SCORES["alibi_captured_slopes"],
                                          mask_mod=MASKS["sliding_window_17"])
    assert_matches(out, lse, ref_out, ref_lse.float(), atol=max(atol, 1e-5 if dtype == torch.float64 else atol))


def test_fully_masked_rows_give_zero_output_and_minus_infinite_lse():
    def late_causal(b, h, q_idx, kv_idx):
        return (q_idx >= 40) & (kv_idx <= q_idx)  # rows 0..39 see nothing

    def drop_first_rows(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < 50, -float("inf"), score)  # rows 0..49 fully masked by the score_mod

    q, k, v = qkv(L=96, S=96)
    block_mask = flexc.create_block_mask(late_causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    out, lse = triton_attention(q, k, v, score_mod=drop_first_rows, block_mask=block_mask)
    assert torch.equal(out[:, :, :50], torch.zeros_like(out[:, :, :50]))
    assert torch.isneginf(lse[:, :, :50]).all() and torch.isfinite(lse[:, :, 50:]).all()
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=drop_first_rows, mask_mod=late_causal)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


def test_output_without_lse_and_in_the_query_memory_layout():
    q, k, v = qkv(L=64, S=64)
    q_bshd = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, L, E] view of [B, L, H, E] memory
    out = flexc.flex_attention(q_bshd, k, v, kernel_options=TRITON)
    assert out.stride(1) < out.stride(2)  # heads inner, like the query
    ref_out, _, _ = dense_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)


# ---- partial blocks run the mask_mod, full blocks do not, empty blocks are never read --------

def _tables_mask(n_blocks: int, block: int, L: int):
    """Per query block row i: block i is partial, block (i+1) % n is full, the rest are empty."""
    rows = torch.arange(n_blocks)
    partial = rows.view(1, 1, n_blocks, 1).expand(1, 1, n_blocks, n_blocks).contiguous()
    full = ((rows + 1) % n_blocks).view(1, 1, n_blocks, 1).expand(1, 1, n_blocks, n_blocks).contiguous()
    counts = torch.ones(1, 1, n_blocks, dtype=torch.int32)

    def even_keys(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    block_mask = torch_flex.BlockMask.from_kv_blocks(counts, partial.int(), counts.clone(), full.int(),
                                                     BLOCK_SIZE=block, mask_mod=even_keys, seq_lengths=(L, L))
    kv_block = torch.arange(L) // block
    q_block = (torch.arange(L) // block).view(L, 1)
    in_partial = kv_block.view(1, L) == q_block
    in_full = kv_block.view(1, L) == (q_block + 1) % n_blocks
    return block_mask, even_keys, in_partial, in_full


def test_partial_blocks_run_mask_mod_full_blocks_do_not_and_empty_blocks_are_never_read():
    L_, block = 128, 32
    block_mask, even_keys, in_partial, in_full = _tables_mask(L_ // block, block, L_)
    q, k, v = qkv(L=L_, S=L_)
    expected_allowed = (in_partial & (torch.arange(L_) % 2 == 0)) | in_full

    def expected_mask(b, h, q_idx, kv_idx):
        return expected_allowed[q_idx, kv_idx]

    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=expected_mask)
    out, lse = triton_attention(q, k, v, block_mask=block_mask, BLOCK_M=32, BLOCK_N=32)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)
    # the test can fail: applying the mask_mod in full blocks too would give a different answer
    masked_everywhere, _, _ = dense_attention(q, k, v, mask_mod=lambda b, h, qi, kv: expected_allowed[qi, kv] & (kv % 2 == 0))
    assert not torch.allclose(masked_everywhere, ref_out, atol=1e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaN poison on purpose
def test_empty_blocks_are_never_read():
    L_, block = 128, 32
    n = L_ // block
    block_mask, _, in_partial, in_full = _tables_mask(n, block, L_)
    q, k, v = qkv(Hq=1, Hkv=1, L=L_, S=L_)
    out_clean, lse_clean = triton_attention(q, k, v, block_mask=block_mask, BLOCK_M=32, BLOCK_N=32)
    # Row block 0 lists key blocks 0 (partial) and 1 (full): poison key blocks 2 and 3 with NaN and
    # inf; query rows of block 0 must be unaffected because those blocks are never visited.
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, 2 * block:] = float("nan")
    v_bad[:, :, 2 * block:] = float("inf")
    out, lse = triton_attention(q, k_bad, v_bad, block_mask=block_mask, BLOCK_M=32, BLOCK_N=32)
    assert torch.equal(out[:, :, :block], out_clean[:, :, :block])
    assert torch.equal(lse[:, :, :block], lse_clean[:, :, :block])
    assert out[:, :, 2 * block:].isnan().any()  # rows that do visit them see the poison: the test can fail


def test_generated_source_applies_mask_mod_only_in_the_partial_block_loop():
    q, k, v = qkv(L=64, S=64)
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    source = flexc.kernel_source(q, k, v, score_mod=SCORES["alibi_captured_slopes"], block_mask=block_mask,
                                 kernel_options=TRITON)
    loop = source[source.index("def attend_tile("):source.index("def attend_blocks(")]
    guard = loop.index("if not IS_FULL_BLOCKS:")
    assert loop.count("mask_mod(") == 1 and loop.index("mask_mod(") > guard
    assert loop.index("score_mod(") < guard  # the score_mod runs in both loops
    kernel = source[source.index("def flex_attention_forward("):]
    assert "partial_block_counts_ptr + mask_row" in kernel.split("IS_FULL_BLOCKS=False")[0]
    assert "full_block_counts_ptr + mask_row" in kernel.split("IS_FULL_BLOCKS=False")[1].split("IS_FULL_BLOCKS=True")[0]


# ---- kernel options ------------------------------------------------------------------------

def test_kernel_options_choose_the_tiles():
    q, k, v = qkv(L=64, S=64)
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=64)
    source = flexc.kernel_source(q, k, v, block_mask=block_mask,
                                 kernel_options={**TRITON, "BLOCK_M": 32, "fwd_BLOCK_N": 16, "num_warps": 8,
                                                 "num_stages": 2})
    assert "BLOCK_M=32, BLOCK_N=16; num_warps=8, num_stages=2" in source
    assert "each listed block spans 4 tiles" in source
    out, lse = triton_attention(q, k, v, block_mask=block_mask, BLOCK_M=32, BLOCK_N=16)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=MASKS["causal"])
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


def test_tiles_that_do_not_divide_the_block_mask_blocks_are_rejected():
    q, k, v = qkv(L=96, S=96)
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 96, 96, device="cpu", BLOCK_SIZE=48)
    with pytest.raises(ValueError, match=r"block size 48 must be a multiple of kernel_options\['BLOCK_M'\]=32"):
        triton_attention(q, k, v, block_mask=block_mask, BLOCK_M=32)
    with pytest.raises(ValueError, match="power of two"):
        triton_attention(q, k, v, block_mask=block_mask, BLOCK_N=24)
    with pytest.raises(TypeError, match="must be an int"):
        triton_attention(q, k, v, block_mask=block_mask, num_warps=4.0)
    # defaults adapt: 48 = 16 x 3, so the default tiles shrink to 16
    out, lse = triton_attention(q, k, v, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=MASKS["causal"])
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


@pytest.mark.parametrize("L_q", [1, 5])
def test_few_query_rows_as_in_decoding(L_q):
    def causal_at_end(b, h, q_idx, kv_idx):
        return q_idx + (200 - L_q) >= kv_idx

    q, k, v = qkv(L=L_q, S=200)
    block_mask = flexc.create_block_mask(causal_at_end, None, None, L_q, 200, device="cpu", BLOCK_SIZE=(16, 64))
    out, lse = triton_attention(q, k, v, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=causal_at_end)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


def test_training_through_the_triton_forward_gives_reference_gradients():
    bias = torch.randn(H, L + S, dtype=torch.float64).float().requires_grad_()

    def learned_relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S]

    q, k, v = (t.requires_grad_() for t in qkv(L=64, S=48))
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 64, 48, device="cpu", BLOCK_SIZE=32)
    out, _ = triton_attention(q, k, v, score_mod=learned_relative, block_mask=block_mask)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    ref_out, _, _ = dense_attention(q, k, v, score_mod=learned_relative, mask_mod=MASKS["causal"])
    ref_grads = torch.autograd.grad(ref_out.square().sum(), (q, k, v, bias))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score_mod", [
    lambda score, b, h, q_idx, kv_idx: torch.full_like(score, 1.5),   # a constant: uniform attention
    lambda score, b, h, q_idx, kv_idx: h * 0.5 + b,                   # varies only per program
    lambda score, b, h, q_idx, kv_idx: q_idx * 0.01,                  # varies only along queries
    lambda score, b, h, q_idx, kv_idx: -(kv_idx % 7).float(),         # varies only along keys
], ids=["constant", "per_head", "per_query", "per_key"])
def test_score_mods_that_do_not_fill_a_tile_are_broadcast(score_mod):
    q, k, v = qkv(L=70, S=90)
    out, lse = triton_attention(q, k, v, score_mod=score_mod)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)


def test_mask_that_allows_nothing_in_partial_blocks():
    q, k, v = qkv(L=64, S=64)
    block_mask = flexc.create_block_mask(MASKS["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    block_mask.mask_mod = lambda b, h, q_idx, kv_idx: (q_idx < 0) & (kv_idx < 0)  # partial blocks: nothing
    out, lse = triton_attention(q, k, v, block_mask=block_mask)
    # only the full blocks (strictly below the diagonal blocks) remain
    below = lambda b, h, q_idx, kv_idx: q_idx // 32 > kv_idx // 32
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=below)
    assert_matches(out, lse, ref_out, ref_lse, atol=2e-5)
