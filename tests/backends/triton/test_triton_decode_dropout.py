"""Attention dropout in the split-KV decode kernel (Triton's interpreter on CPU): at most 16 query rows
with ``dropout_p > 0`` outside training run the decode kernel's dropout variant, whose packed rows
(GQA group x query rows) draw at their real query head and row, so for one seed it keeps the pairs the
TORCH backend and the forward kernel keep: outputs equal theirs and a float64 dense reference with
that mask; fully masked rows stay 0; the logsumexp is the undropped softmax's."""
from __future__ import annotations

import math

import pytest
import torch

import flexc
from flexc.backends import dropout
from flexc.backends.triton import decode as triton_decode
from reference import index_tensors, random_qkv

B, HQ, HKV, S, E = 3, 4, 2, 56, 16  # GQA group G = 2; batch 2 draws past batch 1's dead row
P, SEED = 0.3, 11
SLOPES = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _mask(b, h, q_idx, kv_idx):  # causal from the end; batch 1's first row allows nothing
    return (kv_idx <= q_idx + S - 4) & ~((b == 1) & (q_idx == 0))


def _alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (kv_idx - q_idx).abs() * 0.1


def _call(q, k, v, backend, block_mask, **kwargs):
    return flexc.flex_attention(q, k, v, _alibi, block_mask, enable_gqa=True, dropout_p=P,
                                generator=torch.Generator().manual_seed(SEED), kernel_options={"BACKEND": backend},
                                **kwargs)


def _dense(q, k, v, drop: dropout.Dropout):
    """Dropout attention in float64 with flexc.backends.dropout's mask on the whole [B, Hq, L, S] grid."""
    L = q.shape[2]
    kk, vv = (t.double().repeat_interleave(HQ // HKV, 1) for t in (k, v))
    b, h, qi, kv = index_tensors(B, HQ, L, S)
    s = _alibi(q.double() @ kk.transpose(-1, -2) / math.sqrt(E), b, h, qi, kv)
    s = torch.where(_mask(b, h, qi, kv), s, -math.inf)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, s), -1))
    return (p * dropout.keep_scale(drop, HQ, b, h, qi, kv, torch.float64)) @ vv


@pytest.fixture
def decode_launches(monkeypatch):
    """The dropout flag of every decode kernel launched (a call's plan runs a DecodeLaunch)."""
    seen = []
    launch = triton_decode.DecodeLaunch.__call__

    def recording(self, *args, **kwargs):
        seen.append(self.spec.dropout)
        return launch(self, *args, **kwargs)
    monkeypatch.setattr(triton_decode.DecodeLaunch, "__call__", recording)
    return seen


@pytest.mark.parametrize("L", [1, 3])
def test_decode_rows_keep_the_torch_and_forward_kernel_mask(L, decode_launches):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=L)
    block_mask = flexc.create_block_mask(_mask, B, None, L, S, BLOCK_SIZE=16)
    with torch.no_grad():  # inference: the decode kernel
        got, lse = _call(q, k, v, "TRITON", block_mask, return_lse=True)
    assert decode_launches == [True]
    want, want_lse = _call(q, k, v, "TORCH", block_mask, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # training runs the forward kernel (its backward takes the forward's statistics): the same mask
    forward = _call(q.clone().requires_grad_(), k, v, "TRITON", block_mask).detach()
    assert decode_launches == [True]
    torch.testing.assert_close(got, forward, rtol=1e-5, atol=1e-5)
    ref = _dense(q, k, v, dropout.draw(P, torch.Generator().manual_seed(SEED)))
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    assert (got[1, :, 0] == 0).all()  # the fully masked row stays 0
    plain = flexc.flex_attention(q, k, v, _alibi, block_mask, enable_gqa=True, return_lse=True,
                                 kernel_options={"BACKEND": "TRITON"})
    assert not torch.allclose(got, plain[0], atol=1e-3)  # it does drop
    torch.testing.assert_close(lse, plain[1])  # the logsumexp is the undropped softmax's


def test_kernel_source_shows_the_decode_kernel_that_drops():
    q, k, v = random_qkv(B, HQ, HKV, 3, S, E, seed=5)
    block_mask = flexc.create_block_mask(_mask, B, None, 3, S, BLOCK_SIZE=16)

    def source(**kwargs):
        return flexc.kernel_source(q, k, v, _alibi, block_mask, enable_gqa=True, kernel_options={"BACKEND": "TRITON"},
                                   **kwargs)

    plain, dropped = source(), source(dropout_p=0.25)
    assert "flex_decode_split" in dropped.splitlines()[0]
    decode_text = dropped.split("kernel 2/2")[0]
    assert "def dropout_keep(" in decode_text and decode_text.count("dropout_keep(dropout_ptr, dropout_scale, dropout_head,") == 1
    assert "dropout_head = b * (KV_HEADS * GQA_GROUP) + h" in decode_text
    for word in ("dropout", "philox"):
        assert word not in plain
    # the key tells the variants apart: both live in the cache at once
    spec = triton_decode.make_spec(None, None, q, k, v, block_mask)
    assert spec.key() != triton_decode.make_spec(None, None, q, k, v, block_mask, dropout=True).key()
    compile(dropped, "kernel", "exec")  # the text parses as Python
