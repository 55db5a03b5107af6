"""flexc inside torch.compile: a 2-layer GPT-style model, compiled vs eager, on the CPU.

The model: pre-norm blocks (LayerNorm, fused QKV projection, attention, output projection, GELU
MLP), width 256 = 4 heads x 64, causal BlockMask plus ALiBi on learnable per-head slopes, fp32,
batch 1. For each L it prints medians over repetitions of

  train   one training step: forward, backward, SGD update
  infer   one forward under torch.no_grad()

for eager flexc and for ``torch.compile(model)`` (inductor, default options), their ratio
(compiled / eager; the goal is <= 1.1), and the first compiled call's extra time over a steady
eager call. Beside it, the same model on torch's own ``flex_attention`` compiled by
``torch.compile`` (its first call; torch has no CPU backward, so inference only): that is the
first-call cost users of torch's FlexAttention already pay.

Compilation uses a fresh inductor cache directory, so first calls include compilation.

    python bench/compile.py                  # L = 1024 and 4096 (many minutes: inductor compiles)
    python bench/compile.py --lengths 1024 --reps 3 --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="flexc-bench-inductor-"))

import torch  # noqa: E402
from torch.nn.attention import flex_attention as torch_flex  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import flexc  # noqa: E402
from models import Block  # noqa: E402  (the transformer block tests/torch_compile/test_compile.py compiles too)

warnings.filterwarnings("ignore")
H, D, LAYERS = 4, 64, 2


class GPT(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(attention, H, D) for _ in range(LAYERS))

    def forward(self, x, block_mask):
        for block in self.blocks:
            x = block(x, block_mask)
        return x


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _train_step(model, x, block_mask):
    out = model(x, block_mask)
    out.square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-4 * p.grad
            p.grad = None


def _infer(model, x, block_mask):
    with torch.no_grad():
        model(x, block_mask)


def run(L: int, reps: int) -> None:
    torch._dynamo.reset()  # each length compiles static shapes afresh
    torch.manual_seed(0)
    x = torch.randn(1, L, H * D)
    block_mask = flexc.create_block_mask(causal, None, None, L, L)
    rows = []
    for name, step in (("train", _train_step), ("infer", _infer)):
        eager = GPT(flexc.flex_attention)
        compiled_model = GPT(flexc.flex_attention)
        compiled_model.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled_model)
        step(eager, x, block_mask)  # warm: traces, thread pools
        t = time.perf_counter()
        step(compiled, x, block_mask)
        first = time.perf_counter() - t
        t_eager = _median(lambda: step(eager, x, block_mask), reps)
        t_compiled = _median(lambda: step(compiled, x, block_mask), reps)
        rows.append((name, t_eager, t_compiled, first - t_eager))
    # torch's own FlexAttention, compiled: its first call (inference; no CPU backward in torch)
    torch_mask = torch_flex.create_block_mask(causal, None, None, L, L, device="cpu")
    reference = torch.compile(GPT(torch_flex.flex_attention))
    t = time.perf_counter()
    _infer(reference, x, torch_mask)
    torch_first = time.perf_counter() - t
    for name, t_eager, t_compiled, extra in rows:
        print(f"L={L:5d} {name:5s}  eager {t_eager:8.4f} s  compiled {t_compiled:8.4f} s  "
              f"ratio {t_compiled / t_eager:5.2f}  first-call extra {extra:7.1f} s", flush=True)
    print(f"L={L:5d} torch's flex_attention compiled, first inference call {torch_first:7.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: per-call costs on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {LAYERS} layers, {H} heads x {D}, fp32, "
          f"causal + learnable ALiBi; inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}", flush=True)
    for L in args.lengths:
        run(L, args.reps)


if __name__ == "__main__":
    main()
