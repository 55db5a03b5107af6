"""A small pre-norm transformer block whose attention is FlexAttention with ALiBi on learnable
per-head slopes; shared by tests/test_compile.py and bench/compile.py."""
from __future__ import annotations

import torch


class Block(torch.nn.Module):
    """LayerNorm, fused QKV projection, ``attention`` (``flex_attention``'s signature) with an ALiBi
    score_mod on learnable slopes, output projection, GELU MLP of ``mlp_ratio`` x the width."""

    def __init__(self, attention, heads: int, head_dim: int, mlp_ratio: int = 4):
        super().__init__()
        dim = heads * head_dim
        self.attention, self.heads, self.head_dim = attention, heads, head_dim
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, mlp_ratio * dim), torch.nn.GELU(),
                                       torch.nn.Linear(mlp_ratio * dim, dim))
        self.slopes = torch.nn.Parameter(2.0 ** -torch.linspace(1, 8, heads))

    def forward(self, x, block_mask):
        B, L, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        a = self.attention(q, k, v, score_mod=alibi, block_mask=block_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, C))
        return x + self.mlp(self.norm2(x))
