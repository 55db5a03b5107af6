"""Run independent tasks on worker threads that each use one torch thread, and report the progress
of long runs.

The CPU backend issues many mid-sized torch ops per chunk of query rows, and exact tile evaluation
(:func:`flexc.analysis.tiles.evaluate_tiles`) one batch of tiles after another. Letting each op
split itself over all cores (torch's intra-op threads) puts a barrier after every op, which costs
little on an idle machine but stalls badly when other processes compete for the cores. Giving each
worker thread whole tasks instead, with ``torch.set_num_threads(1)`` (thread-local under
OpenMP/MKL), keeps the cores busy without barriers; torch ops release the GIL, so the workers run
in parallel.

Tasks are assigned statically, longest first to the least-loaded worker, so the assignment (and
with it the order of any floating-point accumulation) is the same on every run; ``dynamic=True``
hands them out as workers come free, for tasks whose results do not depend on it.

:class:`Progress` prints what a run has done on stderr once it has taken more than
:data:`PROGRESS_AFTER_S` seconds; ``FLEXC_PROGRESS=0`` turns it off.
"""
from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TextIO

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


def worker_count(n_tasks: int, total_cost: float, min_cost_per_worker: float = 16e6, threads: int | None = None) -> int:
    """How many workers to use: torch's thread count (or ``threads``), fewer for small jobs.

    Below about 16M scores per worker (L=2048, 8 heads, causal) Python overhead and the GIL make
    workers slower than one thread with torch's own intra-op threads, at least on an idle machine.
    """
    threads = torch.get_num_threads() if threads is None else threads
    n = min(threads, n_tasks, max(1, int(total_cost // min_cost_per_worker)))
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
        dynamic: bool = False, torch_threads: bool = True) -> None:
    """Call ``fn(task, worker_index)`` for every task, without autograd, on ``n_workers`` threads.

    ``dynamic=True`` lets idle workers take the next task (longest first), which keeps the cores
    busy when one of them is shared with another process; use it only when the result does not
    depend on which worker ran a task (the static partition is deterministic).
    ``torch_threads=False``: one worker's tasks run on a one-thread worker too, not here on torch's
    intra-op threads, for tasks of many small ops: their barriers, one per op, stalled the CPU
    backend's soft-cap training step 10-20x on a box with more runnable threads than cores (two
    threads, L=1024, documents: 0.84 s of CPU, 0.07 s on one one-thread worker).
    """
    if n_workers <= 1 and not torch_threads and torch.get_num_threads() > 1:
        n_workers, dynamic = 1, False
    elif n_workers <= 1:
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
    stop = threading.Event()  # a task failed (or the caller was interrupted): start no more

    def work(worker: int) -> None:
        # grad and inference modes are thread-local: carry the caller's into the worker (tensors
        # made under inference_mode may only be updated in place under it)
        with torch.inference_mode() if inference else torch.no_grad():
            while not stop.is_set():
                batch = take(worker)
                if not batch:
                    return
                for i in batch:
                    if stop.is_set():
                        return
                    try:
                        fn(tasks[i], worker)
                    except BaseException:
                        stop.set()
                        raise

    futures = [_pool(n_workers).submit(work, w) for w in range(n_workers)]
    try:
        for future in futures:
            future.result()  # re-raises a worker's exception here
    except BaseException:
        stop.set()
        for future in futures:  # the others stop after their current task; leave none running
            try:
                future.result()
            except BaseException:
                pass
        raise


# ---- progress -------------------------------------------------------------------------------

PROGRESS_AFTER_S = 2.0  # a run reports its progress once it has taken this long ...
PROGRESS_NEARLY_DONE = 0.9  # ... unless this fraction of it is done by then
TTY_INTERVAL_S = 0.5  # on a terminal one line is rewritten in place at most this often
LOG_STEP = 0.1  # elsewhere (a log file, CI) a line is printed each time another 10% is done


def progress_enabled() -> bool:
    """False when ``FLEXC_PROGRESS`` is ``0`` (or ``false``, ``off``, ``no``)."""
    return os.environ.get("FLEXC_PROGRESS", "1").strip().lower() not in ("0", "false", "off", "no")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 9.5 else f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


class Progress:
    """Counts the work a run has done, from any thread, and reports it on stderr if the run is slow.

    Nothing is printed until the run has taken more than ``after_s`` seconds (default
    :data:`PROGRESS_AFTER_S`) and while it is then not nearly done; from then on: on a terminal one
    line rewritten in place (``\\r``) at most every :data:`TTY_INTERVAL_S` seconds, otherwise a line
    each time another :data:`LOG_STEP` of the work is done; :meth:`finish` ends with a final line.
    A line reads ``flexc: <what>: <done>/<total> <unit> (<percent>%), about <time> left``.
    ``FLEXC_PROGRESS=0`` turns it off. Use it as a context manager (``finish`` on exit).
    """

    def __init__(self, what: str, total: int, unit: str = "tiles", after_s: float | None = None,
                 stream: TextIO | None = None):
        self.what, self.total, self.unit = what, max(1, int(total)), unit
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.stream = stream
        self.enabled = progress_enabled()
        self.done = 0
        self.shown = False  # whether a line was printed
        self._start = time.monotonic()
        self._last_time = 0.0
        self._last_step = -1
        self._lock = threading.Lock()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.finish(failed=exc[0] is not None)

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _tty(self) -> bool:
        try:
            return bool(self._out().isatty())
        except (AttributeError, ValueError):
            return False

    def _line(self, now: float) -> str:
        fraction = self.done / self.total
        text = f"flexc: {self.what}: {self.done}/{self.total} {self.unit} ({100 * fraction:.0f}%)"
        if 0 < self.done < self.total:
            left = (now - self._start) * (self.total - self.done) / self.done
            text += f", about {_duration(left)} left"
        return text

    def advance(self, n: int) -> None:
        """Count ``n`` more units done (thread-safe) and print a line when one is due."""
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            if self.done >= self.total:
                return  # finish() prints the last line
            now = time.monotonic()
            if not self.shown:
                if now - self._start <= self.after_s or self.done >= PROGRESS_NEARLY_DONE * self.total:
                    return
                self.shown = True
            elif self._tty():
                if now - self._last_time < TTY_INTERVAL_S:
                    return
            elif int(self.done / self.total / LOG_STEP) <= self._last_step:
                return
            self._last_time = now
            self._last_step = int(self.done / self.total / LOG_STEP)
            self._write(self._line(now), final=False)

    def _write(self, line: str, final: bool) -> None:
        out = self._out()
        if self._tty():
            out.write("\r" + line + "\033[K" + ("\n" if final else ""))  # \033[K: clear the old line's rest
        else:
            out.write(line + "\n")
        out.flush()

    def finish(self, failed: bool = False) -> None:
        """Print the final line if any line was printed (on failure, only end the in-place line)."""
        with self._lock:
            if not self.shown:
                return
            self.shown = False  # once
            if failed:
                if self._tty():
                    self._out().write("\n")
                    self._out().flush()
                return
            elapsed = time.monotonic() - self._start
            self._write(f"flexc: {self.what}: {self.done}/{self.total} {self.unit} "
                        f"({100 * self.done / self.total:.0f}%) in {_duration(elapsed)}", final=True)
