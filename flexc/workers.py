"""Run independent query-row tasks on worker threads that each use one torch thread.

The CPU backend issues many mid-sized torch ops per chunk. Letting each op split itself over all
cores (torch's intra-op threads) puts a barrier after every op, which costs little on an idle
machine but stalls badly when other processes compete for the cores. Giving each worker thread
whole rows instead, with ``torch.set_num_threads(1)`` (thread-local under OpenMP/MKL), keeps the
cores busy without barriers; torch ops release the GIL, so the workers run in parallel.

Rows are assigned statically, longest first to the least-loaded worker, so the assignment (and
with it the order of any floating-point accumulation) is the same on every run.
"""
from __future__ import annotations

import heapq
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _one_torch_thread() -> None:
    # torch initialises a thread's thread count lazily, from the process-wide default, at its
    # first parallel op; trigger that first so the setting below is not overwritten later
    torch.get_num_threads()
    torch.set_num_threads(1)


def _pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n`` started threads whose torch ops each run on one thread."""
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            saved = torch.get_num_threads()
            pool = ThreadPoolExecutor(n, thread_name_prefix="flexc-row", initializer=_one_torch_thread)
            # Start all n workers now (each runs the initializer first), then undo the
            # initializer's process-wide side effect: torch.set_num_threads also sets the default
            # that threads initialising later pick up (the main thread included, if it has not
            # run a parallel op yet). The workers keep their own thread-local setting.
            barrier = threading.Barrier(n)
            list(pool.map(lambda _: barrier.wait(), range(n)))
            torch.set_num_threads(saved)
            _pools[n] = pool
    return pool


def worker_count(n_tasks: int, total_cost: float, min_cost_per_worker: float = 16e6) -> int:
    """How many workers to use: torch's thread count, fewer for small jobs.

    Below about 16M scores per worker (L=2048, 8 heads, causal) Python overhead and the GIL make
    workers slower than one thread with torch's own intra-op threads, at least on an idle machine.
    """
    n = min(torch.get_num_threads(), n_tasks, max(1, int(total_cost // min_cost_per_worker)))
    return max(1, n)


def partition(costs: Sequence[float], n: int) -> list[list[int]]:
    """Task indices per worker: longest task first onto the least-loaded worker (deterministic)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, w) for w in range(n)]
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in order:
        load, w = heapq.heappop(heap)
        parts[w].append(i)
        heapq.heappush(heap, (load + costs[i], w))
    for part in parts:
        part.sort()  # each worker walks its rows in order
    return parts


def run(tasks: Sequence, costs: Sequence[float], fn: Callable[[object, int], None], n_workers: int,
        dynamic: bool = False) -> None:
    """Call ``fn(task, worker_index)`` for every task, without autograd, on ``n_workers`` threads.

    ``dynamic=True`` lets idle workers take the next task (longest first), which keeps the cores
    busy when one of them is shared with another process; use it only when the result does not
    depend on which worker ran a task (the static partition is deterministic).
    """
    if n_workers <= 1:
        with torch.no_grad():
            for task in tasks:
                fn(task, 0)
        return
    if dynamic:
        queue = iter(sorted(range(len(tasks)), key=lambda i: (-costs[i], i)))
        lock = threading.Lock()

        def take(_):
            with lock:
                i = next(queue, None)
            return [] if i is None else [i]
    else:
        parts = partition(costs, n_workers)

        def take(worker):
            batch, parts[worker] = parts[worker], []  # the whole share, once
            return batch

    inference = torch.is_inference_mode_enabled()

    def work(worker: int) -> None:
        # grad and inference modes are thread-local: carry the caller's into the worker (tensors
        # made under inference_mode may only be updated in place under it)
        with torch.inference_mode() if inference else torch.no_grad():
            while True:
                batch = take(worker)
                if not batch:
                    return
                for i in batch:
                    fn(tasks[i], worker)

    futures = [_pool(n_workers).submit(work, w) for w in range(n_workers)]
    for future in futures:
        future.result()  # re-raises a worker's exception here
