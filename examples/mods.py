"""Common score_mods and mask_mods, defined at module level so the ``flexc`` command can reach them.

    flexc trace examples/mods.py                                   # every mod here, as traced
    flexc show examples/mods.py:alibi,causal                       # the kernel for a score_mod and a mask_mod
    flexc show "examples/mods.py:generate_sliding_window(512)" --device cpu
    flexc draw examples/mods.py:document_causal --q-len 4096 --png documents.png

``python examples/mods.py`` checks every mod here against torch's FlexAttention (block masks and
outputs, small sizes on the CPU).
"""
import torch

import flexc

WINDOW = 256        # sliding_window's reach, in tokens
SOFT_CAP = 30.0     # soft_cap squashes scores into (-SOFT_CAP, SOFT_CAP)
MAX_HEADS = 32      # alibi has a slope for each of this many heads
MAX_LEN = 16384     # document_causal covers sequences up to this length

# ALiBi's slopes, one per head: 2**(-8 (h + 1) / MAX_HEADS)
slopes = torch.exp2(-8.0 * torch.arange(1, MAX_HEADS + 1) / MAX_HEADS)

# documents of 64 to 1023 tokens packed into one sequence: document_id[i] is token i's document
_lengths = torch.randint(64, 1024, (MAX_LEN // 64,), generator=torch.Generator().manual_seed(0))
document_id = torch.repeat_interleave(torch.arange(_lengths.numel()), _lengths)[:MAX_LEN]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def generate_sliding_window(window):
    """A causal sliding window of any width (``flexc show "mods.py:generate_sliding_window(512)"``)."""
    def sliding_window_of(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return sliding_window_of


def document_causal(b, h, q_idx, kv_idx):
    return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def soft_cap(score, b, h, q_idx, kv_idx):
    return SOFT_CAP * torch.tanh(score / SOFT_CAP)


def main():
    from torch.nn.attention import flex_attention as torch_flex

    B, H, L, D = 1, 4, 512, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    for mask_mod in (causal, sliding_window, generate_sliding_window(100), document_causal):
        ours = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        theirs = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        assert torch.equal(ours.to_dense(), theirs.to_dense()), mask_mod.__name__
        for score_mod in (None, alibi, soft_cap):
            out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours)
            expected = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs)
            error = (out - expected).abs().max().item()
            assert error < 1e-4, (mask_mod.__name__, score_mod, error)
        print(f"{flexc.trace(mask_mod)}: block mask equal to torch's, outputs within 1e-4 "
              f"with no score_mod, alibi and soft_cap")


if __name__ == "__main__":
    main()
