"""A GPU launch through the compiled kernel passes what Triton's own launch passes, and only when
Triton would launch that same compiled kernel (:mod:`flexc.compiled_launch`).

No GPU here: the kernels flexc launches are captured under a simulated sm_90, their CUDA sources
imported as ``JITFunction``s, and Triton's own binder for an sm_90 target (built offline, as
``bench/kernel_metrics.py`` compiles) says what ``JITFunction.run`` would bind and specialize.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import flexc
from flexc import compiled_launch
from flexc import device as gpu
from flexc.backends.triton import cache

pytest.importorskip("triton")


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _captured_launches(monkeypatch) -> list:
    """``(JITFunction, args, constants, options)`` of every kernel a forward, a training step and a
    decoding step launch on a simulated sm_90 (launches recorded, not run)."""
    launches = []

    def record(fn, grid, spec, device, args, constants, fixed=0):
        launches.append((spec, device, list(args), dict(constants), gpu.launch_options(spec, device), fixed))

    monkeypatch.setattr(gpu, "launch", record)
    g = torch.Generator().manual_seed(0)
    with gpu.simulate("sm_90"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, k, v = (torch.randn(1, 2, 256, 32, generator=g, dtype=torch.bfloat16) for _ in range(3))
        scale = torch.tensor([0.5, 2.0])
        bm = flexc.create_block_mask(_causal, None, None, 256, 256)
        flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * scale[h], block_mask=bm, return_lse=True)
        qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
        flexc.flex_attention(qt, kt, vt, block_mask=bm).sum().backward()
        for position in (130, 131):  # (the second step launches warm: the gathered row, kept scalars)
            row = bm[:, :, torch.tensor([position // 128])]
            row.mask_mod, row.seq_lengths = (lambda b, h, qi, kv: qi + position >= kv), (1, 256)
            flexc.flex_attention(q[:, :, :1], k, v, block_mask=row)
    compiled = []
    for spec, device, args, constants, options, fixed in launches:
        generated = cache.generated_for(spec, device)  # (the source a GPU compiles)
        module, _ = cache.import_source(generated.source, "cuda")
        compiled.append((getattr(module, generated.kernel_name), args, constants, options, fixed))
    return compiled


def _binder(fn):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))


@pytest.fixture(scope="module")
def launches():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _captured_launches(monkeypatch)


def test_every_kind_of_launch_is_captured(launches):
    names = {fn.fn.__name__ for fn, *_ in launches}
    assert len(launches) >= 7 and len(names) >= 4, names  # forward, backward prologue and kernel, decode, merge


def test_bound_arguments_are_the_ones_triton_binds(launches):
    for fn, args, constants, options, fixed in launches:
        bound, _, _ = _binder(fn)(*args, **constants, **options)
        mine = compiled_launch.launches_of(fn).bound(args, constants)
        assert len(mine) == len(bound) and all(a is b for a, b in zip(mine, bound.values())), fn.fn.__name__


def _variants(args: list):
    """Each argument list differing from ``args`` in one argument's specialization class: a tensor
    16-byte misaligned, an integer made 1, 16 or 17, or wider than 32 bits."""
    for i, a in enumerate(args):
        if type(a) is torch.Tensor and a.numel() > 0:
            flat = torch.empty(a.numel() + 16, dtype=a.dtype)
            shift = next(s for s in range(1, 16) if (flat.data_ptr() + s * a.element_size()) & 15)
            yield args[:i] + [flat[shift:shift + a.numel()].view(a.shape)] + args[i + 1:]
        elif type(a) is int:
            for other in (1, 16, 17, 2 ** 40):
                if other != a:
                    yield args[:i] + [other] + args[i + 1:]


def test_launches_triton_compiles_apart_have_different_keys(launches):
    """The key is never equal where Triton's specialization differs (it may differ where Triton's does not)."""
    checked = 0
    for fn, args, constants, options, fixed in launches:
        binder, kept = _binder(fn), compiled_launch.launches_of(fn)
        _, base, _ = binder(*args, **constants, **options)
        keys = [kept.key(fn, args, constants, options, 0, fixed), compiled_launch.arguments_key(args)]
        for variant in _variants(args):
            _, specialization, _ = binder(*variant, **constants, **options)
            if specialization != base:  # (as the launch keys it, with its fixed tail, and all by class)
                assert kept.key(fn, variant, constants, options, 0, fixed) != keys[0], fn.fn.__name__
                assert compiled_launch.arguments_key(variant) != keys[1], fn.fn.__name__
                checked += 1
    assert checked > 20 and any(fixed for *_, fixed in launches)


class _FakeKernel:
    """Stands for a ``CompiledKernel``: records the launcher calls."""

    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self):
        self.calls = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *call):
        self.calls.append(call)


class _FakeJIT:
    """Stands for a ``JITFunction`` of ``kernel(x_ptr, n, scale, BLOCK: constexpr, FLAG: constexpr = 3)``."""

    def __init__(self):
        def kernel(x_ptr, n, scale, BLOCK, FLAG=3):
            pass

        self.fn, self.pre_run_hooks, self.runs, self.compiled = kernel, [], [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.runs.append((grid, args, kwargs))
            self.compiled.append(_FakeKernel())
            return self.compiled[-1]
        return run


def test_a_warm_launch_calls_the_compiled_kernel_with_every_parameter(monkeypatch):
    monkeypatch.setattr(compiled_launch, "current_stream", lambda index: 1000 + index)
    fn, x = _FakeJIT(), torch.zeros(64)
    launches = compiled_launch.launches_of(fn)
    options = {"num_warps": 4, "num_stages": 2}
    launches.launch(fn, (3, 2), [x, 64, 0.5], {"BLOCK": 16}, options, 0)  # compiles: through JITFunction.run
    assert len(fn.runs) == 1 and fn.runs[0][2] == {"BLOCK": 16, **options}
    y = torch.ones(64)
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 16}, options, 1)  # (another device: compiled apart)
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 16}, options, 0)
    assert len(fn.runs) == 2
    kernel = fn.compiled[0]
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert kernel.calls == [(5, 1, 1, 1000, "function handle", "packed metadata", None, *hooks, y, 128, 0.25, 16, 3)]
    # what Triton specializes apart goes through JITFunction.run again: an integer 1, another constexpr,
    # a misaligned tensor, a tensor subclass
    launches.launch(fn, (5,), [y, 1, 0.25], {"BLOCK": 16}, options, 0)
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 32}, options, 0)
    launches.launch(fn, (5,), [torch.zeros(65)[1:], 128, 0.25], {"BLOCK": 16}, options, 0)

    class Sub(torch.Tensor):
        pass

    launches.launch(fn, (5,), [y.as_subclass(Sub), 128, 0.25], {"BLOCK": 16}, options, 0)
    launches.launch(fn, (5,), [y.as_subclass(Sub), 128, 0.25], {"BLOCK": 16}, options, 0)
    assert len(fn.runs) == 7 and len(kernel.calls) == 1
    # a fixed tail is keyed by its values and types: a float where an int was is another kernel
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 16}, options, 0, fixed=2)
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 16}, options, 0, fixed=2)
    launches.launch(fn, (5,), [y, 128.0, 0.25], {"BLOCK": 16}, options, 0, fixed=2)
    assert len(fn.runs) == 9 and fn.compiled[7].calls == [kernel.calls[0]]
    # FLEXC_COMPILED_LAUNCH=0: every launch through JITFunction.run
    monkeypatch.setattr(compiled_launch, "ENABLED", False)
    launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": 16}, options, 0)
    assert len(fn.runs) == 10 and len(kernel.calls) == 1
    # an unhashable constexpr: through JITFunction.run, every time
    monkeypatch.setattr(compiled_launch, "ENABLED", True)
    for _ in range(2):
        launches.launch(fn, (5,), [y, 128, 0.25], {"BLOCK": [16]}, options, 0)
    assert len(fn.runs) == 12 and len(kernel.calls) == 1
