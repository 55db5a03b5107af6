"""Generation with a KV cache: prefill a prompt, then decode one token at a time.

A one-layer attention model (random weights, grouped-query attention 8/2) over packed documents
with a sliding window, and an ALiBi score_mod. The BlockMask is built once over the whole cache;
each decoding step slices the block row of the current position and shifts the mods by it,
the idiom torch users know from gpt-fast:

    mask = block_mask[:, :, input_pos // 128]
    mask.mask_mod = shifted(mask_mod, input_pos[0]); mask.seq_lengths = (1, MAX_LEN)

Short queries run flexc's decode path (a few batched ops on the CPU, a split-KV kernel on the
TRITON backend), and the trace cache makes the re-created closures free. Every step's logits are
checked against one full forward over the whole sequence.
"""
import time

import torch

import flexc

VOCAB, DIM, HQ, HKV, HEAD = 64, 128, 8, 2, 16
DOCUMENTS = [150, 110, 60]  # packed prompts; positions past the first two are generated
MAX_LEN = sum(DOCUMENTS)
PREFILL = DOCUMENTS[0] + DOCUMENTS[1] + 10
WINDOW = 96

document_id = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))
slopes = torch.exp2(-8.0 * torch.arange(1, HQ + 1) / HQ)


def mask_mod(b, h, q_idx, kv_idx):
    same_document = document_id[q_idx] == document_id[kv_idx]
    return same_document & (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx)


def shifted_mask(mod, offset):
    """The mask_mod of query rows that start at position ``offset`` (gpt-fast's get_mask_mod)."""
    def mask(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + offset, kv_idx)
    return mask


def shifted_score(mod, offset):
    def score(score, b, h, q_idx, kv_idx):
        return mod(score, b, h, q_idx + offset, kv_idx)
    return score


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.q = torch.nn.Linear(DIM, HQ * HEAD, bias=False)
        self.kv = torch.nn.Linear(DIM, 2 * HKV * HEAD, bias=False)
        self.out = torch.nn.Linear(HQ * HEAD, VOCAB, bias=False)

    def project(self, tokens):
        x = self.embed(tokens)  # [1, T, DIM]
        T = x.shape[1]
        q = self.q(x).view(1, T, HQ, HEAD).transpose(1, 2)
        k, v = self.kv(x).view(1, T, 2, HKV, HEAD).permute(2, 0, 3, 1, 4)
        return q, k, v

    def logits(self, attended):
        return self.out(attended.transpose(1, 2).flatten(2))  # [1, T, VOCAB]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = TinyModel()
    tokens = torch.randint(0, VOCAB, (1, MAX_LEN))
    block_mask = flexc.create_block_mask(mask_mod, None, None, MAX_LEN, MAX_LEN)

    # the reference: one forward over the whole sequence
    q, k, v = model.project(tokens)
    full = model.logits(flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True))

    # prefill the cache with the prompt, then decode token by token
    k_cache = torch.zeros(1, HKV, MAX_LEN, HEAD)
    v_cache = torch.zeros(1, HKV, MAX_LEN, HEAD)
    q, k, v = model.project(tokens[:, :PREFILL])
    k_cache[:, :, :PREFILL], v_cache[:, :, :PREFILL] = k, v
    prefill_mask = flexc.create_block_mask(mask_mod, None, None, PREFILL, PREFILL)
    prefill = model.logits(flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=prefill_mask, enable_gqa=True))
    worst = (prefill - full[:, :PREFILL]).abs().max().item()

    input_pos = torch.tensor([PREFILL])
    start = time.perf_counter()
    for pos in range(PREFILL, MAX_LEN):
        q, k, v = model.project(tokens[:, pos:pos + 1])
        k_cache[:, :, input_pos], v_cache[:, :, input_pos] = k, v
        mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
        mask.mask_mod, mask.seq_lengths = shifted_mask(mask_mod, input_pos[0]), (1, MAX_LEN)
        out = flexc.flex_attention(q, k_cache, v_cache, score_mod=shifted_score(alibi, input_pos[0]),
                                   block_mask=mask, enable_gqa=True)
        worst = max(worst, (model.logits(out) - full[:, pos:pos + 1]).abs().max().item())
        input_pos += 1
    steps = MAX_LEN - PREFILL
    per_token = (time.perf_counter() - start) / steps
    print(f"prefill {PREFILL} tokens, decoded {steps} tokens ({per_token * 1e3:.2f} ms per token, model included)")
    print(f"max |logits(KV-cache decode) - logits(full forward)| = {worst:.2e}")
    assert worst < 1e-4, worst


if __name__ == "__main__":
    main()
