"""Prefix-LM: the first PREFIX tokens (the prompt) attend bidirectionally, the rest causally.

Written as `or_masks(prefix, causal)`; checked against dense SDPA with the same boolean mask.
"""
import torch
import torch.nn.functional as F

import flexc

B, H, L, D, PREFIX = 2, 4, 1000, 64, 300  # L is not a multiple of the 128 block: ragged last block


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < PREFIX


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    block_mask = flexc.create_block_mask(flexc.or_masks(prefix, causal), None, None, L, L, device="cpu")
    print(block_mask.to_string())
    out = flexc.flex_attention(q, k, v, block_mask=block_mask)

    pos = torch.arange(L)
    allowed = (pos[None, :] < PREFIX) | (pos[:, None] >= pos[None, :])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    error = (out - expected).abs().max().item()
    print(f"prefix-LM with a {PREFIX}-token prefix: max |flexc - SDPA| = {error:.2e}")
    assert error < 1e-4, error


if __name__ == "__main__":
    main()
