"""Kernel cache growth: captured numbers as kernel arguments, the LRU bound and cache_clear.

Builds (generates, writes and imports; no launch) the interpreter forward and backward kernels for
N score_mods: first ``score / temperature`` for N captured temperatures (one forward and one
backward kernel expected: the backward's ``1 / temperature`` is computed from the argument too),
then N mods whose constant is a literal written in the source (N structures: the LRU bound keeps
at most ``cache_limit`` kernels). Prints kernels compiled, cached (forward/backward), files in the
cache directory and the process's resident memory after each phase and after ``cache_clear()``.

    PYTHONPATH=$PWD python bench/kernel_cache.py --count 300
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    os.environ["FLEXC_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexc-cache-bench-")
    import flexc
    from flexc.backends.triton import backward as tbw, cache as kernel_cache, forward as tb
    from flexc.codegen.scalars import lift_scalars

    def build(mod):
        lifted = lift_scalars(flexc.trace(mod))
        kernel_cache.get_kernel(tb.make_spec(lifted, None, torch.float32, 64, 64, None, None, "interpreter", False))
        kernel_cache.get_kernel(tbw.make_backward_spec(lifted, None, torch.float32, 64, 64, None, None, "interpreter"))

    def report(phase: str) -> None:
        gc.collect()
        info = flexc.cache_info()
        backward = sum(type(k.generated).__name__ == "GeneratedBackward" for k in kernel_cache.cached_kernels())
        cached = f"{info.size:>4} ({info.size - backward} fwd, {backward} bwd)"
        files = len([f for f in os.listdir(kernel_cache.cache_dir()) if f.endswith(".py")])
        print(f"{phase:<44} compiled {info.misses:>4}  cached {cached:<20} files {files:>4}  RSS {rss_mib():7.1f} MiB")

    build(lambda score, b, h, q_idx, kv_idx: score * 0.5)  # warm-up: imports triton
    flexc.cache_clear()
    report("start (after warm-up)")
    for i in range(args.count):
        temperature = 0.5 + i / args.count

        def scaled(score, b, h, q_idx, kv_idx):
            return score / temperature

        build(scaled)
    report(f"{args.count} captured temperatures")
    for i in range(args.count):
        build(eval(f"lambda score, b, h, q_idx, kv_idx: score * {0.5 + i / args.count!r}"))
    report(f"+ {args.count} literal constants (limit {kernel_cache.cache_limit()})")
    flexc.cache_clear()
    report("after cache_clear()")


if __name__ == "__main__":
    main()
