"""Time and peak memory of ``create_block_mask`` at long sequence lengths.

Each case runs in its own subprocess, so peak RSS (VmHWM) is the case's own. The reported increase
is the peak during the call minus the resident size just before it (after imports and a warm-up).

    .venv/bin/python bench/block_mask_memory.py                 # flexc, L=16384, 3 masks
    .venv/bin/python bench/block_mask_memory.py --torch         # also torch's eager create_block_mask
    .venv/bin/python bench/block_mask_memory.py --length 32768 --no-analysis
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = ("causal", "sliding_window_256", "document")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _mask_mod(case: str, length: int):
    import torch

    if case == "causal":
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    if case == "sliding_window_256":
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)
    if case == "document":
        # documents of pseudo-random lengths between 1 and 2048 tokens
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, 2049, (length,), generator=g)
        ends = torch.cumsum(lengths, 0)
        lengths = lengths[: int((ends < length).sum()) + 1]
        document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:length].contiguous()
        return lambda b, h, q_idx, kv_idx: document_id[q_idx] == document_id[kv_idx]
    raise ValueError(f"unknown case {case!r}; expected one of {CASES}")


def run_one(case: str, length: int, library: str, analytic: bool) -> dict:
    """Runs in the child process: build one mask and report seconds and KiB."""
    import time

    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    mod = _mask_mod(case, length)
    if library == "flexc":
        sys.path.insert(0, ROOT)
        import flexc

        build = lambda L: flexc.create_block_mask(mod, None, None, L, L, device="cpu", _analytic=analytic)
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        build = lambda L: create_block_mask(mod, None, None, L, L, device="cpu")
    build(256)  # warm-up: lazy imports, allocator pools
    before = _status_kib("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    bm = build(length)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _status_kib("VmHWM")
    return {"case": case, "library": library, "length": length, "seconds": round(seconds, 3),
            "cpu_seconds": round(cpu_seconds, 3),
            "peak_increase_mib": round((peak - before) / 1024, 1), "sparsity": round(bm.sparsity(), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--torch", action="store_true", help="also measure torch's eager create_block_mask")
    parser.add_argument("--no-analysis", action="store_true", help="flexc: evaluate every tile exactly")
    parser.add_argument("--child", nargs=4, metavar=("CASE", "LENGTH", "LIBRARY", "ANALYTIC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, length, library, analytic = args.child
        print(json.dumps(run_one(case, int(length), library, analytic == "1")))
        return
    libraries = ["flexc"] + (["torch"] if args.torch else [])
    print(f"{'case':<20} {'library':<7} {'L':>6} {'seconds':>8} {'cpu s':>7} {'peak RSS +MiB':>14} {'sparsity %':>10}")
    for case in args.cases:
        for library in libraries:
            child = [sys.executable, os.path.abspath(__file__), "--child", case, str(args.length), library,
                     "0" if args.no_analysis else "1"]
            out = subprocess.run(child, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{case:<20} {library:<7} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{r['case']:<20} {r['library']:<7} {r['length']:>6} {r['seconds']:>8.3f} {r['cpu_seconds']:>7.3f} "
                  f"{r['peak_increase_mib']:>14.1f} {r['sparsity']:>10.2f}")


if __name__ == "__main__":
    main()
