"""create_block_mask on masks the tile analysis cannot decide: the exact tile evaluation's time.

Both masks read data or arithmetic that interval analysis cannot see through, so most of their tiles
reach :func:`flexc.analysis.tiles.evaluate_tiles` (element by element). Each line gives the seconds
of one ``create_block_mask`` call (and the process's CPU seconds during it: more than the wall
time when threads ran in parallel), how many tiles were evaluated exactly, and a digest of the block
tables (equal digests: identical tables, whatever the thread count or version).

    .venv/bin/python bench/undecided_tiles.py --threads 1 --lengths 32768 131072
    .venv/bin/python bench/undecided_tiles.py --threads 2
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = ("random_keep_or_causal", "hash_13")
BLOCK = 128


def mask_mod(name: str, length: int):
    import torch

    if name == "random_keep_or_causal":
        keep = torch.rand(length, generator=torch.Generator().manual_seed(0)) > 0.5

        def random_keep_or_causal(b, h, q_idx, kv_idx):
            return keep[q_idx] & keep[kv_idx] | (q_idx >= kv_idx)

        return random_keep_or_causal
    if name == "hash_13":
        def hash_13(b, h, q_idx, kv_idx):
            return ((q_idx * 7919 + kv_idx * 104729) % 13) != 0

        return hash_13
    raise ValueError(f"unknown mask {name!r}; expected one of {MASKS}")


def digest(block_mask) -> str:
    h = hashlib.sha256()
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        h.update(getattr(block_mask, name).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    import flexc
    from flexc.masks import create as create_module

    if args.threads:
        torch.set_num_threads(args.threads)
    evaluated = [0]
    original = create_module.evaluate_tiles

    def counting(traced, coords, *a, **k):
        evaluated[0] += coords.shape[0]
        return original(traced, coords, *a, **k)

    create_module.evaluate_tiles = counting
    flexc.create_block_mask(mask_mod(MASKS[0], 1024), None, None, 1024, 1024, device="cpu", BLOCK_SIZE=BLOCK)
    for length in args.lengths:
        for name in args.masks:
            mod = mask_mod(name, length)
            evaluated[0] = 0
            start, cpu = time.perf_counter(), time.process_time()
            bm = flexc.create_block_mask(mod, None, None, length, length, device="cpu", BLOCK_SIZE=BLOCK)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            tiles = (length // BLOCK) ** 2
            print(f"{name:22s} L={length:7d} threads={torch.get_num_threads()} {seconds:7.2f} s "
                  f"(CPU {cpu:7.2f} s)  "
                  f"evaluated {evaluated[0]}/{tiles} tiles  tables {digest(bm)}", flush=True)


if __name__ == "__main__":
    main()
