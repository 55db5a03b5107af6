"""Document masking: several documents packed in one sequence, each attending causally within itself.

The document id of every position is a captured tensor; the block mask skips the blocks between
documents. Checked against dense SDPA with the same boolean mask.
"""
import torch
import torch.nn.functional as F

import flexc

B, H, D = 1, 4, 64
LENGTHS = [300, 77, 410, 129, 108]  # documents of uneven length, 1024 tokens in all
L = sum(LENGTHS)


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    document_id = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    block_mask = flexc.create_block_mask(document_causal, None, None, L, L, device="cpu")
    print(block_mask.to_string())
    out = flexc.flex_attention(q, k, v, block_mask=block_mask)

    pos = torch.arange(L)
    allowed = (document_id[:, None] == document_id[None, :]) & (pos[:, None] >= pos[None, :])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    error = (out - expected).abs().max().item()
    print(f"{len(LENGTHS)} packed documents: max |flexc - SDPA| = {error:.2e}")
    assert error < 1e-4, error


if __name__ == "__main__":
    main()
