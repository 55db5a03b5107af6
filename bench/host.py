"""Host time per flexc call: what flexc's Python costs around its kernels (issue 38).

Under ``flexc.device.simulate("sm_90")`` (CPU tensors take an H100's host decisions) with
:func:`flexc.device.launch` replaced by a no-op that counts its calls, so each row measures everything
a call does on the host up to the launch, and nothing of the kernel or of Triton's launcher:

- forward: warm ``flex_attention`` (B=1, H=8, L=256, D=64, bf16, causal BlockMask);
- forward + lse: the same call with ``return_lse=True``;
- training step: that forward on inputs that require grad, then ``torch.autograd.grad``;
- floor: a trivial ``torch.autograd.Function`` making the training step's launches (the same stub,
  as many times forward and backward) and allocating its outputs: what any autograd op pays;
- decode step: gpt-fast's idiom on a 1024-key cache, one query row, positions advancing:
  ``mask = block_mask[:, :, input_pos // 128]``, a new ``mask_mod`` closure over ``input_pos[0]`` and
  ``mask.seq_lengths = (1, 1024)`` every step, then the call (slicing included);
- of which the idiom alone: the decode step's own ops without flexc (advancing ``input_pos``, the
  new closure, ``input_pos // 128``): what the step costs whichever library serves the slice and call;
- compiled forward: the forward row inside ``torch.compile(fullgraph=True)``, with
  ``backend="aot_eager"`` (inductor's compile is minutes on a small CPU; at run time a compiled graph
  of one custom-op node costs the guards, the runtime wrapper and the op itself, which is this).

- CPU training step against SDPA: the small training row (B=2, H=4, L=256, D=32, fp32, causal,
  forward and backward) on the CPU for real (no simulation, nothing stubbed), flexc with a causal
  BlockMask against ``torch.nn.functional.scaled_dot_product_attention`` with the dense boolean mask
  (bench/cpu_training.py's "small" row): where kernels are this short, host time shows;
- CPU forward against SDPA: the same row's forward without autograd (inference), causal and a
  sliding window of 64 (one dense tile on flexc's side).
- CPU decode step against SDPA: the decode step row in fp32 on the CPU for real, against SDPA
  reading the position's row of a dense causal boolean mask.
- launch binding, per kernel kind: what a GPU launch costs before Triton's launcher runs, which the
  stub leaves out: ``JITFunction.run``'s argument binding, specialization and cache key (Triton's
  binder for an sm_90 target, built without a GPU) against :mod:`flexc.compiled_launch`'s key and
  argument list, for the arguments of each kind's launch above.

Medians over repetitions (interleaved: each repetition times every row once), one thread, µs per call.
The last line is a one-line summary.

Usage: python bench/host.py [--repeats N] [--calls N] [--cpu-time]
  --cpu-time: time.thread_time (this thread's CPU time) instead of wall time, for a loaded machine
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT]  # this checkout's flexc

import torch  # noqa: E402

import flexc  # noqa: E402
from flexc import compiled_launch  # noqa: E402
from flexc import device as gpu  # noqa: E402

B, H, L, D = 1, 8, 256, 64
CACHE = 1024  # the decode step's keys
DTYPE = torch.bfloat16
BLOCK = 128


class LaunchCounter:
    """Stands in for :func:`flexc.device.launch`: counts the launches and launches nothing; keeps the
    latest (warm) launch of each kernel kind while ``recording`` (``seen``: name -> (spec, device, args,
    constexprs, fixed))."""

    def __init__(self):
        self.count = 0
        self.seen: dict = {}
        self.recording = False  # (only while rows warm up: nothing is recorded while they are timed)

    def __call__(self, fn, grid, spec, device, args, constants, fixed: int = 0) -> None:
        self.count += 1
        if self.recording and spec is not None:
            self.seen[type(spec).__name__.removesuffix("Spec").lower()] = (spec, device, args, constants, fixed)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _rows(stub: LaunchCounter) -> dict[str, Callable[[], object]]:
    """Each row's call, warm: built here and called once before timing."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(DTYPE) for _ in range(3))
    bm = flexc.create_block_mask(causal, None, None, L, L)
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(B, H, L, D, generator=g).to(DTYPE)

    def forward():
        return flexc.flex_attention(q, k, v, block_mask=bm)

    def forward_lse():
        return flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)

    def training():
        out = flexc.flex_attention(qt, kt, vt, block_mask=bm)
        return torch.autograd.grad(out, (qt, kt, vt), grad_out)

    # the floor makes as many launches as the training step: counted on one step
    before = stub.count
    out = flexc.flex_attention(qt, kt, vt, block_mask=bm)
    forward_launches = stub.count - before
    torch.autograd.grad(out, (qt, kt, vt), grad_out)
    backward_launches = stub.count - before - forward_launches

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            for _ in range(forward_launches):
                gpu.launch(None, (1,), None, query.device, [], {})
            return torch.empty_like(query)

        @staticmethod
        def backward(ctx, grad):
            for _ in range(backward_launches):
                gpu.launch(None, (1,), None, grad.device, [], {})
            return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)

    def floor():
        out = Trivial.apply(qt, kt, vt)
        return torch.autograd.grad(out, (qt, kt, vt), grad_out)

    # gpt-fast's decode step
    qd = torch.randn(B, H, 1, D, generator=g).to(DTYPE)
    kd, vd = (torch.randn(B, H, CACHE, D, generator=g).to(DTYPE) for _ in range(2))
    parent = flexc.create_block_mask(causal, None, None, CACHE, CACHE, BLOCK_SIZE=BLOCK)
    input_pos = torch.tensor([CACHE // 2])
    positions = iter(range(10 ** 9))

    def decode():
        input_pos.fill_(CACHE // 2 + next(positions) % (CACHE // 2))  # advanced in place, as gpt-fast does
        offset = input_pos[0]

        def mask_mod(b, h, q_idx, kv_idx):  # a new closure every step, as gpt-fast's get_mask_mod makes it
            return causal(b, h, q_idx + offset, kv_idx)

        mask = parent[:, :, input_pos // BLOCK]
        mask.mask_mod, mask.seq_lengths = mask_mod, (1, CACHE)
        return flexc.flex_attention(qd, kd, vd, block_mask=mask)

    def decode_idiom():  # the step without flexc: its own torch ops and closure, which any library's step pays
        input_pos.fill_(CACHE // 2 + next(positions) % (CACHE // 2))
        offset = input_pos[0]

        def mask_mod(b, h, q_idx, kv_idx):
            return causal(b, h, q_idx + offset, kv_idx)
        return input_pos // BLOCK, mask_mod

    def attend(query, key, value, block_mask):
        return flexc.flex_attention(query, key, value, block_mask=block_mask)

    compiled_attend = torch.compile(attend, backend="aot_eager", fullgraph=True)

    def compiled():
        return compiled_attend(q, k, v, bm)

    return {"forward": forward, "forward + lse": forward_lse, "training step": training,
            "floor (trivial autograd.Function)": floor, "decode step (gpt-fast)": decode,
            IDIOM: decode_idiom, "compiled forward (aot_eager)": compiled}


IDIOM = "  of which the idiom alone"  # (the decode step's own ops: a row that launches nothing)


def measure(repeats: int = 7, calls: int = 200, clock: Callable[[], float] = time.perf_counter
            ) -> dict[str, tuple[float, int]]:
    """``{row: (median µs per call, launches per call)}``, one thread, launches stubbed, sm_90 simulated."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stub = LaunchCounter()
    real_launch, gpu.launch = gpu.launch, stub
    try:
        with gpu.simulate("sm_90"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (flexc's "called without torch.compile"-style notes)
            rows = _rows(stub)
            launches = {}
            stub.recording = True
            for name, fn in rows.items():
                fn()  # warm: kernels generated, tables built, graphs compiled
                before = stub.count
                fn()
                launches[name] = stub.count - before
            stub.recording = False
            medians = interleaved_medians(rows, repeats, calls, clock)
    finally:
        gpu.launch = real_launch
        torch.set_num_threads(threads)
    measure.seen = stub.seen  # (the launches measure_binding times)
    return {name: (us, launches[name]) for name, us in medians.items()}


def measure_binding(seen: dict, repeats: int = 7, calls: int = 2000, clock: Callable[[], float] = time.perf_counter
                    ) -> dict[str, dict[str, float]]:
    """``{kernel kind: {"triton": µs, "flexc": µs}}`` per launch on a GPU, before the launcher runs:
    ``JITFunction.run``'s binding, specialization and cache key (Triton's binder for an sm_90 target,
    built offline) against :mod:`flexc.compiled_launch`'s key and bound arguments, for the arguments
    each kind's last launch in :func:`measure` had (``seen``: :attr:`LaunchCounter.seen`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    from flexc.backends.triton import cache

    backend = make_backend(GPUTarget("cuda", 90, 32))
    out = {}
    for kind, (spec, device, args, constants, fixed) in seen.items():
        generated = cache.generated_for(spec, device)  # (the source a GPU compiles, imported as one)
        module, _ = cache.import_source(generated.source, "cuda")
        fn = getattr(module, generated.kernel_name)
        binder, keys = create_function_from_signature(fn.signature, fn.params, backend), {}
        options = gpu.launch_options(spec, device)
        launches = compiled_launch.launches_of(fn)

        def triton_binds():
            kwargs = dict(constants, **options, debug=False)
            bound, specialization, opts = binder(*args, **kwargs)
            return compute_cache_key(keys, specialization, opts), list(bound.values())

        def flexc_binds():
            return launches.kernels.get(launches.key(fn, args, constants, options, 0, fixed)), launches.bound(args, constants)

        out[kind] = interleaved_medians({"triton": triton_binds, "flexc": flexc_binds}, repeats, calls, clock)
    return out


def interleaved_medians(rows: dict[str, Callable[[], object]], repeats: int, calls: int,
                        clock: Callable[[], float]) -> dict[str, float]:
    """``{row: median µs per call}``: each repetition times ``calls`` calls of every row in turn, so a
    busy moment of the machine falls on all rows alike."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            start = clock()
            for _ in range(calls):
                fn()
            times[name].append((clock() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


CPU_ROW = (2, 4, 256, 32)  # B, H, L, D of the CPU training row


def measure_cpu_training(repeats: int = 7, calls: int = 20, clock: Callable[[], float] = time.perf_counter
                         ) -> dict[str, float]:
    """``{"flexc": µs, "sdpa": µs}`` per CPU training step (forward and backward, causal), one thread."""
    def steps(leaves, grad_out, block_mask, dense):
        return {
            "flexc": lambda: torch.autograd.grad(flexc.flex_attention(*leaves, block_mask=block_mask), leaves,
                                                 grad_out),
            "sdpa": lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=dense), leaves, grad_out),
        }
    return _cpu_rows(steps, causal, True, repeats, calls, clock)


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < CPU_WINDOW)


CPU_WINDOW = 64


def measure_cpu_forward(repeats: int = 7, calls: int = 20, clock: Callable[[], float] = time.perf_counter
                        ) -> dict[str, float]:
    """``{"flexc causal": µs, "sdpa causal": µs, "flexc window": µs, "sdpa window": µs}`` per CPU forward
    without autograd (inference) of the small row, one thread; SDPA with the dense boolean mask."""
    rows = {}
    for name, mask_mod in (("causal", causal), ("window", sliding_window)):
        def steps(leaves, grad_out, block_mask, dense):
            return {f"flexc {name}": lambda: flexc.flex_attention(*leaves, block_mask=block_mask),
                    f"sdpa {name}": lambda: torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=dense)}
        rows.update(_cpu_rows(steps, mask_mod, False, repeats, calls, clock))
    return rows


def measure_cpu_decode(repeats: int = 7, calls: int = 20, clock: Callable[[], float] = time.perf_counter
                       ) -> dict[str, float]:
    """``{"flexc": µs, "sdpa": µs}`` per CPU decoding step, one thread: gpt-fast's idiom (the decode
    step row's, B=1 H=8, a 1024-key cache, D=64) in fp32 on the CPU, against the same step with SDPA
    reading the row ``input_pos`` of a dense causal boolean mask (gpt-fast's path without flex)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(B, H, 1, D, generator=g)
        k, v = (torch.randn(B, H, CACHE, D, generator=g) for _ in range(2))
        parent = flexc.create_block_mask(causal, None, None, CACHE, CACHE, device="cpu", BLOCK_SIZE=BLOCK)
        dense = torch.ones(CACHE, CACHE, dtype=torch.bool).tril()
        input_pos = torch.tensor([CACHE // 2])
        positions = iter(range(10 ** 9))

        def flexc_step():
            input_pos.fill_(CACHE // 2 + next(positions) % (CACHE // 2))
            offset = input_pos[0]

            def mask_mod(b, h, q_idx, kv_idx):
                return causal(b, h, q_idx + offset, kv_idx)
            mask = parent[:, :, input_pos // BLOCK]
            mask.mask_mod, mask.seq_lengths = mask_mod, (1, CACHE)
            return flexc.flex_attention(q, k, v, block_mask=mask)

        def sdpa_step():
            input_pos.fill_(CACHE // 2 + next(positions) % (CACHE // 2))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None, input_pos])
        rows = {"flexc": flexc_step, "sdpa": sdpa_step}
        for _ in range(CACHE // 2):  # warm: every row's plan made
            flexc_step()
        sdpa_step()
        return interleaved_medians(rows, repeats, calls, clock)
    finally:
        torch.set_num_threads(threads)


def _cpu_rows(steps: Callable, mask_mod: Callable, grad: bool, repeats: int, calls: int,
              clock: Callable[[], float]) -> dict[str, float]:
    """Medians of ``steps(leaves, grad_out, block_mask, dense_mask)``'s rows on the CPU row's inputs
    (leaves requiring grad where ``grad``) under ``mask_mod``, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        q, k, v, grad_out = (torch.randn(*CPU_ROW, generator=g) for _ in range(4))
        leaves = tuple(t.requires_grad_(grad) for t in (q, k, v))
        L = CPU_ROW[2]
        block_mask = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu")
        positions = torch.arange(L)
        dense = mask_mod(0, 0, positions.view(-1, 1), positions.view(1, -1))
        rows = steps(leaves, grad_out, block_mask, dense)
        for step in rows.values():
            step()  # warm
        return interleaved_medians(rows, repeats, calls, clock)
    finally:
        torch.set_num_threads(threads)


def summary(results: dict[str, tuple[float, int]], cpu: dict[str, float] | None = None) -> str:
    t = {name: us for name, (us, _) in results.items()}
    floor = t["floor (trivial autograd.Function)"]
    return (f"host µs/call (sm_90 simulated, launches stubbed, 1 thread, medians): forward {t['forward']:.0f}, "
            f"forward+lse {t['forward + lse']:.0f}, training step {t['training step']:.0f} "
            f"({t['training step'] - floor:+.0f} over the floor's {floor:.0f}), decode step "
            f"{t['decode step (gpt-fast)']:.0f} (the idiom's own ops {t[IDIOM]:.0f}), compiled forward (aot_eager) {t['compiled forward (aot_eager)']:.0f}"
            + (f"; CPU training step {cpu['flexc']:.0f} us = {cpu['flexc'] / cpu['sdpa']:.2f}x SDPA's" if cpu else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="repetitions, each timing every row (median)")
    parser.add_argument("--calls", type=int, default=200, help="calls per row per repetition")
    parser.add_argument("--cpu-time", action="store_true", help="time this thread's CPU time, not wall time")
    args = parser.parse_args(argv)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    results = measure(args.repeats, args.calls, clock)
    cpu = measure_cpu_training(args.repeats, max(1, args.calls // 10), clock)
    print(f"B={B} H={H} L={L} D={D} {str(DTYPE).removeprefix('torch.')}, causal; decode: cache {CACHE}, one row")
    print(f"{'row':<36} {'µs/call':>9} {'launches':>9}")
    for name, (us, launches) in results.items():
        print(f"{name:<36} {us:>9.1f} {launches:>9}")
    B2, H2, L2, D2 = CPU_ROW
    print(f"CPU training step, B={B2} H={H2} L={L2} D={D2} fp32, causal: flexc {cpu['flexc']:.1f} µs, "
          f"SDPA {cpu['sdpa']:.1f} µs")
    forward = measure_cpu_forward(args.repeats, max(1, args.calls // 10), clock)
    for name in ("causal", "window"):
        print(f"CPU forward (no autograd), same row, {name}{' ' + str(CPU_WINDOW) if name == 'window' else ''}: "
              f"flexc {forward['flexc ' + name]:.1f} µs, SDPA {forward['sdpa ' + name]:.1f} µs "
              f"({forward['flexc ' + name] / forward['sdpa ' + name]:.2f}x)")
    decode = measure_cpu_decode(args.repeats, args.calls, clock)
    print(f"CPU decode step (gpt-fast), B={B} H={H} cache {CACHE} D={D} fp32: flexc {decode['flexc']:.1f} µs, "
          f"SDPA with the boolean mask row {decode['sdpa']:.1f} µs ({decode['flexc'] / decode['sdpa']:.2f}x)")
    for kind, us in measure_binding(measure.seen, args.repeats).items():
        print(f"{kind} launch on a GPU, before the launcher: JITFunction.run's binding {us['triton']:.1f} µs, "
              f"flexc.compiled_launch {us['flexc']:.1f} µs")
    print(summary(results, cpu))


if __name__ == "__main__":
    main()
