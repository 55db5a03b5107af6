"""The forward kernel's specialised paths, run through Triton's interpreter against a float64 dense
reference and the TORCH backend: the divisible fast path and the checked last tile (lengths on both
sides of a tile multiple), int64 index arithmetic where int32 would wrap, int64 offsets, the
positive-scale FMA fold with negative and zero scales, a power-of-two scale carried by q, and torch's PRESCALE_QK,
ROWS_GUARANTEED_SAFE and BLOCKS_ARE_CONTIGUOUS options."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import flexc
from flexc.mods import ir
from flexc.backends.triton import forward as triton_forward, launcher as triton_launcher
from flexc.codegen.index_width import index_dtype, may_overflow_int32
from reference import dense_attention, random_qkv

TILES = {"BACKEND": "TRITON", "BLOCK_M": 32, "BLOCK_N": 32}  # small tiles: several per BlockMask block


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def soft_cap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def run(q, k, v, score_mod=None, mask_mod=None, scale=None, **options):
    L, S = q.shape[2], k.shape[2]
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, S, device="cpu", BLOCK_SIZE=64) if mask_mod else None
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True,
                                kernel_options={**TILES, **options})


def check(q, k, v, score_mod=None, mask_mod=None, scale=None, atol=2e-5, **options):
    out, lse = run(q, k, v, score_mod, mask_mod, scale, **options)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod, mask_mod, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    finite = ~torch.isneginf(ref_lse)
    assert torch.equal(finite, ~torch.isneginf(lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=atol, rtol=0)


@pytest.mark.parametrize("L,S", [(128, 128), (128, 127), (96, 129), (31, 65)])
def test_divisible_and_ragged_lengths(L, S):
    # 128/128: every tile whole (no bounds work); otherwise only the tile holding KV_LEN is checked,
    # and a ragged query tile is masked on load and store
    q, k, v = random_qkv(1, 2, 2, L, S, 16)
    check(q, k, v, mask_mod=causal)
    check(q, k, v, score_mod=soft_cap)


def test_ragged_lengths_in_16_bit():
    q, k, v = random_qkv(1, 1, 1, 80, 97, 32, dtype=torch.bfloat16, seed=3)
    check(q, k, v, score_mod=soft_cap, mask_mod=causal, atol=2e-2)


def test_index_arithmetic_that_overflows_int32_matches_torch():
    # torch computes this in int64, where it is 0; in int32 it wraps once q_idx * kv_idx >= 22
    def hashed_bias(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * kv_idx * 100_000_000) % 1000).float() * 0.01

    assert index_dtype((flexc.trace(hashed_bias), None), 1, 1, 64, 64) == "int64"
    q, k, v = random_qkv(1, 1, 1, 64, 64, 16, seed=4)
    out, _ = run(q, k, v, score_mod=hashed_bias)
    expected = flexc.flex_attention(q, k, v, score_mod=hashed_bias, kernel_options={"BACKEND": "TORCH"})
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


def test_index_width_is_proven_from_the_extents():
    q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
    product = ir.binary("mul", q, kv)
    assert not may_overflow_int32(product, {"q_idx": 46341, "kv_idx": 46341})  # 46340**2 < 2**31
    assert may_overflow_int32(product, {"q_idx": 46342, "kv_idx": 46342})
    flat = ir.binary("add", ir.binary("mul", q, ir.const(70000)), kv)  # q_idx * S + kv_idx
    assert not may_overflow_int32(flat, {"q_idx": 30000, "kv_idx": 70000})
    assert may_overflow_int32(flat, {"q_idx": 40000, "kv_idx": 70000})
    assert index_dtype((flexc.trace(causal), None), 8, 64, 1 << 20, 1 << 20) == "int32"  # compares only


def test_int64_offsets_path(monkeypatch):
    # tensors of 2**31 elements do not fit here: lower the threshold so the int64 variant runs
    monkeypatch.setattr(triton_launcher, "INT32_OFFSET_LIMIT", 1)
    slopes = torch.tensor([0.5, 0.25])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = random_qkv(1, 2, 2, 40, 72, 16, seed=5)
    check(q, k, v, score_mod=alibi, mask_mod=causal)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_non_positive_scale_without_score_mod(scale):
    q, k, v = random_qkv(1, 1, 1, 64, 64, 16, seed=6)
    check(q, k, v, mask_mod=causal, scale=scale)


@pytest.mark.parametrize("scale", [0.25, -0.5, 0.3])
def test_power_of_two_scale_rides_in_q(scale):
    # a power-of-two scale folds into q exactly (POW2_SCALE); others multiply the scores
    q, k, v = random_qkv(1, 2, 2, 48, 48, 16, seed=8)
    check(q, k, v, soft_cap, causal, scale=scale)
    check(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), soft_cap, causal, scale=scale, atol=2e-2)


def test_power_of_two_scale_is_folded_only_where_exact():
    spec = triton_forward.make_spec(flexc.trace(soft_cap), None, torch.bfloat16, 64, 64, None, None,
                                     "interpreter", False)
    assert triton_forward.exact_in_query(spec, 0.125) and triton_forward.exact_in_query(spec, 1.0)
    assert not triton_forward.exact_in_query(spec, 0.088) and not triton_forward.exact_in_query(spec, 2.0 ** -30)
    assert not triton_forward.exact_in_query(dataclasses.replace(spec, dtype=torch.float16), 0.125)  # narrow exponent
    assert not triton_forward.exact_in_query(dataclasses.replace(spec, score_mod=None), 0.125)  # scale in the exponent


def test_prescale_and_rows_guaranteed_safe():
    q, k, v = random_qkv(1, 2, 2, 64, 96, 16, seed=7)
    check(q, k, v, mask_mod=causal, PRESCALE_QK=True, ROWS_GUARANTEED_SAFE=True)


def test_blocks_are_contiguous_is_honoured():
    q, k, v = random_qkv(1, 1, 1, 64, 192, 16, seed=8)
    check(q, k, v, mask_mod=causal, BLOCKS_ARE_CONTIGUOUS=True)  # causal blocks 0..i are contiguous

    def gapped(b, h, q_idx, kv_idx):  # key blocks 0 and 2 of 64: not contiguous
        return (kv_idx < 64) | (kv_idx >= 128)

    honest, _ = run(q, k, v, mask_mod=gapped)
    promised, _ = run(q, k, v, mask_mod=gapped, BLOCKS_ARE_CONTIGUOUS=True)
    torch.testing.assert_close(honest.double(), dense_attention(q, k, v, mask_mod=gapped)[0], atol=2e-5, rtol=0)
    assert not torch.allclose(honest, promised)  # the wrong promise reads block 1 instead of 2, as in torch


def test_option_flags_must_be_bools():
    q, k, v = random_qkv(1, 1, 1, 32, 32, 16)
    with pytest.raises(TypeError, match="PRESCALE_QK"):
        run(q, k, v, PRESCALE_QK="yes")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_forward_tiles_fit_the_gpus_shared_memory_and_a_simulated_launch_takes_them(arch):
    # the tiles chosen for Hopper, checked against each architecture's per-block limit (sm_80: 163 KB)
    with flexc.device.simulate(arch) as facts:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            for d in (16, 64, 128, 256):
                q = torch.empty(1, 1, 16, d, dtype=dtype)
                spec = triton_forward.spec_for_call(q, q, None, None, None, None, need_lse=True)
                assert flexc.device.shared_memory_estimate(spec) <= facts.shared_memory, (dtype, d, spec)
        q, k, v = random_qkv(1, 1, 1, 32, 32, 128, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no out-of-resources retry: the tiles fit from the start
            out = flexc.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON"})
    torch.testing.assert_close(out, dense_attention(q, k, v)[0], atol=1e-10, rtol=0)
