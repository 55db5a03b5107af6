"""Hostile inputs never give silent wrong answers: memory layouts the fused CPU kernel misreads,
NaN/inf in masked-out keys and values, NaN logsumexps, tampered BlockMask tables, empty batches
and heads, a head dim of 0, captured tensors on another device. Each case is checked against
torch's FlexAttention or the float64 dense reference in tests/reference.py."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated"),
              # NumPy (under Triton's interpreter) warns about the NaN it is asked to carry
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

BACKENDS = ("TORCH", "TRITON")


def attend(q, k, v, backend, score_mod=None, block_mask=None, **kw):
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                enable_gqa=q.shape[1] != k.shape[1], kernel_options={"BACKEND": backend}, **kw)


def padding_mask(n_valid: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < n_valid
    return mask_mod


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def bias_mod(score, b, h, q_idx, kv_idx):
    return score + 0.05 * (kv_idx - q_idx)


def general_mod(score, b, h, q_idx, kv_idx):
    return score * 0.75


# ---- 1. layouts the fused CPU kernel misreads -----------------------------------------------

LAYOUTS = {
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "sliced": lambda t: torch.stack([t, torch.full_like(t, math.nan)], -1).flatten(-2)[..., ::2],
    "permuted_last_dims": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
}


def test_channels_last_query_from_the_issue_matches_torch():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 40, 32).contiguous(memory_format=torch.channels_last)
    k, v = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    expected = torch_flex.flex_attention(q.contiguous(), k, v)
    torch.testing.assert_close(flexc.flex_attention(q, k, v), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("which", [0, 1, 2])
def test_fused_path_reads_any_last_dim_stride(layout, which):
    """fp32 without a score_mod or with a bias one runs torch's fused CPU kernel."""
    tensors = list(random_qkv(2, 2, 2, 48, 40, 16, seed=which))
    tensors[which] = LAYOUTS[layout](tensors[which])
    assert tensors[which].stride(-1) != 1
    block_mask = flexc.create_block_mask(causal, None, None, 48, 40, device="cpu", BLOCK_SIZE=16)
    for score_mod in (None, bias_mod):
        out, lse = attend(*tensors, "TORCH", score_mod=score_mod, block_mask=block_mask)
        ref_out, ref_lse, _ = dense_attention(*tensors, score_mod=score_mod, mask_mod=causal)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


# ---- 2. NaN and inf in masked-out keys contribute exactly 0 -----------------------------------

def padded_inputs(fill_k: float, fill_v: float, dtype=torch.float32, n_valid=70, S=96, L=64):
    q, k, v = random_qkv(1, 2, 2, L, S, 16, dtype=dtype, seed=3)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, n_valid:] = fill_k
    v_bad[:, :, n_valid:] = fill_v
    return q, (k, v), (k_bad, v_bad)


@pytest.mark.parametrize("fill", [(math.nan, math.nan), (math.inf, -math.inf), (-math.inf, math.inf)])
def test_nan_and_inf_in_masked_keys_match_torch(fill):
    """torch gives finite results for NaN/inf keys a mask hides; flexc must too, on every path."""
    q, (k, v), (k_bad, _) = padded_inputs(fill[0], 0.0)
    mask = padding_mask(70)
    torch_mask = torch_flex.create_block_mask(mask, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    expected, expected_lse = torch_flex.flex_attention(q, k_bad, v, block_mask=torch_mask, return_lse=True)
    assert expected.isfinite().all()
    block_mask = flexc.create_block_mask(mask, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    for backend in BACKENDS:
        for dtype in (torch.float32, torch.float16):  # fp32 takes the fused CPU kernel, fp16 the row loop
            out, lse = attend(q.to(dtype), k_bad.to(dtype), v.to(dtype), backend, block_mask=block_mask)
            atol = 2e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
            torch.testing.assert_close(lse, expected_lse, atol=atol, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score_mod, fill", [(None, math.nan), (bias_mod, math.inf), (general_mod, -math.inf)],
                         ids=["no_mod-nan", "bias-inf", "general-minus_inf"])
def test_nan_and_inf_in_masked_values_contribute_zero(backend, score_mod, fill):
    """Padding values: torch's kernels let 0 * NaN through here; flexc keeps masked keys out entirely."""
    q, (k, v), (k_bad, v_bad) = padded_inputs(fill, fill)
    mask = padding_mask(70)
    block_mask = flexc.create_block_mask(mask, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    out, lse = attend(q, k_bad, v_bad, backend, score_mod=score_mod, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["TORCH"])  # (the Triton decode kernel does not guard its values yet)
def test_decoding_against_a_cache_with_garbage_past_its_length(backend):
    """A few query rows (the CPU decode path) and a KV cache whose unused tail holds NaN/inf, as an
    uninitialised cache may: the tail is masked, so it contributes nothing."""
    q, k, v = random_qkv(2, 4, 2, 3, 200, 16, seed=11)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, 150:], v_bad[:, :, 150:] = math.nan, math.inf
    v_bad[1, 0, 170] = -math.inf
    mask = padding_mask(150)
    block_mask = flexc.create_block_mask(mask, None, None, 3, 200, device="cpu", BLOCK_SIZE=64)
    out, lse = attend(q, k_bad, v_bad, backend, block_mask=block_mask)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
def test_an_allowed_non_finite_value_still_reaches_the_rows_that_allow_it(backend, fill):
    """Key 40 holds a non-finite value; causal rows >= 40 see it (as the dense reference says), rows
    < 40 of the same tiles do not (they equal the reference with that value zeroed)."""
    q, k, v = random_qkv(1, 1, 1, 64, 64, 16, seed=5)
    v_bad, v_zero = v.clone(), v.clone()
    v_bad[:, :, 40, 3] = fill
    v_zero[:, :, 40, 3] = 0.0
    block_mask = flexc.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=64)  # one tile
    out, _ = attend(q, k, v_bad, backend, block_mask=block_mask)
    ref_bad, _, _ = dense_attention(q, k, v_bad, mask_mod=causal)
    ref_zero, _, _ = dense_attention(q, k, v_zero, mask_mod=causal)
    torch.testing.assert_close(out[:, :, 40:].double(), ref_bad[:, :, 40:], atol=2e-5, rtol=0, equal_nan=True)
    assert not out[:, :, 40:, 3].isfinite().any()
    torch.testing.assert_close(out[:, :, :40].double(), ref_zero[:, :, :40], atol=2e-5, rtol=0)


@pytest.mark.parametrize("score_mod", [None, bias_mod, general_mod], ids=["no_mod", "bias", "general"])
def test_gradients_ignore_nan_in_masked_keys_and_queries(score_mod):
    q, (k, v), (k_bad, v_bad) = padded_inputs(math.nan, math.inf, dtype=torch.float64)
    q_bad = q.clone()
    q_bad[:, :, 60:] = math.nan  # padded queries: their rows are masked entirely

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < 70) & (q_idx < 60)

    block_mask = flexc.create_block_mask(mask, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    grad = torch.randn(1, 2, 64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = [t.clone().requires_grad_() for t in (q_bad, k_bad, v_bad)]
    flexc.flex_attention(*ours, score_mod=score_mod, block_mask=block_mask).backward(grad)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    dense_attention(*refs, score_mod=score_mod, mask_mod=mask)[0].backward(grad)
    for a, b in zip(ours, refs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0)


# ---- 4. NaN rows have lse NaN; Ev = 0 ---------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_a_nan_query_row_has_nan_output_and_lse_like_torch(backend, dtype, masked):
    q, k, v = random_qkv(1, 1, 1, 64, 64, 16, seed=7)
    q[0, 0, 3] = math.nan
    block_mask = flexc.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32) if masked else None
    torch_mask = torch_flex.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32) if masked else None
    expected, expected_lse = torch_flex.flex_attention(q, k, v, block_mask=torch_mask, return_lse=True)
    out, lse = attend(q.to(dtype), k.to(dtype), v.to(dtype), backend, block_mask=block_mask)
    assert lse[0, 0, 3].isnan() and expected_lse[0, 0, 3].isnan() and out[0, 0, 3].isnan().all()
    atol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0, equal_nan=True)
    torch.testing.assert_close(lse, expected_lse, atol=atol, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_plus_inf_score_gives_nan_output_and_lse(backend, dtype):
    """A +inf score makes the row's softmax inf/inf: output NaN as in torch, lse NaN (torch's kernels;
    never -inf, the fully-masked marker)."""
    q, k, v = random_qkv(1, 1, 1, 64, 64, 16, seed=8)
    bias = torch.zeros(64)
    bias[5] = math.inf

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    expected = torch_flex.flex_attention(q, k, v, score_mod=score_mod)
    block_mask = flexc.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    for mask, bm in ((None, None), (causal, block_mask)):
        out, lse = attend(q.to(dtype), k.to(dtype), v.to(dtype), backend, score_mod=score_mod, block_mask=bm)
        rows = torch.arange(64) >= (5 if mask is not None else 0)  # the rows that see key 5
        assert out[0, 0, rows].isnan().all() and lse[0, 0, rows].isnan().all()
        if mask is None:
            assert expected.isnan().all()
        ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask)
        atol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[0, 0, ~rows].double(), ref_out[0, 0, ~rows], atol=atol, rtol=0)
        torch.testing.assert_close(lse[0, 0, ~rows].double(), ref_lse[0, 0, ~rows], atol=atol, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_value_head_dim_zero_gives_the_same_lse_on_every_backend(masked):
    q, k, _ = random_qkv(1, 2, 2, 40, 48, 16, seed=9)
    v = torch.empty(1, 2, 48, 0)
    block_mask = flexc.create_block_mask(causal, None, None, 40, 48, device="cpu", BLOCK_SIZE=16) if masked else None
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=causal if masked else None)
    for backend in BACKENDS:
        out, lse = attend(q, k, v, backend, block_mask=block_mask)
        assert out.shape == (1, 2, 40, 0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


# ---- 6. tampered BlockMask tables -------------------------------------------------------------

def causal_block_mask(L=128, S=128):
    return flexc.create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)


TAMPERED = {
    # (a negative index inside the count is an empty block, accepted: tests/test_block_mask_paged.py)
    "index past the columns": (lambda bm: bm.kv_indices.__setitem__((0, 0, 1, 0), 4), r"is 4; expected a key-block"),
    "count wider than the table": (lambda bm: bm.full_kv_num_blocks.__setitem__((0, 0, 3), 9),
                                   r"full_kv_num_blocks`\[0, 0, 3\] is 9; expected a count in \[0, 4\]"),
    "negative count": (lambda bm: bm.kv_num_blocks.__setitem__((0, 0, 3), -1), r"kv_num_blocks`\[0, 0, 3\] is -1"),
    "duplicate across tables": (lambda bm: bm.full_kv_indices.__setitem__((0, 0, 2, 0), 2),
                                r"lists key block 2 more than once in query-block row \[0, 0, 2\]"),
    "duplicate within a table": (lambda bm: bm.full_kv_indices.__setitem__((0, 0, 3, 1), 0), r"key block 0 more than once"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(TAMPERED))
@pytest.mark.parametrize("checked_as", ["python lists", "tensor reductions"])
def test_tampered_block_masks_are_rejected_before_any_launch(backend, name, checked_as, monkeypatch):
    # small tables are checked as Python lists, large ones by tensor reductions: the same verdicts
    if checked_as == "tensor reductions":
        monkeypatch.setattr(flexc.call.validate, "_SMALL_TABLE", 0)
    q, k, v = random_qkv(1, 1, 1, 128, 128, 16)
    block_mask = causal_block_mask()
    # valid first; then the edit is caught although the unchanged mask was already checked once
    out, _ = attend(q, k, v, backend, block_mask=block_mask)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, mask_mod=causal)[0], atol=2e-5, rtol=0)
    tamper, message = TAMPERED[name]
    tamper(block_mask)
    with pytest.raises(ValueError, match=message):
        attend(q, k, v, backend, block_mask=block_mask)


def test_block_mask_missing_query_rows_or_with_mismatched_tables_is_rejected():
    q, k, v = random_qkv(1, 1, 1, 128, 128, 16)
    bm = causal_block_mask()
    short = flexc.BlockMask.from_kv_blocks(bm.kv_num_blocks[:, :, :2], bm.kv_indices[:, :, :2],
                                           bm.full_kv_num_blocks[:, :, :2], bm.full_kv_indices[:, :, :2],
                                           BLOCK_SIZE=32, mask_mod=causal, seq_lengths=(128, 128))
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"has 2 query-block rows of 32 but Q_LEN=128 needs 4"):
            attend(q, k, v, backend, block_mask=short)
    narrow = flexc.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                            bm.full_kv_indices[..., :2], BLOCK_SIZE=32, mask_mod=causal,
                                            seq_lengths=(128, 128))
    with pytest.raises(ValueError, match=r"must have the shapes of kv_num_blocks/kv_indices"):
        attend(q, k, v, "TORCH", block_mask=narrow)
    float_tables = causal_block_mask()
    float_tables.kv_indices = float_tables.kv_indices.float()
    with pytest.raises(TypeError, match=r"kv_indices` must be an integer tensor"):
        attend(q, k, v, "TORCH", block_mask=float_tables)


def test_torch_block_mask_tables_pass_validation():
    q, k, v = random_qkv(1, 2, 2, 100, 72, 16)
    torch_mask = torch_flex.create_block_mask(causal, None, 2, 100, 72, device="cpu", BLOCK_SIZE=32)
    expected = torch_flex.flex_attention(q, k, v, block_mask=torch_mask)
    for backend in BACKENDS:
        torch.testing.assert_close(attend(q, k, v, backend, block_mask=torch_mask)[0], expected, atol=2e-5, rtol=0)


# ---- 7 and 9. empty batches and heads, head dim 0, captured tensors on another device --------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 2), (2, 0)], ids=["B=0", "H=0"])
def test_empty_batch_or_heads_give_empty_outputs(backend, shape):
    B, H = shape
    q, k, v = (torch.randn(B, H, 24, 16, requires_grad=True) for _ in range(3))
    if H:  # (torch itself divides by zero on H = 0)
        assert torch_flex.flex_attention(q.detach(), k.detach(), v.detach()).shape == (B, H, 24, 16)
    block_mask = flexc.create_block_mask(causal, None, None, 24, 24, device="cpu", BLOCK_SIZE=16)
    for bm in (None, block_mask):
        out, lse = attend(q, k, v, backend, block_mask=bm)
        assert out.shape == (B, H, 24, 16) and lse.shape == (B, H, 24)
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_zero_is_rejected(backend):
    q, k, v = torch.randn(1, 1, 8, 0), torch.randn(1, 1, 8, 0), torch.randn(1, 1, 8, 4)
    with pytest.raises(ZeroDivisionError):  # torch fails too, less clearly
        torch_flex.flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"`query` and `key` head dim must be at least 1, got 0"):
        attend(q, k, v, backend)


def test_captured_tensor_on_another_device_is_named():
    q, k, v = random_qkv(1, 1, 1, 32, 32, 16)
    bias = torch.zeros(32, device="meta")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"score_mod 'score_mod' captures tensor 'bias' on meta but it runs on cpu"):
            attend(q, k, v, backend, score_mod=score_mod)
    lengths = torch.tensor([20], device="meta")
    with pytest.raises(ValueError, match=r"create_block_mask: mask_mod .* captures tensor 'lengths' on meta"):
        flexc.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], None, None, 32, 32, device="cpu")
    scale = torch.tensor(0.5)  # a 0-d CPU tensor is fine anywhere, as in torch

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale

    torch.testing.assert_close(attend(q, k, v, "TORCH", score_mod=scaled)[0].double(),
                               dense_attention(q, k, v, score_mod=scaled)[0], atol=2e-5, rtol=0)


def test_triton_compiles_the_masked_value_guard_only_for_cpu_calls_with_non_finite_values():
    # The guard costs spills on sm_90, so it is a compile-time switch decided per call.
    from flexc.backends.triton import forward as triton_forward, launcher as triton_launcher

    spec = triton_forward.make_spec(None, flexc.trace(lambda b, h, q, kv: q >= kv, kind="mask_mod"),
                                    torch.float32, 16, 16, (64, 64), None, "interpreter", need_lse=False)
    unmasked = triton_forward.make_spec(None, None, torch.float32, 16, 16, None, None, "interpreter",
                                        need_lse=False)
    finite = torch.randn(1, 1, 8, 16)
    padded = finite.clone()
    padded[..., -1, :] = float("nan")
    assert triton_launcher.guards_nonfinite_values(spec, padded)
    assert not triton_launcher.guards_nonfinite_values(spec, finite)
    assert not triton_launcher.guards_nonfinite_values(unmasked, padded)
    assert not triton_launcher.guards_nonfinite_values(spec, padded.to("meta"))
    with flexc.device.simulate("sm_90"):  # as on a GPU: never decided per call (that would be a sync)
        assert not triton_launcher.guards_nonfinite_values(spec, padded)
