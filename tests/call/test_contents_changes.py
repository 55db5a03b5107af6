"""Calls after a tensor got other contents without moving its version counter (``.data = new``,
``vector_to_parameters``, a view of another storage) or after a freed or rebound tensor's memory was
reused equal float64 dense attention: nothing flexc remembers between calls (traces, derived
replays, causal decisions, non-finite verdicts) is served for contents it was not computed from."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from reference import dense_attention, index_tensors, random_qkv
from strategies import SWAPS, document_ids, examples, swap_in

# the swaps that leave the version counter alone: what a memo keyed by identity and version missed
QUIET_SWAPS = SWAPS[:3]
TINY = dict(B=1, Hq=2, Hkv=2, L=32, S=32, E=16)  # (the Triton interpreter runs these)


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 2)])
def test_a_mod_transforming_a_captured_parameter_follows_its_new_contents(backend, n):
    """``score * exp(log_temp)[h]`` without gradients: the replay of ``exp(log_temp)`` is redone
    after every change of ``log_temp``, however made."""
    @examples(n)
    @given(hows=st.lists(st.sampled_from(SWAPS), min_size=1, max_size=2), last=st.sampled_from(QUIET_SWAPS),
           seed=st.integers(0, 1 << 16))
    def check(hows, last, seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = random_qkv(**TINY, seed=seed)
        log_temp = torch.nn.Parameter(torch.zeros(2))

        def temperature(score, b, h, q_idx, kv_idx):
            return score * torch.exp(log_temp)[h]
        with torch.no_grad():
            for how in (None, *hows, last):
                if how is not None:
                    swap_in(log_temp, torch.randn(2, generator=g), how)
                out = flexc.flex_attention(q, k, v, score_mod=temperature, kernel_options={"BACKEND": backend})
                _close(out, dense_attention(q, k, v, score_mod=temperature)[0], f"after {how}")
    check()


def _lower_triangle(L: int, block: int, mask_mod) -> flexc.BlockMask:
    """A BlockMask listing every block on and below the diagonal as partial: valid for any mask_mod
    that allows no key after its query, so one mask serves every documents' layout."""
    n = L // block
    num = torch.arange(1, n + 1, dtype=torch.int32).view(1, 1, n)
    indices = torch.arange(n, dtype=torch.int32).expand(n, n).contiguous().view(1, 1, n, n)
    return flexc.BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(L, L))


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 1)])
def test_a_document_mask_follows_its_ids_new_contents(backend, n):
    """Causal attention inside documents whose captured ids get other contents between calls: the
    documents TORCH runs as causal kernel calls are those of the ids now."""
    L = 128

    @examples(n)
    @given(first=document_ids(L), later=st.lists(st.tuples(document_ids(L), st.sampled_from(QUIET_SWAPS)),
                                                 min_size=1, max_size=2), seed=st.integers(0, 1 << 16))
    def check(first, later, seed):
        q, k, v = random_qkv(1, 2, 2, L, L, 16, seed=seed)
        ids = first.clone()

        def same_document_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        block_mask = _lower_triangle(L, 32, same_document_causal)
        for new, how in ((None, None), *later):
            if new is not None:
                swap_in(ids, new, how)
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            _close(out, dense_attention(q, k, v, mask_mod=same_document_causal)[0], f"documents {ids.tolist()}")
    check()


def _dense_with_nan_values(q, k, v, mask_mod):
    """Dense attention where a NaN value row poisons exactly the rows that may see its key."""
    clean = torch.where(v.isnan(), 0.0, v)
    out = dense_attention(q, k, clean, mask_mod=mask_mod)[0]
    seen = v.isnan().any(-1)  # [B, H, S]
    b, h, qi, kv = index_tensors(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    poisoned = (torch.broadcast_to(mask_mod(b, h, qi, kv), (*q.shape[:3], k.shape[2])) & seen[:, :, None, :]).any(-1)
    return out.masked_fill(poisoned[..., None], math.nan)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 2)])
def test_a_nan_swapped_into_the_values_reaches_only_the_rows_that_see_it(backend, n):
    """``v.data = <v with a NaN>``: the verdict that ``v`` is finite is not served again, so rows
    before the NaN's key stay finite and equal dense attention (and after the NaN is swapped out
    again, every row is)."""
    L = TINY["L"]
    block_mask = flexc.create_block_mask(_causal, None, None, L, L, BLOCK_SIZE=16)

    @examples(n)
    @given(row=st.integers(1, L - 1), how=st.sampled_from(QUIET_SWAPS), back=st.sampled_from(SWAPS),
           seed=st.integers(0, 1 << 16))
    def check(row, how, back, seed):
        q, k, v = random_qkv(**TINY, seed=seed)
        clean = v.clone()
        for new, way in ((None, None), (clean.index_fill(2, torch.tensor([row]), math.nan), how), (clean, back)):
            if new is not None:
                swap_in(v, new, way)
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            _close(out, _dense_with_nan_values(q, k, v, _causal), f"NaN at key {row} ({way})")
    check()


def test_under_compile_a_nan_swapped_into_the_values_reaches_only_the_rows_that_see_it():
    """The same through torch.compile (the custom op's TORCH implementation asks the same memo)."""
    L = TINY["L"]
    block_mask = flexc.create_block_mask(_causal, None, None, L, L, BLOCK_SIZE=16)
    q, k, v = random_qkv(**TINY, seed=3)
    clean = v.clone()
    compiled = torch.compile(flexc.flex_attention, backend="aot_eager", fullgraph=True)
    for new in (None, clean.index_fill(2, torch.tensor([20]), math.nan)):
        if new is not None:
            swap_in(v, new, ".data = new")
        out = compiled(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TORCH"})
        _close(out, _dense_with_nan_values(q, k, v, _causal), "compiled")


def _document_mask_of(ids):
    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return same_document


def _bias_mod_of(bias):
    def with_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    return with_bias


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_new_tensor_at_a_reused_address_gets_its_own_trace(backend):
    """Captured tensors keyed by memory (no grad): a new view at the address of an old one that was
    swapped away, or a new tensor where a freed one lay, is traced for its own values, so
    create_mask, create_block_mask and attention read what it holds."""
    L = TINY["L"]
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(**TINY, seed=0)
    ids_base, bias_base = torch.zeros(2, L, dtype=torch.long), torch.zeros(2, L)
    for step in range(6):
        if step < 4:  # new views of a storage that stays: the old view was swapped away
            ids, bias = ids_base[step % 2], bias_base[step % 2]
        else:  # new tensors, likely where the freed ones lay
            ids, bias = torch.randint(0, 3, (L,), generator=g), torch.randn(L, generator=g)
        want = ids[:, None] == ids[None, :]
        assert torch.equal(flexc.create_mask(_document_mask_of(ids), None, None, L, L)[0, 0], want), step
        expect = flexc.create_block_mask(_document_mask_of(ids.clone()), None, None, L, L, BLOCK_SIZE=8)
        got = flexc.create_block_mask(_document_mask_of(ids), None, None, L, L, BLOCK_SIZE=8)
        assert torch.equal(got.kv_num_blocks, expect.kv_num_blocks), step
        with_bias = _bias_mod_of(bias)
        out = flexc.flex_attention(q, k, v, score_mod=with_bias, kernel_options={"BACKEND": backend})
        _close(out, dense_attention(q, k, v, score_mod=with_bias)[0], f"step {step}")
        swap_in(ids, torch.randint(0, 3, (L,), generator=g), ".data = new")
        swap_in(bias, torch.randn(L, generator=g), ".data = new")
        del ids, bias
        ids_base.copy_(torch.randint(0, 3, (2, L), generator=g))
        bias_base.copy_(torch.randn(2, L, generator=g))
