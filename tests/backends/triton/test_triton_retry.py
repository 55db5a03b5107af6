"""Every Triton launch (forward, backward, decode) runs again with a smaller configuration when the GPU
cannot hold it (Triton's ``OutOfResources``), warns once with a FallbackWarning saying what runs now,
remembers it per GPU capability, and lets every other error through. The GPU's launch code runs
under a simulated sm_90 (or sm_80); the launch is wrapped to raise ``OutOfResources`` for the large
configurations, as loading the compiled kernel does on a GPU, and the results are checked against
float64 dense."""
from __future__ import annotations

import warnings

import pytest
import torch

import flexc
from flexc import device as gpu
from flexc.backends.triton import cache as kernel_cache
from flexc.codegen.backward import BackwardSpec
from flexc.codegen.decode import DecodeSpec
from flexc.codegen.forward import ForwardSpec
from reference import dense_attention, random_qkv

OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources


def causal(b, h, q, kv):
    return q >= kv


@pytest.fixture()
def launches(monkeypatch):
    """``(launched specs, set_rule)``: ``set_rule(fn)`` makes a launch of a spec with ``fn(spec)`` true
    raise (``OutOfResources`` by default, else what ``fn`` returns); the rest run."""
    launch = gpu.launch
    launched, rule = [], [lambda spec: False]

    def guarded(fn, grid, spec, device, args, constants, fixed=0):
        launched.append(spec)
        error = rule[0](spec)
        if error:
            raise OutOfResources(300000, gpu.facts(device).shared_memory, "shared memory") if error is True else error
        return launch(fn, grid, spec, device, args, constants, fixed)

    monkeypatch.setattr(gpu, "launch", guarded)
    kernel_cache.cache_clear()
    yield launched, lambda fn: rule.__setitem__(0, fn)
    kernel_cache.cache_clear()


# backward tiles above fp32's default (torch's 16 x 16), so the retry has tiles to halve
TILES_32 = {"BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32, "bwd_num_stages": 1}


def test_backward_out_of_resources_runs_smaller_tiles_with_one_fallback_warning(launches):
    launched, set_rule = launches
    set_rule(lambda spec: isinstance(spec, BackwardSpec) and spec.block_n1 > 16)  # 32 x 32 tiles do not fit
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 1, 40, 40, 16, seed=5))
    block_mask = flexc.create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=32)
    grad = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(6))
    with gpu.simulate("sm_90"):
        with pytest.warns(flexc.FallbackWarning, match=r"backward kernel cannot run as configured: with BLOCK_M1=32, "
                          r"BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=32, num_stages=1 it needs more GPU resources than "
                          r"cpu \(sm_90\) has.*It runs with BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, "
                          r"num_stages=2 from now on") as record:
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=TILES_32)
            out.backward(grad)
        assert len([w for w in record if issubclass(w.category, flexc.FallbackWarning)]) == 1
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        launched.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", flexc.FallbackWarning)  # remembered: once per kernel and GPU
            flexc.flex_attention(q2, k2, v2, block_mask=block_mask, enable_gqa=True,
                                 kernel_options=TILES_32).backward(grad)
    assert [s.block_n1 for s in launched if isinstance(s, BackwardSpec)] == [16, 16]  # row pass, then backward
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, mask_mod=causal)[0]
    ref.backward(grad.double())
    for ours, theirs in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(ours.double(), theirs, atol=2e-5, rtol=2e-5)
    assert torch.equal(q2.grad, q.grad)


def test_decode_out_of_resources_runs_a_smaller_key_tile_with_one_fallback_warning(launches):
    launched, set_rule = launches
    set_rule(lambda spec: isinstance(spec, DecodeSpec) and spec.block_n > 32)
    q, k, v = random_qkv(2, 4, 2, 1, 256, 32, seed=7)
    with gpu.simulate("sm_90"):
        with pytest.warns(flexc.FallbackWarning, match=r"decode kernel cannot run as configured: with BLOCK_M=16, "
                          r"BLOCK_N=64, num_stages=1 .*It runs with BLOCK_M=16, BLOCK_N=32, num_stages=2 from now on"):
            out = flexc.flex_attention(q, k, v, enable_gqa=True)
        assert [(s.block_n, s.num_stages) for s in launched if isinstance(s, DecodeSpec)] == [(64, 1), (32, 2)]
    torch.testing.assert_close(out.double(), dense_attention(q, k, v)[0], atol=1e-5, rtol=1e-5)


def test_a_fallback_found_on_one_gpu_capability_does_not_apply_to_another(launches):
    """sm_80 has 164 KB of shared memory per block; what it cannot hold, sm_90 may."""
    launched, set_rule = launches
    set_rule(lambda spec: isinstance(spec, ForwardSpec) and spec.num_stages > 2 and gpu.simulated().name == "sm_80")
    q, k, v = random_qkv(1, 2, 2, 64, 64, 16, seed=8)
    options = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 3}
    with gpu.simulate("sm_80"):
        with pytest.warns(flexc.FallbackWarning, match="num_stages=2 from now on"):
            flexc.flex_attention(q, k, v, kernel_options=options)
        assert "num_stages=2" in flexc.kernel_source(q, k, v, kernel_options=options)
    launched.clear()
    with gpu.simulate("sm_90"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", flexc.FallbackWarning)
            out = flexc.flex_attention(q, k, v, kernel_options=options)
        assert [s.num_stages for s in launched] == [3]  # sm_90's own configuration, tried and run
        assert "num_stages=3" in flexc.kernel_source(q, k, v, kernel_options=options)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["forward", "backward", "decode"])
def test_an_error_other_than_out_of_resources_propagates_and_is_not_remembered(launches, kernel):
    launched, set_rule = launches
    kind = {"forward": ForwardSpec, "backward": BackwardSpec, "decode": DecodeSpec}[kernel]
    set_rule(lambda spec: isinstance(spec, kind) and RuntimeError("CUDA error: an illegal memory access"))
    L = 1 if kernel == "decode" else 32
    q, k, v = (t.requires_grad_(kernel == "backward") for t in random_qkv(1, 2, 2, L, 32, 16, seed=9))
    with gpu.simulate("sm_90"), warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)  # no fallback is taken
        with pytest.raises(RuntimeError, match="illegal memory access"):
            out = flexc.flex_attention(q, k, v)
            if kernel == "backward":
                out.sum().backward()
        tried = [s for s in launched if isinstance(s, kind)]
        assert len(tried) == 1 and kernel_cache.resolve_fallback(tried[0], q.device) is tried[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real out-of-resources error needs a CUDA device")
def test_tiles_too_large_for_the_gpu_fall_back_forward_and_backward_on_cuda():
    """kernel_options whose pipelined tiles exceed the GPU's shared memory (bf16, D=128: 256-key tiles
    at 5 stages forward, 128 x 128 tiles at 4 stages backward) run, each with one FallbackWarning."""
    kernel_cache.cache_clear()
    q, k, v = (t.cuda().to(torch.bfloat16).requires_grad_() for t in random_qkv(1, 2, 2, 512, 512, 128, seed=12))
    options = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 256, "fwd_num_stages": 5, "bwd_BLOCK_M1": 128, "bwd_BLOCK_N1": 128,
               "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 128, "bwd_num_stages": 4, "BACKEND": "TRITON"}
    grad = torch.randn(1, 2, 512, 128, device="cuda").to(torch.bfloat16)
    with pytest.warns(flexc.FallbackWarning) as record:
        out = flexc.flex_attention(q, k, v, kernel_options=options)
        out.backward(grad)
    kinds = sorted(w.message.args[0].split(" kernel ")[0].split()[-1] for w in record
                   if issubclass(w.category, flexc.FallbackWarning))
    assert kinds == ["backward", "forward"], [str(w.message) for w in record]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd)[0]
    ref.backward(grad.double())
    for ours, theirs in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(ours.double(), theirs, atol=3e-2, rtol=3e-2)
    kernel_cache.cache_clear()
