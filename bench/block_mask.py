"""create_block_mask: flexc (analytic tile classification) vs torch eager vs torch compiled.

Every measurement runs in its own subprocess so peak memory is that case's alone. Columns: seconds
of the call (compiled torch: first call, including compilation, and a steady-state second call),
the peak resident memory increase during the call, and for flexc the fraction of tiles decided by
analysis alone (without evaluating any element).

    .venv/bin/python bench/block_mask.py --quick          # L = 4K and 16K, a few minutes
    .venv/bin/python bench/block_mask.py                  # L = 4K..64K, flexc alone to 1M
    .venv/bin/python bench/block_mask.py --limit 1200     # stop starting new cases after 20 min

torch eager materialises the dense [L, L] mask (plus int temporaries); cases it cannot fit in this
machine's memory are skipped and marked so.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = ("causal", "sliding_window_256", "document_causal", "prefix_lm")
COMPARED_LENGTHS = (4096, 16384, 32768, 65536)
FLEXC_ONLY_LENGTHS = (131072, 262144, 1048576)
BLOCK = 128
# torch eager needs about 10.6 GB at 32K for causal (the bool mask plus int temporaries, 10 bytes
# an element); 64K would need 4x that.
EAGER_BYTES_PER_ELEMENT = 10


def mask_mod(name: str, length: int):
    import torch

    if name == "causal":
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    if name == "sliding_window_256":
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)
    if name == "prefix_lm":
        prefix = length // 4
        return lambda b, h, q_idx, kv_idx: (kv_idx < prefix) | (q_idx >= kv_idx)
    if name == "document_causal":
        # packed documents of random lengths (1 .. 4096 tokens, seeded), sorted ids
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, 4097, (length // 2 + 1,), generator=g)
        count = int((torch.cumsum(lengths, 0) < length).sum()) + 1
        doc = torch.repeat_interleave(torch.arange(count), lengths[:count])[:length].contiguous()
        return lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    raise ValueError(f"unknown mask {name!r}; expected one of {MASKS}")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def child(impl: str, name: str, length: int) -> dict:
    """One measurement, in a fresh process."""
    mod = mask_mod(name, length)
    result = {"impl": impl, "mask": name, "L": length}
    if impl == "flexc":
        sys.path.insert(0, ROOT)
        import flexc

        call = lambda: flexc.create_block_mask(mod, None, None, length, length, device="cpu", BLOCK_SIZE=BLOCK)
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        compiled = impl == "torch_compiled"
        call = lambda: create_block_mask(mod, None, None, length, length, device="cpu", BLOCK_SIZE=BLOCK,
                                         _compile=compiled)
    if impl == "torch_eager":  # warm-up at a small length: lazy imports, allocator pools
        create_block_mask(mod, None, None, 256, 256, device="cpu", BLOCK_SIZE=BLOCK)
    before = _kib("VmRSS")
    start = time.perf_counter()
    call()
    result["seconds"] = time.perf_counter() - start
    if impl != "torch_eager":  # flexc: steady = a second call (tracing, sympy import, forms cached)
        start = time.perf_counter()
        call()
        result["steady_seconds"] = time.perf_counter() - start
    result["peak_mib"] = (_kib("VmHWM") - before) / 1024
    if impl == "flexc":
        from flexc.analysis.ranges import UNDECIDED, classify_tiles

        classes = classify_tiles(flexc.trace(mod), 1, 1, length, length, BLOCK, BLOCK)
        result["decided"] = float((classes != UNDECIDED).float().mean())
    return result


def run(impl: str, name: str, length: int, threads: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, name, str(length), str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "mask": name, "L": length, "error": f"timeout {timeout:.0f}s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"impl": impl, "mask": name, "L": length, "error": last[:60]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _total_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only L = 4K and 16K, no flexc-only lengths")
    parser.add_argument("--limit", type=float, default=1800, help="seconds after which no new case starts")
    parser.add_argument("--masks", nargs="*", default=list(MASKS))
    parser.add_argument("--lengths", nargs="*", type=int, help="only these lengths (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (15-20 s per mask and L)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in every case (0: torch's default). On a shared machine use 1: "
                             "busy cores make OpenMP workers wait on each other, which can cost 10x")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, name, length, threads = args.child
        if int(threads):
            import torch

            torch.set_num_threads(int(threads))
        print(json.dumps(child(impl, name, int(length))))
        return

    compared = COMPARED_LENGTHS[:2] if args.quick else COMPARED_LENGTHS
    flexc_only = () if args.quick else FLEXC_ONLY_LENGTHS
    memory = _total_memory_bytes()
    deadline = time.monotonic() + args.limit
    impls = ["flexc", "torch_eager"] + ([] if args.no_compile else ["torch_compiled"])
    print(f"block {BLOCK}x{BLOCK}, B = H = 1, torch threads {args.threads or 'default'}; times in seconds, "
          f"peak = resident memory increase in MiB")
    print("flexc: 1st = first call in a fresh process (imports, tracing), steady = second call; "
          "x = torch time / flexc time (eager and steady vs flexc steady, 1st vs flexc 1st)")
    print(f"{'mask':<20}{'L':>8} {'flexc 1st':>9} {'steady':>7} {'peak':>6} {'decided':>8} | {'eager s':>8} "
          f"{'peak':>6} {'x':>6} | {'compile 1st':>11} {'steady':>7} {'x 1st':>6} {'x steady':>8}")
    for name in args.masks:
        for length in (*compared, *flexc_only):
            if args.lengths and length not in args.lengths:
                continue
            row = {}
            for impl in impls if length in compared else ["flexc"]:
                if time.monotonic() > deadline:
                    row[impl] = {"error": "time limit"}
                elif impl == "torch_eager" and length * length * EAGER_BYTES_PER_ELEMENT > 0.8 * memory:
                    row[impl] = {"error": "skipped: needs > memory"}
                else:
                    row[impl] = run(impl, name, length, args.threads, timeout=max(10.0, deadline - time.monotonic() + 60))
            print(_format(name, length, row), flush=True)


def _format(name: str, length: int, row: dict) -> str:
    def cell(impl, key, width, fmt="{:.3f}"):
        r = row.get(impl)
        if r is None:
            return " " * width
        if "error" in r:
            return r["error"][:width].rjust(width) if key in ("seconds",) else "-".rjust(width)
        return fmt.format(r[key]).rjust(width) if key in r else "-".rjust(width)

    def ratio(impl, key, flexc_key):
        f, t = row.get("flexc", {}), row.get(impl, {})
        if flexc_key not in f or key not in t:
            return "-"
        return f"{t[key] / f[flexc_key]:.0f}"

    text = f"{name:<20}{length:>8} {cell('flexc', 'seconds', 9)} {cell('flexc', 'steady_seconds', 7)} "
    text += f"{cell('flexc', 'peak_mib', 6, '{:.0f}')} {cell('flexc', 'decided', 8, '{:.4f}')}"
    if "torch_eager" in row or "torch_compiled" in row:
        text += f" | {cell('torch_eager', 'seconds', 8)} {cell('torch_eager', 'peak_mib', 6, '{:.0f}')} "
        text += f"{ratio('torch_eager', 'seconds', 'steady_seconds'):>6} | {cell('torch_compiled', 'seconds', 11)} "
        text += f"{cell('torch_compiled', 'steady_seconds', 7)} {ratio('torch_compiled', 'seconds', 'seconds'):>6} "
        text += f"{ratio('torch_compiled', 'steady_seconds', 'steady_seconds'):>8}"
    return text


if __name__ == "__main__":
    main()
