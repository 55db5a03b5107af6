"""GPU benchmark: flexc's generated Triton kernels vs torch.compile(flex_attention) vs SDPA.

    python bench/gpu.py                 # correctness for 6 mods, then the TFLOP/s table (< 10 minutes)
    python bench/gpu.py --quick         # D=64, L=1K and 4K only
    python bench/gpu.py --budget 300    # stop starting new cells after 300 s
    python bench/gpu.py --backward      # forward + backward: gradients checked, then training TFLOP/s
    python bench/gpu.py --decode        # decoding (one query row, KV cache 1K..16K): bench/decode.py on the GPU
    python bench/gpu.py --all --out gpu-results.md   # the prepared run (< 9 minutes), see below
    python bench/gpu.py --all --simulate sm_90       # the same logic on the CPU, no GPU, tiny sizes

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

``--all`` is the one prepared run for a GPU machine: seven parts, each within its share of the budget
(``--budget``, 450 s by default: correctness 90, capture 25, forward 100, forward+backward 140,
decode 55, host time 20, block-mask build 20, scaled to the budget; time a part leaves unused goes
to the parts after it). Every case runs in its own guard: a failure (an exception, or a result
that differs from its reference) prints one ``FAIL case: Type: first line (at file:line)`` line,
is counted, and the next case starts. A part whose share is spent stops its loop and says how many
cases it did not run; one still busy 60 s past its share is stopped by a watchdog. Then:

1. correctness: every mask_mod of tests/catalogue.py once and three score_mods alone (ALiBi with
   learnable slopes, soft-capping, a learnable relative-position bias; the score_mods also take
   turns beside the masks), L=512, D=64, GQA 4/2, against float64 dense: the forward with lse, and
   in turn the backward (dq, dk, dv, the captured tensors' gradients) or decoding with 1 or 16
   query rows through gpt-fast's idiom (``block_mask[:, :, input_pos // BLOCK]``, a new mask_mod
   capturing ``input_pos[0]``, input_pos advanced in place); dtypes alternate (see check_plan).
2. capture: a decoding step (cache write, sliced BlockMask, shifted ALiBi) captured in a
   ``torch.cuda.CUDAGraph`` and replayed with input_pos advanced in place, each replay against
   dense; then the step under ``torch.compile(mode="reduce-overhead")``.
3. forward and 4. forward+backward: ms and TFLOP/s of flexc and torch's compiled FlexAttention
   (SDPA beside causal), bf16, B*L = 16K, 16 heads, causal, sliding window 256, document, ALiBi +
   causal, soft-cap + causal, at D=128 and 64 and L=8192 then 1024 (``--dims``, ``--lengths``),
   flexc's output checked against torch's.
5. decode: one token per step, B=4, Hq=32, Hkv=8, KV cache 16K, 4K, 1K (``--decode-lengths``),
   causal and sliding window, each step captured in a CUDA graph (flexc's also with 4 warps).
6. host time: wall time per eager call (a small forward, a decoding step), flexc and torch compiled;
   the forward also with flexc's launches through Triton's ``JITFunction.run``
   (``FLEXC_COMPILED_LAUNCH=0``), whose output must equal the compiled launch's bit for bit.
7. block-mask build: a causal document mask (1000-token documents) at L=32K (both) and 128K (flexc).

Every table has a flexc/torch column: torch's time over flexc's (> 1: flexc faster). The tables
are printed and written as markdown to ``--out`` (gpu-results.md; rewritten after every part). The
last line is the summary: ``gpu.py summary: ok|FAILED; N passed, N failed (cases), N not run
(per part); flexc/torch speed: worst and geomean per table; tables in FILE; seconds``. Status 1
when a case failed, else 0. ``--parts`` runs some parts only; ``--fail-case NAME`` makes one case
fail, to prove the run goes on.

``--simulate sm_90`` runs every part on the CPU: CPU tensors take the GPU's host decisions,
kernels run in Triton's interpreter, every problem is tiny (L=128, D=64), CUDA graphs are eager
calls, torch's FlexAttention runs eagerly (it has no CPU backward): the times are no measurement,
the logic is the GPU run's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import signal
import subprocess
import sys
import threading
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
        "alibi_causal": (alibi, causal, None),
        "softcap_causal": (softcap, causal, None),
        "_lengths": lengths,
    }


def allowed_pairs(name: str, L: int, lengths: list[int]) -> int:
    if name == "causal" or name.endswith("_causal"):
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
             backward: bool = False, *, sdpa: bool = True, check: bool = False, torch_backward: bool = True,
             timer=None, tokens: int | None = None, heads: int | None = None, margin: float = 45.0,
             first_only: bool = False) -> dict:
    """One (mask, L, D) cell: ``flexc``, ``torch``, ``sdpa`` TFLOP/s (or why none, a string), their
    ``*_ms``, ``flexc_first_s`` and ``B``. flexc's own failure is also kept as ``flexc_error`` (the
    exception); with ``check``, so is a flexc output differing from torch's by more than 2e-2 (a
    WrongResult). ``timer`` (default bench_ms) gives ms per call (``first_only``: the first call's
    time stands for it, as under simulation, where times are no measurement); torch is skipped when
    fewer than ``margin`` seconds are left, or for the backward when ``torch_backward`` is False."""
    timer = timer or bench_ms
    H = heads or HEADS
    B = max(1, (tokens or TOKENS) // L)
    mods = make_mods(L, H, device)
    score_mod, mask_mod, sdpa_kind = mods[name]
    flops = (14 if backward else 4) * B * H * D * allowed_pairs(name, L, mods["_lengths"])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(backward) for _ in range(3))
    row = {"B": B}
    outputs, forwards = {}, {}  # the first call's output (forward only), the forward (for the check)

    def timed(forward):
        if not backward:
            return forward
        grad_out = torch.randn_like(q)
        return lambda: torch.autograd.grad(forward(), (q, k, v), grad_out)

    def measure(col: str, forward) -> float:
        """The first call (which compiles), then the timing: the first call's seconds."""
        t0 = time.time()
        result = timed(forward)()
        sync(device)
        first = time.time() - t0
        if not backward:
            outputs[col] = result
        forwards[col] = forward
        ms = first * 1e3 if first_only else timer(timed(forward))
        row[f"{col}_ms"], row[col] = ms, flops / (ms * 1e-3) / 1e12
        return first

    try:
        bm = flexc.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
        row["flexc_first_s"] = measure("flexc", lambda: flexc.flex_attention(q, k, v, score_mod=score_mod,
                                                                             block_mask=bm, kernel_options=TRITON))
    except OutOfTime:
        raise
    except Exception as e:
        row["flexc"], row["flexc_error"] = short_error(e), e
    if backward and not torch_backward:
        row["torch"] = "n/a (CPU)"
    elif time.time() < deadline - margin:  # a first compile of torch's kernel can take half a minute
        try:
            tbm = torch_flex.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
            measure("torch", lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm))
        except OutOfTime:
            raise
        except Exception as e:
            row["torch"] = short_error(e)
    else:
        row["torch"] = "skipped (time)"
    if check and "flexc_ms" in row and "torch_ms" in row:
        with torch.no_grad():
            got, want = (outputs[col] if col in outputs else forwards[col]() for col in ("flexc", "torch"))
        error = relative_error(got, want)
        if not error <= 2e-2:
            row["flexc_error"] = WrongResult(f"flexc's output differs from torch's by {error:.1e} "
                                             f"(over max(1, max|torch's|))")
    if not sdpa:
        return row
    try:
        mask_bytes = L * L * (2 * H if sdpa_kind == "bias" else 1)
        if sdpa_kind is None:
            row["sdpa"] = "n/a (not expressible)"
        elif mask_bytes > 4 << 30:
            row["sdpa"] = "skipped (mask > 4 GB)"
        else:
            mask, is_causal = sdpa_inputs(sdpa_kind, score_mod, mask_mod, L, H, q.dtype, device)
            ms = timer(timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                      is_causal=is_causal)))
            row["sdpa_ms"], row["sdpa"] = ms, flops / (ms * 1e-3) / 1e12
            del mask
    except OutOfTime:
        raise
    except Exception as e:
        row["sdpa"] = short_error(e)
    return row


def run_table(flexc, torch_flex, compiled_flex, device: str, dims, lengths, deadline: float,
              backward: bool = False, names=MASK_NAMES, rows: list | None = None) -> list:
    """One row per (D, L, mask), appended to ``rows``: TFLOP/s of each implementation, or why it has none."""
    rows = [] if rows is None else rows
    for D in dims:
        for L in lengths:
            for name in names:
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
        first = row.get("flexc_first_s")  # absent for a skipped or failed cell
        first = "-" if first is None else f"{first:.2f}"
        print(f"{D:>4} {L:>6} {row.get('B', ''):>3} {name:<9} {fmt(f)} {fmt(t):>20} {fmt(s)} {ratio} {first:>16}")
        for col in ("flexc", "torch", "sdpa"):
            if isinstance(row.get(col), str):
                notes.append(f"  D={D} L={L} {name} {col}: {row[col]}")
    if notes:
        print("notes:")
        print("\n".join(notes))


# ---- --all: the prepared GPU run ----------------------------------------------------------------

ALL_BUDGET = 450.0  # seconds for the whole --all run: under 8 minutes with Python's start and the last prints
# Each part's share of the budget, in seconds at the default budget (scaled to --budget). A part that
# ends early passes its time on to the parts after it; a part that spends its share stops its loop
# (its remaining cases count as not run) and the next part starts.
PART_SHARES = {"correctness": 90, "capture": 25, "forward": 100, "forward+backward": 140, "decode": 55,
               "host time": 20, "block-mask build": 20}
WATCHDOG_GRACE = 60.0  # seconds a part may run past its share (a compile in flight) before it is stopped
TABLE_MASKS = ("causal", "sliding", "document", "alibi_causal", "softcap_causal")
TRITON = {"BACKEND": "TRITON"}
# max |error| over max(1, max |reference|), against float64 dense evaluation of the same inputs
# (gradients: at the returned output's delta, see reference_grads). Under simulation (every case
# at L=128, a few at 512) bf16 errors were at most 1.0e-2, fp32 ones at most 6.4e-6.
TOLERANCE = {torch.bfloat16: {"out": 2e-2, "lse": 1e-2, "grad": 5e-2},
             torch.float32: {"out": 1e-4, "lse": 1e-4, "grad": 1e-3}}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
DECODE_ROWS = (1, 16)
# the decoding table's problem: gpt-fast's shapes, GQA 32/8, so one token is the 16-row tile
DECODE_BATCH, DECODE_HQ, DECODE_HKV, DECODE_WINDOW = 4, 32, 8, 1024


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each part's problems are: a GPU's, or the simulation's tiny ones."""

    check_length: int  # correctness: L (D=64, B=2, Hq=4, Hkv=2)
    dims: tuple  # the tables' and decoding's head dims
    lengths: tuple  # the forward and forward+backward tables' L (in this order), B*L = tokens
    tokens: int
    heads: int
    decode_lengths: tuple  # decoding: S
    decode_heads: tuple  # decoding: (B, Hq, Hkv)
    host_calls: int
    host_forward: tuple  # host time of one forward call: (B, H, L, D), causal
    host_decode: tuple  # host time of one decoding step: (B, H, S, D)
    build_lengths: tuple  # block-mask build, document mask: L
    build_torch_max: int  # torch's build timed up to this L (its dense mask is L*L bytes)
    document: int  # tokens per document in the block-mask build


GPU_SIZES = Sizes(check_length=512, dims=(128, 64), lengths=(8192, 1024), tokens=TOKENS, heads=HEADS,
                  decode_lengths=(16384, 4096, 1024), decode_heads=(DECODE_BATCH, DECODE_HQ, DECODE_HKV),
                  host_calls=200, host_forward=(1, 8, 256, 64), host_decode=(4, 32, 4096, 128),
                  build_lengths=(32768, 131072), build_torch_max=32768, document=1000)
# under simulation the kernels run in Triton's interpreter: every part's problem is tiny
SIMULATED_SIZES = Sizes(check_length=128, dims=(64,), lengths=(128,), tokens=128, heads=2,
                        decode_lengths=(256,), decode_heads=(1, 4, 2), host_calls=1,
                        host_forward=(1, 2, 128, 64), host_decode=(1, 2, 256, 64), build_lengths=(1024,),
                        build_torch_max=1024, document=100)


class WrongResult(Exception):
    """A result differs from its reference (the message says by how much)."""


class ForcedFailure(RuntimeError):
    """The failure --fail-case injects into one case, to prove that the run goes on."""


class CaseFailed(Exception):
    """A case failed but measured something: ``cause`` is the failure, ``row`` what was measured."""

    def __init__(self, cause: BaseException, row: dict):
        super().__init__(str(cause))
        self.cause, self.row = cause, row


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:240] if text else ""


def raised_at(e: BaseException) -> str:
    """``path:line`` of the innermost frame that raised ``e`` (relative to the repository)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    path = os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename
    return f"{path}:{frame.lineno}"


class Run:
    """What --all has done: each part's cases passed, failed and not run, every failure (case,
    exception type, first line of its message, where it was raised), the baselines' errors (notes,
    not failures) and each part's table."""

    def __init__(self, fail_case: str | None = None):
        self.counts: dict = {}  # part -> {"passed": n, "failed": n, "not run": n}
        self.failures: list = []  # (case, type name, first line, where)
        self.notes: dict = {}  # part -> lines
        self.stops: dict = {}  # part -> why it stopped before its last case
        self.sections: dict = {}  # part -> (title, columns, rows of strings) or (title, None, lines)
        self.stats: dict = {}  # part -> (label, row) pairs for the flexc/torch ratios
        self.took: dict = {}  # part -> seconds
        self.fail_case, self.fail_case_seen = fail_case, False

    def count(self, part: str, outcome: str, n: int = 1) -> None:
        counts = self.counts.setdefault(part, {"passed": 0, "failed": 0, "not run": 0})
        counts[outcome] += n

    def note(self, part: str, text: str) -> None:
        self.notes.setdefault(part, []).append(text)

    def fail(self, part: str, case: str, e: BaseException) -> None:
        where = "" if isinstance(e, (WrongResult, ForcedFailure)) else raised_at(e)
        self.failures.append((case, type(e).__name__, first_line(e), where))
        self.count(part, "failed")
        print(f"FAIL {case}: {type(e).__name__}: {first_line(e)}" + (f" (at {where})" if where else ""), flush=True)

    def attempt(self, part: str, case: str, fn):
        """``fn()`` in its own guard: its result when it passes; when it fails, the failure is counted
        and listed, and the result is what it measured (CaseFailed's row) or None."""
        try:
            if case == self.fail_case:
                self.fail_case_seen = True
                raise ForcedFailure(f"forced by --fail-case {case!r}")
            result = fn()
        except OutOfTime:
            raise
        except CaseFailed as e:
            self.fail(part, case, e.cause)
            return e.row
        except Exception as e:
            self.fail(part, case, e)
            return None
        self.count(part, "passed")
        return result

    def stop(self, part: str, left: list, why: str) -> None:
        self.count(part, "not run", len(left))
        self.stops[part] = f"{why}; {len(left)} case{'s' if len(left) != 1 else ''} not run" + (
            f" ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})" if left else "")
        print(f"({part}: {self.stops[part]})", flush=True)

    def totals(self) -> dict:
        return {key: sum(c[key] for c in self.counts.values()) for key in ("passed", "failed", "not run")}


def now() -> float:
    return time.monotonic()


def run_cases(run: Run, part: str, cases: list, deadline: float) -> dict:
    """Runs ``cases`` (``(name, fn)`` pairs) each in its guard until the part's share is spent
    (``deadline``): {name: result} of the cases that ran (None for a failure without a row)."""
    results: dict = {}
    names = [name for name, _ in cases]
    try:
        for name, fn in cases:
            if now() > deadline:
                run.stop(part, names[len(results):], "its share of the budget is spent")
                break
            results[name] = run.attempt(part, name, fn)
            if torch.cuda.is_available():  # the case's tensors died with it
                torch.cuda.empty_cache()
    except OutOfTime:
        left = names[len(results):]
        run.stop(part, left, f"stopped by the watchdog {WATCHDOG_GRACE:g} s past its share"
                             + (f", in {left[0]}" if left else ""))
    return results


@contextlib.contextmanager
def watchdog(seconds: float):
    """Raises OutOfTime in the main thread after ``seconds`` (a part stuck past its share)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise OutOfTime()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclasses.dataclass
class Context:
    """What the parts of --all share: the libraries, the device, the sizes and how to time."""

    flexc: object
    torch_flex: object
    baseline: object  # torch's flex_attention: compiled on a GPU, eager under simulation
    device: str
    simulated: bool
    sizes: Sizes
    case_limit: int | None = None
    compile_step: bool = True

    def timer(self, fn) -> float:
        """Milliseconds per call: do_bench on a GPU; under simulation the wall time of one call (the
        cells have made a first call already)."""
        if not self.simulated:
            return bench_ms(fn)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def dense64(q, k, v, score_mod=None, mask_mod=None):
    """float64 attention by dense evaluation on the inputs' device: ``(out, lse)``; GQA by
    repetition; rows with no allowed key give output 0 and lse ``-inf`` (and zero gradients).
    Differentiable in q, k, v and the mods' captured tensors."""
    B, Hq, L, E = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    dev = q.device
    kk, vv = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(E)
    b, h = torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    qi, kv = torch.arange(L, device=dev).view(1, 1, L, 1), torch.arange(S, device=dev).view(1, 1, 1, S)
    if score_mod is not None:
        scores = torch.broadcast_to(score_mod(scores, b, h, qi, kv), scores.shape).double()
    if mask_mod is not None:
        scores = scores.masked_fill(~torch.broadcast_to(mask_mod(b, h, qi, kv), scores.shape), float("-inf"))
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(torch.where(dead, 0.0, scores), dim=-1, keepdim=True)
    probs = torch.where(dead, 0.0, torch.exp(scores - lse))
    return probs @ vv, torch.where(dead, float("-inf"), lse).squeeze(-1)


def reference_grads(ref, ref_lse, out, grad_out, inputs) -> tuple:
    """float64 gradients of ``(ref * grad_out).sum()`` with respect to ``inputs``, taken, as every
    flash-attention backward (torch's too) takes them, at ``delta = rowsum(out * grad_out)`` of the
    output returned (16-bit: rounded) rather than of the exact one: d scores = p * (dp - delta).

    The term ``c * lse``, ``c = delta_exact - delta_returned``, adds ``p * c`` to d scores. Without
    it a gradient summed over every pair amplifies the output's rounding: ALiBi slopes' (weighted
    by q - kv) was 4.2e-2 off at L=512 in bf16, and equal to 5e-5 with it."""
    c = ((ref.detach() - out.detach().double()) * grad_out.double()).sum(-1)
    live = ~torch.isneginf(ref_lse)
    objective = (ref * grad_out.double()).sum() + (c * ref_lse.masked_fill(~live, 0.0))[live].sum()
    return torch.autograd.grad(objective, inputs)


def shifted_mask(mask_mod, offset):
    """gpt-fast's get_mask_mod: the query rows of a sliced BlockMask start at ``offset``."""
    def mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    return mask


def shifted_score(score_mod, offset):
    def score(s, b, h, q_idx, kv_idx):
        return score_mod(s, b, h, q_idx + offset, kv_idx)
    return score


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|) (NaN when got holds NaN)."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def expect_close(label: str, what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    error = relative_error(got, want)
    if not error <= tol:  # also NaN
        raise WrongResult(f"{label}: {what} max|error| {error:.2e} > {tol:.0e} (over max(1, max|float64 reference|))")
    return error


def expect_lse(label: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        raise WrongResult(f"{label}: lse is -inf (a row with no allowed key) at other rows than the reference's")
    live = ~torch.isneginf(want)
    return expect_close(label, "lse", got[live], want[live], tol) if live.any() else 0.0


def check_score_mods(H: int, L: int, device: str) -> dict:
    """name -> (score_mod, its trainable captured tensors): ALiBi with learnable slopes, soft-capping,
    and a learnable relative-position bias per head (a gather through a computed index)."""
    g = torch.Generator().manual_seed(2)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H).to(device).requires_grad_()
    table = (0.5 * torch.randn(H, 2 * L - 1, generator=g)).to(device).requires_grad_()

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + (L - 1)]

    return {"alibi": (alibi, [slopes]), "softcap": (soft_cap, []), "rel_bias": (relative_bias, [table])}


def check_cases(B: int, H: int, L: int, device: str) -> list:
    """``(label, mask_name, mask_mod, score_name)``: each score_mod alone, then every catalogue
    mask_mod, the score_mods taking turns beside them."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from catalogue import mask_catalogue

    cases = [(f"{s} (no mask)", "none", None, s) for s in ("alibi", "softcap", "rel_bias")]
    turns = ("alibi", "softcap", "rel_bias", None)
    for i, (name, mask_mod) in enumerate(mask_catalogue(B, H, L, L, device).items()):
        score = turns[i % len(turns)]
        cases.append((name + (f" + {score}" if score else ""), name, mask_mod, score))
    return cases


def _randn(shape, dtype, device, g):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


# ---- part: correctness against float64 dense ------------------------------------------------

EXTRA_CHECKS = ("backward", "decode 1 row", "decode 16 rows")


def check_plan(i: int, score_alone: int = 3) -> tuple:
    """``(dtype, decode_dtype, checks)`` of case ``i``: the score_mods alone take every check; each
    mask after them the forward with lse and one of backward / decoding with 1 / with 16 rows in
    turn (a cycle of 3 beside the score_mods' cycle of 4, so backward meets every score_mod); the
    dtypes alternate, decoding in the other one. Every mask once, not every product: 90 s on a GPU."""
    dtype, decode_dtype = (torch.bfloat16, torch.float32) if i % 2 == 0 else (torch.float32, torch.bfloat16)
    checks = EXTRA_CHECKS if i < score_alone else (EXTRA_CHECKS[(i - score_alone) % 3],)
    return dtype, decode_dtype, checks


def check_case(flexc, case, dtype, decode_dtype, L: int, device: str, scores: dict, checks=EXTRA_CHECKS, B=2,
               Hq=4, Hkv=2, E=64) -> str:
    """The forward with lse in ``dtype``, then ``checks``: the backward (dq, dk, dv, captured-tensor
    gradients) in ``dtype``, the gpt-fast decoding idiom with 1 or 16 query rows in ``decode_dtype``,
    each against float64 dense. Raises WrongResult at the first difference; returns the errors seen."""
    label, _, mask_mod, score_name = case
    score_mod, captured = scores[score_name] if score_name else (None, [])
    g = torch.Generator().manual_seed(sum(map(ord, label)))
    tol = TOLERANCE[dtype]
    where = f"{label} {DTYPE_NAMES[dtype]}"
    backward = "backward" in checks
    q = _randn((B, Hq, L, E), dtype, device, g).requires_grad_(backward)
    k, v = (_randn((B, Hkv, L, E), dtype, device, g).requires_grad_(backward) for _ in range(2))
    block_mask = flexc.create_block_mask(mask_mod, B, Hq, L, L, device=device) if mask_mod else None
    out, aux = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                    return_aux=flexc.AuxRequest(lse=True), kernel_options=TRITON)
    leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref, ref_lse = dense64(*leaves, score_mod, mask_mod)
    text = [f"out {expect_close(f'forward {where}', 'out', out, ref, tol['out']):.1e}",
            f"lse {expect_lse(f'forward {where}', aux.lse, ref_lse, tol['lse']):.1e}"]
    if backward:
        grad_out = _randn(out.shape, dtype, device, g)
        got = torch.autograd.grad(out, [q, k, v, *captured], grad_out)
        want = reference_grads(ref, ref_lse, out, grad_out, [*leaves, *captured])
        names = ["dq", "dk", "dv"] + [f"d(captured {tuple(t.shape)})" for t in captured]
        grads = [expect_close(f"backward {where}", name, a, b, tol["grad"]) for name, a, b in zip(names, got, want)]
        text.append(f"dq/dk/dv {max(grads[:3]):.1e}" + (f" captured {max(grads[3:]):.1e}" if captured else ""))
    for rows in DECODE_ROWS:
        if f"decode {rows} row{'s' if rows > 1 else ''}" in checks:
            error = check_decode(flexc, case, decode_dtype, L, device, scores, block_mask, rows, g, B, Hq, E)
            text.append(f"decode {DTYPE_NAMES[decode_dtype]} {rows} row{'s' if rows > 1 else ''} {error:.1e}")
    return ", ".join(text)


@torch.no_grad()
def check_decode(flexc, case, dtype, L: int, device: str, scores: dict, block_mask, rows: int, g, B, H, E) -> float:
    """Two decoding steps of ``rows`` query rows through the gpt-fast idiom: the BlockMask's row of
    ``input_pos`` sliced and given a new mask_mod capturing ``input_pos[0]``; input_pos advances in place."""
    label, _, mask_mod, score_name = case
    score_mod = scores[score_name][0] if score_name else None
    where = f"decode {rows} row{'s' if rows > 1 else ''} {label} {DTYPE_NAMES[dtype]}"
    k, v = (_randn((B, H, L, E), dtype, device, g) for _ in range(2))
    block = block_mask.BLOCK_SIZE[0] if block_mask is not None else 128
    start = min(L - 2 * max(DECODE_ROWS), L // 2 + 5)  # both steps' rows inside one query block
    assert start // block == (start + 2 * rows - 1) // block, (start, rows, block)
    input_pos = torch.tensor([start], device=device)
    worst = 0.0
    for step in range(2):
        q = _randn((B, H, rows, E), dtype, device, g)
        sliced = None
        if block_mask is not None:
            sliced = block_mask[:, :, input_pos // block]
            sliced.mask_mod, sliced.seq_lengths = shifted_mask(mask_mod, input_pos[0]), (rows, L)
        score = shifted_score(score_mod, input_pos[0]) if score_mod else None
        out = flexc.flex_attention(q, k, v, score_mod=score, block_mask=sliced, kernel_options=TRITON)
        position = int(input_pos)
        ref, _ = dense64(q, k, v, shifted_score(score_mod, position) if score_mod else None,
                         shifted_mask(mask_mod, position) if mask_mod else None)
        worst = max(worst, expect_close(f"{where} (step {step}, input_pos {position})", "out", out, ref,
                                        TOLERANCE[dtype]["out"]))
        input_pos += rows
    return worst


def part_correctness(ctx: Context, run: Run, deadline: float) -> None:
    """Every catalogue mask_mod once and three score_mods alone (the score_mods also take turns
    beside the masks), each case in its own guard; see check_plan for what each case checks."""
    L, device = ctx.sizes.check_length, ctx.device
    cases = check_cases(2, 4, L, device)[:ctx.case_limit]
    scores = check_score_mods(4, L, device)
    print(f"{len(cases)} cases (the catalogue's mask_mods and 3 score_mods), L={L}, D=64, B=2, Hq=4, Hkv=2 "
          f"(decoding: Hkv=4), against float64 dense; max|error| over max(1, max|reference|)")
    rows = {}

    def one(i: int, case) -> None:
        dtype, decode_dtype, checks = check_plan(i)
        errors = check_case(ctx.flexc, case, dtype, decode_dtype, L, device, scores, checks)
        rows[case[0]] = [case[0], DTYPE_NAMES[dtype], errors]
        print(f"PASS {case[0]:<44} {DTYPE_NAMES[dtype]}  {errors}", flush=True)

    jobs = [(f"correctness: {case[0]}", functools.partial(one, i, case)) for i, case in enumerate(cases)]
    results = run_cases(run, "correctness", jobs, deadline)
    failures = {case: f"FAILED: {kind}: {message}" for case, kind, message, _ in run.failures}
    table = [rows.get(case[0]) or [case[0], DTYPE_NAMES[check_plan(i)[0]],
                                   failures.get(name, "FAILED") if name in results else "not run"]
             for i, ((name, _), case) in enumerate(zip(jobs, cases))]
    run.sections["correctness"] = (f"Correctness: L={L}, D=64, GQA 4/2, max|error| over max(1, max|float64 "
                                   f"dense|)", ("case", "dtype", "checks and errors"), table)


# ---- part: a decoding step captured in a CUDA graph, and under reduce-overhead ---------------

def decode_step_problem(flexc, S: int, device: str, dtype, write_cache: bool, B=2, Hq=8, Hkv=2, E=64):
    """A gpt-fast decoding step over packed documents with a sliding window and ALiBi (GQA 8/2):
    ``(step, reference, advance, input_pos)``. ``step()`` slices the BlockMask's row of
    ``input_pos`` and shifts both mods by ``input_pos[0]`` (and, with ``write_cache``, first writes
    the new token's key and value at ``input_pos``); ``advance()`` moves input_pos and the token's
    inputs on in place; ``reference()`` is float64 dense attention at the current position."""
    g = torch.Generator().manual_seed(11)
    lengths = [S // 2 - 10, S // 4 + 7]
    document_id = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths + [S - sum(lengths)])).to(device)
    slopes = torch.exp2(-8.0 * torch.arange(1, Hq + 1, dtype=torch.float32) / Hq).to(device)
    window = S // 4

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    q = _randn((B, Hq, 1, E), dtype, device, g)
    k_cache, v_cache = (_randn((B, Hkv, S, E), dtype, device, g) for _ in range(2))
    k_new, v_new = (_randn((B, Hkv, 1, E), dtype, device, g) for _ in range(2))
    block_mask = flexc.create_block_mask(mask_mod, None, None, S, S, device=device)
    input_pos = torch.tensor([S // 2], device=device)

    def step():
        if write_cache:
            k_cache.index_copy_(2, input_pos, k_new)
            v_cache.index_copy_(2, input_pos, v_new)
        mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
        mask.mask_mod, mask.seq_lengths = shifted_mask(mask_mod, input_pos[0]), (1, S)
        return flexc.flex_attention(q, k_cache, v_cache, score_mod=shifted_score(alibi, input_pos[0]),
                                    block_mask=mask, enable_gqa=True)

    def reference():
        position = int(input_pos)
        return dense64(q, k_cache, v_cache, shifted_score(alibi, position), shifted_mask(mask_mod, position))[0]

    def advance():
        input_pos.add_(1)
        for t in (q, k_new, v_new):
            t.copy_(_randn(t.shape, dtype, device, g))
    return step, reference, advance, input_pos


def capture_graph(flexc, S: int, device: str, simulated: bool, replays: int = 4) -> str:
    """A decoding step captured in a ``torch.cuda.CUDAGraph``, replayed with input_pos advanced in
    place, each replay against dense (simulated: the replays are eager calls writing into the
    captured output). Raises WrongResult when a replay differs."""
    tol = TOLERANCE[torch.bfloat16]["out"]
    with torch.no_grad():
        step, reference, advance, input_pos = decode_step_problem(flexc, S, device, torch.bfloat16, write_cache=True)
        step()  # warm up: traces, kernels, validation of the tables
        sync(device)
        if simulated:
            out = step()
            replay = lambda: out.copy_(step())
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            replay = graph.replay
        errors = []
        for _ in range(replays):
            advance()
            replay()
            sync(device)
            errors.append(expect_close(f"CUDA graph replay at input_pos {int(input_pos)}", "out", out, reference(),
                                       tol))
    return f"{replays} replays with input_pos advanced in place equal dense (max error {max(errors):.1e})"


def capture_compiled(flexc, S: int, device: str, simulated: bool, replays: int = 4) -> str:
    """The decoding step under ``torch.compile(mode="reduce-overhead")``, each step against dense."""
    from torch._dynamo.utils import counters

    tol = TOLERANCE[torch.bfloat16]["out"]
    with torch.no_grad():
        skips = counters["inductor"].get("cudagraph_skips", 0)
        step, reference, advance, input_pos = decode_step_problem(flexc, S, device, torch.bfloat16, write_cache=False)
        compiled = torch.compile(step, mode="reduce-overhead")
        errors = []
        for i in range(replays + 1):
            if i:
                advance()
            out = compiled()
            sync(device)
            errors.append(expect_close(f"reduce-overhead step {i} at input_pos {int(input_pos)}", "out", out,
                                       reference(), tol))
        skipped = counters["inductor"].get("cudagraph_skips", 0) - skips
    return (f"{replays + 1} steps equal dense (max error {max(errors):.1e})"
            + (f"; inductor skipped CUDA graphs {skipped}x" if skipped and not simulated else ""))


def part_capture(ctx: Context, run: Run, deadline: float) -> None:
    S = ctx.sizes.check_length
    how = ("its replays run as eager calls (simulated: CUDA graphs need a GPU)" if ctx.simulated
           else "captured in a torch.cuda.CUDAGraph and replayed")
    print(f"a decoding step (GQA 8/2, S={S}, bf16, cache write + sliced BlockMask + shifted ALiBi), {how}; "
          f"then under torch.compile(mode='reduce-overhead')")
    lines = {}

    def one(what: str, fn) -> None:
        lines[what] = fn(ctx.flexc, S, ctx.device, ctx.simulated)
        print(f"{what}: {lines[what]}", flush=True)

    jobs = [("capture: CUDA graph", functools.partial(one, "CUDA graph", capture_graph))]
    if ctx.compile_step:
        jobs.append(("capture: reduce-overhead", functools.partial(one, "reduce-overhead", capture_compiled)))
    else:
        run.note("capture", "reduce-overhead: not run (--no-compile)")
    results = run_cases(run, "capture", jobs, deadline)
    text = [f"- {name.split(': ')[1]}: " + (lines.get(name.split(': ')[1]) or
                                             ("FAILED" if name in results else "not run")) for name, _ in jobs]
    run.sections["capture"] = (f"Capture: a decoding step, S={S}, bf16"
                               + (" (simulated: eager replays)" if ctx.simulated else ""), None, text)


def decode_mask(name: str):
    if name == "causal":
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < DECODE_WINDOW)


def graph_ms(fn, device: str, row: dict, who: str) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (the GPU's time, no Python); if
    capture fails, per eager call, with a note in ``row``."""
    fn()
    sync(device)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        sync(device)
    except OutOfTime:
        raise
    except Exception as e:
        row["note"] = (row.get("note", "") + f" {who} timed eagerly (capture failed: {short_error(e)[:80]})").strip()
        return bench_ms(fn)
    return bench_ms(graph.replay)


# ---- parts: the timing tables against torch's FlexAttention ------------------------------------

def speed(row: dict) -> float | None:
    """flexc's speed over torch's (torch's time / flexc's; > 1: flexc faster), or None."""
    f, t = row.get("flexc_ms"), row.get("torch_ms")
    return t / f if isinstance(f, float) and isinstance(t, float) and f > 0 else None


def time_cell(row: dict, who: str, notes: list, label: str, scale: float = 1.0, digits: int = 3) -> str:
    """``who``'s time (``{who}_ms`` times ``scale``), else why it has none (``row[who]``): a short
    reason as it is, a long one (an error) as "error", its text added to ``notes``."""
    ms = row.get(f"{who}_ms")
    if isinstance(ms, float):
        return f"{ms * scale:.{digits}f}"
    reason = row.get(who)
    if not isinstance(reason, str):
        return "-"
    if len(reason) <= 24:
        return reason
    notes.append(f"{label} {who}: {reason}")
    return "error"


def number(row: dict, key: str, digits: int) -> str:
    return f"{row[key]:.{digits}f}" if isinstance(row.get(key), float) else "-"


def finish_table(run: Run, part: str, title: str, columns: tuple, cases: list, results: dict, cells) -> None:
    """Files the part's table: ``cases`` are ``(name, label, row defaults)``; ``cells(row, notes,
    label)`` gives a row's strings, and a last column says ok, FAILED or not run. The flexc/torch
    ratios of the rows that passed go to the summary."""
    failed = {failure[0] for failure in run.failures}
    rows, stats, notes = [], [], []
    for name, label, defaults in cases:
        status = "not run" if name not in results else "FAILED" if name in failed else "ok"
        row = dict(defaults, **(results.get(name) or {}))
        rows.append(cells(row, notes, label) + [status])
        if status == "ok":
            stats.append((label, row))
    run.sections[part] = (title, columns + ("result",), rows)
    run.stats[part] = stats
    for text in notes:
        run.note(part, text)


def cell_line(part: str, label: str, row: dict, unit: str = "ms", scale: float = 1.0) -> None:
    ratio = speed(row)
    times = [f"{row[f'{who}_ms'] * scale:.3f}" if isinstance(row.get(f"{who}_ms"), float) else "-"
             for who in ("flexc", "torch")]
    print(f"{part} {label}: flexc {times[0]} {unit}, torch {times[1]} {unit}"
          + (f", flexc/torch {ratio:.2f}" if ratio else ""), flush=True)


def part_table(ctx: Context, run: Run, deadline: float, backward: bool) -> None:
    """Forward (or forward + backward) time of flexc and torch's FlexAttention (compiled) for the
    TABLE_MASKS at each head dim and length, SDPA beside causal; flexc's output checked against torch's."""
    part = "forward+backward" if backward else "forward"
    s = ctx.sizes
    keys = [(D, L, mask) for L in s.lengths for D in s.dims for mask in TABLE_MASKS]
    print(f"bf16, {s.heads} heads, B*L = {s.tokens} tokens; ms, TFLOP/s over allowed pairs "
          f"({14 if backward else 4} * D FLOPs a pair); flexc/torch = torch's time / flexc's (> 1: flexc faster)")

    def one(D: int, L: int, mask: str) -> dict:
        row = run_cell(ctx.flexc, ctx.torch_flex, ctx.baseline, mask, L, D, ctx.device, math.inf, backward,
                       sdpa=mask == "causal", check=True, torch_backward=not ctx.simulated, timer=ctx.timer,
                       tokens=s.tokens, heads=s.heads, first_only=ctx.simulated)
        cell_line(part, f"D={D} L={L} {mask}", row)
        if "flexc_error" in row:
            raise CaseFailed(row.pop("flexc_error"), row)
        return row

    cases = [(f"{part}: D={D} L={L} {mask}", functools.partial(one, D, L, mask)) for D, L, mask in keys]
    results = run_cases(run, part, cases, deadline)

    def cells(row, notes, label):
        ratio = speed(row)
        return [str(row["D"]), str(row["L"]), str(row.get("B", "-")), row["mask"],
                *(time_cell(row, who, notes, label) for who in ("flexc", "torch", "sdpa")),
                number(row, "flexc", 1), number(row, "torch", 1), f"{ratio:.2f}" if ratio else "-",
                number(row, "flexc_first_s", 2)]

    finish_table(run, part, f"{'Forward+backward' if backward else 'Forward'}: bf16, H={s.heads}, "
                 f"B*L={s.tokens}" + (" (simulated: interpreter wall time, not a measurement)" if ctx.simulated else ""),
                 ("D", "L", "B", "mask", "flexc ms", "torch ms", "SDPA ms", "flexc TFLOP/s", "torch TFLOP/s",
                  "flexc/torch", "flexc 1st call s"),
                 [(name, f"D={D} L={L} {mask}", {"D": D, "L": L, "mask": mask})
                  for (name, _), (D, L, mask) in zip(cases, keys)], results, cells)


def part_forward(ctx: Context, run: Run, deadline: float) -> None:
    part_table(ctx, run, deadline, backward=False)


def part_forward_backward(ctx: Context, run: Run, deadline: float) -> None:
    part_table(ctx, run, deadline, backward=True)


class DecodeStep:
    """One token at position S-1 of an S-key cache, bf16, through gpt-fast's idiom (the BlockMask's
    row of ``input_pos`` sliced, the mask_mod shifted by ``input_pos[0]``), for either library."""

    def __init__(self, name: str, S: int, D: int, device: str, B: int, Hq: int, Hkv: int):
        g = torch.Generator().manual_seed(3)
        self.S, self.device, self.mask_mod = S, device, decode_mask(name)
        self.q = _randn((B, Hq, 1, D), torch.bfloat16, device, g)
        self.k, self.v = (_randn((B, Hkv, S, D), torch.bfloat16, device, g) for _ in range(2))
        self.input_pos = torch.tensor([S - 1], device=device)
        keys = S if name == "causal" else min(S, DECODE_WINDOW)
        self.flops = 4 * D * keys * B * Hq

    def step(self, lib):
        """``lib``'s step (flexc or torch.nn.attention.flex_attention), its BlockMask built once."""
        block_mask = lib.create_block_mask(self.mask_mod, None, None, self.S, self.S, device=self.device)

        def one_step():
            mask = block_mask[:, :, self.input_pos // block_mask.BLOCK_SIZE[0]]
            mask.mask_mod, mask.seq_lengths = shifted_mask(self.mask_mod, self.input_pos[0]), (1, self.S)
            return lib.flex_attention(self.q, self.k, self.v, block_mask=mask, enable_gqa=True)
        return one_step


def run_decode_cell(ctx: Context, name: str, S: int, D: int) -> dict:
    """flexc's step and torch's compiled step, each timed as replays of a CUDA graph (simulated:
    eager calls); flexc's also with 4 warps (the 16-row tile takes 2 by default). Raises CaseFailed
    when flexc fails or its output differs from torch's by more than 2e-2."""
    from flexc.backends.triton import config as triton_config

    B, Hq, Hkv = ctx.sizes.decode_heads
    problem = DecodeStep(name, S, D, ctx.device, B, Hq, Hkv)
    row: dict = {"B": B}
    time_ms = ((lambda fn, who: ctx.timer(fn)) if ctx.simulated
               else (lambda fn, who: graph_ms(fn, ctx.device, row, who)))
    failure, outputs = None, {}
    try:
        flexc_step = problem.step(ctx.flexc)
        row["flexc_ms"] = time_ms(flexc_step, "flexc")
        with torch.no_grad():
            outputs["flexc"] = flexc_step()
        default_warps = getattr(triton_config, "default_warps", None)
        if default_warps is not None:
            triton_config.default_warps = lambda block_m, target: 4  # the same step with 4 warps
            try:
                row["flexc_w4_ms"] = time_ms(flexc_step, "flexc 4 warps")
            finally:
                triton_config.default_warps = default_warps
    except OutOfTime:
        raise
    except Exception as e:
        failure = e
    try:
        torch_step = problem.step(ctx.torch_flex)
        if not ctx.simulated:
            torch_step = torch.compile(torch_step)
        row["torch_ms"] = time_ms(torch_step, "torch")
        with torch.no_grad():
            outputs["torch"] = torch_step()
    except OutOfTime:
        raise
    except Exception as e:
        row["torch"] = short_error(e)
    if len(outputs) == 2 and failure is None:
        error = relative_error(outputs["flexc"], outputs["torch"])
        if not error <= 2e-2:
            failure = WrongResult(f"flexc's decoding step differs from torch's by {error:.1e}")
    if failure is not None:
        raise CaseFailed(failure, row)
    return row


def part_decode(ctx: Context, run: Run, deadline: float) -> None:
    s = ctx.sizes
    B, Hq, Hkv = s.decode_heads
    keys = [(D, S, mask) for S in s.decode_lengths for D in s.dims for mask in ("causal", "sliding")]
    print(f"bf16, B={B}, Hq={Hq}, Hkv={Hkv}, one query row at position S-1, sliding window {DECODE_WINDOW}; "
          + ("eager calls (simulated)" if ctx.simulated else "each step captured in a CUDA graph, replays timed")
          + "; flexc/torch = torch's time / flexc's")

    def one(D: int, S: int, mask: str) -> dict:
        try:
            row = run_decode_cell(ctx, mask, S, D)
        except CaseFailed as e:
            cell_line("decode", f"D={D} S={S} {mask}", e.row, "us", 1e3)
            raise
        cell_line("decode", f"D={D} S={S} {mask}", row, "us", 1e3)
        return row

    cases = [(f"decode: D={D} S={S} {mask}", functools.partial(one, D, S, mask)) for D, S, mask in keys]
    results = run_cases(run, "decode", cases, deadline)

    def cells(row, notes, label):
        ratio = speed(row)
        if row.get("note"):
            notes.append(f"{label}: {row['note']}")
        return [str(row["D"]), str(row["S"]), row["mask"],
                *(time_cell(row, who, notes, label, 1e3, 1) for who in ("flexc", "torch")),
                f"{ratio:.2f}" if ratio else "-", time_cell(row, "flexc_w4", notes, label, 1e3, 1)]

    finish_table(run, "decode", f"Decode per token: bf16, B={B}, Hq={Hq}, Hkv={Hkv}"
                 + (" (simulated: interpreter wall time, not a measurement)" if ctx.simulated else ", CUDA graphs"),
                 ("D", "S", "mask", "flexc us", "torch us", "flexc/torch", "flexc 4 warps us"),
                 [(name, f"D={D} S={S} {mask}", {"D": D, "S": S, "mask": mask})
                  for (name, _), (D, S, mask) in zip(cases, keys)], results, cells)


# ---- parts: host time per call, and the block-mask build -------------------------------------

def host_ms(fn, calls: int, device: str) -> float:
    """Wall milliseconds per call of ``calls`` back-to-back calls (one sync at the end): where the
    kernel is shorter than the host's work, this is the host's time."""
    for _ in range(min(calls, 3)):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e3


def part_host_time(ctx: Context, run: Run, deadline: float) -> None:
    s, device = ctx.sizes, ctx.device
    print(f"eager calls, wall time per call over {s.host_calls} calls; torch "
          + ("eager (simulated)" if ctx.simulated else "compiled"))

    def side(row: dict, who: str, make) -> None:
        try:
            row[f"{who}_ms"] = host_ms(make(), s.host_calls, device)
        except OutOfTime:
            raise
        except Exception as e:
            if who == "flexc":
                row["flexc_error"] = e
            row[who] = short_error(e)

    from flexc import compiled_launch  # (FLEXC_COMPILED_LAUNCH: flexc's launches through JITFunction.run)

    def forward(through_jit: bool = False) -> dict:
        B, H, L, D = s.host_forward
        g = torch.Generator().manual_seed(4)
        q, k, v = (_randn((B, H, L, D), torch.bfloat16, device, g) for _ in range(3))
        causal = decode_mask("causal")
        row: dict = {}

        def make(lib, call):
            block_mask = lib.create_block_mask(causal, None, None, L, L, device=device)
            return lambda: call(q, k, v, block_mask=block_mask)
        enabled = compiled_launch.ENABLED
        try:
            compiled_launch.ENABLED = not through_jit
            side(row, "flexc", lambda: make(ctx.flexc, ctx.flexc.flex_attention))
            if not through_jit:  # the compiled launch computes what Triton's own launch does, bit for bit
                call = make(ctx.flexc, ctx.flexc.flex_attention)
                direct = call()
                compiled_launch.ENABLED = False
                if not torch.equal(direct, call()):
                    row["flexc_error"] = AssertionError("the compiled launch's output differs from JITFunction.run's")
        finally:
            compiled_launch.ENABLED = enabled
        side(row, "torch", lambda: make(ctx.torch_flex, ctx.baseline))
        return row

    def decode() -> dict:
        B, H, S, D = s.host_decode
        problem = DecodeStep("causal", S, D, device, B, H, H)
        row: dict = {}
        side(row, "flexc", lambda: problem.step(ctx.flexc))
        side(row, "torch", lambda: (problem.step(ctx.torch_flex) if ctx.simulated
                                    else torch.compile(problem.step(ctx.torch_flex))))
        return row

    B, H, L, D = s.host_forward
    Bd, Hd, S, Dd = s.host_decode
    labels = {"forward": f"forward B={B}, H={H}, L={L}, D={D}, causal",
              "forward via JITFunction.run": f"forward B={B}, H={H}, L={L}, D={D}, causal, FLEXC_COMPILED_LAUNCH=0",
              "decode": f"decode B={Bd}, H={Hd}, 1 row, S={S}, D={Dd}"}

    def one(what: str) -> dict:
        row = {"forward": forward, "forward via JITFunction.run": functools.partial(forward, True),
               "decode": decode}[what]()
        cell_line("host time", labels[what], row, "us", 1e3)
        if "flexc_error" in row:
            raise CaseFailed(row.pop("flexc_error"), row)
        return row

    cases = [(f"host time: {what}", functools.partial(one, what)) for what in labels]
    results = run_cases(run, "host time", cases, deadline)

    def cells(row, notes, label):
        ratio = speed(row)
        return [label, *(time_cell(row, who, notes, label, 1e3, 0) for who in ("flexc", "torch")),
                f"{ratio:.2f}" if ratio else "-"]

    finish_table(run, "host time", f"Per-call host time: eager calls, wall us per call, {s.host_calls} calls",
                 ("call", "flexc us", "torch us", "flexc/torch"),
                 [(name, labels[name.split(": ")[1]], {}) for name, _ in cases], results, cells)


def block_count(block_mask) -> int:
    """Tiles a BlockMask runs: partial plus full."""
    full = block_mask.full_kv_num_blocks
    return int(block_mask.kv_num_blocks.sum()) + (int(full.sum()) if full is not None else 0)


def build_ms(lib, mask_mod, L: int, device: str, repeats: int) -> tuple:
    """Median wall milliseconds of ``repeats`` builds after a first one (which traces), and the mask."""
    block_mask = lib.create_block_mask(mask_mod, None, None, L, L, device=device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        block_mask = lib.create_block_mask(mask_mod, None, None, L, L, device=device)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, block_mask


def part_block_mask(ctx: Context, run: Run, deadline: float) -> None:
    s, device = ctx.sizes, ctx.device
    repeats = 1 if ctx.simulated else 5
    print(f"create_block_mask of a causal document mask ({s.document}-token documents, the document ids a "
          f"captured tensor on the device): median of {repeats} builds after the first; torch up to "
          f"L={s.build_torch_max}")

    def one(L: int) -> dict:
        document_id = (torch.arange(L) // s.document).to(device)

        def document_causal(b, h, q_idx, kv_idx):
            return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)
        row: dict = {}
        try:
            row["flexc_ms"], ours = build_ms(ctx.flexc, document_causal, L, device, repeats)
            row["flexc_blocks"] = block_count(ours)
        except OutOfTime:
            raise
        except Exception as e:
            row["flexc"] = short_error(e)
            raise CaseFailed(e, row)
        if L <= s.build_torch_max:
            try:
                row["torch_ms"], theirs = build_ms(ctx.torch_flex, document_causal, L, device, repeats)
                row["torch_blocks"] = block_count(theirs)
            except OutOfTime:
                raise
            except Exception as e:
                row["torch"] = short_error(e)
        else:
            row["torch"] = "not run (L)"
        cell_line("block-mask build", f"L={L}", row)
        if row.get("torch_blocks", row["flexc_blocks"]) != row["flexc_blocks"]:
            raise CaseFailed(WrongResult(f"flexc's BlockMask runs {row['flexc_blocks']} tiles, torch's "
                                         f"{row['torch_blocks']}"), row)
        return row

    cases = [(f"block-mask build: L={L}", functools.partial(one, L)) for L in s.build_lengths]
    results = run_cases(run, "block-mask build", cases, deadline)

    def cells(row, notes, label):
        ratio = speed(row)
        blocks = {str(row[key]) for key in ("flexc_blocks", "torch_blocks") if key in row}
        return [label, *(time_cell(row, who, notes, label, digits=1) for who in ("flexc", "torch")),
                f"{ratio:.2f}" if ratio else "-", " vs ".join(sorted(blocks)) or "-"]

    finish_table(run, "block-mask build", f"Block-mask build: causal document mask, {s.document}-token documents",
                 ("L", "flexc ms", "torch ms", "flexc/torch", "tiles"),
                 [(name, f"L={L}", {}) for (name, _), L in zip(cases, s.build_lengths)], results, cells)


# ---- the run: parts in turn, tables on the console and in markdown, the summary ----------------

PARTS = {"correctness": part_correctness, "capture": part_capture, "forward": part_forward,
         "forward+backward": part_forward_backward, "decode": part_decode, "host time": part_host_time,
         "block-mask build": part_block_mask}
assert tuple(PARTS) == tuple(PART_SHARES)


def render(columns: tuple, rows: list, markdown: bool) -> list:
    """A table's lines: aligned columns for the console, or a markdown table."""
    if markdown:
        cell = lambda text: str(text).replace("|", "\\|")
        return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                + ["| " + " | ".join(cell(text) for text in row) + " |" for row in rows])
    widths = [max([len(name)] + [len(row[i]) for row in rows]) for i, name in enumerate(columns)]
    line = lambda cells: "  ".join(text.rjust(width) for text, width in zip(cells, widths)).rstrip()
    return [line(columns)] + [line(row) for row in rows]


def section_lines(run: Run, part: str, markdown: bool) -> list:
    title, columns, rows = run.sections.get(part, (part, None, []))
    lines = render(columns, rows, markdown) if columns else list(rows)
    if part in run.stops:
        lines.append(f"({run.stops[part]})")
    lines += [f"note: {text}" for text in run.notes.get(part, [])]
    if markdown and part in run.took:
        lines.append(f"({run.took[part]:.0f} s)")
    return [f"## {title}", ""] + lines + [""] if markdown else lines


def ratio_stats(stats: list) -> str:
    """``worst W (where) geomean G (N cells)`` of flexc/torch speed over the rows measured on both sides."""
    ratios = [(speed(row), label) for label, row in stats if speed(row)]
    if not ratios:
        return "no cells"
    worst = min(ratios)
    mean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
    return f"worst {worst[0]:.2f} ({worst[1]}) geomean {mean:.2f} ({len(ratios)} cells)"


def summary_line(run: Run, out: str, seconds: float) -> str:
    totals = run.totals()
    failed = [failure[0] for failure in run.failures]
    listed = f" ({'; '.join(failed[:3])}{'; ...' if len(failed) > 3 else ''})" if failed else ""
    per_part = ", ".join(f"{part} {c['passed']}/{sum(c.values())}" for part, c in run.counts.items())
    ratios = "; ".join(f"{part} {ratio_stats(stats)}" for part, stats in run.stats.items()
                       if ratio_stats(stats) != "no cells") or "none measured"
    return (f"gpu.py summary: {'FAILED' if failed else 'ok'}; {totals['passed']} passed, {len(failed)} failed"
            f"{listed}, {totals['not run']} not run (passed/cases: {per_part}); flexc/torch speed: {ratios}; "
            f"tables in {out}; {seconds:.0f} s")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with local changes" if dirty.stdout.strip() else "")


def write_markdown(path: str, header: list, run: Run, parts: list, summary: str | None) -> None:
    """The whole report so far, rewritten after every part (a run stopped from outside keeps it)."""
    lines = ["# bench/gpu.py --all", ""] + [f"{line}  " for line in header] + [""]
    if summary:
        lines += ["Summary:", "", "```", summary, "```", ""]
    if run.failures:
        lines += [f"## Failures ({len(run.failures)})", ""]
        lines += [f"- `{case}`: {kind}: {message}" + (f" (at `{where}`)" if where else "")
                  for case, kind, message, where in run.failures] + [""]
    for part in parts:
        if part in run.sections or part in run.stops or part in run.notes:
            lines += section_lines(run, part, markdown=True)
    temporary = f"{path}.partial"
    with open(temporary, "w") as f:
        f.write("\n".join(lines))
    os.replace(temporary, path)


def run_all(args) -> int:
    """``--all``: the parts in turn, each within its share of the budget and every case in its own
    guard; the tables on the console and in markdown (``--out``); the last line is the summary.
    Status 1 when a case failed (or --fail-case named no case), else 0."""
    start = now()
    simulated = args.simulate is not None
    budget = args.budget if args.budget is not None else ALL_BUDGET * (2 if simulated else 1)
    if not simulated and not torch.cuda.is_available():
        print("bench/gpu.py --all: no CUDA device on this machine; run it with --simulate sm_90 to exercise its "
              "logic on the CPU. Nothing was run.")
        print("gpu.py summary: nothing run (no CUDA device)")
        return 0
    import warnings

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="return_lse is deprecated")
    import triton

    import flexc
    from torch.nn.attention import flex_attention as torch_flex

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    sizes = SIMULATED_SIZES if simulated else GPU_SIZES
    given = {"dims": args.dims, "lengths": args.lengths, "check_length": args.check_length,
             "decode_lengths": args.decode_lengths}
    sizes = dataclasses.replace(sizes, **{key: value for key, value in given.items() if value is not None})
    ctx = Context(flexc, torch_flex, torch_flex.flex_attention if simulated else torch.compile(torch_flex.flex_attention),
                  "cpu" if simulated else "cuda", simulated, sizes, args.cases, not args.no_compile)
    run = Run(args.fail_case)
    parts = list(args.parts)
    where = (f"simulated {args.simulate} (CPU tensors take its host decisions, kernels run in Triton's interpreter, "
             f"tiny sizes: timings are not measurements)" if simulated else torch.cuda.get_device_name())
    header = [f"Device: {where}", f"Stack: torch {torch.__version__}, triton {triton.__version__}, "
              f"Python {sys.version.split()[0]}; flexc commit {git_commit()}",
              f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; budget {budget:.0f} s; parts: "
              f"{', '.join(parts)}"]
    print(f"bench/gpu.py --all on {where}")
    print("; ".join(header[1:]) + f"; markdown to {args.out}")
    try:
        write_markdown(args.out, header, run, parts, None)
    except OSError as e:
        print(f"bench/gpu.py --all: cannot write --out {args.out!r} ({e}). Fix: pass a writable path.")
        return 2
    end = start + budget
    with flexc.device.simulate(args.simulate) if simulated else contextlib.nullcontext():
        for i, part in enumerate(parts):
            begin = now()
            # its fixed share, or more when the parts before it left time unused (never less: a part
            # the watchdog stopped late does not eat the next part's time, it lengthens the run)
            share = max(budget * PART_SHARES[part] / sum(PART_SHARES[p] for p in parts),
                        (end - begin) * PART_SHARES[part] / sum(PART_SHARES[p] for p in parts[i:]))
            print(f"\n== {i + 1}. {part} (its share: {share:.0f} s) ==", flush=True)
            try:
                with watchdog(share + WATCHDOG_GRACE):
                    PARTS[part](ctx, run, begin + share)
            except OutOfTime:
                run.stop(part, [], f"stopped by the watchdog {WATCHDOG_GRACE:g} s past its share")
            except Exception as e:  # outside any case's guard: the part's own set-up
                traceback.print_exc()
                run.fail(part, f"{part}: (the part's set-up)", e)
            if run.sections.get(part, (None, None))[1] is not None and part not in ("correctness", "capture"):
                print("\n" + "\n".join(section_lines(run, part, markdown=False)), flush=True)
            run.took[part] = now() - begin
            print(f"({part}: {run.took[part]:.0f} s of its {share:.0f} s)", flush=True)
            try:
                write_markdown(args.out, header, run, parts, None)
            except OSError as e:
                print(f"(could not write {args.out}: {e})")
    if run.fail_case and not run.fail_case_seen:
        run.fail("--fail-case", f"--fail-case {run.fail_case!r}",
                 ValueError("matched no case; the case names are in the FAIL/PASS lines and the tables"))
    summary = summary_line(run, args.out, now() - start)
    try:
        write_markdown(args.out, header, run, parts, summary)
    except OSError as e:
        print(f"(could not write {args.out}: {e})")
    if run.failures:
        print(f"\n== failures ({len(run.failures)}) ==")
        for case, kind, message, where in run.failures:
            print(f"FAIL {case}: {kind}: {message}" + (f" (at {where})" if where else ""))
    print(summary, flush=True)
    return 1 if run.failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=64, L=1K and 4K only")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds before no new cell starts (540; with --all: the whole run, {ALL_BUDGET:.0f}, "
                             f"shared by its parts)")
    ints = lambda text: tuple(int(x) for x in text.split(","))
    parser.add_argument("--dims", type=ints, default=None, help="head dims, comma-separated (64,128)")
    parser.add_argument("--lengths", type=ints, default=None,
                        help="sequence lengths, comma-separated (1024,...,16384; with --all 8192,1024)")
    parser.add_argument("--backward", action="store_true", help="check gradients and time forward + backward")
    parser.add_argument("--decode", action="store_true", help="the decoding table of bench/decode.py on this GPU")
    parser.add_argument("--all", action="store_true",
                        help="the prepared run: correctness, capture, the timing tables, host time, block-mask "
                             "build, every case guarded; one summary line; under 8 minutes")
    parser.add_argument("--simulate", choices=("sm_80", "sm_90", "sm_100"), default=None,
                        help="with --all, no GPU needed: CPU tensors take that GPU's host decisions, kernels run "
                             "in Triton's interpreter, every problem tiny")
    parser.add_argument("--out", default="gpu-results.md",
                        help="with --all: the markdown file the tables are written to (gpu-results.md)")
    parser.add_argument("--parts", type=lambda text: tuple(p.strip() for p in text.split(",")),
                        default=tuple(PART_SHARES),
                        help=f"with --all: the parts to run, comma-separated ({','.join(PART_SHARES)})")
    parser.add_argument("--fail-case", default=None,
                        help="with --all: make the case of this name fail, to prove that the run goes on")
    parser.add_argument("--check-length", type=int, default=None,
                        help="with --all: sequence length of the correctness and capture checks (512; simulated 128)")
    parser.add_argument("--decode-lengths", type=ints, default=None,
                        help="with --all: KV-cache lengths of the decoding table (16384,4096,1024; simulated 256)")
    parser.add_argument("--cases", type=int, default=None, help="with --all: only the first N correctness cases")
    parser.add_argument("--no-compile", action="store_true",
                        help="with --all: skip the reduce-overhead step of the capture part")
    args = parser.parse_args(argv)
    if args.simulate and not args.all:
        parser.error("--simulate goes with --all")
    unknown = [part for part in args.parts if part not in PART_SHARES]
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(map(repr, unknown))}; the parts are "
                     f"{', '.join(PART_SHARES)}")
    if args.all:
        return run_all(args)
    args.dims = args.dims or (64, 128)
    args.lengths = args.lengths or (1024, 2048, 4096, 8192, 16384)
    if args.budget is None:
        args.budget = 540.0
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
          f"flexc kernels cached in {flexc.backends.triton.cache.cache_dir()}")

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
