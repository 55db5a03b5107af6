"""A BlockMask's last block may reach past the sequence while the tiles divide its length.

S=96 keys in 64-key blocks with 16-key tiles: the kernels walk all four tiles of the second block,
two of them past the keys. Before, "the length is a multiple of BLOCK_N" chose the variant without
bounds checks, so those tiles read whatever lay past the tensors (garbage or NaN outputs, a
fuzzer's find). Inputs here are views into buffers whose rows past the end hold NaN, so reading
past the end cannot go unnoticed; outputs and gradients are checked against the float64 dense reference.
"""
import pytest
import torch

import flexc
from reference import dense_attention

INTERPRET = {"BACKEND": "TRITON"}


def window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + 40) & (kv_idx >= q_idx - 40)


def _poisoned(B, H, n, D, generator):
    """``[B, H, n, D]`` random values viewed from a buffer whose rows past ``n`` are NaN."""
    buffer = torch.full((B, H, n + 64, D), float("nan"))
    buffer[:, :, :n] = torch.randn(B, H, n, D, generator=generator)
    return buffer[:, :, :n]


@pytest.mark.parametrize("L, S, block, tiles", [
    (54, 96, (16, 64), (16, 16)),   # keys: 96 = 6 tiles of 16, but 2 blocks of 64
    (96, 80, (64, 32), (32, 16)),   # queries and keys both end inside a block
])
def test_tiles_past_the_end_of_a_last_block_are_bounds_checked(L, S, block, tiles):
    g = torch.Generator().manual_seed(0)
    q, k, v = _poisoned(1, 2, L, 16, g), _poisoned(1, 2, S, 16, g), _poisoned(1, 2, S, 16, g)
    block_mask = flexc.create_block_mask(window, None, None, L, S, device="cpu", BLOCK_SIZE=block)
    options = {**INTERPRET, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
    out, lse = flexc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True, kernel_options=options)
    gold_out, gold_lse, _ = dense_attention(q, k, v, mask_mod=window)
    torch.testing.assert_close(out.double(), gold_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), gold_lse, atol=1e-5, rtol=1e-5)


def test_backward_tiles_past_the_end_of_a_last_block_are_bounds_checked():
    L, S = 96, 80  # multiples of the 16/32 tiles, not of the 64-long blocks
    g = torch.Generator().manual_seed(1)
    q, k, v = (_poisoned(1, 2, n, 16, g).requires_grad_() for n in (L, S, S))
    grad_out = _poisoned(1, 2, L, 16, g)
    block_mask = flexc.create_block_mask(window, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    options = {**INTERPRET, "BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16}
    out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options=options)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    gold = dense_attention(q, k, v, mask_mod=window)[0]
    for got, want in zip(grads, torch.autograd.grad(gold, (q, k, v), grad_out.double())):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
