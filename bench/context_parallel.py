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

``--run``: a real exchange. Two gloo ranks (spawned with torch.multiprocessing, one thread each) run
flexc.call.distributed.flex_attention on their shards of a causal and a sliding-window sequence
(default 1024 tokens, window 256, B=1, H=8, D=64, fp32, block 128), against one process with two threads
running flexc.flex_attention on the whole sequence. Printed: wall time of forward and of
forward+backward (median of reps; a distributed rep lasts until its slowest rank is done), and the
bytes each rank actually received, counted by wrapping the torch.distributed calls flexc makes
(``irecv``: the buffer's bytes; ``all_reduce``/``all_gather``: the tensors' bytes, what a rank gets
back), next to the plan's prediction, with the time each phase spent blocked in ``wait()`` on its
posted sends and receives (the exchange compute did not hide). The distributed outputs are checked
against the single-process ones first.

    python bench/context_parallel.py --run [--tokens 1024] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's flexc

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import flexc  # noqa: E402
from flexc.call import distributed as cp  # noqa: E402


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


# ---- --run: a real exchange over gloo ------------------------------------------------------------

RUN_SHAPE = dict(B=1, H=8, D=64, block=128)


class _TimedWork:
    """A posted send or receive whose ``wait`` adds the seconds spent blocked to ``waited``."""

    def __init__(self, work, waited: dict, phase: str):
        self.work, self.waited, self.phase = work, waited, phase

    def wait(self, *args):
        start = time.perf_counter()
        try:
            return self.work.wait(*args)
        finally:
            self.waited[self.phase] = self.waited.get(self.phase, 0.0) + time.perf_counter() - start


class ReceivedBytes:
    """Wraps the torch.distributed calls flexc.call.distributed makes and counts the bytes this rank
    receives, by phase (``self.phase`` is set by the caller: "forward" or "backward"), and the
    seconds spent waiting for posted sends and receives (exchange time not hidden by compute)."""

    CALLS = ("irecv", "recv", "all_reduce", "all_gather", "broadcast", "isend")

    def __init__(self):
        self.phase, self.bytes, self.calls, self.waited = "forward", {}, {}, {}
        self.originals = {name: getattr(dist, name) for name in self.CALLS}
        for name, original in self.originals.items():
            setattr(dist, name, self._counting(name, original))

    def _counting(self, name, original):
        def call(tensor, *args, **kwargs):
            if name == "all_gather":  # (output list, input): what arrives is the others' tensors
                got = sum(t.numel() * t.element_size() for t in tensor) - args[0].numel() * args[0].element_size()
            else:
                got = 0 if name == "isend" else tensor.numel() * tensor.element_size()
            key = (self.phase, name)
            self.bytes[key] = self.bytes.get(key, 0) + got
            self.calls[key] = self.calls.get(key, 0) + 1
            work = original(tensor, *args, **kwargs)
            return _TimedWork(work, self.waited, self.phase) if name in ("irecv", "isend") else work
        return call

    def restore(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _run_masks(L: int, window: int) -> dict:
    return {"causal": lambda b, h, q, kv: q >= kv,
            f"sliding {window}": lambda b, h, q, kv: (q >= kv) & (q - kv < window)}


def _inputs(L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, D = RUN_SHAPE["B"], RUN_SHAPE["H"], RUN_SHAPE["D"]
    return [torch.randn(B, H, L, D, generator=g) for _ in range(3)], torch.randn(B, H, L, D, generator=g)


def _timed(fn, reps: int, sync=lambda: None) -> float:
    """Median seconds of ``fn`` over ``reps`` (after one warm-up); ``sync`` lines the ranks up."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if dist.is_initialized():  # a distributed step lasts until its slowest rank is done
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def _rank(rank: int, size: int, port: int, L: int, window: int, reps: int, outfile: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    lines = []
    try:
        for name, mask_mod in _run_masks(L, window).items():
            bm = flexc.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=RUN_SHAPE["block"])
            plan = cp.plan_context_parallel(bm, size)
            (q, k, v), grad = _inputs(L)
            local = [cp.shard_sequence(t, bm, plan=plan).requires_grad_() for t in (q, k, v)]
            grad_local = cp.shard_sequence(grad, bm, plan=plan)

            def forward():
                with torch.no_grad():
                    return cp.flex_attention(*local, block_mask=bm, plan=plan)

            def forward_backward():
                for t in local:
                    t.grad = None
                cp.flex_attention(*local, block_mask=bm, plan=plan).backward(grad_local)

            # correct first: the distributed output equals one process's on the whole sequence
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            expect = flexc.flex_attention(*full, block_mask=bm)
            expect.backward(grad)
            counter = ReceivedBytes()
            try:
                out = cp.flex_attention(*local, block_mask=bm, plan=plan)
                counter.phase = "backward"
                out.backward(grad_local)
            finally:
                counter.restore()
            torch.testing.assert_close(out, cp.shard_sequence(expect.detach(), bm, plan=plan), atol=1e-5, rtol=1e-5)
            for t, f in zip(local, full):
                torch.testing.assert_close(t.grad, cp.shard_sequence(f.grad, bm, plan=plan), atol=1e-5, rtol=1e-5)
            fwd = _timed(forward, reps, dist.barrier)
            both = _timed(forward_backward, reps, dist.barrier)
            token_bytes = 2 * RUN_SHAPE["B"] * RUN_SHAPE["H"] * RUN_SHAPE["D"] * 4  # k + v, fp32
            received = {phase: sum(b for (p, _), b in counter.bytes.items() if p == phase)
                        for phase in ("forward", "backward")}
            calls = ", ".join(f"{p} {n} x{c}" for (p, n), c in sorted(counter.calls.items()))
            calls += "; waited " + ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in sorted(counter.waited.items()))
            lines.append((name, rank, fwd, both, received, plan.bytes_received(rank, token_bytes), calls))
    finally:
        dist.destroy_process_group()
    with open(f"{outfile}.{rank}", "w") as f:
        f.write(repr(lines))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(L: int, window: int, reps: int) -> None:
    """Two gloo ranks against one process with two threads (see the module docstring)."""
    size = 2
    print(f"{L} tokens, B={RUN_SHAPE['B']} H={RUN_SHAPE['H']} D={RUN_SHAPE['D']} fp32, block {RUN_SHAPE['block']}; "
          f"median of {reps} reps, wall time")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        start = time.perf_counter()
        mp.spawn(_rank, args=(size, _free_port(), L, window, reps, out), nprocs=size, join=True)
        spawned = time.perf_counter() - start
        results = [eval(open(f"{out}.{r}").read()) for r in range(size)]  # (our own repr of numbers and strings)
    header = (f"{'mask':<14} | {'1 proc 2 thr fwd':>16} {'fwd+bwd':>9} | {'2 ranks fwd':>11} {'fwd+bwd':>9} | "
              f"{'ranks/1 proc fwd':>16} {'fwd+bwd':>8} | {'1 proc 1 thr fwd':>16} {'fwd+bwd':>9}")
    print(header)
    print("-" * len(header))
    for i, (name, mask_mod) in enumerate(_run_masks(L, window).items()):
        bm = flexc.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=RUN_SHAPE["block"])
        (q, k, v), grad = _inputs(L)
        full = [t.clone().requires_grad_() for t in (q, k, v)]

        def forward():
            with torch.no_grad():
                return flexc.flex_attention(*full, block_mask=bm)

        def forward_backward():
            for t in full:
                t.grad = None
            flexc.flex_attention(*full, block_mask=bm).backward(grad)

        times = {}
        for threads in (2, 1):  # (one thread: what a rank's share of the machine does alone)
            torch.set_num_threads(threads)
            times[threads] = _timed(forward, reps), _timed(forward_backward, reps)
        (fwd, both), (fwd1, both1) = times[2], times[1]
        _, _, cp_fwd, cp_both, _, _, _ = results[0][i]
        print(f"{name:<14} | {fwd * 1e3:14.1f}ms {both * 1e3:7.1f}ms | {cp_fwd * 1e3:9.1f}ms {cp_both * 1e3:7.1f}ms | "
              f"{cp_fwd / fwd:15.2f}x {cp_both / both:7.2f}x | {fwd1 * 1e3:14.1f}ms {both1 * 1e3:7.1f}ms")
    print("\nbytes received per rank (counted at the torch.distributed calls; plan: key+value blocks fetched):")
    for per_rank in zip(*results):
        for name, rank, _, _, received, planned, calls in per_rank:
            print(f"  {name:<14} rank {rank}: forward {received['forward'] / 1e6:.3f} MB (plan {planned / 1e6:.3f} MB), "
                  f"backward {received['backward'] / 1e6:.3f} MB  [{calls}]")
    print(f"(spawning, planning and checking the 2 ranks took {spawned:.1f} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: other processes' load shows in every column)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="sequence length (default 65536; --run: 1024)")
    parser.add_argument("--window", type=int, default=None, help="sliding window (default 1024; --run: 256)")
    parser.add_argument("--run", action="store_true", help="a real exchange over gloo, timed (see above)")
    parser.add_argument("--reps", type=int, default=5, help="--run: timed repetitions")
    args = parser.parse_args()
    if args.run:
        run(args.tokens or 1024, args.window or 256, args.reps)
        return
    args.tokens, args.window = args.tokens or 65536, args.window or 1024
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
