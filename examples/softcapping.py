"""Soft-capping (Gemma 2 / Grok style): scores squashed into (-CAP, CAP) by CAP * tanh(score / CAP).

Uses large queries so the cap matters, and a causal block mask. SDPA cannot express tanh on the
scores, so the reference applies it to an explicitly computed score matrix, passed as a float mask
to SDPA with a zero query (SDPA then attends with exactly that additive bias).
"""
import torch
import torch.nn.functional as F

import flexc

B, H, L, D, CAP = 1, 4, 768, 64, 20.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    q = q * 8  # scores of size ~60: well past the cap
    block_mask = flexc.create_block_mask(causal, None, None, L, L, device="cpu")
    print(block_mask.to_string())
    out = flexc.flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask)

    pos = torch.arange(L)
    capped = CAP * torch.tanh((q @ k.transpose(-1, -2)) / D**0.5 / CAP)
    bias = capped.masked_fill(pos[:, None] < pos[None, :], float("-inf"))
    expected = F.scaled_dot_product_attention(torch.zeros_like(q), k, v, attn_mask=bias)
    error = (out - expected).abs().max().item()
    print(f"soft-capping at {CAP}: max |flexc - SDPA| = {error:.2e}")
    assert error < 1e-4, error


if __name__ == "__main__":
    main()
