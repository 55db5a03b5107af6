"""A BERT-style fine-tuning step that keeps attention dropout (torch's FlexAttention has none).

Bidirectional attention over a padded batch (each sequence attends to its own tokens only), with
``dropout_p=0.1`` on the attention probabilities. The dropout mask is a pure function of a seed
drawn from the generator and of (batch, head, query, key), so the backward regenerates it, and the
same seed gives the same step. The output is checked against a float64 dense computation that uses
flexc's mask for that seed, and the mean over many seeds against the undropped output.
"""
import math

import torch

import flexc
from flexc.backends import dropout

B, H, L, D, P = 2, 4, 96, 32, 0.1
lengths = torch.tensor([96, 61])  # the second sequence is padded after 61 tokens


def padding_mask(b, h, q_idx, kv_idx):
    return (q_idx < lengths[b]) & (kv_idx < lengths[b])


def dense(q, k, v, drop):
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    qi, kv = torch.arange(L).view(1, 1, -1, 1), torch.arange(L).view(1, 1, 1, -1)
    s = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(~padding_mask(b, h, qi, kv), -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1))  # padded rows allow nothing: 0
    return (p * dropout.keep_scale(drop, H, b, h, qi, kv, torch.float64)) @ v.double()


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    block_mask = flexc.create_block_mask(padding_mask, B, None, L, L, BLOCK_SIZE=32)
    generator = torch.Generator().manual_seed(1234)
    state = generator.get_state()
    out = flexc.flex_attention(q, k, v, block_mask=block_mask, dropout_p=P, generator=generator)
    out.square().mean().backward()
    generator.set_state(state)  # the same seed again: the same mask
    drop = dropout.draw(P, generator)
    error = (out.double() - dense(q, k, v, drop)).abs().max().item()
    kept = (dropout.keep_scale(drop, H, torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
                               torch.arange(L).view(1, 1, -1, 1), torch.arange(L).view(1, 1, 1, -1),
                               torch.float32) > 0).float().mean().item()
    with torch.no_grad():
        plain = flexc.flex_attention(q, k, v, block_mask=block_mask)
        mean = sum(flexc.flex_attention(q, k, v, block_mask=block_mask, dropout_p=P,
                                        generator=torch.Generator().manual_seed(s)) for s in range(100)) / 100
    print(f"kept {kept:.3f} of the pairs (expected {1 - P}); max |out - dense with the same mask| = {error:.1e}; "
          f"|q.grad| = {q.grad.norm():.3f}; mean of 100 seeds vs undropped: max diff {(mean - plain).abs().max():.3f}")
    assert error < 1e-5 and abs(kept - (1 - P)) < 0.01 and (out[1, :, 61:] == 0).all()


if __name__ == "__main__":
    main()
