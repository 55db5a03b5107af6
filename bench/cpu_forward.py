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
one call, sampled every 0.2 ms, with glibc told to return large frees to the OS so growth is real.

    python bench/cpu_forward.py            # full table (a few minutes: torch.compile is slow)
    python bench/cpu_forward.py --quick    # L=1024 only, fewer repetitions, no torch.compile
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
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


def run(lengths, reps: int, with_compile: bool, with_eager_long: bool) -> None:
    _return_large_frees_to_os()
    torch.manual_seed(0)
    compiled = torch.compile(torch_flex.flex_attention, dynamic=False) if with_compile else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; H={H} D={D} fp32, B=1; "
          f"times in seconds (median of {reps}), memory = peak extra resident set of one call")
    header = (f"{'L':>5} {'variant':<13} {'flexc 1st':>9} {'flexc':>7} {'eager':>7} {'compile1st':>10} "
              f"{'compiled':>8} {'sdpa':>7} | {'mem flexc':>9} {'eager':>7} {'compiled':>8} {'sdpa':>7} | "
              f"{'flexc/compiled':>14} {'mem flexc/sdpa':>14}")
    print(header)
    print("-" * len(header))
    for L in lengths:
        q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
        for name, (mask_mod, score_mod, sdpa_kwargs) in variants(L).items():
            bm = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
            tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu")
            call_flexc = lambda: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
            start = time.perf_counter()
            call_flexc()
            first = time.perf_counter() - start
            t_flexc = median_time(call_flexc, reps)
            m_flexc = peak_memory(call_flexc)

            t_eager = m_eager = None
            if L <= 1024 or with_eager_long:
                call_eager = lambda: torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm)
                call_eager()
                t_eager = median_time(call_eager, 1 if L > 1024 else reps)
                m_eager = peak_memory(call_eager)

            t_comp_first = t_comp = m_comp = None
            if compiled is not None:
                call_comp = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm)
                start = time.perf_counter()
                call_comp()
                t_comp_first = time.perf_counter() - start
                t_comp = median_time(call_comp, reps)
                m_comp = peak_memory(call_comp)

            kwargs = sdpa_kwargs()
            call_sdpa = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)
            call_sdpa()
            t_sdpa = median_time(call_sdpa, reps)
            m_sdpa = peak_memory(call_sdpa)

            ratio_t = f"{t_flexc / t_comp:14.2f}" if t_comp else f"{'-':>14}"
            ratio_m = f"{m_flexc / m_sdpa:14.2f}" if m_sdpa else f"{'-':>14}"
            print(f"{L:>5} {name:<13} {first:9.3f} {fmt_time(t_flexc)} {fmt_time(t_eager)} "
                  f"{fmt_time(t_comp_first):>10} {fmt_time(t_comp):>8} {fmt_time(t_sdpa)} | "
                  f"{fmt_mem(m_flexc):>9} {fmt_mem(m_eager)} {fmt_mem(m_comp):>8} {fmt_mem(m_sdpa)} | "
                  f"{ratio_t} {ratio_m}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L=1024 only, 3 reps, no torch.compile")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per cell (default 7, quick 3)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(flex_attention)")
    parser.add_argument("--no-eager-long", action="store_true", help="skip torch eager flex above L=1024 (slow, ~2 GB)")
    args = parser.parse_args()
    lengths = args.lengths or ([1024] if args.quick else [1024, 4096])
    reps = args.reps or (3 if args.quick else 7)
    run(lengths, reps, with_compile=not (args.quick or args.no_compile),
        with_eager_long=not (args.quick or args.no_eager_long))


if __name__ == "__main__":
    main()
