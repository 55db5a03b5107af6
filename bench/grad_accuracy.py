"""Worst gradient-accuracy ratio over seeds of every case of tests/test_dropin_grad_accuracy.py.

flexc's rmse against the exact (float64) gradient divided by the reference's: SDPA with a dense
mask for fp32, torch-order eager math for bf16 (bounds 1.2x and 1.1x).

    python bench/grad_accuracy.py [--seeds N] [--backend TORCH|TRITON] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "call")]  # this checkout's flexc and its tests
import flexc  # noqa: E402
import test_dropin_grad_accuracy as cases  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--backend", choices=("TORCH", "TRITON"), action="append")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), action="append")
    parser.add_argument("--case", action="append")
    args = parser.parse_args()
    print(f"flexc from {os.path.dirname(flexc.__file__)}")
    print(f"{'backend':8} {'dtype':9} {'case':9} {'grad':8} {'worst':>7} {'seed':>4}  bound")
    for backend, dtype, case in cases.PARAMS:
        if (args.backend and backend not in args.backend or args.dtype and str(dtype)[6:] not in args.dtype
                or args.case and case not in args.case):
            continue
        t0 = time.perf_counter()
        worst = cases.worst_ratios(backend, dtype, case, range(args.seeds))
        bound = cases.BOUND[dtype]
        for name, (r, seed) in worst.items():
            flag = "" if r <= bound else "  FAIL"
            print(f"{backend:8} {str(dtype)[6:]:9} {case:9} {name:8} {r:7.3f} {seed:4}  {bound}{flag}")
        print(f"{'':8} ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
