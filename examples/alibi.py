"""ALiBi: a per-head linear distance penalty added to causal attention scores (a score_mod).

Checks flexc.flex_attention against dense SDPA with the equivalent float additive mask
(bias = slope[h] * (kv - q), and -inf above the diagonal).
"""
import torch
import torch.nn.functional as F

import flexc

B, H, L, D = 2, 8, 1024, 64


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1) / H)  # the geometric ALiBi slopes

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = flexc.create_block_mask(causal, None, None, L, L, device="cpu")
    print(block_mask.to_string())
    out = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)

    pos = torch.arange(L)
    bias = slopes.view(H, 1, 1) * (pos.view(1, 1, L) - pos.view(1, L, 1)).float()
    bias = bias.masked_fill(pos.view(1, L, 1) < pos.view(1, 1, L), float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    error = (out - expected).abs().max().item()
    print(f"causal ALiBi: max |flexc - SDPA| = {error:.2e}")
    assert error < 1e-4, error


if __name__ == "__main__":
    main()
