"""GPU benchmark: flexc's generated Triton kernels vs torch.compile(flex_attention) vs SDPA.

    python bench/gpu.py                 # correctness for 6 mods, then the TFLOP/s table (< 10 minutes)
    python bench/gpu.py --quick         # D=64, L=1K and 4K only
    python bench/gpu.py --budget 300    # stop starting new cells after 300 s
    python bench/gpu.py --backward      # forward + backward: gradients checked, then training TFLOP/s
    python bench/gpu.py --decode        # decoding (one query row, KV cache 1K..16K): bench/decode.py on the GPU

1. Correctness: six mods (full, causal, sliding window, document, ALiBi, soft-capping + causal) at
   L=2048 plus a ragged causal case (L=1000, D=96), bf16; flexc, torch's compiled FlexAttention and
   SDPA (where it can express the mod) are each compared with a float32 dense reference.
2. Speed: forward TFLOP/s, bf16, D = 64 and 128, L = 1K..16K, B*L = 16K tokens, 16 heads, for the
   causal / sliding-window / document / ALiBi mods. FLOPs count only allowed (query, key) pairs
   (4 * D per pair), the same for every column, so SDPA, which computes masked pairs too, is
   charged for what it wastes.

With ``--backward`` the correctness part also compares dq, dk, dv with the float32 reference's
gradients, and the table times one forward plus one backward (flexc's generated backward kernel,
torch's compiled FlexAttention backward, SDPA's backward), counting 14 * D FLOPs per allowed pair
(4 forward, 10 backward: the recomputed scores, dP, dV, dQ and dK products).

Needs a CUDA GPU; on a machine without one it says so and exits with status 0. Every cell is
guarded: a failure prints one line and the table continues; a watchdog prints what was measured
if the time budget runs out.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WINDOW = 256
HEADS = 16
TOKENS = 16384
MASK_NAMES = ("causal", "sliding", "document", "alibi")


class OutOfTime(Exception):
    pass


# ---- the mods -----------------------------------------------------------------------------

def make_mods(L: int, H: int, device: str, seed: int = 0) -> dict:
    """name -> (score_mod or None, mask_mod or None, sdpa_kind) for one sequence length."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < L:
        n = int(torch.randint(max(1, L // 16), max(2, L // 3), (), generator=g))
        lengths.append(min(n, L - total))
        total += lengths[-1]
    document_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H).to(device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def document(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    return {
        "full": (None, None, "full"),
        "causal": (None, causal, "causal"),
        "sliding": (None, sliding, "mask"),
        "document": (None, document, "mask"),
        "alibi": (alibi, None, "bias"),
        "softcap_causal": (softcap, causal, None),
        "_lengths": lengths,
    }


def allowed_pairs(name: str, L: int, lengths: list[int]) -> int:
    if name == "causal":
        return L * (L + 1) // 2
    if name == "sliding":
        return sum(min(q, WINDOW) + 1 for q in range(L))
    if name == "document":
        return sum(n * (n + 1) // 2 for n in lengths)
    return L * L


def index_tensors(L: int, H: int, device: str):
    ar = lambda n: torch.arange(n, device=device)
    return ar(1).view(1, 1, 1, 1), ar(H).view(1, H, 1, 1), ar(L).view(1, 1, L, 1), ar(L).view(1, 1, 1, L)


def sdpa_inputs(kind: str, score_mod, mask_mod, L: int, H: int, dtype, device: str):
    """``(attn_mask, is_causal)`` expressing the mod for SDPA, or None when it cannot."""
    if kind == "full":
        return None, False
    if kind == "causal":
        return None, True
    b, h, q, kv = index_tensors(L, H, device)
    if kind == "mask":
        return mask_mod(b, h, q, kv), False
    if kind == "bias":
        zero = torch.zeros((), device=device)
        return score_mod(zero, b, h, q, kv).to(dtype), False
    raise ValueError(kind)


def dense_reference(q, k, v, score_mod, mask_mod):
    """float32 attention by dense evaluation: ``(out, lse)``."""
    B, H, L, D = q.shape
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    b, h, qi, kv = index_tensors(L, H, q.device)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    if score_mod is not None:
        scores = torch.broadcast_to(score_mod(scores, b, h, qi, kv), scores.shape).float()
    if mask_mod is not None:
        scores = scores.masked_fill(~torch.broadcast_to(mask_mod(b, h, qi, kv), scores.shape), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v.float(), lse


# ---- timing -------------------------------------------------------------------------------

def bench_ms(fn) -> float:
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    except Exception:  # fall back to CUDA events if do_bench's signature differs
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:160]


# ---- the two parts ------------------------------------------------------------------------

def _grad_errors(q, k, v, out, ref) -> float:
    """Largest |error| of flexc's dq, dk, dv against the float32 reference's, for one random dO."""
    grad_out = torch.randn_like(out)
    mine = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.float(), retain_graph=True)  # ref serves twice
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(mine, want))


def check_correctness(flexc, torch_flex, compiled_flex, device: str, L_main: int = 2048,
                      ragged: tuple[int, int] = (1000, 96), backward: bool = False) -> bool:
    print("\n== correctness (bf16; max |error| against a float32 dense reference) ==")
    if backward:
        print("(with gradients: 'flexc grad' is the largest |error| of dq, dk, dv; torch's for comparison)")
    print(f"{'mod':<16} {'L':>5} {'D':>4} {'flexc out':>10} {'flexc lse':>10} {'torch flex':>11} {'SDPA':>9}  verdict")
    ok_all = True
    cases = [(name, L_main, 64) for name in ("full", "causal", "sliding", "document", "alibi", "softcap_causal")]
    cases.append(("causal", *ragged))  # ragged length, non-power-of-two head dim
    for name, L, D in cases:
        try:
            B, H = 2, 4
            mods = make_mods(L, H, device)
            score_mod, mask_mod, sdpa_kind = mods[name]
            gen = torch.Generator(device=device).manual_seed(1)
            q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16, generator=gen)
                       .requires_grad_(backward) for _ in range(3))
            ref, ref_lse = dense_reference(q, k, v, score_mod, mask_mod)
            bm = flexc.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
            out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                                            kernel_options={"BACKEND": "TRITON"})
            err = (out.float() - ref).abs().max().item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
            tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
            t_err = (compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm).float() - ref).abs().max().item()
            s_err = float("nan")
            if sdpa_kind is not None:
                mask, is_causal = sdpa_inputs(sdpa_kind, score_mod, mask_mod, L, H, q.dtype, device)
                s_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
                s_err = (s_out.float() - ref).abs().max().item()
            ok = err <= max(2e-2, 2 * t_err) and lse_err <= 2e-2 and not out.isnan().any().item()
            grads = ""
            if backward:
                g_err = _grad_errors(q, k, v, out, ref)
                t_out = compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)
                t_g_err = _grad_errors(q, k, v, t_out, ref)
                ok = ok and g_err <= max(5e-2, 2 * t_g_err)
                grads = f" flexc grad {g_err:.2e} torch grad {t_g_err:.2e}"
            ok_all &= ok
            print(f"{name:<16} {L:>5} {D:>4} {err:>10.2e} {lse_err:>10.2e} {t_err:>11.2e} {s_err:>9.2e}  "
                  f"{'PASS' if ok else 'FAIL'}{grads}")
        except OutOfTime:
            raise
        except Exception as e:
            ok_all = False
            print(f"{name:<16} {L:>5} {D:>4}  ERROR {short_error(e)}")
    return ok_all


def run_cell(flexc, torch_flex, compiled_flex, name: str, L: int, D: int, device: str, deadline: float,
             backward: bool = False) -> dict:
    B = max(1, TOKENS // L)
    mods = make_mods(L, HEADS, device)
    score_mod, mask_mod, sdpa_kind = mods[name]
    flops = (14 if backward else 4) * B * HEADS * D * allowed_pairs(name, L, mods["_lengths"])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, HEADS, L, D, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(backward) for _ in range(3))
    row = {"B": B}

    def timed(forward):
        if not backward:
            return forward
        grad_out = torch.randn_like(q)
        return lambda: torch.autograd.grad(forward(), (q, k, v), grad_out)

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    try:
        bm = flexc.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
        fn = timed(lambda: flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                kernel_options={"BACKEND": "TRITON"}))
        t0 = time.time()
        fn()
        sync(device)
        row["flexc_first_s"] = time.time() - t0
        row["flexc"] = tflops(bench_ms(fn))
    except OutOfTime:
        raise
    except Exception as e:
        row["flexc"] = short_error(e)
    if time.time() < deadline - 45:  # a first compile of torch's kernel can take half a minute
        try:
            tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
            fn = timed(lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm))
            fn()
            row["torch"] = tflops(bench_ms(fn))
        except OutOfTime:
            raise
        except Exception as e:
            row["torch"] = short_error(e)
    else:
        row["torch"] = "skipped (time)"
    try:
        mask_bytes = L * L * (2 * HEADS if sdpa_kind == "bias" else 1)
        if mask_bytes > 4 << 30:
            row["sdpa"] = "skipped (mask > 4 GB)"
        else:
            mask, is_causal = sdpa_inputs(sdpa_kind, score_mod, mask_mod, L, HEADS, q.dtype, device)
            fn = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                is_causal=is_causal))
            row["sdpa"] = tflops(bench_ms(fn))
            del mask
    except OutOfTime:
        raise
    except Exception as e:
        row["sdpa"] = short_error(e)
    return row


def run_table(flexc, torch_flex, compiled_flex, device: str, dims, lengths, deadline: float,
              backward: bool = False) -> list:
    """One row per (D, L, mask): TFLOP/s of each implementation, or why it has none."""
    rows: list = []
    for D in dims:
        for L in lengths:
            for name in MASK_NAMES:
                if time.time() > deadline:
                    rows.append(((D, L, name), {"flexc": "skipped (time)"}))
                    continue
                try:
                    rows.append(((D, L, name), run_cell(flexc, torch_flex, compiled_flex, name, L, D, device,
                                                        deadline, backward)))
                except OutOfTime:
                    raise
                except Exception as e:  # e.g. out of memory: report it, keep going
                    rows.append(((D, L, name), {"flexc": short_error(e)}))
                if torch.cuda.is_available():  # the cell's tensors died with its frame
                    torch.cuda.empty_cache()
    return rows


def fmt(x) -> str:
    return f"{x:8.1f}" if isinstance(x, float) else "       -"


def print_table(rows: list, backward: bool = False) -> None:
    what = "forward + backward" if backward else "forward"
    print(f"\n== {what} TFLOP/s (bf16, 16 heads, B*L = 16K tokens; allowed pairs only) ==")
    print(f"{'D':>4} {'L':>6} {'B':>3} {'mask':<9} {'flexc':>8} {'torch.compile(flex)':>20} {'SDPA':>8} "
          f"{'flexc/flex':>10} {'flexc 1st call s':>16}")
    notes = []
    for (D, L, name), row in rows:
        f, t, s = row.get("flexc"), row.get("torch"), row.get("sdpa")
        ratio = f"{f / t:10.2f}" if isinstance(f, float) and isinstance(t, float) else "         -"
        first = row.get("flexc_first_s")
        print(f"{D:>4} {L:>6} {row.get('B', ''):>3} {name:<9} {fmt(f)} {fmt(t):>20} {fmt(s)} {ratio} "
              f"{first if first is None else round(first, 2):>16}")
        for col in ("flexc", "torch", "sdpa"):
            if isinstance(row.get(col), str):
                notes.append(f"  D={D} L={L} {name} {col}: {row[col]}")
    if notes:
        print("notes:")
        print("\n".join(notes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=64, L=1K and 4K only")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds before no new cell starts (540)")
    ints = lambda text: tuple(int(x) for x in text.split(","))
    parser.add_argument("--dims", type=ints, default=(64, 128), help="head dims, comma-separated (64,128)")
    parser.add_argument("--lengths", type=ints, default=(1024, 2048, 4096, 8192, 16384),
                        help="sequence lengths, comma-separated (1024,...,16384)")
    parser.add_argument("--backward", action="store_true", help="check gradients and time forward + backward")
    parser.add_argument("--decode", action="store_true", help="the decoding table of bench/decode.py on this GPU")
    args = parser.parse_args(argv)
    if args.decode:  # one query row per head against a KV cache: flexc's split-KV decode kernel
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import decode

        decode.main(["--device", "cuda"] + (["--quick"] if args.quick else []))
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine; this benchmark needs an NVIDIA GPU. Nothing was run.")
        return 0
    start = time.time()
    deadline = start + args.budget

    def on_alarm(signum, frame):
        raise OutOfTime()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.budget + 50))  # hard stop: still leaves time to print the table

    try:
        import triton

        import flexc
        from torch.nn.attention import flex_attention as torch_flex
    except Exception:  # report a broken environment plainly rather than half a table
        traceback.print_exc()
        print("bench/gpu.py: could not import triton, flexc or torch's flex_attention (above); nothing was run.")
        return 1

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    compiled_flex = torch.compile(torch_flex.flex_attention)
    device = "cuda"
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"flexc kernels cached in {flexc.backends.triton_backend.cache_dir()}")

    ok = False
    rows: list = []
    try:
        ok = check_correctness(flexc, torch_flex, compiled_flex, device, backward=args.backward)
        dims = (64,) if args.quick else args.dims
        lengths = (1024, 4096) if args.quick else args.lengths
        rows = run_table(flexc, torch_flex, compiled_flex, device, dims, lengths, deadline, args.backward)
    except OutOfTime:
        print("\n(time budget exhausted: the table below is partial)")
    except Exception:
        traceback.print_exc()
    finally:
        signal.alarm(0)
    print_table(rows, args.backward)
    info = flexc.cache_info()
    print(f"\nflexc kernel cache: {info.misses} compiled, {info.hits} reused; total {time.time() - start:.0f} s; "
          f"correctness {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
