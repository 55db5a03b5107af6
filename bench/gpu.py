"""GPU benchmark: flexc's generated Triton kernels vs torch.compile(flex_attention) vs SDPA.

    python bench/gpu.py                 # correctness for 6 mods, then the TFLOP/s table (< 10 minutes)
    python bench/gpu.py --quick         # D=64, L=1K and 4K only
    python bench/gpu.py --budget 300    # stop starting new cells after 300 s
    python bench/gpu.py --backward      # forward + backward: gradients checked, then training TFLOP/s
    python bench/gpu.py --decode        # decoding (one query row, KV cache 1K..16K): bench/decode.py on the GPU
    python bench/gpu.py --all           # the prepared run (< 8 minutes): correctness, capture, timing, summary
    python bench/gpu.py --all --simulate sm_90   # its correctness and capture logic on the CPU, no GPU

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

``--all`` is the one prepared run for a GPU machine (budget 450 s, every part inside it):

1. Correctness, failing fast: every mask_mod of tests/catalogue.py and three score_mods alone (ALiBi
   with learnable slopes, soft-capping, a learnable relative-position bias; the score_mods also take
   turns beside the masks), L=512, D=64, GQA 4/2, each against float64 dense evaluation: the
   forward with lse and the backward (dq, dk, dv and the captured tensors' gradients) in bf16 or
   fp32 (alternating by case), and decoding in the other dtype with 1 and 16 query rows through
   gpt-fast's idiom (``block_mask[:, :, input_pos // BLOCK]``, a new mask_mod capturing
   ``input_pos[0]``, input_pos advanced in place). The first wrong result (or error) prints one
   line starting with ``FAIL`` and ends the run with status 1. Half the budget at most; cases
   past it are counted as not run.
2. A decoding step (cache write, sliced BlockMask, shifted ALiBi) captured in a
   ``torch.cuda.CUDAGraph`` and replayed with input_pos advanced in place, each replay checked
   against dense; then the step under ``torch.compile(mode="reduce-overhead")``. A wrong value
   fails fast; an error is reported and the run goes on to the timing (status 1 at the end).
3. Timing against torch's compiled FlexAttention, bf16, D=64 and 128, L=1K..16K: forward and
   forward + backward TFLOP/s (causal, document), and decoding per token (causal, sliding window;
   both steps captured in CUDA graphs; flexc's also with 4 warps instead of the 16-row tile's 2),
   with the ratio flexc/torch. The tables share what the first parts left of the budget; cells
   past a table's share are listed as skipped.

The last line is the summary: ``gpu.py summary: ...`` (correctness pass/fail/not-run counts, the
capture results, worst and geometric-mean flexc/torch ratio per table). With ``--simulate
sm_90`` parts 1 and 2 run on the CPU (CPU tensors take the GPU's host decisions, kernels run in
Triton's interpreter, the graph's replays are eager calls; L=128, budget 900 s) and part 3 says it
needs a GPU.
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


# ---- --all: the prepared GPU run (correctness, capture, timing) ---------------------------

ALL_BUDGET = 450.0  # seconds for the whole --all run: under 8 minutes with Python's start and the last prints
TRITON = {"BACKEND": "TRITON"}
# max |error| over max(1, max |reference|), against float64 dense evaluation of the same inputs
# (gradients: at the returned output's delta, see reference_grads). Under simulation (every case
# at L=128, a few at 512) bf16 errors were at most 1.0e-2, fp32 ones at most 6.4e-6.
TOLERANCE = {torch.bfloat16: {"out": 2e-2, "lse": 1e-2, "grad": 5e-2},
             torch.float32: {"out": 1e-4, "lse": 1e-4, "grad": 1e-3}}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
CHECKS_PER_CASE = 4  # forward (out, lse), backward (dq, dk, dv, captured), decode with 1 and 16 rows
DECODE_ROWS = (1, 16)
# the timing table's decoding problem: gpt-fast's shapes, GQA 32/8, so one token is the 16-row tile
DECODE_BATCH, DECODE_HQ, DECODE_HKV, DECODE_WINDOW = 4, 32, 8, 1024
ALL_MASKS = ("causal", "document")  # the forward and forward + backward tables of --all


class WrongResult(Exception):
    """A result differs from the float64 reference (the message is the one line printed)."""


class Tally:
    """Counts of checks passed, failed and not run, and the first failure."""

    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.failure = ""

    def text(self) -> str:
        return f"correctness {self.passed} pass, {self.failed} fail, {self.skipped} not run"


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


def check_case(flexc, case, dtype, decode_dtype, L: int, device: str, scores: dict, done: list, B=2, Hq=4,
               Hkv=2, E=64) -> str:
    """Forward with lse and backward (dq, dk, dv, captured-tensor gradients) in ``dtype``, then the
    gpt-fast decoding idiom with 1 and 16 query rows in ``decode_dtype``, each against float64 dense
    (the checks passed are appended to ``done``). Raises WrongResult at the first difference;
    returns the errors seen."""
    label, _, mask_mod, score_name = case
    score_mod, captured = scores[score_name] if score_name else (None, [])
    g = torch.Generator().manual_seed(sum(map(ord, label)))
    tol = TOLERANCE[dtype]
    where = f"{label} {DTYPE_NAMES[dtype]}"
    q = _randn((B, Hq, L, E), dtype, device, g).requires_grad_()
    k, v = (_randn((B, Hkv, L, E), dtype, device, g).requires_grad_() for _ in range(2))
    block_mask = flexc.create_block_mask(mask_mod, B, Hq, L, L, device=device) if mask_mod else None
    out, aux = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                    return_aux=flexc.AuxRequest(lse=True), kernel_options=TRITON)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense64(*leaves, score_mod, mask_mod)
    errors = [expect_close(f"forward {where}", "out", out, ref, tol["out"]),
              expect_lse(f"forward {where}", aux.lse, ref_lse, tol["lse"])]
    done.append("forward")
    grad_out = _randn(out.shape, dtype, device, g)
    got = torch.autograd.grad(out, [q, k, v, *captured], grad_out)
    want = reference_grads(ref, ref_lse, out, grad_out, [*leaves, *captured])
    names = ["dq", "dk", "dv"] + [f"d(captured {tuple(t.shape)})" for t in captured]
    grads = [expect_close(f"backward {where}", name, a, b, tol["grad"]) for name, a, b in zip(names, got, want)]
    errors += [max(grads[:3]), max(grads[3:], default=0.0)]
    done.append("backward")
    decode = []
    for rows in DECODE_ROWS:
        decode.append(check_decode(flexc, case, decode_dtype, L, device, scores, block_mask, rows, g, B, Hq, E))
        done.append(f"decode {rows} row{'s' if rows > 1 else ''}")
    captured_text = f" captured {errors[3]:.1e}" if captured else ""
    return (f"out {errors[0]:.1e} lse {errors[1]:.1e} dq/dk/dv {errors[2]:.1e}{captured_text} | decode "
            f"{DTYPE_NAMES[decode_dtype]} 1 row {decode[0]:.1e}, 16 rows {decode[1]:.1e}")


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


def run_correctness(flexc, tally: Tally, L: int, device: str, deadline: float, limit: int | None = None) -> bool:
    """Part 1: every case; False at the first failure (printed as one line starting with FAIL)."""
    cases = check_cases(2, 4, L, device)
    if limit is not None:
        cases = cases[:limit]
    scores = check_score_mods(4, L, device)
    print(f"\n== 1. correctness: {len(cases)} cases (the catalogue's mask_mods and 3 score_mods), L={L}, D=64, "
          f"B=2, Hq=4, Hkv=2 (decoding: Hkv=4), against float64 dense; max|error| over max(1, max|reference|) ==")
    for i, case in enumerate(cases):
        if time.time() > deadline:
            tally.skipped += CHECKS_PER_CASE * (len(cases) - i)
            print(f"(correctness budget spent: {len(cases) - i} cases not run)")
            return True
        dtype, decode_dtype = (torch.bfloat16, torch.float32) if i % 2 == 0 else (torch.float32, torch.bfloat16)
        done: list = []
        try:
            errors = check_case(flexc, case, dtype, decode_dtype, L, device, scores, done)
        except OutOfTime:
            tally.passed += len(done)
            tally.skipped += CHECKS_PER_CASE * (len(cases) - i) - len(done)
            raise
        except WrongResult as e:
            tally.failure = str(e)
        except Exception as e:  # an error is a failure too: flexc must run every case
            part = ("forward", "backward", "decode 1 row", "decode 16 rows")[len(done)]
            tally.failure = f"{part} {case[0]} {DTYPE_NAMES[dtype if len(done) < 2 else decode_dtype]}: {short_error(e)}"
        if tally.failure:
            tally.passed += len(done)
            tally.failed += 1
            tally.skipped += CHECKS_PER_CASE * (len(cases) - i) - len(done) - 1
            print(f"FAIL {tally.failure}", flush=True)
            return False
        tally.passed += CHECKS_PER_CASE
        print(f"PASS {case[0]:<44} {DTYPE_NAMES[dtype]}  {errors}", flush=True)
    return True


# ---- part 2: a decoding step captured in a CUDA graph, and under reduce-overhead -----------

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


def run_capture(flexc, S: int, device: str, simulated: bool, compile_step: bool, replays: int = 4) -> dict:
    """Part 2. ``{"graph": ..., "compile": ...}``, each "ok", "error: ..." or "not run"; raises
    WrongResult when a replayed step differs from dense. Simulated (CPU tensors standing in for a
    GPU), the graph's replays are eager calls writing into the captured output, the same checks."""
    dtype = torch.bfloat16
    tol = TOLERANCE[dtype]["out"]
    result = {"graph": "not run", "compile": "not run"}
    what = ("its replays run as eager calls (simulated: CUDA graphs need a GPU)" if simulated
            else "captured in a torch.cuda.CUDAGraph and replayed")
    print(f"\n== 2. a decoding step (GQA 8/2, S={S}, bf16, cache write + sliced BlockMask + shifted ALiBi), "
          f"{what}; then under torch.compile(mode='reduce-overhead') ==")
    with torch.no_grad():
        try:
            step, reference, advance, input_pos = decode_step_problem(flexc, S, device, dtype, write_cache=True)
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
                errors.append(expect_close(f"CUDA graph replay at input_pos {int(input_pos)}", "out", out,
                                           reference(), tol))
            result["graph"] = "ok"
            print(f"graph: {replays} replays with input_pos advanced in place equal dense "
                  f"(max error {max(errors):.1e})")
        except (WrongResult, OutOfTime):
            raise
        except Exception as e:
            result["graph"] = f"error: {short_error(e)}"
            print(f"graph: ERROR {short_error(e)}")
        if not compile_step:
            return result
        try:
            from torch._dynamo.utils import counters

            skips = sum(counters["inductor"].get(key, 0) for key in ("cudagraph_skips",))
            step, reference, advance, input_pos = decode_step_problem(flexc, S, device, dtype, write_cache=False)
            compiled = torch.compile(step, mode="reduce-overhead")
            errors = []
            for i in range(replays + 1):
                if i:
                    advance()
                out = compiled()
                sync(device)
                errors.append(expect_close(f"reduce-overhead step {i} at input_pos {int(input_pos)}", "out", out,
                                           reference(), tol))
            skipped = sum(counters["inductor"].get(key, 0) for key in ("cudagraph_skips",)) - skips
            result["compile"] = "ok" + (f" (CUDA graphs skipped {skipped}x)" if skipped and not simulated else "")
            print(f"reduce-overhead: {replays + 1} steps equal dense (max error {max(errors):.1e})"
                  + (f"; inductor skipped CUDA graphs {skipped}x" if skipped and not simulated else ""))
        except (WrongResult, OutOfTime):
            raise
        except Exception as e:
            result["compile"] = f"error: {short_error(e)}"
            print(f"reduce-overhead: ERROR {short_error(e)}")
    return result


# ---- part 3: decoding per token against torch's compiled step ------------------------------

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


def run_decode_cell(flexc, torch_flex, name: str, S: int, D: int, device: str, deadline: float) -> dict:
    """One token at position S-1 of an S-key cache: flexc's step and torch's compiled step, each
    captured in a CUDA graph; flexc's also with 4 warps (the 16-row tile takes 2 by default)."""
    from flexc.backends.triton import config as triton_config

    B, Hq, Hkv = DECODE_BATCH, DECODE_HQ, DECODE_HKV
    g = torch.Generator().manual_seed(3)
    q = _randn((B, Hq, 1, D), torch.bfloat16, device, g)
    k, v = (_randn((B, Hkv, S, D), torch.bfloat16, device, g) for _ in range(2))
    input_pos = torch.tensor([S - 1], device=device)
    mask_mod = decode_mask(name)
    keys = S if name == "causal" else min(S, DECODE_WINDOW)
    flops = 4 * D * keys * B * Hq
    ours = flexc.create_block_mask(mask_mod, None, None, S, S, device=device)
    row: dict = {"B": B}

    def sliced(block_mask):
        mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
        mask.mask_mod, mask.seq_lengths = shifted_mask(mask_mod, input_pos[0]), (1, S)
        return mask

    def flexc_step():
        return flexc.flex_attention(q, k, v, block_mask=sliced(ours), enable_gqa=True)

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    try:
        row["flexc_us"] = graph_ms(flexc_step, device, row, "flexc") * 1e3
        row["flexc"] = tflops(row["flexc_us"] * 1e-3)
        default_warps = triton_config.default_warps
        triton_config.default_warps = lambda block_m, target: 4  # the same step with 4 warps
        try:
            row["flexc_w4_us"] = graph_ms(flexc_step, device, row, "flexc 4 warps") * 1e3
        finally:
            triton_config.default_warps = default_warps
    except OutOfTime:
        raise
    except Exception as e:
        row["flexc"] = short_error(e)
    if time.time() < deadline - 45:
        try:
            theirs = torch_flex.create_block_mask(mask_mod, None, None, S, S, device=device)
            compiled = torch.compile(lambda: torch_flex.flex_attention(q, k, v, block_mask=sliced(theirs),
                                                                       enable_gqa=True))
            want, got = compiled(), flexc_step()
            error = relative_error(got, want)
            if not error <= 2e-2:
                row["note"] = f"flexc and torch differ by {error:.1e}"
            row["torch_us"] = graph_ms(compiled, device, row, "torch") * 1e3
            row["torch"] = tflops(row["torch_us"] * 1e-3)
        except OutOfTime:
            raise
        except Exception as e:
            row["torch"] = short_error(e)
    else:
        row["torch"] = "skipped (time)"
    return row


def run_decode_table(flexc, torch_flex, device: str, dims, lengths, deadline: float, rows: list | None = None) -> list:
    """One row per (D, S, mask) appended to ``rows``: microseconds and TFLOP/s, or why none."""
    rows = [] if rows is None else rows
    for D in dims:
        for S in lengths:
            for name in ("causal", "sliding"):
                if time.time() > deadline:
                    rows.append(((D, S, name), {"flexc": "skipped (time)"}))
                    continue
                try:
                    rows.append(((D, S, name), run_decode_cell(flexc, torch_flex, name, S, D, device, deadline)))
                except OutOfTime:
                    raise
                except Exception as e:
                    rows.append(((D, S, name), {"flexc": short_error(e)}))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return rows


def print_decode_table(rows: list) -> None:
    print(f"\n== decoding, per token (bf16, B={DECODE_BATCH}, Hq={DECODE_HQ}, Hkv={DECODE_HKV}, one query row at "
          f"position S-1; each step captured in a CUDA graph, replays timed) ==")
    print(f"{'D':>4} {'S':>6} {'mask':<8} {'flexc us':>9} {'TFLOP/s':>8} {'torch us':>9} {'TFLOP/s':>8} "
          f"{'flexc/torch':>11} {'flexc 4 warps us':>16}")
    notes = []
    for (D, S, name), row in rows:
        f, t = row.get("flexc"), row.get("torch")
        ratio = f"{f / t:11.2f}" if isinstance(f, float) and isinstance(t, float) else f"{'-':>11}"
        us = lambda key: f"{row[key]:9.1f}" if key in row else f"{'-':>9}"
        w4 = f"{row['flexc_w4_us']:16.1f}" if "flexc_w4_us" in row else f"{'-':>16}"
        print(f"{D:>4} {S:>6} {name:<8} {us('flexc_us')} {fmt(f)} {us('torch_us')} {fmt(t)} {ratio} {w4}")
        for col in ("flexc", "torch", "note"):
            if isinstance(row.get(col), str):
                notes.append(f"  D={D} S={S} {name} {col}: {row[col]}")
    pairs = [(row["flexc_us"], row["flexc_w4_us"]) for _, row in rows if "flexc_w4_us" in row]
    if pairs:
        mean = math.exp(sum(math.log(a / b) for a, b in pairs) / len(pairs))
        print(f"the 16-row tile with 2 warps (default) over 4 warps: time ratio geomean {mean:.2f} ({len(pairs)} cells)")
    if notes:
        print("notes:")
        print("\n".join(notes))


def ratio_stats(rows: list) -> str:
    """``worst W geomean G (N cells)`` of flexc/torch over the cells where both were measured."""
    ratios = [row["flexc"] / row["torch"] for _, row in rows
              if isinstance(row.get("flexc"), float) and isinstance(row.get("torch"), float) and row["torch"] > 0]
    if not ratios:
        return "no cells"
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return f"worst {min(ratios):.2f} geomean {mean:.2f} ({len(ratios)} cells)"


def spread(values) -> tuple:
    """Every other value first (1K, 4K, 16K, then 2K, 8K): a spent budget still leaves a spread."""
    values = tuple(values)
    return values[::2] + values[1::2]


def run_all(args) -> int:
    """``--all``: correctness (fail fast), capture, then the timing tables within the budget; the
    last line printed is the one summary line."""
    start = time.time()
    simulated = args.simulate is not None
    budget = args.budget if args.budget is not None else ALL_BUDGET * (2 if simulated else 1)
    summary = {"capture": "not run", "timing": "not run"}
    tally = Tally()
    if not simulated and not torch.cuda.is_available():
        print("bench/gpu.py --all: no CUDA device on this machine; run it with --simulate sm_90 to exercise its "
              "logic on the CPU. Nothing was run.")
        print("gpu.py summary: nothing run (no CUDA device)")
        return 0
    import contextlib
    import warnings

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="return_lse is deprecated")
    import triton

    import flexc
    from torch.nn.attention import flex_attention as torch_flex

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    device = "cpu" if simulated else "cuda"
    L = args.check_length or (128 if simulated else 512)
    where = (f"simulated {args.simulate} (CPU tensors, kernels in Triton's interpreter)" if simulated
             else torch.cuda.get_device_name())
    print(f"bench/gpu.py --all on {where}; torch {torch.__version__}, triton {triton.__version__}, "
          f"budget {budget:.0f} s")

    def on_alarm(signum, frame):
        raise OutOfTime()

    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        previous_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(budget) + 5)  # hard stop: what was measured is still printed
    tables: dict = {}  # title -> rows, filled cell by cell (a hard stop keeps what was measured)
    printed: set = set()
    ok, failure = False, ""
    context = flexc.device.simulate(args.simulate) if simulated else contextlib.nullcontext()
    try:
        with context:
            ok = run_correctness(flexc, tally, L, device, start + budget * (0.85 if simulated else 0.5),
                                 args.cases)
            if ok:
                capture = run_capture(flexc, L, device, simulated, not args.no_compile)
                summary["capture"] = ", ".join(f"{'CUDA graph' if k == 'graph' else 'reduce-overhead'} "
                                               f"{'(simulated) ' if simulated and k == 'graph' else ''}{v}"
                                               for k, v in capture.items())
                ok = all(v.startswith("ok") or v == "not run" for v in capture.values())
                if simulated:
                    print("\n== 3. timing: needs a CUDA GPU (simulation runs the kernels in Triton's interpreter); "
                          "not run ==")
                    summary["timing"] = "timing needs a GPU (not run)"
                else:
                    summary["timing"] = run_timing(flexc, torch_flex, device, args, start + budget - 15, tables,
                                                   printed)
    except OutOfTime:
        print("\n(time budget exhausted: what follows is partial)")
        for title, rows in tables.items():
            if title not in printed:
                rows.sort(key=lambda item: item[0])
                print_timing(title, rows)
        summary["timing"] = "; ".join(f"{title} flexc/torch {ratio_stats(rows)}" for title, rows in tables.items())
        summary["timing"] = summary["timing"] or "timing not run (time)"
    except WrongResult as e:  # a capture replay differed from dense
        summary["capture"] = "FAILED"
        failure = str(e)
        print(f"FAIL {failure}", flush=True)
        ok = False
    except Exception as e:  # a bug of this script: still the summary line, and status 1
        traceback.print_exc()
        crashed = short_error(e)
        summary["timing"] = f"{summary['timing']} (stopped by {crashed})"
        ok = False
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous_handler)
    failure = tally.failure or failure
    head = (f"FAILED at {failure}; " if failure else "ok; " if ok else
            "FAILED (capture error); " if "error" in summary["capture"] else "FAILED (an error, above); ")
    print(f"gpu.py summary: {head}{tally.text()}; capture {summary['capture']}; {summary['timing']}; "
          f"{time.time() - start:.0f} s")
    return 0 if ok and not failure else 1


def print_timing(title: str, rows: list) -> None:
    if title == "decode":
        print_decode_table(rows)
    else:
        print_table(rows, backward=title == "forward+backward")


def run_timing(flexc, torch_flex, device: str, args, deadline: float, tables: dict, printed: set) -> str:
    """Part 3: forward, forward + backward and decoding tables against torch's compiled
    FlexAttention, sharing what is left of the budget (40%, 35%, the rest); a spent share leaves
    its remaining cells as 'skipped (time)'. Returns the tables' ratio summary."""
    compiled_flex = torch.compile(torch_flex.flex_attention)
    dims, lengths = args.dims, spread(args.lengths)
    shares = (("forward", 0.40), ("forward+backward", 0.35 / 0.60), ("decode", 1.0))
    for title, share in shares:
        table_deadline = time.time() + share * max(0.0, deadline - time.time())
        tables[title] = []
        for L in lengths:  # both head dims at each length before the next length
            for D in dims:
                if title == "decode":
                    run_decode_table(flexc, torch_flex, device, (D,), (L,), table_deadline, rows=tables[title])
                else:
                    run_table(flexc, torch_flex, compiled_flex, device, (D,), (L,), table_deadline,
                              backward=title != "forward", names=ALL_MASKS, rows=tables[title])
        tables[title].sort(key=lambda item: item[0])
        print_timing(title, tables[title])
        printed.add(title)
    return "; ".join(f"{title} flexc/torch {ratio_stats(rows)}" for title, rows in tables.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=64, L=1K and 4K only")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds before no new cell starts (540; with --all: the whole run, 450)")
    ints = lambda text: tuple(int(x) for x in text.split(","))
    parser.add_argument("--dims", type=ints, default=(64, 128), help="head dims, comma-separated (64,128)")
    parser.add_argument("--lengths", type=ints, default=(1024, 2048, 4096, 8192, 16384),
                        help="sequence lengths, comma-separated (1024,...,16384)")
    parser.add_argument("--backward", action="store_true", help="check gradients and time forward + backward")
    parser.add_argument("--decode", action="store_true", help="the decoding table of bench/decode.py on this GPU")
    parser.add_argument("--all", action="store_true",
                        help="the prepared run: correctness (fail fast), CUDA graph capture, the timing tables, "
                             "one summary line; under 8 minutes")
    parser.add_argument("--simulate", choices=("sm_80", "sm_90", "sm_100"), default=None,
                        help="with --all, no GPU needed: CPU tensors take that GPU's host decisions, kernels run "
                             "in Triton's interpreter (correctness and capture logic only)")
    parser.add_argument("--check-length", type=int, default=None,
                        help="with --all: sequence length of the correctness checks (512; simulated 128)")
    parser.add_argument("--cases", type=int, default=None, help="with --all: only the first N correctness cases")
    parser.add_argument("--no-compile", action="store_true",
                        help="with --all: skip the reduce-overhead step of the capture part")
    args = parser.parse_args(argv)
    if args.simulate and not args.all:
        parser.error("--simulate goes with --all")
    if args.all:
        return run_all(args)
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
