"""Attention dropout in the generated Triton kernels (Triton's interpreter on CPU): the Philox device
helper draws flexc.backends.dropout's bits exactly, so for one seed the TRITON backend keeps the TORCH
backend's pairs, and its outputs and gradients equal TORCH's up to float rounding (GQA, a mask with
dead rows, a score_mod with a learnable tensor, uneven lengths, float64, short queries, inference and
training); the dropout code is in a kernel's source only when the call drops."""
from __future__ import annotations

import warnings

import pytest
import torch

import flexc
from flexc.backends import dropout
from flexc.backends.triton.cache import import_source
from flexc.codegen.parts import DROPOUT_HELPERS
from reference import random_qkv

# the helpers, and a kernel that applies them to vectors of counters and pairs
_HELPER_KERNELS = '''
@triton.jit
def draw(seed_ptr, c_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    c0 = tl.load(c_ptr + offs).to(tl.uint32)
    c1 = tl.load(c_ptr + N + offs).to(tl.uint32)
    c2 = tl.load(c_ptr + 2 * N + offs).to(tl.uint32)
    c3 = tl.load(c_ptr + 3 * N + offs).to(tl.uint32)
    tl.store(out_ptr + offs, philox(tl.load(seed_ptr), c0, c1, c2, c3).to(tl.int64))


@triton.jit
def keep(dropout_ptr, dropout_scale, head, out_ptr, M: tl.constexpr, N: tl.constexpr):
    q_idx = tl.arange(0, M)[:, None]
    kv_idx = tl.arange(0, N)[None, :]
    tl.store(out_ptr + q_idx * N + kv_idx, dropout_keep(dropout_ptr, dropout_scale, head, q_idx, kv_idx))
'''


@pytest.fixture(scope="module")
def helpers():
    module, _ = import_source("\n".join(["import triton", "import triton.language as tl", "", DROPOUT_HELPERS,
                                         _HELPER_KERNELS]), "interpreter")
    return module


SEEDS = (0, 1, 0x1234_5678_9ABC_DEF0, 2 ** 62 - 1)


def test_philox_helper_draws_the_torch_bits_exactly(helpers):
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 2 ** 32, (4, 64), generator=g, dtype=torch.int64)
    counters[:, :4] = torch.tensor([0, 0xFFFFFFFF, 1, 0x80000000]).view(1, 4)  # the edges of 32 bits
    for seed in SEEDS:
        got = torch.empty(64, dtype=torch.int64)
        helpers.draw[(1,)](torch.tensor([seed]), counters.contiguous(), got, N=64)
        assert torch.equal(got, dropout.philox(seed, *counters)), seed


@pytest.mark.parametrize("p", [1e-9, 0.3, 0.7, 0.999])  # thresholds from 4 to above 2**31
def test_dropout_keep_helper_is_the_torch_keep_scale(helpers, p):
    M, N, Hq = 16, 32, 3
    for seed in SEEDS[1:]:
        drop = dropout.Dropout(p, seed)
        for b, h in ((0, 0), (1, 2)):
            got = torch.empty(M, N)
            helpers.keep[(1,)](torch.tensor([drop.seed, drop.threshold]), drop.scale, b * Hq + h, got, M=M, N=N)
            q_idx, kv_idx = torch.arange(M).view(-1, 1), torch.arange(N).view(1, -1)
            want = dropout.keep_scale(drop, Hq, torch.tensor(b), torch.tensor(h), q_idx, kv_idx, torch.float32)
            assert torch.equal(got, want), (p, seed, b, h)


B, HQ, HKV, L, S, E = 2, 4, 2, 40, 56, 16


def _mask(b, h, q_idx, kv_idx):  # causal from the end, with dead rows (q % 7 == 3)
    return (q_idx + (S - L) >= kv_idx) & (q_idx % 7 != 3)


def _run(backend, q, k, v, p, seed, score_mod=None, block_mask=None, leaves=(), **kwargs):
    """The call's output and, when ``leaves`` require grad, their gradients against a fixed dO."""
    out = flexc.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, dropout_p=p,
                               generator=torch.Generator().manual_seed(seed), kernel_options={"BACKEND": backend},
                               **kwargs)
    if not leaves:
        return [out]
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return [out, *torch.autograd.grad((out * d_out).sum(), leaves)]


def _same(torch_results, triton_results, names, rtol=1e-5, atol=1e-5):
    for name, want, got in zip(names, torch_results, triton_results):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_triton_keeps_the_torch_mask_forward_and_backward():
    q, k, v = (t.requires_grad_() for t in random_qkv(B, HQ, HKV, L, S, E, seed=2))
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() * 0.1

    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=16)
    leaves = (q, k, v, slopes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)  # TRITON draws the dropout itself now
        got = _run("TRITON", q, k, v, 0.3, 7, alibi, block_mask, leaves)
    want = _run("TORCH", q, k, v, 0.3, 7, alibi, block_mask, leaves)
    _same(want, got, ["out", "dq", "dk", "dv", "dslopes"])
    plain = _run("TRITON", q, k, v, 0.0, 7, alibi, block_mask)[0]
    assert not torch.allclose(got[0], plain, atol=1e-3)  # it does drop
    dead = torch.tensor([i % 7 == 3 for i in range(L)])
    assert (got[0][:, :, dead] == 0).all() and (got[1][:, :, dead] == 0).all()  # masked rows stay 0, no dq


# (float64: the kernel's 1 / (1 - p) is an fp32 argument; bfloat16: the kernels round p to it before dots)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-7), (torch.bfloat16, 2e-2)])
def test_triton_keeps_the_torch_mask_without_mods_at_uneven_lengths(dtype, tol):
    # no score_mod (the forward folds the scale into exp2), no BlockMask, lengths off the tiles, and
    # p above 1/2 (a threshold above 2**31)
    q, k, v = (t.to(dtype).requires_grad_() for t in random_qkv(1, 2, 1, 21, 37, 8, seed=4))
    got = _run("TRITON", q, k, v, 0.6, 5, leaves=(q, k, v))
    want = _run("TORCH", q, k, v, 0.6, 5, leaves=(q, k, v))
    _same(want, got, ["out", "dq", "dk", "dv"], rtol=tol, atol=tol)


def test_short_queries_in_inference_run_the_decode_kernel_with_the_torch_mask():
    # at most 16 query rows: the decode kernel's dropout variant (test_triton_decode_dropout.py)
    q, k, v = random_qkv(B, HQ, HKV, 4, S, E, seed=6)
    block_mask = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + S - 4, None, None, 4, S,
                                         BLOCK_SIZE=16)
    with torch.no_grad():
        got, lse = _run("TRITON", q, k, v, 0.25, 8, block_mask=block_mask, return_lse=True)[0]
        want, want_lse = _run("TORCH", q, k, v, 0.25, 8, block_mask=block_mask, return_lse=True)[0]
    _same([want, want_lse], [got, lse], ["out", "lse"])
    plain_lse = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True,
                                     kernel_options={"BACKEND": "TRITON"})[1]
    torch.testing.assert_close(lse, plain_lse)  # the logsumexp is the undropped softmax's
    text = flexc.kernel_source(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options={"BACKEND": "TRITON"},
                               dropout_p=0.25)
    assert "flex_decode_split" in text.splitlines()[0] and "dropout_keep(" in text


@pytest.mark.parametrize("backward", [False, True])
def test_kernel_source_has_the_dropout_code_only_with_dropout(backward):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=7)
    block_mask = flexc.create_block_mask(_mask, None, None, L, S, BLOCK_SIZE=16)

    def source(**kwargs):
        return flexc.kernel_source(q, k, v, block_mask=block_mask, enable_gqa=True, backward=backward,
                                   kernel_options={"BACKEND": "TRITON"}, **kwargs)

    plain, dropped = source(), source(dropout_p=0.1)
    assert source(dropout_p=0.0) == plain
    for word in ("dropout", "philox", "Philox"):
        assert word not in plain
    assert "def philox(" in dropped and "def dropout_keep(" in dropped
    # the backward: the row pass (fp32: PRECISE_GRADIENTS) and both kinds of backward program draw it
    assert dropped.count("dropout_keep(dropout_ptr, dropout_scale, dropout_head,") == (3 if backward else 1)
    compile(dropped, "kernel", "exec")  # the text parses as Python


def test_a_context_parallel_shard_runs_its_dropout_on_torch_and_says_so():
    # a shard draws the pairs at their global positions, which the kernels do not take
    from flexc.call.attention import attend

    q, k, v = random_qkv(1, 2, 2, 8, 8, 16, seed=8)
    drop = dropout.Dropout(0.3, 5, q_positions=torch.arange(8) + 8, kv_positions=torch.arange(8))
    with pytest.warns(flexc.FallbackWarning, match="context-parallel shard's global positions"):
        got = attend(q, k, v, None, None, None, False, False, {"BACKEND": "TRITON"}, None, drop)
    assert torch.equal(got, attend(q, k, v, None, None, None, False, False, {"BACKEND": "TORCH"}, None, drop))
