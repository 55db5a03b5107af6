"""The generated Triton backward (BACKEND "TRITON"), run on CPU through Triton's interpreter:
dq, dk, dv, dlse and captured-tensor gradients against autograd through a float64 dense reference
and against the TORCH backend's backward, for the mask and score_mod catalogues; GQA, Bkv = 1,
Ev != E, ragged lengths, fp32/fp16/bf16; the three cases torch 2.13 cannot differentiate; proof
that the generated kernel ran; kernel_source(backward=True) and `flexc show --backward`.

Sizes are tiny on purpose: the interpreter costs milliseconds per tile step."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from strategies import examples
import flexc.call.attention
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention, random_qkv

B, H, L, S, E = 1, 2, 72, 56, 16  # ragged: neither length is a multiple of a block
BLOCK = (64, 32)
HC = 1  # heads for the catalogue sweeps (the interpreter's cost is per tile; GQA has its own tests)
TRITON = {"BACKEND": "TRITON"}


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _captured(fn, dtype=torch.float64):
    """The float tensors ``fn`` captures, made ``dtype`` leaves that require grad (in place)."""
    leaves = []
    for t in flexc.trace(fn).buffers:
        if t.is_floating_point():
            t.data = t.data.to(dtype)
            t.requires_grad_()
            leaves.append(t)
    return leaves


def _grads(q, k, v, score_mod=None, mask_mod=None, backend="TRITON", extra=(), block=BLOCK, lse_weight=0.25,
           seed=1, **options):
    """Gradients of ``sum(out * w) + lse_weight * sum(finite lse)`` for (q, k, v, *extra).

    lse may be float32 (then so is its incoming gradient): 0.25 keeps the weight exact.
    """
    Bq, Hq, Lq, _ = q.shape
    Sk = k.shape[2]
    w = torch.randn(Bq, Hq, Lq, v.shape[-1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if backend == "DENSE":
        out, lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    else:
        bm = (flexc.create_block_mask(mask_mod, Bq, Hq, Lq, Sk, device="cpu", BLOCK_SIZE=block)
              if mask_mod is not None else None)
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                                        enable_gqa=Hq != k.shape[1], kernel_options={"BACKEND": backend, **options})
    lse_term = torch.where(torch.isinf(lse), 0.0, lse.double()).sum() * lse_weight
    grads = torch.autograd.grad((out.double() * w).sum() + lse_term, (q, k, v, *extra), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, k, v, *extra))]


def _assert_close(mine, ref, rtol, atol):
    for a, b in zip(mine, ref):
        assert a.shape == b.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


def _check(q, k, v, score_mod=None, mask_mod=None, extra=(), rtol=1e-9, atol=1e-9, **kw):
    mine = _grads(q, k, v, score_mod, mask_mod, "TRITON", extra, **kw)
    _assert_close(mine, _grads(q, k, v, score_mod, mask_mod, "DENSE", extra, **kw), rtol, atol)
    _assert_close(mine, _grads(q, k, v, score_mod, mask_mod, "TORCH", extra, **kw), rtol, atol)
    return mine


MASKS = mask_catalogue(B, H, L, S)
CATALOGUE_MASKS = mask_catalogue(B, HC, L, S)


@pytest.mark.parametrize("name", sorted(CATALOGUE_MASKS))
def test_every_catalogue_mask_gives_reference_gradients(name):
    q, k, v = _leaves(*random_qkv(B, HC, HC, L, S, E, dtype=torch.float64, seed=len(name)))
    _check(q, k, v, mask_mod=CATALOGUE_MASKS[name])


@pytest.mark.parametrize("name", sorted(score_catalogue(B, HC, L, S)))
def test_every_catalogue_score_mod_gives_reference_gradients_including_captured_tensors(name):
    score_mod = score_catalogue(B, HC, L, S)[name]  # fresh tensors: they become float64 leaves here
    extra = _captured(score_mod)
    q, k, v = _leaves(*random_qkv(B, HC, HC, L, S, E, dtype=torch.float64, seed=len(name) + 1))
    # index-only biases (exp_decay, log_distance_penalty, sigmoid_gate) are computed in float32, as torch
    # promotes them, where Triton's exp/log and torch's may differ in the last place (1e-6 of the
    # largest gradient); every other score_mod computes in float64 throughout, within 1e-11 of it
    tolerance = 1e-6 if name in FLOAT32_INDEX_MATH else 1e-11
    mine = _check(q, k, v, score_mod, MASKS["causal"], extra=extra, rtol=1e-7, atol=1e-7)
    ref = _grads(q, k, v, score_mod, MASKS["causal"], "DENSE", extra)
    for a, b in zip(mine, ref):
        assert (a - b).abs().max() <= tolerance * b.abs().max(), (name, float((a - b).abs().max() / b.abs().max()))


FLOAT32_INDEX_MATH = {"exp_decay", "log_distance_penalty", "sigmoid_gate"}


def test_float64_tanh_near_zero_keeps_float64_accuracy():
    """A soft cap whose argument stays below 0.1 (the interpreter's tanh takes its Taylor series
    there): outputs and gradients within 1e-13 of float64 dense."""
    def soft_cap(score, b, h, q_idx, kv_idx):
        return 40.0 * torch.tanh(score / 40.0)
    q, k, v = _leaves(*random_qkv(B, HC, HC, L, S, E, dtype=torch.float64, seed=31))
    mine, ref = _grads(q, k, v, soft_cap), _grads(q, k, v, soft_cap, backend="DENSE")
    for a, b in zip(mine, ref):
        assert (a - b).abs().max() <= 1e-13 * b.abs().max()


def test_score_mod_with_the_wider_elementwise_math_differentiates_in_the_kernel():
    # derivatives that print as rsqrt, cosh, exp(-x^2), trunc: the printer's whole vocabulary
    mod = lambda s, b, h, q_idx, kv_idx: (torch.atan(s) + torch.erf(s * 0.3) + torch.asinh(s) * torch.sinh(s * 0.2)
                                          + torch.fmod(s, 0.75) + torch.log1p(s * s))
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=13))
    # erf, asinh, log1p are printed as fp32-accurate helpers (flexc/codegen/triton_helpers.py), so the
    # scores themselves, not only their gradients, differ from torch's in the 8th digit
    _check(q, k, v, mod, MASKS["sliding_window_17"], rtol=1e-5, atol=1e-7)


def test_float32_gradients_within_1e4_of_float64():
    score_mod = score_catalogue(B, H, L, S)["alibi_captured_slopes"]
    slopes = _captured(score_mod, torch.float32)
    q64, k64, v64 = random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=3)
    mine = _grads(*_leaves(q64.float(), k64.float(), v64.float()), score_mod, MASKS["sliding_window_17"],
                  extra=slopes)
    ref_mod = score_catalogue(B, H, L, S)["alibi_captured_slopes"]
    slopes64 = _captured(ref_mod)
    ref = _grads(*_leaves(q64, k64, v64), ref_mod, MASKS["sliding_window_17"], "DENSE", extra=slopes64)
    assert mine[0].dtype == torch.float32 and mine[3].dtype == torch.float32
    _assert_close(mine, ref, rtol=1e-4, atol=1e-4)


def test_int64_offsets_give_reference_gradients(monkeypatch):
    # tensors of 2**31 elements do not fit here: lower the threshold so the dK/dV programs take their
    # query and grad_out head offsets in int64 (INT64_OFFSETS)
    from flexc.backends.triton import launcher

    monkeypatch.setattr(launcher, "INT32_OFFSET_LIMIT", 1)
    score_mod = score_catalogue(B, H, L, S)["alibi_captured_slopes"]
    slopes = _captured(score_mod)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=21))
    _check(q, k, v, score_mod, MASKS["causal"], extra=slopes)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.1), (torch.float16, 1.5e-2)])
def test_half_precision_gradients_are_close_to_float64(dtype, atol):
    q64, k64, v64 = random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=4)
    mine = _grads(*_leaves(q64.to(dtype), k64.to(dtype), v64.to(dtype)), None, MASKS["causal"])
    ref = _grads(*_leaves(q64, k64, v64), None, MASKS["causal"], "DENSE")
    for a, b in zip(mine, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=5e-2)


# ---- the three cases torch 2.13 cannot differentiate ------------------------------------------

def test_zero_dim_captured_scalar_gets_its_gradient():
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=5))
    mine = _check(q, k, v, lambda s, b, h, q_idx, kv_idx: s * temperature, MASKS["sliding_window_17"],
                  extra=(temperature,))
    assert mine[3].shape == () and mine[3] != 0


def test_float64_captured_gradient_keeps_float64_through_captured_numbers():
    # d/dt of `t * (q - kv) * factor` is `factor * (q - kv)`: float32 in torch's rules for float * int,
    # float64 along the original expression; the float64 kernel computes it in float64
    t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    factor = 0.7
    mod = lambda s, b, h, q_idx, kv_idx: s * factor + t * (q_idx - kv_idx) * factor
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=14))
    _check(q, k, v, mod, MASKS["causal"], extra=(t,))


def test_score_mod_that_ignores_the_score_gives_its_table_a_gradient_and_zero_dq_dk():
    table = torch.randn(H, L, S, dtype=torch.float64, requires_grad=True)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=6))
    mine = _check(q, k, v, lambda s, b, h, q_idx, kv_idx: table[h, q_idx, kv_idx], MASKS["causal"], extra=(table,))
    assert torch.all(mine[0] == 0) and torch.all(mine[1] == 0) and mine[3].abs().sum() > 0


def test_tensor_gathered_twice_accumulates_both_gradients():
    pos = torch.randn(max(L, S), dtype=torch.float64, requires_grad=True)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=7))
    _check(q, k, v, lambda s, b, h, q_idx, kv_idx: s + pos[q_idx] * pos[kv_idx], MASKS["document_causal"],
           extra=(pos,))



@pytest.mark.parametrize("case", ["bias[doc[kv_idx]]", "table[idx[h], kv_idx]"])
def test_tensor_gathered_through_an_index_tensor_gets_its_gradient(case):
    # the gradient's address reads another captured tensor (doc, idx): the score_mod's, not an accumulator
    g = torch.Generator().manual_seed(15)
    doc, idx = torch.randint(0, 5, (S,), generator=g), torch.randint(0, 3, (H,), generator=g)
    bias = torch.randn(5, dtype=torch.float64, generator=g).requires_grad_()
    table = torch.randn(3, S, dtype=torch.float64, generator=g).requires_grad_()
    mods = {"bias[doc[kv_idx]]": (lambda s, b, h, q_idx, kv_idx: s + bias[doc[kv_idx]], bias),
            "table[idx[h], kv_idx]": (lambda s, b, h, q_idx, kv_idx: s * 0.5 + table[idx[h], kv_idx], table)}
    mod, trainable = mods[case]
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=15))
    mine = _check(q, k, v, mod, MASKS["causal"], extra=(trainable,))
    assert mine[3].abs().sum() > 0


def _sweep_mods(name, Bs, Hs, Ls, Ss):
    """One (mask_mod, score_mod, trainable tensors) case of the mask/score sweep below."""
    g = torch.Generator().manual_seed(Ls * 100 + Ss)
    doc, doc_q = torch.randint(0, 4, (Ss,), generator=g), torch.randint(0, 4, (Ls,), generator=g)
    idx = torch.randint(0, 3, (Hs,), generator=g)
    leaf = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()
    bias, table, pair, per_doc = leaf(Ls, Ss), leaf(3, Ss), leaf(4, 4), leaf(4)
    cases = {
        # the two: a 2-D [L, S] bias under masks that read h
        "h_or_causal/bias2d": (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (h == 0),
                               lambda s, b, h, q_idx, kv_idx: s + bias[q_idx, kv_idx], (bias,)),
        "kv_le_q_plus_h/bias2d": (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + h,
                                  lambda s, b, h, q_idx, kv_idx: s + bias[q_idx, kv_idx], (bias,)),
        # a mask part constant over the tile (b only), a score-dependent nested 2-D gather
        "b_or_prefix/pair": (lambda b, h, q_idx, kv_idx: (b == 0) | (kv_idx < 5),
                             lambda s, b, h, q_idx, kv_idx: s + pair[doc_q[q_idx], doc[kv_idx]] * s, (pair,)),
        # a mask reading only h (the whole tile allowed or not)
        "h_only/bias2d": (lambda b, h, q_idx, kv_idx: h == 0,
                          lambda s, b, h, q_idx, kv_idx: s + bias[q_idx, kv_idx], (bias,)),
        "window_b_h/table[idx[h]]": (lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx).abs() <= 9 + 4 * b) & (kv_idx < Ss - h),
                                     lambda s, b, h, q_idx, kv_idx: s + table[idx[h], kv_idx], (table,)),
        "q_only/per_doc": (lambda b, h, q_idx, kv_idx: q_idx % 3 != 1,
                           lambda s, b, h, q_idx, kv_idx: s * 0.8 + per_doc[doc[kv_idx]], (per_doc,)),
    }
    return cases[name]


# (case, (B, H, L, S), BlockMask BLOCK_SIZE): lengths that are not multiples of the blocks, query
# blocks larger or smaller than key blocks, blocks larger than the whole sequence
@pytest.mark.parametrize("case,shape,block", [
    ("h_or_causal/bias2d", (1, 2, 120, 64), (32, 128)),
    ("kv_le_q_plus_h/bias2d", (1, 2, 120, 64), (32, 128)),
    ("b_or_prefix/pair", (2, 1, 50, 77), (64, 16)),
    ("h_only/bias2d", (1, 2, 40, 24), (16, 32)),
    ("window_b_h/table[idx[h]]", (2, 2, 17, 33), (128, 128)),
    ("q_only/per_doc", (1, 2, 64, 48), (16, 32)),
])
def test_masks_reading_any_index_with_trainable_gathers_at_ragged_lengths_and_uneven_blocks(case, shape, block):
    # a mask part that is one value per program (h == 0, b == 0) made an int32 tile under the
    # interpreter, which the gathers' atomic adds rejected as a mask ("mask has unsupported dtype")
    Bs, Hs, Ls, Ss = shape
    mask_mod, score_mod, extra = _sweep_mods(case, Bs, Hs, Ls, Ss)
    q, k, v = _leaves(*random_qkv(Bs, Hs, Hs, Ls, Ss, E, dtype=torch.float64, seed=Ls + Ss))
    _check(q, k, v, score_mod, mask_mod, extra=extra, block=block)

# ---- shapes -----------------------------------------------------------------------------------

def test_fully_masked_rows_get_zero_gradients():
    dead_rows = lambda b, h, q_idx, kv_idx: (q_idx % 5 != 0) & (kv_idx <= q_idx)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=8))
    dq = _check(q, k, v, mask_mod=dead_rows)[0]
    assert torch.all(dq[:, :, ::5] == 0) and dq[:, :, 1:5].abs().sum() > 0


@examples(4)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 3]), bkv_one=st.booleans(),
       q_len=st.integers(1, 64), kv_len=st.integers(1, 64), block=st.sampled_from([(16, 32), (32, 16), (64, 64)]),
       dims=st.sampled_from([(16, 16), (8, 24), (40, 16)]), window=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_random_shapes_gqa_and_batch_broadcast_match_the_reference(b, hkv, group, bkv_one, q_len, kv_len, block,
                                                                   dims, window, seed):
    e, ev = dims
    q, k, v = _leaves(*random_qkv(b, hkv * group, hkv, q_len, kv_len, e, ev, torch.float64,
                                  Bkv=1 if bkv_one else b, seed=seed))
    bias = torch.randn(hkv * group, q_len + kv_len, dtype=torch.float64, requires_grad=True)
    mask_mod = lambda b_, h, q_idx, kv_idx: ((q_idx - kv_idx).abs() <= window) | (kv_idx == 0)
    score_mod = lambda s, b_, h, q_idx, kv_idx: s * 0.9 + bias[h, q_idx - kv_idx + kv_len]
    mine = _check(q, k, v, score_mod, mask_mod, extra=(bias,), block=block, seed=seed)
    assert mine[1].shape == k.shape and mine[2].shape == v.shape


def test_key_value_batch_broadcast_with_grouped_heads_and_value_dim():
    q, k, v = _leaves(*random_qkv(2, 4, 2, 40, 70, 16, 24, torch.float64, Bkv=1, seed=9))
    score_mod = score_catalogue(2, 4, 40, 70)["soft_capping_tanh"]
    mine = _check(q, k, v, score_mod, mask_catalogue(2, 4, 40, 70)["padding_per_batch"])
    assert mine[1].shape == (1, 2, 70, 16) and mine[2].shape == (1, 2, 70, 24)


def test_lengths_that_divide_the_tiles_run_without_bounds_checks():
    # 128 x 64 with 64-wide tiles: the DIVISIBLE variant, where nothing is bounds-checked
    q, k, v = _leaves(*random_qkv(B, H, H, 128, 64, E, dtype=torch.float64, seed=12))
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    alibi = lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)
    _check(q, k, v, alibi, mask_catalogue(B, H, 128, 64)["causal"], extra=(slopes,), block=(64, 64))
    source = flexc.kernel_source(q, k, v, score_mod=alibi, backward=True, kernel_options=TRITON)
    rows, backward = source.split("# ======== kernel 2/2: flex_attention_backward ========")
    assert "flex_attention_backward_rows" in rows  # (float64: PRECISE_GRADIENTS' row pass first)
    assert rows.count("if DIVISIBLE:") == 2 and backward.count("if DIVISIBLE:") == 4


def test_no_block_mask_and_user_tiles():
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=10))
    _check(q, k, v, score_catalogue(B, H, L, S)["relative_position"], bwd_BLOCK_M2=16, BLOCK_N1=16)


def test_tiles_that_do_not_divide_the_blocks_are_rejected():
    q, k, v = _leaves(*random_qkv(B, H, H, 64, 64, E, dtype=torch.float64))
    bm = flexc.create_block_mask(MASKS["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={**TRITON, "BLOCK_M1": 64})
    with pytest.raises(ValueError, match=r"multiple of kernel_options\['BLOCK_M1'\]=64 for the backward"):
        out.sum().backward()


# ---- it is the generated kernel that runs -------------------------------------------------------

def test_training_runs_the_generated_backward_not_the_torch_row_loop(monkeypatch):
    from flexc.backends.triton import cache as kernel_cache

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch row-loop backward ran")

    monkeypatch.setattr(flexc.call.training, "torch_backward", forbidden)
    kernel_cache.cache_clear()
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    alibi = lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)
    q, k, v = _leaves(*random_qkv(B, H, H, L, S, E, dtype=torch.float64, seed=11))
    mine = _grads(q, k, v, alibi, MASKS["causal"], extra=(slopes,))
    info = kernel_cache.cache_info()
    # the forward, the backward's row pass (float64: PRECISE_GRADIENTS) and the backward kernel
    assert info.misses == 3 and info.size == 3
    kinds = sorted(type(k.generated).__name__ for k in kernel_cache.cached_kernels())
    assert kinds == ["GeneratedBackward", "GeneratedBackward", "GeneratedForward"]
    ref = _grads(q, k, v, alibi, MASKS["causal"], "DENSE", extra=(slopes,))
    _assert_close(mine, ref, 1e-9, 1e-9)
    _grads(q, k, v, alibi, MASKS["causal"], extra=(slopes,))  # new call, same structure: cache hits
    assert kernel_cache.cache_info().misses == 3


# ---- the source -------------------------------------------------------------------------------

def test_kernel_source_backward_prints_the_derivative_and_gradient_buffers():
    slopes = torch.rand(H, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = random_qkv(B, H, H, 64, 64, E)
    bm = flexc.create_block_mask(MASKS["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    text = flexc.kernel_source(q, k, v, score_mod=alibi, block_mask=bm, backward=True, kernel_options=TRITON)
    # two launches: the row pass (fp32 and fp64: delta and the probability sum per query row), then the backward
    assert text.startswith("# flexc: this call launches 2 kernels, in this order: flex_attention_backward_rows, "
                           "then flex_attention_backward.")
    source = text[text.index("# flexc backward attention kernel"):]
    assert "#   d score_mod / d score = 1.0" in source
    assert "#     d / d slopes[h] = kv_idx - q_idx" in source
    assert "tl.atomic_add(gather0_address(" in source and "summed over the tile" in source
    # dq/dk/dv are written by one program each: the only atomics are the captured-tensor ones
    assert source.count("tl.atomic_add(") == 1
    blocks = source[source.index("def dkdv_blocks("):source.index("return dk, dv")]
    assert blocks.index("mask_mod(") > blocks.index("if not IS_FULL_BLOCKS:")
    slopes.requires_grad_(False)
    frozen = flexc.kernel_source(q, k, v, score_mod=alibi, block_mask=bm, backward=True, kernel_options=TRITON)
    assert "atomic_add" not in frozen and "d / d slopes" not in frozen


def test_cli_show_backward(tmp_path, capsys):
    from flexc.tools.cli import main

    path = tmp_path / "mods.py"
    path.write_text("import torch\n"
                    "table = torch.zeros(256, requires_grad=True)\n"
                    "def learned(score, b, h, q_idx, kv_idx):\n"
                    "    return torch.tanh(score) + table[kv_idx]\n"
                    "def causal(b, h, q_idx, kv_idx):\n"
                    "    return q_idx >= kv_idx\n")
    assert main(["show", f"{path}:learned,causal", "--backward", "--head-dim", "128"]) == 2  # table: 256 keys
    assert "--q-len 4096, --kv-len 4096" in capsys.readouterr().err
    assert main(["show", f"{path}:learned,causal", "--backward", "--head-dim", "128", "--q-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "# flexc backward attention kernel" in out
    assert "d score_mod / d score = 1.0 - tanh(score) * tanh(score)" in out
    assert "d / d table[kv_idx] = 1.0" in out and "summed over the queries" in out
    # torch's sm_90 tiles at D=128, soft-capped or not (docs/kernels.md "Defaults")
    assert "dQ programs BLOCK_M2=128 x BLOCK_N2=64, dK/dV programs BLOCK_M1=64 x BLOCK_N1=128" in out


def test_backward_tiles_are_torchs_whatever_the_score_derivative():
    from flexc.backends.triton.backward import make_backward_spec

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (kv_idx - q_idx)

    def tiles(mod, head_dim, options=None):
        spec = make_backward_spec(flexc.trace(mod), None, torch.bfloat16, head_dim, head_dim, (128, 128), options,
                                  "cuda")
        return spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2

    # soft-capping's derivative is a tile the dK/dV steps carry (BLOCK_M1=32 at D=128 once avoided a
    # spill in the offline compile); no hardware row measured it, so torch's tile stands
    assert tiles(soft_cap, 128) == tiles(alibi, 128) == (64, 128, 128, 64)
    assert tiles(soft_cap, 64) == (64, 128, 128, 64)
    assert tiles(soft_cap, 128, {"BLOCK_M1": 32}) == (32, 128, 128, 64)  # the user's choice stands


# ---- the CUDA variant compiles for Hopper without a GPU ----------------------------------------

def test_cuda_backward_with_captured_gradients_compiles_for_hopper_and_fits():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend is not installed")
    from flexc.backends.triton import backward as triton_backward, cache as kernel_cache, forward as triton_forward, offline as triton_offline

    slopes = torch.rand(4, requires_grad=True)
    table = torch.zeros(2000, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return torch.tanh(score) + slopes[h] * (kv_idx - q_idx) + table[q_idx - kv_idx + 1000]

    score_mod, mask_mod = flexc.trace(biased), flexc.trace(MASKS["causal"])
    # lengths not multiples of the tiles: the bounds-checked variant, with fp32 atomics for both tensors
    # (head dim 32, one stage: the smallest kernel that still has every part, to compile in seconds)
    spec = triton_backward.make_backward_spec(score_mod, mask_mod, torch.bfloat16, 32, 32, (128, 128),
                                              {"bwd_num_stages": 1}, "cuda", (0, 1))
    fwd_spec = triton_forward.make_spec(score_mod, mask_mod, torch.bfloat16, 32, 32, (128, 128), None, "cuda", True)
    inputs = triton_offline.offline_inputs(fwd_spec, 1, 4, 1000, 1000)
    source = kernel_cache.source_for(spec)  # on CUDA the mods and derivatives print fast tanh, as the forward
    assert source.count("fast_tanh(score, score * 2.8853900817779268)") >= 2 and "def tanh(" not in source
    compiled = triton_offline.compile_offline(spec, inputs=inputs)
    assert 0 < compiled.metadata.shared <= 232448  # fits an H100's 227 KiB
    assert "atom.global" in compiled.asm["ptx"] or "red.global" in compiled.asm["ptx"]


def test_offline_backward_compile_specialises_like_a_cuda_launch(monkeypatch):
    # the stand-in tensors are uninitialised (here: NaN); a CUDA launch never compiles the CPU-only
    # NaN/inf input guard in, so neither may the offline compile, whatever the stand-ins hold
    from flexc.backends.triton import backward as triton_backward, forward as triton_forward, offline as triton_offline

    seen = {}
    monkeypatch.setattr(triton_offline, "compile_like_launcher",
                        lambda fn, args, constants, *rest: seen.update(constants))
    score_mod, mask_mod = flexc.trace(lambda s, b, h, q_idx, kv_idx: s * 0.5), flexc.trace(MASKS["causal"])
    spec = triton_backward.make_backward_spec(score_mod, mask_mod, torch.bfloat16, 32, 32, (128, 128), None, "cuda")
    fwd_spec = triton_forward.make_spec(score_mod, mask_mod, torch.bfloat16, 32, 32, (128, 128), None, "cuda", True)
    inputs = triton_offline.offline_inputs(fwd_spec, 1, 2, 256, 256)
    for t in inputs[:3]:
        t.fill_(float("nan"))
    triton_offline.compile_offline(spec, inputs=inputs)
    assert seen["GUARD_NONFINITE_INPUTS"] is False and seen["DIVISIBLE"] is True


def test_int64_index_arithmetic_variant_trains_like_the_reference(monkeypatch):
    # lengths past 46340 make q_idx * kv_idx wrap int32, so the backward (as the forward) widens the
    # mods' index arithmetic to int64 there; here the variant is forced at small lengths and checked
    from flexc.backends.triton import backward as triton_backward, cache as kernel_cache, config as triton_config

    big = torch.empty(1, 1, 50000, E)
    assert "q_idx = q_idx.to(tl.int64)" in triton_backward.backward_source(
        big, big, flexc.trace(lambda s, b, h, q_idx, kv_idx: s + (q_idx * kv_idx) % 7), None, None, None)
    monkeypatch.setattr(triton_config, "index_dtype", lambda *args: "int64")
    table = torch.randn(L + S, dtype=torch.float64, requires_grad=True)

    def wide(score, b, h, q_idx, kv_idx):
        return score * ((q_idx * kv_idx) % 5 + 1) + table[q_idx - kv_idx + S]

    q, k, v = _leaves(*random_qkv(B, HC, HC, L, S, E, dtype=torch.float64, seed=16))
    _check(q, k, v, wide, MASKS["causal"], extra=(table,))
    sources = [kernel.generated.source for kernel in kernel_cache.cached_kernels()]
    assert any("flex_attention_backward" in src and "q_idx = q_idx.to(tl.int64)" in src for src in sources)
    kernel_cache.cache_clear()  # the forced variant must not serve later tests


def test_non_finite_padding_keys_and_queries_do_not_reach_the_gradients():
    # keys (and values) past 40 and queries past 50 hold NaN/inf padding that the mask excludes
    q, k, v = random_qkv(B, H, H, 64, 64, E, dtype=torch.float64, seed=15)
    k[:, :, 40:], v[:, :, 40:], q[:, :, 50:] = float("nan"), float("inf"), float("nan")
    padding = lambda b, h, q_idx, kv_idx: (kv_idx < 40) & (q_idx < 50)
    bm = flexc.create_block_mask(padding, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    grads = {}
    for backend in ("TRITON", "TORCH"):
        qq, kk, vv = _leaves(q, k, v)
        out = flexc.flex_attention(qq, kk, vv, block_mask=bm, kernel_options={"BACKEND": backend})
        grads[backend] = torch.autograd.grad(out.square().sum(), (qq, kk, vv))
    for mine, ref in zip(grads["TRITON"], grads["TORCH"]):
        assert not mine.isnan().any()
        torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-9)
