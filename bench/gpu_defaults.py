"""The kernel defaults that depart from torch's, or that the proxy favoured, timed on a GPU one at a time.

    python bench/gpu_defaults.py               # bf16 forward: num_warps 4 vs 8 at D=64; USE_TMA off vs on
    python bench/gpu_defaults.py --budget 90   # stop starting new rows after 90 s

Each row times flexc's forward (do_bench, ms) for one mask at B*L = 16K tokens, 16 heads, with the
default kernel_options and with one option changed, so the ratio isolates that option: what
docs/kernels.md "Defaults" asks for before a default departs from torch's pick. FAST_MATH rows time a
soft-capped causal forward with FAST_MATH on and off. Every row is guarded; the last line is a summary.
Needs a CUDA GPU (exits 0 without one).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexc  # noqa: E402

WINDOW = 256


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def soft_cap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


MASKS = {"causal": causal, "sliding window 256": sliding}
# (what is compared, the mask, score_mod, head dim, baseline kernel_options, changed kernel_options)
ROWS = [
    ("num_warps 8 / 4", "causal", None, 64, {"num_warps": 4}, {"num_warps": 8}),
    ("num_warps 8 / 4", "sliding window 256", None, 64, {"num_warps": 4}, {"num_warps": 8}),
    ("USE_TMA on / off", "sliding window 256", None, 128, {"USE_TMA": False}, {"USE_TMA": True}),
    ("USE_TMA on / off", "causal", None, 128, {"USE_TMA": False}, {"USE_TMA": True}),
    ("FAST_MATH on / off", "causal", soft_cap, 128, {"FAST_MATH": False}, {"FAST_MATH": True}),
]


def bench_ms(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=150.0, help="seconds before no new row starts")
    parser.add_argument("--lengths", default="1024,8192", help="sequence lengths, comma-separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_defaults.py: no CUDA GPU here; nothing to time")
        return 0
    start, failures, lines = time.time(), 0, []
    print("| option | mask | D | L | baseline ms | changed ms | changed / baseline |")
    print("|---|---|---|---|---|---|---|")
    for what, mask_name, score_mod, head_dim, base, changed in ROWS:
        for length in (int(x) for x in args.lengths.split(",")):
            if time.time() - start > args.budget:
                print(f"(budget spent: {what} {mask_name} L={length} not run)")
                continue
            try:
                batch = max(1, 16384 // length)
                q, k, v = (torch.randn(batch, 16, length, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                bm = flexc.create_block_mask(MASKS[mask_name], None, None, length, length, device="cuda")
                times = []
                for options in (base, changed):
                    run = lambda: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                       kernel_options=options)
                    run()
                    times.append(bench_ms(run))
                line = (f"| {what} | {mask_name} | {head_dim} | {length} | {times[0]:.3f} | {times[1]:.3f} | "
                        f"{times[1] / times[0]:.2f} |")
            except Exception as e:  # one row's failure never stops the others
                failures += 1
                line = f"| {what} | {mask_name} | {head_dim} | {length} | FAILED: {type(e).__name__}: " \
                       f"{str(e).splitlines()[0][:120] if str(e) else ''} | | |"
            lines.append(line)
            print(line, flush=True)
    print(f"gpu_defaults.py summary: {len(lines) - failures} rows, {failures} failed, {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
