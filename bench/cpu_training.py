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
    python bench/cpu_training.py --pairs       # issue 41's table by allowed pairs (below)

``--pairs`` times flexc's training step (B=1, H=8, D=64, fp32, ``--length`` L, default 4096) for every
mask_mod of tests/catalogue.py × {no score_mod, ALiBi, soft-cap (tanh, cap 20)} and prints each one's
CPU time per allowed (b, h, q, kv) pair relative to the causal no-mod step's (1.00: as cheap per pair as
causal; the target is at most 1.5). Times are the process's CPU time (user + system, all threads:
``resource.getrusage``), medians of ``--reps``, so other processes on a shared box count less than in
wall time; with ``--threads 2`` the wall time is printed too. ``--masks`` picks catalogue entries.
"""
from __future__ import annotations

import argparse
import os
import resource
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


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, reps: int) -> tuple[float, float]:
    """Median ``(cpu seconds, wall seconds)`` of ``fn`` after one warm-up call."""
    fn()
    cpu, wall = [], []
    for _ in range(reps):
        c0, t0 = _cpu_seconds(), time.perf_counter()
        fn()
        cpu.append(_cpu_seconds() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(cpu), statistics.median(wall)


def allowed_pairs(mask_mod, B: int, H: int, L: int) -> int:
    """How many ``(b, h, q, kv)`` pairs ``mask_mod`` allows, counted a band of query rows at a time."""
    b, h, kv = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1), torch.arange(L).view(1, 1, 1, -1)
    total = 0
    for q0 in range(0, L, 256):
        q = torch.arange(q0, min(q0 + 256, L)).view(1, 1, -1, 1)
        total += int(mask_mod(b, h, q, kv).expand(B, H, q.shape[2], L).sum())
    return total


def pairs_table(L: int, threads: int, reps: int, masks: list[str] | None) -> None:
    """Issue 41's table: training-step CPU time per allowed pair, relative to causal without a mod."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from catalogue import mask_catalogue

    B, H, D = 1, 8, 64
    torch.set_num_threads(threads)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, L, D, generator=gen)
    catalogue = mask_catalogue(B, H, L, L)
    names = masks or list(catalogue)
    if "causal" in names:
        names.remove("causal")
    names.insert(0, "causal")
    print(f"L={L} B={B} H={H} D={D} fp32, {threads} thread(s), CPU time (all threads), median of {reps}")
    print(f"{'mask':32} {'allowed':>8} {'mod':8} {'cpu s':>7} {'wall s':>7} {'ns/pair':>8} {'vs causal':>9}")
    base, worst = None, (0.0, "")
    for name in names:
        mask_mod = catalogue[name]
        n_pairs = allowed_pairs(mask_mod, B, H, L)
        block_mask = flexc.create_block_mask(mask_mod, B, H, L, L, device="cpu")
        for label, score_mod in (("none", None), ("alibi", alibi), ("softcap", soft_cap)):
            def step():
                flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask).backward(grad)
                q.grad = k.grad = v.grad = None
            cpu, wall = timed(step, reps)
            per_pair = cpu / max(n_pairs, 1)
            base = base if base is not None else per_pair
            ratio = per_pair / base
            if n_pairs and ratio > worst[0]:
                worst = (ratio, f"{name} + {label}")
            print(f"{name:32} {n_pairs / (B * H * L * L):8.1%} {label:8} {cpu:7.3f} {wall:7.3f} "
                  f"{per_pair * 1e9:8.3f} {ratio:9.2f}", flush=True)
    n_rows = len(names) * 3
    print(f"summary: L={L}, {threads} thread(s): worst {worst[0]:.2f}x causal's time per allowed pair "
          f"({worst[1]}) over {n_rows} mask x mod rows; target <= 1.5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--pairs", action="store_true", help="issue 41's table by allowed pairs")
    parser.add_argument("--length", type=int, default=4096, help="--pairs: sequence length L")
    parser.add_argument("--masks", nargs="+", help="--pairs: catalogue mask names (default: all)")
    args = parser.parse_args()
    if args.pairs:
        for threads in args.threads if args.threads != [1, 2] else [1]:
            pairs_table(args.length, threads, args.reps if args.reps != 15 else 3, args.masks)
        return
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
