"""Per-token attention cost while decoding with a KV cache (CPU, one thread, fp32, D=64).

One process, interleaved rounds, medians. For each cache size (1K/4K/16K), head layout (H=8, and
GQA 32 query / 8 key heads) and mask (causal, sliding window 1024), one query row at the last
cache position, with the slicing idiom torch users know (gpt-fast):

    mask = block_mask[:, :, pos // 128]; mask.mask_mod = shifted(mask_mod, input_pos[0]); mask.seq_lengths = (1, S)

- flexc: that idiom on a flexc BlockMask, then flexc.flex_attention;
- torch eager / torch compiled: the same idiom with torch's BlockMask and flex_attention, the
  compiled one as one ``torch.compile``d decode step (slice + attention, as gpt-fast compiles it);
- flexc compiled: flexc's step compiled the same way (its ``flexc::flex_attention_inference`` node);
- SDPA: ``scaled_dot_product_attention`` on the cache slice the mask allows (the lower bound).

Also printed: the host overhead of a call with L=128 and no mask (flexc vs SDPA), and the time to
slice a 16K causal BlockMask for one query block.

--gpt-fast: the per-token cost of gpt-fast's idiom against a captured position, flexc only (issue 28):
B=2, Hq=8, Hkv=2 (enable_gqa), cache 1024, D=64, fp32, one row, positions advancing across key
blocks, with 1 and 2 threads:

- captured: one mask_mod, built once, reading a 0-d position tensor advanced in place; one
  BlockMask for the query row listing every key block (built once);
- captured + slice: the same mask_mod, with the BlockMask sliced each step as gpt-fast does;
- idiom int / idiom tensor: gpt-fast's idiom, ``block_mask[:, :, input_pos // 128]`` and a new
  closure each step, ``q_idx + offset >= kv_idx`` with ``offset`` a Python int / a fresh 0-d tensor.

Every form is checked against float64 dense attention at several positions before timing.

Usage: python bench/decode.py [--quick] [--no-compile] [--breakdown] [--rounds N] [--device cuda]
       python bench/decode.py --gpt-fast [--rounds N] [--cpu-time]
  --quick: only cache 4096 with H=8 (the issue's acceptance case)
  --cpu-time: time.thread_time instead of wall time, for a loaded machine
  --breakdown: what the slicing idiom, flexc's call and a compiled torch step each add to SDPA's call
  --device cuda: the same table on a GPU in bf16 (flexc's split-KV Triton decode kernel); also
                 reached as ``python bench/gpu.py --decode``
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
import warnings
from typing import Callable

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's flexc, and the dense reference

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import flex_attention as tfa  # noqa: E402

import flexc  # noqa: E402
from reference import dense_attention  # noqa: E402

WINDOW = 1024


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def shifted(mask_mod, offset):
    """gpt-fast's get_mask_mod: query row 0 sits at ``offset`` in the cache."""
    def mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    return mask


CLOCK = time.perf_counter  # --cpu-time: time.thread_time, this thread's CPU time


def per_call(fn, calls: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = CLOCK()
    for _ in range(calls):
        fn()
    sync()
    return (CLOCK() - start) / calls


def interleaved(fns: dict, rounds: int, calls: int) -> dict:
    """Median seconds per call of each function, measured in alternating rounds."""
    for fn in fns.values():  # warm up (and compile)
        for _ in range(3):
            fn()
    # the first full collection after importing torch takes ~0.1 s: done now, not inside some round
    gc.collect()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(per_call(fn, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def decode_case(S: int, Hq: int, Hkv: int, mask_mod, compile_torch: bool, rounds: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32, breakdown: bool = False) -> dict:
    D = 64
    q = torch.randn(1, Hq, 1, D, device=device, dtype=dtype)
    k, v = (torch.randn(1, Hkv, S, D, device=device, dtype=dtype) for _ in range(2))
    gqa = Hq != Hkv
    pos = S - 1
    input_pos = torch.tensor([pos], device=device)
    ours = flexc.create_block_mask(mask_mod, None, None, S, S, device=device)
    theirs = tfa.create_block_mask(mask_mod, None, None, S, S, device=device)
    lo = max(0, pos - WINDOW + 1) if mask_mod is sliding else 0

    def sliced(block_mask, input_pos):  # the idiom, on either library's BlockMask
        mask = block_mask[:, :, input_pos // 128]
        mask.mask_mod, mask.seq_lengths = shifted(mask_mod, input_pos[0]), (1, S)
        return mask

    def flexc_step_of(q, k, v, input_pos):
        return flexc.flex_attention(q, k, v, block_mask=sliced(ours, input_pos), enable_gqa=gqa)

    def flexc_step():
        return flexc_step_of(q, k, v, input_pos)

    def torch_step(q, k, v, input_pos):
        return tfa.flex_attention(q, k, v, block_mask=sliced(theirs, input_pos), enable_gqa=gqa)

    def sdpa_step():
        return F.scaled_dot_product_attention(q, k[:, :, lo:pos + 1], v[:, :, lo:pos + 1], enable_gqa=gqa)

    fns = {"flexc": flexc_step, "torch eager": lambda: torch_step(q, k, v, input_pos), "SDPA": sdpa_step}
    if breakdown:  # the user's idiom on flexc's mask, then SDPA: what flexc's call adds is flexc - this
        def idiom_then_sdpa():
            sliced(ours, input_pos)
            return sdpa_step()
        fns["idiom + SDPA"] = idiom_then_sdpa
    if compile_torch:
        for name, step in (("torch compiled", torch_step), ("flexc compiled", flexc_step_of)):
            compiled = torch.compile(step)
            try:
                compiled(q, k, v, input_pos)
                fns[name] = functools.partial(compiled, q, k, v, input_pos)
            except Exception as e:  # report, keep measuring the rest
                print(f"  {name}: torch.compile failed: {type(e).__name__}: {str(e)[:120]}")
    # every implementation agrees before anything is timed
    ref = sdpa_step()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for name, fn in fns.items():
        torch.testing.assert_close(fn(), ref, atol=tol, rtol=tol, msg=f"{name} differs from SDPA")
    # rounds of tens of milliseconds on the CPU: shorter ones (a few calls) let one preemption or
    # collection decide a round's time, and the medians then favoured whichever ran in quiet rounds
    calls = 100 if device == "cuda" else max(5, min(200, 40_000_000 // (S * Hq * 8)))
    return interleaved(fns, rounds, calls)


def host_overhead(rounds: int) -> dict:
    q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    fns = {"flexc": lambda: flexc.flex_attention(q, k, v),
           "SDPA": lambda: F.scaled_dot_product_attention(q, k, v)}
    torch.testing.assert_close(fns["flexc"](), fns["SDPA"](), atol=2e-5, rtol=2e-5)
    return interleaved(fns, rounds, 50)


def slice_time(rounds: int) -> float:
    bm = flexc.create_block_mask(causal, None, None, 16384, 16384)
    rows = iter(range(10**9))
    return interleaved({"slice": lambda: bm[:, :, next(rows) % 128]}, rounds, 200)["slice"]


def gpt_fast_forms(B: int = 2, Hq: int = 8, Hkv: int = 2, S: int = 1024, D: int = 64, block: int = 128,
                   first: int = 500) -> tuple[dict, Callable]:
    """``({form: step(pos)}, reference(pos))`` for :func:`gpt_fast_ratio`: each step attends one new
    query row at cache position ``pos``; ``reference`` is float64 dense attention there."""
    q = torch.randn(B, Hq, 1, D)
    k, v = (torch.randn(B, Hkv, S, D) for _ in range(2))
    parent = flexc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=block)
    position = torch.tensor(first)  # the captured form's position, advanced in place

    def captured_mod(b, h, q_idx, kv_idx):
        return q_idx + position >= kv_idx

    n = S // block  # one query row listing every key block as partial: the mask_mod decides
    whole = flexc.BlockMask.from_kv_blocks(torch.full((1, 1, 1), n, dtype=torch.int32),
                                           torch.arange(n, dtype=torch.int32).view(1, 1, 1, n),
                                           BLOCK_SIZE=block, mask_mod=captured_mod, seq_lengths=(1, S))

    def attend(mask):
        return flexc.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)

    def captured(pos):
        position.fill_(pos)
        return attend(whole)

    input_pos = torch.tensor([first])  # gpt-fast's, advanced in place each step

    def captured_slice(pos):
        position.fill_(pos)
        input_pos.fill_(pos)
        mask = parent[:, :, input_pos // block]
        mask.mask_mod, mask.seq_lengths = captured_mod, (1, S)
        return attend(mask)

    def idiom(offset, pos):
        def causal_offset(b, h, q_idx, kv_idx):  # a new closure every step, as gpt-fast makes it
            return q_idx + offset >= kv_idx
        input_pos.fill_(pos)
        mask = parent[:, :, input_pos // block]
        mask.mask_mod, mask.seq_lengths = causal_offset, (1, S)
        return attend(mask)

    def reference(pos):
        return dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + pos >= kv_idx)[0]

    forms = {"captured": captured, "captured + slice": captured_slice,
             "idiom int": lambda pos: idiom(pos, pos), "idiom tensor": lambda pos: idiom(torch.tensor(pos), pos)}
    return forms, reference


def gpt_fast_ratio(rounds: int, threads: int, steps: int = 100) -> dict:
    """Median seconds per token of each :func:`gpt_fast_forms` form, ``steps`` positions a round."""
    torch.set_num_threads(threads)
    forms, reference = gpt_fast_forms()
    first, S = 500, 1024
    for pos in (first, 511, 512, 513, 640, S - 1):  # inside a block, either side of a boundary, the end
        ref = reference(pos)
        for name, step in forms.items():
            torch.testing.assert_close(step(pos).double(), ref, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"{name} at position {pos}: {m}")
    positions = [first + i % (S - first) for i in range(steps)]

    def run(step):
        return lambda: [step(pos) for pos in positions]

    times = interleaved({name: run(step) for name, step in forms.items()}, rounds, 1)
    return {name: t / steps for name, t in times.items()}


def print_gpt_fast(rounds: int) -> None:
    clock = "CPU time of this thread" if CLOCK is time.thread_time else "wall time"
    print(f"gpt-fast decoding, flexc: ms per token ({clock}, median of {rounds} interleaved rounds of 100 "
          f"steps), B=2 Hq=8 Hkv=2 cache 1024 D=64 fp32, positions 500..599")
    forms = ("captured", "captured + slice", "idiom int", "idiom tensor")
    print(f"{'threads':>7} | " + " ".join(f"{f:>16}" for f in forms) + " | idiom int / captured, tensor / captured")
    for threads in (1, 2):
        t = gpt_fast_ratio(rounds, threads)
        base = t["captured"]
        print(f"{threads:>7} | " + " ".join(f"{t[f] * 1e3:15.3f}m" for f in forms)
              + f" | {t['idiom int'] / base:.2f}x, {t['idiom tensor'] / base:.2f}x (target <= 1.2x)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only cache 4096 with H=8")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the slicing idiom followed by SDPA, and print per row what the idiom, "
                             "flexc's call and a compiled torch step each add to SDPA's call (microseconds)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="measure this thread's CPU time instead of wall time (on a loaded machine: what a "
                             "call costs without the waits for a core; one thread only)")
    parser.add_argument("--gpt-fast", action="store_true",
                        help="only gpt-fast's idiom against a captured position (flexc, 1 and 2 threads)")
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.thread_time
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    if args.gpt_fast:
        print_gpt_fast(args.rounds)
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/decode.py --device cuda: no CUDA device on this machine; nothing was run.")
            return
        dtype = torch.bfloat16
        print(f"per-call time on {torch.cuda.get_device_name()}, one query row, bf16, D=64 "
              f"(medians of interleaved rounds; flexc runs its split-KV Triton decode kernel)")
    else:
        dtype = torch.float32
        torch.set_num_threads(1)
        print(f"per-call {'CPU' if args.cpu_time else 'wall'} time, one query row, fp32, D=64, one thread "
              f"(medians of interleaved rounds)")
    print(f"{'cache':>6} {'Hq/Hkv':>7} {'mask':>8} | {'flexc':>9} {'SDPA':>9} {'eager':>9} {'compiled':>9}"
          f" | {'/SDPA':>6} {'/eager':>7} {'/compiled':>9} | {'flexc comp':>10} {'/compiled':>9}")
    sizes = [4096] if args.quick else [1024, 4096, 16384]
    heads = [(8, 8)] if args.quick else [(8, 8), (32, 8)]
    for S in sizes:
        for Hq, Hkv in heads:
            for mask_mod in (causal, sliding):
                t = decode_case(S, Hq, Hkv, mask_mod, not args.no_compile, args.rounds, args.device, dtype,
                                args.breakdown)
                ms = lambda name: f"{t[name] * 1e3:8.3f}m" if name in t else f"{'n/a':>9}"
                ratio = lambda name, of="flexc": f"{t[of] / t[name]:.2f}x" if name in t and of in t else "n/a"
                print(f"{S:>6} {f'{Hq}/{Hkv}':>7} {mask_mod.__name__:>8} | {ms('flexc')} {ms('SDPA')} "
                      f"{ms('torch eager')} {ms('torch compiled')} | {ratio('SDPA'):>6} {ratio('torch eager'):>7} "
                      f"{ratio('torch compiled'):>9} | {ms('flexc compiled'):>10} "
                      f"{ratio('torch compiled', 'flexc compiled'):>9}")
                if "idiom + SDPA" in t:
                    over = lambda a, b: f"{(t[a] - t[b]) * 1e6:.0f} us" if a in t and b in t else "n/a"
                    print(f"{'':>24}   over SDPA's call: the idiom {over('idiom + SDPA', 'SDPA')}, then flexc's call "
                          f"{over('flexc', 'idiom + SDPA')}; a compiled torch step {over('torch compiled', 'SDPA')}")
    if args.device == "cuda":
        return
    t = host_overhead(args.rounds)
    print(f"L=128, no mask, H=8: flexc {t['flexc'] * 1e3:.3f} ms, SDPA {t['SDPA'] * 1e3:.3f} ms, "
          f"ratio {t['flexc'] / t['SDPA']:.2f}x (target <= 2x)")
    print(f"slicing a 16K causal BlockMask for one query block: {slice_time(args.rounds) * 1e3:.4f} ms "
          f"(target <= 0.1 ms)")


if __name__ == "__main__":
    main()
