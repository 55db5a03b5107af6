"""flexc.workers.run: a single worker's tasks run on torch's own threads in the calling thread, or,
with ``torch_threads=False``, on a one-thread worker (no intra-op barriers to stall on a busy box)."""
import threading

import torch

from flexc import workers


def _where(torch_threads: bool):
    seen = []
    workers.run([0, 1, 2], [1.0, 1.0, 1.0],
                lambda task, worker: seen.append((threading.get_ident(), torch.get_num_threads(), worker)), 1,
                torch_threads=torch_threads)
    return seen


def test_one_worker_runs_on_one_torch_thread_off_the_caller_when_asked():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = threading.get_ident()
        assert {(ident == here, n) for ident, n, _ in _where(torch_threads=True)} == {(True, 2)}
        assert {(ident == here, n, w) for ident, n, w in _where(torch_threads=False)} == {(False, 1, 0)}
        assert torch.get_num_threads() == 2  # the caller's own setting is untouched
    finally:
        torch.set_num_threads(threads)
