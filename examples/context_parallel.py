"""Context parallelism: one document+causal sequence split over 4 CPU processes (gloo).

Each process holds a shard of q, k, v chosen by the plan (balanced by the mask's work), fetches only
the key/value blocks its queries need, and runs forward and backward; the result is compared with a
single process. The default length is modest for a shared CPU; raise it with ``--tokens 65536``.

    python examples/context_parallel.py [--tokens 2048] [--ranks 4]
"""
from __future__ import annotations

import argparse
import pathlib
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexc
from flexc.call import distributed as cp


def problem(n: int):
    """Documents of random lengths, causal within each, with GQA; q, k, v and the BlockMask."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(n // 16, 1), max(n // 4, 2), (64,), generator=g)
    doc = torch.repeat_interleave(torch.arange(64), lengths)[:n]
    doc = torch.cat([doc, torch.full((n - doc.numel(),), 64)])

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = flexc.create_block_mask(document_causal, None, None, n, n, BLOCK_SIZE=128)
    q = torch.randn(1, 4, n, 64, generator=g)
    k, v = torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)
    return q, k, v, block_mask


def worker(rank: int, ranks: int, port: int, n: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    q, k, v, block_mask = problem(n)
    plan = cp.plan_context_parallel(block_mask, ranks)
    if rank == 0:
        print(plan.summary(token_bytes=2 * 2 * 64 * 4))  # fp32 k + v, 2 kv heads x 64
    shards = [cp.shard_sequence(t, block_mask, plan=plan).requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    out = cp.flex_attention(*shards, block_mask=block_mask, enable_gqa=True, plan=plan)
    out.sum().backward()
    dist.barrier()
    elapsed = time.perf_counter() - start
    full = [cp.unshard_sequence(t, block_mask, plan=plan) for t in (out, *(s.grad for s in shards))]
    if rank == 0:
        start = time.perf_counter()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = flexc.flex_attention(*leaves, block_mask=block_mask, enable_gqa=True)
        ref.sum().backward()
        single = time.perf_counter() - start
        errors = [(a - b).abs().max().item() for a, b in zip(full, (ref, *(t.grad for t in leaves)))]
        print(f"{ranks} ranks, {n} tokens: forward+backward {elapsed:.2f} s ({single:.2f} s in one process); "
              f"max |difference| out {errors[0]:.1e}, dq {errors[1]:.1e}, dk {errors[2]:.1e}, dv {errors[3]:.1e}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    args, _ = parser.parse_known_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # import this file as a module so spawned processes find `worker` also when run via run_all.py
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import context_parallel

    mp.spawn(context_parallel.worker, args=(args.ranks, port, args.tokens), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
