"""Property test: the generated kernel (under Triton's interpreter) equals a float64 dense reference
for random lengths, block sizes, tiles, head counts (GQA), head dims and window-style masks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexc
from reference import dense_attention
from strategies import examples


def window_mask(lower: int, upper: int, period: int, head_step: int):
    """Allows kv_idx in [q_idx - lower, q_idx + upper + head_step * h] and keys that are multiples of period."""
    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= q_idx - lower) & (kv_idx <= q_idx + upper + head_step * h)) | (kv_idx % period == 0)
    return mask_mod


def score_mod_for(slope: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slope * (h + 1) * (q_idx - kv_idx).abs()
    return score_mod


@st.composite
def problems(draw):
    L, S = draw(st.integers(1, 150)), draw(st.integers(1, 150))
    q_block, kv_block = draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32, 64]))
    block_m = draw(st.sampled_from([t for t in (16, 32, 64) if q_block % t == 0]))
    block_n = draw(st.sampled_from([t for t in (16, 32, 64) if kv_block % t == 0]))
    Hq, Hkv = draw(st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]))
    E, Ev = draw(st.sampled_from([16, 24, 40])), draw(st.sampled_from([16, 32, 48]))
    per_head_mask = draw(st.booleans())  # a mask that varies by head needs a BlockMask built per head
    mask = window_mask(draw(st.integers(-5, 60)), draw(st.integers(-5, 60)), draw(st.integers(1, 200)),
                       draw(st.integers(0, 20)) if per_head_mask else 0)
    score = score_mod_for(draw(st.sampled_from([0.0, 0.05]))) if draw(st.booleans()) else None
    return dict(L=L, S=S, block=(q_block, kv_block), tiles=(block_m, block_n), Hq=Hq, Hkv=Hkv, E=E, Ev=Ev,
                mask=mask, score=score, per_head_mask=per_head_mask, seed=draw(st.integers(0, 2**16)))


@pytest.mark.filterwarnings("ignore:return_lse is deprecated")
@examples(16, slow=True)  # (each draw runs the interpreter: ~1.3 s; other Triton tests cover the catalogue)
@given(problems())
def test_random_problems_match_dense_reference(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(1, p["Hq"], p["L"], p["E"], generator=g)
    k = torch.randn(1, p["Hkv"], p["S"], p["E"], generator=g)
    v = torch.randn(1, p["Hkv"], p["S"], p["Ev"], generator=g)
    block_mask = flexc.create_block_mask(p["mask"], None, p["Hq"] if p["per_head_mask"] else None, p["L"], p["S"],
                                         device="cpu", BLOCK_SIZE=p["block"])
    out, lse = flexc.flex_attention(q, k, v, score_mod=p["score"], block_mask=block_mask, return_lse=True,
                                    enable_gqa=p["Hq"] != p["Hkv"],
                                    kernel_options={"BACKEND": "TRITON", "BLOCK_M": p["tiles"][0],
                                                    "BLOCK_N": p["tiles"][1]})
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=p["score"], mask_mod=p["mask"])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=3e-5, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=3e-5, rtol=0)
