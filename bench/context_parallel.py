"""Context-parallel plans at long lengths: bytes exchanged and work balance, from the BlockMask alone.

For causal, sliding-window and document(+causal) masks at 2, 4 and 8 ranks, prints flexc's plan
(key/value bytes received in total, max/mean work per rank) next to an all-gather of keys and
values (what torch's experimental context_parallel moves, whatever the mask) and next to a
contiguous split of the sequence planned the same way. No attention is computed: the plan reads the
BlockMask's tile tables. Bytes assume bf16 keys and values with 8 kv heads of dim 128. Wall times
of the distributed call are left to examples/context_parallel.py: on a CPU host shared by all ranks
they measure the host's core count, not the exchange.

    python bench/context_parallel.py                  # 64K tokens
    python bench/context_parallel.py --tokens 131072 --window 2048

The last line is ``context parallel: sliding-window bytes X of all-gather's, causal max/mean work Y``
(8 ranks).
"""
from __future__ import annotations

import argparse
import time

import torch

import flexc
from flexc.call import distributed as cp


def masks(n: int, window: int, seed: int = 0) -> dict:
    """name -> BlockMask of the full sequence."""
    g = torch.Generator().manual_seed(seed)
    # documents of random lengths (mean ~n/24), each attending causally within itself
    lengths = torch.randint(n // 48, n // 12, (64,), generator=g)
    doc = torch.repeat_interleave(torch.arange(64), lengths)[:n]
    doc = torch.cat([doc, torch.full((n - doc.numel(),), 64)])
    mods = {
        "causal": lambda b, h, q, kv: q >= kv,
        f"sliding-window {window}": lambda b, h, q, kv: (q >= kv) & (q - kv < window),
        "document+causal": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
    }
    return {name: flexc.create_block_mask(m, None, None, n, n, BLOCK_SIZE=128) for name, m in mods.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    token_bytes = 2 * 8 * 128 * 2  # key + value, 8 heads x 128, bf16

    start = time.perf_counter()
    built = masks(args.tokens, args.window)
    print(f"{args.tokens} tokens, block 128; masks built in {time.perf_counter() - start:.1f} s; "
          f"bytes for bf16 k+v, 8 kv heads x 128\n")
    header = (f"{'mask':<24} {'ranks':>5} {'layout':>16} {'recv MB':>9} {'all-gather MB':>13} {'ratio':>6} "
              f"{'contig MB':>10} {'max/mean':>9} {'contig max/mean':>16} {'skipped pairs':>13}")
    print(header)
    print("-" * len(header))
    results = {}
    for name, bm in built.items():
        for ranks in (2, 4, 8):
            plan = cp.plan_context_parallel(bm, ranks)
            contig = cp.plan_context_parallel(bm, ranks, layout="contiguous")
            recv = plan.total_recv_tokens() * token_bytes
            gather = plan.all_gather_tokens() * token_bytes
            skipped = sum(len(plan.skipped_pairs(r)) for r in range(ranks))
            results[name, ranks] = (recv / gather, plan.imbalance())
            print(f"{name:<24} {ranks:>5} {plan.layout:>16} {recv / 1e6:>9.1f} {gather / 1e6:>13.1f} "
                  f"{recv / gather:>6.3f} {contig.total_recv_tokens() * token_bytes / 1e6:>10.1f} "
                  f"{plan.imbalance():>9.3f} {contig.imbalance():>16.3f} {skipped:>6}/{ranks * (ranks - 1)}")
    sliding = results[f"sliding-window {args.window}", 8][0]
    causal = results["causal", 8][1]
    print(f"context parallel: sliding-window bytes {sliding:.3f} of all-gather's, causal max/mean work {causal:.3f}")


if __name__ == "__main__":
    main()
