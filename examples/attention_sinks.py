"""A gpt-oss-style attention layer: a sliding window with learned attention sinks, trained one step.

Each query head has one learned sink logit that joins the softmax's denominator but has no value
row, so a head can put probability mass "nowhere". torch's FlexAttention has no such argument
(Hugging Face transformers rescales the output with the logsumexp afterwards); flexc takes it as
the keyword ``sinks=``. The output and the sinks' gradient are checked against a float64 softmax
with the sink logit appended as an extra column.
"""
import math

import torch

import flexc

B, HQ, HKV, L, D, WINDOW = 2, 8, 2, 256, 32, 64


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def dense_reference(q, k, v, sinks):
    """Softmax over [scores..., sink] with the sink's column dropped, in float64."""
    G = HQ // HKV
    kk, vv = (t.double().repeat_interleave(G, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)
    qi, kv = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    s = s.masked_fill(~sliding_window(None, None, qi, kv), -math.inf)
    full = torch.cat([s, sinks.double().view(1, HQ, 1, 1).expand(B, HQ, L, 1)], dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1] @ vv


def main():
    torch.manual_seed(0)
    q = torch.randn(B, HQ, L, D, requires_grad=True)
    k, v = torch.randn(B, HKV, L, D), torch.randn(B, HKV, L, D)
    sinks = torch.zeros(HQ, requires_grad=True)  # learned, one per query head
    block_mask = flexc.create_block_mask(sliding_window, None, None, L, L)
    optimizer = torch.optim.SGD([sinks], lr=1.0)
    for step in range(2):
        out = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, sinks=sinks)
        ref = dense_reference(q, k, v, sinks)
        error = (out.double() - ref).abs().max().item()
        loss = out.square().mean()
        optimizer.zero_grad()
        loss.backward()
        grad = sinks.grad.clone()
        ref_grad, = torch.autograd.grad(ref.square().mean(), sinks)
        print(f"step {step}: max |out - dense| = {error:.1e}, max |d sinks - dense| = "
              f"{(grad.double() - ref_grad).abs().max().item():.1e}, sinks[:4] = {sinks.detach()[:4].tolist()}")
        assert error < 1e-5 and torch.allclose(grad.double(), ref_grad.double(), atol=1e-6)
        optimizer.step()


if __name__ == "__main__":
    main()
