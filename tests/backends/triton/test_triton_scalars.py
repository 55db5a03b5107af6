"""Captured Python numbers are kernel arguments (new values reuse one kernel), and the kernel cache
is bounded (LRU) and really frees modules and files when it drops or clears kernels. Results are
checked against the dense float64 reference under Triton's interpreter."""
from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
import torch

import flexc
from flexc.backends.triton import cache as kernel_cache
from flexc.codegen.scalars import lift_scalars
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

TRITON = {"BACKEND": "TRITON"}
L, S = 64, 48


def temperature_mod(temperature: float, window: int):
    def softcap_window(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= window, score / temperature, score * 0.5)

    return softcap_window


def test_new_captured_numbers_reuse_one_kernel():
    q, k, v = random_qkv(1, 1, 1, L, S, 16)
    kernel_cache.cache_clear()
    for temperature, window in ((1.0, 3), (0.3, 17), (7.25, -4)):
        mod = temperature_mod(temperature, window)
        out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options=TRITON)
        ref, _, _ = dense_attention(q, k, v, score_mod=mod)
        torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=0)
    info = flexc.cache_info()
    assert (info.misses, info.hits, info.size) == (1, 2, 1)
    source = flexc.kernel_source(q, k, v, score_mod=temperature_mod(9.0, 2), kernel_options=TRITON)
    assert "def score_mod(score, b, h, q_idx, kv_idx, score_mod_window, score_mod_temperature):" in source
    assert "score * 0.5" in source and "9.0" not in source  # literals stay, captured values do not


def test_float64_calls_on_gpus_keep_captured_floats_as_literals():
    # a compiled kernel receives a Python float argument as fp32; torch computes a float64 call's
    # mod in float64, so on a GPU such a call keeps captured floats literals (ints still lifted)
    from types import SimpleNamespace

    from flexc.codegen.scalars import floats_travel_exactly, lift_for_call
    from flexc.mods.trace import trace

    gpu64 = SimpleNamespace(dtype=torch.float64, device=torch.device("cuda", 0))
    assert not floats_travel_exactly(gpu64)
    assert floats_travel_exactly(SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0)))
    assert floats_travel_exactly(torch.empty(1, dtype=torch.float64))  # the interpreter keeps float64
    traced = trace(temperature_mod(0.1 + 1e-9, 5))
    (lifted,) = lift_for_call(gpu64, traced)
    assert lifted.scalars == (5,)
    assert lift_for_call(torch.empty(1), traced)[0].scalars == (5, 0.1 + 1e-9)
    # on the CPU a float64 call lifts the float and stays exact
    q, k, v = (t.double() for t in random_qkv(1, 1, 1, L, S, 16))
    out = flexc.flex_attention(q, k, v, score_mod=temperature_mod(0.1 + 1e-9, 5), kernel_options=TRITON)
    ref = dense_attention(q, k, v, score_mod=temperature_mod(0.1 + 1e-9, 5))[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def softcap_mod(cap: float, temperature: float):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) / temperature

    return softcap


def _training_grads(q, k, v, mod, backend):
    """Gradients of ``sum(out * w)`` for (q, k, v); "DENSE" is autograd through the float64 reference."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if backend == "DENSE":
        out, _, _ = dense_attention(q, k, v, score_mod=mod, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    else:
        block_mask = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, L, S, BLOCK_SIZE=16)
        out = flexc.flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, kernel_options={"BACKEND": backend})
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return torch.autograd.grad((out.double() * w).sum(), (q, k, v))


def test_new_captured_numbers_train_with_one_backward_kernel():
    # d/d score of cap * tanh(score / cap) / temperature is (1 - tanh(score / cap)**2) / temperature:
    # the backward must compute it from the arguments, not from constants folded for one call
    q, k, v = random_qkv(1, 1, 1, L, S, 16, dtype=torch.float64, seed=4)
    kernel_cache.cache_clear()
    values = ((20.0, 1.0), (3.5, 0.7), (0.8, 2.5))
    for cap, temperature in values:
        mod = softcap_mod(cap, temperature)
        mine = _training_grads(q, k, v, mod, "TRITON")
        for backend in ("DENSE", "TORCH"):
            for a, b in zip(mine, _training_grads(q, k, v, mod, backend)):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    kinds = sorted(type(kernel.generated).__name__ for kernel in kernel_cache.cached_kernels())
    # one of each for all three calls
    assert kinds == ["GeneratedBackward", "GeneratedBackward", "GeneratedForward"]  # (the row pass is one)
    assert flexc.cache_info().misses == 3
    source = flexc.kernel_source(q, k, v, score_mod=softcap_mod(0.8, 2.5), backward=True, kernel_options=TRITON)
    assert "score_grad(score, b, h, q_idx, kv_idx, score_mod_cap, score_mod_temperature)" in source
    for literal in ("0.8", "2.5", "0.4"):  # the values, and 1 / 2.5 folded
        assert literal not in source


def test_captured_numbers_in_mask_mods_are_arguments_too():
    q, k, v = random_qkv(1, 1, 1, L, S, 16, seed=1)
    kernel_cache.cache_clear()
    for window in (5, 20):
        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

        block_mask = flexc.create_block_mask(sliding, 1, 1, L, S, BLOCK_SIZE=16)
        out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options=TRITON)
        ref, _, _ = dense_attention(q, k, v, mask_mod=sliding)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    assert flexc.cache_info().misses == 1


def test_structural_numbers_stay_literals():
    small = torch.arange(S, dtype=torch.uint8)
    wide = torch.randn(S, dtype=torch.float64)
    divisor, exponent, offset, weight = 16, 2, 300, 0.25

    def structural(score, b, h, q_idx, kv_idx):
        return (score + (q_idx // divisor) ** exponent + (small[kv_idx] + offset).float()
                + wide[kv_idx] * weight)

    lifted = lift_scalars(flexc.trace(structural))
    assert lifted.scalars == ()  # a divisor, an exponent, a uint8 operand, a float64 operand
    traced = flexc.trace(temperature_mod(2.0, 3))
    lifted = lift_scalars(traced)
    assert lifted.scalars == (3, 2.0) and str(lifted) == "where(q_idx - kv_idx <= window, score / temperature, score * 0.5)"
    grid = dict(score=torch.randn(1, 1, 8, 8), b=torch.zeros(1, 1, 1, 1, dtype=torch.long),
                h=torch.zeros(1, 1, 1, 1, dtype=torch.long), q_idx=torch.arange(8).view(1, 1, 8, 1),
                kv_idx=torch.arange(8).view(1, 1, 1, 8))
    assert torch.equal(flexc.evaluate(lifted, **grid), flexc.evaluate(traced, **grid))


def _run(mod):
    q, k, v = random_qkv(1, 1, 1, 32, 32, 16, seed=2)
    flexc.flex_attention(q, k, v, score_mod=mod, kernel_options=TRITON)
    return kernel_cache.cached_kernels()[-1]


def _module_of(kernel):
    name = os.path.splitext(os.path.basename(kernel.path))[0]
    return name, weakref.ref(sys.modules[name])


def test_cache_is_lru_bounded_and_frees_dropped_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXC_CACHE_DIR", str(tmp_path))
    mods = [lambda s, b, h, q_idx, kv_idx: s + 1.5,
            lambda s, b, h, q_idx, kv_idx: s * 3.5,
            lambda s, b, h, q_idx, kv_idx: s - q_idx]
    kernel_cache.cache_clear()
    previous = kernel_cache.cache_limit(2)
    try:
        first = _run(mods[0])
        name, module = _module_of(first)
        path = first.path
        del first
        _run(mods[1])
        _run(mods[0])  # a hit: the first kernel becomes the most recently used
        _run(mods[2])  # evicts the second kernel, not the first
        assert flexc.cache_info().size == 2 and name in sys.modules and os.path.exists(path)
        _run(mods[1])  # evicts the first
        assert flexc.cache_info().size == 2
        assert name not in sys.modules and not os.path.exists(path)
        gc.collect()
        assert module() is None
    finally:
        kernel_cache.cache_limit(previous)
    with pytest.raises(ValueError, match="cache_limit: kernels must be a positive int"):
        kernel_cache.cache_limit(0)


def test_cache_clear_frees_modules_and_files(tmp_path, monkeypatch):
    kernel_cache.cache_clear()
    monkeypatch.setenv("FLEXC_CACHE_DIR", str(tmp_path))
    kernel = _run(lambda s, b, h, q_idx, kv_idx: s + 0.125 * kv_idx)
    name, module = _module_of(kernel)
    path = kernel.path
    del kernel
    flexc.cache_clear()
    assert tuple(flexc.cache_info()) == (0, 0, 0)
    assert name not in sys.modules and not os.path.exists(path)
    gc.collect()
    assert module() is None
    _run(lambda s, b, h, q_idx, kv_idx: s + 0.125 * kv_idx)  # compiles again from scratch
    assert flexc.cache_info().misses == 1 and os.path.exists(path)
