"""CPU forward benchmark: flexc vs torch FlexAttention (eager and torch.compile) vs SDPA.

Prints, for L in (1024, 4096), H=8, D=64, fp32 and the masks causal, sliding-window-256 and
causal+ALiBi: the median time of several calls and the peak extra memory of one call, for

  flexc first   flexc.flex_attention's first call (traces the mods; no compilation)
  flexc         flexc.flex_attention at steady state
  eager         torch's flex_attention without compile (materialises L x S scores)
  compile 1st   torch.compile(flex_attention)'s first call (includes compilation)
  compiled      torch.compile(flex_attention) at steady state
  sdpa          F.scaled_dot_product_attention (is_causal, or an explicit dense mask)

and the ratios flexc/compiled and flexc memory/SDPA memory. Block masks are built once per row
outside the timed calls. Peak memory is the largest growth of the process's resident set during
one call, sampled every 0.2 ms, measured in a child process in which glibc returns large frees to
the OS (so growth is real; that setting slows allocation, so timings are taken without it).

    python bench/cpu_forward.py            # full table (a few minutes: torch.compile is slow)
    python bench/cpu_forward.py --quick    # L=1024 only, fewer repetitions, no torch.compile
    python bench/cpu_forward.py --share    # issue 28's table: flexc / torch.compile and flexc's share of sgemm
    python bench/cpu_forward.py --share --contended   # also: another process spinning on one core
    python bench/cpu_forward.py --contended [--train] # flexc alone: quiet 1 thread vs default threads, one core busy

``--share`` runs L=4096, H=8, D=64 fp32 with the masks causal, sliding window 256, 6 documents +
causal, ALiBi + causal and soft-cap (tanh) + causal, at one thread and at two. Useful work is 4·D
FLOPs per allowed (q, kv) pair per head; the share is flexc's FLOP rate over a square sgemm's at
the same thread count, timed in the same rounds: each round calls flexc, torch.compile and the
sgemm once, so load from other processes shifts all three alike (the table prints the sgemm rate and
the 1-minute load average of each row; on a shared box compare rows within a run, not across runs).
torch.compile's side is its own C++ flex template (torch 2.13): in fp32 it computes ``q @ k^T`` with a
micro-GEMM blocked 1 x 16 (one vector accumulator per row, so one FMA chain: about 19 GFLOP/s measured
for that part against 60-70 for sgemm on this box; perf puts ~46% of its causal time there), whatever
BLOCK_SIZE (64/128/256 gave 0.94/1.05/1.08 s causal, 0.090/0.113/0.161 s sliding at 1 thread; the
table uses the default 128, as flexc does). There are no graph breaks and no recompiles inside the timing.
``--contended`` adds, with default threads while another process spins on
one core, flexc/SDPA (dense mask) against its one-thread figure.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexc  # noqa: E402

warnings.filterwarnings("ignore")
H, D = 8, 64
WINDOW = 256
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _return_large_frees_to_os() -> None:
    """Make glibc serve allocations >= 64 KiB with mmap, so freeing them shrinks the resident set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_memory(fn) -> int:
    """Largest resident-set growth (bytes) while ``fn()`` runs."""
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = fn()
    peak[0] = max(peak[0], _rss())
    done.set()
    thread.join()
    del result
    return peak[0] - base


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def variants(L: int):
    """name -> (mask_mod, score_mod, sdpa kwargs builder)."""
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    sliding = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)
    alibi = lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
    pos = torch.arange(L)

    def sdpa_sliding():
        return {"attn_mask": (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] <= WINDOW)}

    def sdpa_alibi():
        bias = slopes.view(H, 1, 1) * (pos[None, None, :] - pos[None, :, None]).float()
        return {"attn_mask": bias.masked_fill(pos[None, :, None] < pos[None, None, :], float("-inf"))}

    return {
        "causal": (causal, None, lambda: {"is_causal": True}),
        f"sliding-{WINDOW}": (sliding, None, sdpa_sliding),
        "causal+alibi": (causal, alibi, sdpa_alibi),
    }


def fmt_time(t: float | None) -> str:
    return "      -" if t is None else f"{t:7.3f}"


def fmt_mem(m: int | None) -> str:
    return "      -" if m is None else f"{m / 2**20:6.0f}M"


def calls(L: int, name: str, with_compile: bool, with_eager_long: bool):
    """impl -> zero-argument call for one row; block masks are built here, outside any timing."""
    mask_mod, score_mod, sdpa_kwargs = variants(L)[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    bm = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
    tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu")
    kwargs = sdpa_kwargs()
    out = {"flexc": lambda: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)}
    if L <= 1024 or with_eager_long:
        out["eager"] = lambda: torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm)
    if with_compile:
        compiled = _compiled()
        out["compiled"] = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm)
    out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out


_COMPILED = []


def _compiled():
    if not _COMPILED:
        import torch._dynamo
        torch._dynamo.config.recompile_limit = 64  # a new mask or score_mod is a recompile: one per row
        _COMPILED.append(torch.compile(torch_flex.flex_attention, dynamic=False))
    return _COMPILED[0]


def memory_child(lengths, with_compile: bool, with_eager_long: bool) -> None:
    """Print ``L name impl bytes`` for every cell: peak extra memory of one warmed-up call.

    Runs in its own process because making glibc return large frees to the OS (so the resident
    set shows real growth) slows every allocation down, which must not touch the timings.
    """
    _return_large_frees_to_os()
    for L in lengths:
        for name in variants(L):
            for impl, call in calls(L, name, with_compile, with_eager_long).items():
                call()
                print(L, name, impl, peak_memory(call), flush=True)


def measure_memory(lengths, with_compile: bool, with_eager_long: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", "--lengths", *map(str, lengths)]
    if not with_compile:
        cmd.append("--no-compile")
    if not with_eager_long:
        cmd.append("--no-eager-long")
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    memory = {}
    for line in result.stdout.splitlines():
        L, name, impl, peak = line.split()
        memory[(int(L), name, impl)] = int(peak)
    return memory


def run(lengths, reps: int, with_compile: bool, with_eager_long: bool) -> None:
    memory = measure_memory(lengths, with_compile, with_eager_long)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; H={H} D={D} fp32, B=1; "
          f"times in seconds (median of {reps}), memory = peak extra resident set of one call")
    header = (f"{'L':>5} {'variant':<13} {'flexc 1st':>9} {'flexc':>7} {'eager':>7} {'compile1st':>10} "
              f"{'compiled':>8} {'sdpa':>7} | {'mem flexc':>9} {'eager':>7} {'compiled':>8} {'sdpa':>7} | "
              f"{'flexc/compiled':>14} {'mem flexc/sdpa':>14}")
    print(header)
    print("-" * len(header))
    for L in lengths:
        for name in variants(L):
            cells = calls(L, name, with_compile, with_eager_long)
            times, firsts = {}, {}
            for impl, call in cells.items():
                start = time.perf_counter()
                call()
                firsts[impl] = time.perf_counter() - start
                times[impl] = median_time(call, 1 if (impl == "eager" and L > 1024) else reps)
            mem = {impl: memory.get((L, name, impl)) for impl in ("flexc", "eager", "compiled", "sdpa")}
            t_comp = times.get("compiled")
            ratio_t = f"{times['flexc'] / t_comp:14.2f}" if t_comp else f"{'-':>14}"
            ratio_m = f"{mem['flexc'] / mem['sdpa']:14.2f}" if mem["sdpa"] else f"{'-':>14}"
            print(f"{L:>5} {name:<13} {firsts['flexc']:9.3f} {fmt_time(times['flexc'])} {fmt_time(times.get('eager'))} "
                  f"{fmt_time(firsts.get('compiled')):>10} {fmt_time(t_comp):>8} {fmt_time(times['sdpa'])} | "
                  f"{fmt_mem(mem['flexc']):>9} {fmt_mem(mem['eager'])} {fmt_mem(mem['compiled']):>8} {fmt_mem(mem['sdpa'])} | "
                  f"{ratio_t} {ratio_m}", flush=True)


SHARE_L, DOCUMENTS, CAP = 4096, 6, 20.0


def share_variants(L: int):
    """name -> (mask_mod, score_mod) of the ``--share`` table."""
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    doc = torch.arange(L) * DOCUMENTS // L  # six equal documents
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)
    return {
        "causal": (causal, None),
        f"sliding {WINDOW}": (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW), None),
        f"document ({DOCUMENTS}) + causal": (lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx),
                                             None),
        "ALiBi + causal": (causal, lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)),
        "soft-cap (tanh) + causal": (causal, lambda score, b, h, q_idx, kv_idx: CAP * torch.tanh(score / CAP)),
    }


_SGEMM_N = 2048


def _sgemm_call():
    """A zero-argument square fp32 matmul (2 * _SGEMM_N**3 FLOPs) at the current thread count."""
    a, b = torch.randn(_SGEMM_N, _SGEMM_N), torch.randn(_SGEMM_N, _SGEMM_N)
    return lambda: a @ b


def interleaved(fns, reps: int) -> list[float]:
    """Median seconds of each of ``fns``, called in turn ``reps`` times (one call of each per round)."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def _spin() -> None:
    while True:
        pass


def share_table(reps: int, contended: bool, L: int = SHARE_L) -> None:
    import multiprocessing
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    compiled = _compiled()
    rows = {}
    for name, (mask_mod, score_mod) in share_variants(L).items():
        bm = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        allowed = int(flexc.create_mask(mask_mod, 1, 1, L, L).sum())
        rows[name] = (bm, tbm, score_mod, mask_mod, allowed * H * 4 * D)
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}; L={L} H={H} D={D} fp32, B=1; medians of {reps}; useful work 4*D FLOPs "
          f"per allowed pair per head")
    print(f"{'mask':<26} {'threads':>7} {'flexc s':>8} {'compiled s':>10} {'flexc/compiled':>14} {'sgemm share':>11} "
          f"{'GFLOP/s':>7} {'load':>5}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (bm, tbm, score_mod, _, flops) in rows.items():
            # compile (or recompile: the generated kernel is specialised on the thread count, and
            # dynamo guards on it) and warm both up outside the timing
            compiled(q, k, v, score_mod=score_mod, block_mask=tbm)
            flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
            # flexc, torch.compile and the sgemm alternate within each repetition, so a burst of
            # load from another process lands on all three rather than on one side's block of calls
            ours, theirs, gemm = interleaved(
                [lambda: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                 lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm), _sgemm_call()], reps)
            rate = 2 * _SGEMM_N ** 3 / gemm
            print(f"{name:<26} {threads:>7} {ours:8.3f} {theirs:10.3f} {ours / theirs:14.2f} "
                  f"{flops / ours / rate:10.0%} {rate / 1e9:7.0f} {os.getloadavg()[0]:5.1f}", flush=True)
    torch.set_num_threads(default_threads)
    if not contended:
        return
    print(f"\nflexc / SDPA (dense mask), 1 thread quiet vs {default_threads} threads with a spinning process")
    spinner = multiprocessing.Process(target=_spin, daemon=True)
    for name, (bm, _, score_mod, mask_mod, _) in rows.items():
        dense = flexc.create_mask(mask_mod, 1, 1, L, L)
        if score_mod is not None:
            continue  # SDPA takes the mask alone: the mask rows compare like with like
        figures = []
        for threads, spin in ((1, False), (default_threads, True)):
            torch.set_num_threads(threads)
            if spin and not spinner.is_alive():
                spinner.start()
            ours = median_time(lambda: flexc.flex_attention(q, k, v, block_mask=bm), reps)
            sdpa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), reps)
            figures.append(ours / sdpa)
        print(f"{name:<26} quiet 1 thread {figures[0]:5.2f}  contended {figures[1]:5.2f}  "
              f"({figures[1] / figures[0]:.2f}x)", flush=True)
    spinner.terminate()
    torch.set_num_threads(default_threads)


def contention_table(reps: int, L: int = SHARE_L, train: bool = False) -> None:
    """flexc alone (no torch.compile): each ``--share`` row's wall time at one thread on a quiet box,
    then at the default thread count while another process spins on one core, and their ratio
    (issue 41's target: at most 1.5). ``train``: forward + backward."""
    import multiprocessing
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, requires_grad=train) for _ in range(3))
    grad = torch.randn(1, H, L, D)
    calls = {}
    for name, (mask_mod, score_mod) in share_variants(L).items():
        bm = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        forward = lambda bm=bm, score_mod=score_mod: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        calls[name] = (lambda forward=forward: forward().backward(grad)) if train else forward
    default_threads = torch.get_num_threads()
    times = {}
    spinner = multiprocessing.Process(target=_spin, daemon=True)
    for threads, spin in ((1, False), (default_threads, True)):
        torch.set_num_threads(threads)
        if spin:
            spinner.start()
            time.sleep(0.5)
        for name, call in calls.items():
            call()
            times[name, spin] = median_time(call, reps)
    spinner.terminate()
    torch.set_num_threads(default_threads)
    print(f"L={L} H={H} D={D} fp32, B=1, {'forward + backward' if train else 'forward'}; wall s, medians of {reps}; "
          f"load {os.getloadavg()[0]:.1f}")
    for name in calls:
        quiet, busy = times[name, False], times[name, True]
        print(f"{name:<26} 1 thread quiet {quiet:7.3f}  {default_threads} threads, one core busy {busy:7.3f}  "
              f"({busy / quiet:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L=1024 only, 3 reps, no torch.compile")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per cell (default 7, quick 3)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(flex_attention)")
    parser.add_argument("--no-eager-long", action="store_true", help="skip torch eager flex above L=1024 (slow, ~2 GB)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--share", action="store_true", help="flexc/torch.compile and the sgemm share, 1 and 2 threads")
    parser.add_argument("--contended", action="store_true", help="with --share: also another process on one core; "
                        "alone: flexc's quiet one-thread vs contended default-thread times, no torch.compile")
    parser.add_argument("--train", action="store_true", help="with --contended alone: forward + backward")
    args = parser.parse_args()
    if args.contended and not args.share:
        contention_table(args.reps or 5, (args.lengths or [SHARE_L])[0], args.train)
        return
    if args.share:
        share_table(args.reps or 5, args.contended, (args.lengths or [SHARE_L])[0])
        return
    lengths = args.lengths or ([1024] if args.quick else [1024, 4096])
    reps = args.reps or (3 if args.quick else 7)
    with_compile = not (args.quick or args.no_compile)
    with_eager_long = not (args.quick or args.no_eager_long)
    if args.memory_child:
        memory_child(lengths, with_compile, with_eager_long)
    else:
        run(lengths, reps, with_compile, with_eager_long)


if __name__ == "__main__":
    main()
