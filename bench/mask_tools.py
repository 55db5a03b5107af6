"""BlockMask tools at long lengths: create_block_mask, sparsity() and str(), on one thread.

A sliding-window mask ``(q >= kv) & (q - kv <= 1024)`` at 128K and 1M tokens with the default
128 block (a 1024 x 1024 and an 8192 x 8192 block table), plus a causal mask for contrast.
Seconds are the best of ``--repeat`` calls (create_block_mask: one call).

    .venv/bin/python bench/mask_tools.py              # 128K and 1M
    .venv/bin/python bench/mask_tools.py --lengths 1048576 --masks sliding
"""
from __future__ import annotations

import argparse
import time

import torch

import flexc

WINDOW = 1024


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


def causal(b, h, q, kv):
    return q >= kv


MASKS = {"sliding": sliding, "causal": causal}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1 << 17, 1 << 20])
    parser.add_argument("--masks", nargs="+", default=["sliding", "causal"], choices=sorted(MASKS))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    summary = []
    print(f"{'mask':>8} {'length':>8} {'create_block_mask':>18} {'sparsity()':>11} {'str()':>8}  sparsity")
    for name in args.masks:
        for length in args.lengths:
            start = time.perf_counter()
            block_mask = flexc.create_block_mask(MASKS[name], None, None, length, length, device="cpu")
            create = time.perf_counter() - start
            sparsity = best(block_mask.sparsity, args.repeat)
            text = best(lambda: str(block_mask), args.repeat)
            print(f"{name:>8} {length:>8} {create:>17.3f}s {sparsity:>10.4f}s {text:>7.4f}s  "
                  f"{block_mask.sparsity():.2f}%", flush=True)
            summary.append(f"{name}@{length // 1024}K create {create:.2f}s sparsity {sparsity:.3f}s str {text:.3f}s")
    print("mask_tools (1 thread): " + "; ".join(summary))


if __name__ == "__main__":
    main()
