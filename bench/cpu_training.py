"""CPU training step (forward + backward) benchmark: flexc vs SDPA with the same mask as a dense tensor.

Issue 28's training rows, each at one thread and at two, timed side by side in one process
(calls alternate, medians of ``--reps``):

  small causal     B=2, H=4, L=256,  D=32   (a small model's layer: fixed costs dominate)
  causal           B=4, H=8, L=512,  D=64
  document         B=4, H=8, L=1024, D=64   (6 documents, causal inside each)
  unmasked         B=4, H=8, L=512,  D=64   (no block mask; SDPA with no mask either)
  hf-style         B=2, Hq=8, Hkv=2, L=256, D=32: a Hugging Face layer's call: [B, L, H, E] memory,
                   GQA, its score_mod with nothing configured, causal and padding mask_mod (reads b),
                   return_lse=True (SDPA: the dense causal mask, enable_gqa)

flexc runs ``flex_attention(q, k, v, block_mask=...)`` with the block mask built once outside the
timed calls; SDPA runs ``scaled_dot_product_attention(q, k, v, attn_mask=dense)`` with the boolean
[L, L] mask. Both then backpropagate the same upstream gradient into q, k and v. The ratio is
flexc / SDPA (lower is better).

    python bench/cpu_training.py               # every row, 1 and 2 threads
    python bench/cpu_training.py --rows small  # one row
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexc  # noqa: E402

warnings.filterwarnings("ignore")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(L: int, n_docs: int = 6):
    doc_of = torch.arange(L) * n_docs // L

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc_of[q_idx] == doc_of[kv_idx]) & (q_idx >= kv_idx)
    return same_document_causal


def hf_style_pair(B: int, H: int, L: int, D: int, kv_heads: int = 2):
    """``(flexc_step, sdpa_step)`` for a call as Hugging Face's flex integration makes it."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, L, h, D, generator=gen).transpose(1, 2).requires_grad_() for h in (H, kv_heads, kv_heads))
    grad = torch.randn(B, H, L, D, generator=gen)
    padding = torch.ones(B, L, dtype=torch.bool)  # the attention_mask of a batch without padding
    softcap = None

    def causal_and_padding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & padding[b, kv_idx]

    def score_mod(score, b, h, q_idx, kv_idx):  # soft-capping, when the config asks for it
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        return score
    block_mask = flexc.create_block_mask(causal_and_padding, B, None, L, L, device="cpu")
    dense = torch.ones(L, L, dtype=torch.bool).tril()

    def flexc_step():
        out, _ = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                      return_lse=True)
        out.backward(grad)

    def sdpa_step():
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True).backward(grad)
    return flexc_step, sdpa_step


def step_pair(B: int, H: int, L: int, D: int, mask_mod):
    """``(flexc_step, sdpa_step)``: one forward + backward each, on the same tensors."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, L, D, generator=gen)
    block_mask = dense = None
    if mask_mod is not None:
        block_mask = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        positions = torch.arange(L)
        dense = mask_mod(None, None, positions[:, None], positions[None, :])

    def flexc_step():
        flexc.flex_attention(q, k, v, block_mask=block_mask).backward(grad)

    def sdpa_step():
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(grad)
    return flexc_step, sdpa_step


def masked(mask_mod_for):
    """The step pair of a row whose block mask is ``mask_mod_for(L)`` (None: no mask)."""
    return lambda B, H, L, D: step_pair(B, H, L, D, mask_mod_for(L))


ROWS = {  # name: (B, H, L, D, (B, H, L, D) -> (flexc_step, sdpa_step))
    "small": (2, 4, 256, 32, masked(lambda L: causal)),
    "causal": (4, 8, 512, 64, masked(lambda L: causal)),
    "document": (4, 8, 1024, 64, masked(document)),
    "unmasked": (4, 8, 512, 64, masked(lambda L: None)),
    "hf-style": (2, 8, 256, 32, hf_style_pair),
}


def side_by_side(a, b, reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, called alternately after a warm-up of each."""
    for fn in (a, b, a, b):
        fn()
    ta, tb = [], []
    for _ in range(reps):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    print(f"flexc from {os.path.dirname(flexc.__file__)}")
    print(f"{'row':10} {'B':>2} {'H':>2} {'L':>5} {'D':>3} {'threads':>7} {'flexc ms':>9} {'sdpa ms':>9} {'ratio':>6}")
    for name in args.rows:
        B, H, L, D, pair = ROWS[name]
        for threads in args.threads:
            torch.set_num_threads(threads)
            flexc_step, sdpa_step = pair(B, H, L, D)
            reps = args.reps if L * B * H <= 8192 else max(3, args.reps // 3)
            tf, ts = side_by_side(flexc_step, sdpa_step, reps)
            print(f"{name:10} {B:2} {H:2} {L:5} {D:3} {threads:7} {tf * 1e3:9.2f} {ts * 1e3:9.2f} {tf / ts:6.2f}")


if __name__ == "__main__":
    main()
