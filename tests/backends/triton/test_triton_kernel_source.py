"""``flexc.kernel_source`` is the source of exactly the kernels ``flex_attention`` launches: the
kernels a call fetches from the Triton backend's cache are recorded and compared with what
kernel_source returns for the same arguments, over catalogue masks and a score_mod, inference with
and without the logsumexp, training (forward, and ``backward=True`` against the backward pass) and
1, 16 and 48 query rows, on the CPU (the interpreter's source) and under a simulated sm_90 (the
CUDA source). Calls that run no generated kernel get a message saying what runs instead."""
from __future__ import annotations

import ast
import re

import pytest
import torch

import flexc
from flexc.call import plan
from catalogue import mask_catalogue, score_catalogue
from flexc.backends.triton import cache as kernel_cache
from reference import random_qkv

TRITON = {"BACKEND": "TRITON"}
B, HQ, HKV, S, E = 1, 2, 1, 64, 16
SEPARATOR = re.compile(r"\n# ======== kernel (\d+)/(\d+): (\w+) ========\n")


@pytest.fixture()
def launched(monkeypatch):
    """The sources of the kernels launched since the last ``launched.clear()``: what the CPU runs,
    or under simulation what a GPU compiles for the spec launched (the interpreter runs its variant)."""
    sources: list[str] = []
    get_kernel = kernel_cache.get_kernel

    def recording(spec, device=None, key=None):
        kernel = get_kernel(spec, device, key)
        sources.append(kernel_cache.generate(spec).source if flexc.device.simulated() else kernel.generated.source)
        return kernel

    monkeypatch.setattr(kernel_cache, "get_kernel", recording)
    return sources


def split(text: str) -> list[str]:
    """kernel_source's text as the list of its kernels' sources, in launch order."""
    parts = SEPARATOR.split(text)
    if len(parts) == 1:
        return [text]
    preamble, rest = parts[0], parts[1:]
    count = len(rest) // 4
    assert preamble.startswith(f"# flexc: this call launches {count} kernels, in this order: ")
    assert [(int(i), int(n)) for i, n in zip(rest[0::4], rest[1::4])] == [(j, count) for j in range(1, count + 1)]
    names = rest[2::4]
    assert preamble.split("in this order: ")[1].split(".\n")[0] == ", then ".join(names)
    ast.parse(text)  # still one Python module
    return rest[3::4]


def check_call(launched, q, k, v, *, score_mod=None, block_mask=None, return_lse=False, train=False, **extra):
    """Run the call, recording its launches, and compare them with kernel_source (and, when training,
    the backward pass's with kernel_source(..., backward=True))."""
    options = dict(score_mod=score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   return_lse=return_lse, kernel_options=TRITON, **extra)
    if train:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    launched.clear()
    result = flexc.flex_attention(q, k, v, **options)
    forward = list(launched)
    assert forward, "the call launched no kernel"
    assert split(flexc.kernel_source(q, k, v, **options)) == forward
    if train:
        launched.clear()
        (result[0] if return_lse else result).sum().backward()
        assert split(flexc.kernel_source(q, k, v, **options, backward=True)) == list(launched)
        # the row pass (fp32: PRECISE_GRADIENTS' delta and probability sum), then the backward kernel
        assert len(launched) == 2 and "def flex_attention_backward_rows(" in launched[0]
        assert "def flex_attention_backward(" in launched[1]
    return forward


def catalogue_cases(L: int):
    masks = mask_catalogue(B, HQ, L, S)
    alibi = score_catalogue(B, HQ, L, S)["alibi_captured_slopes"]
    return [(None, None), (masks["causal"], None), (masks["document_causal"], alibi), (masks["noop"], alibi)]


@pytest.mark.parametrize("L", [1, 16, 48])
def test_kernel_source_is_what_the_call_launches(launched, L):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=L)
    for i, (mask, score) in enumerate(catalogue_cases(L)):
        block_mask = flexc.create_block_mask(mask, B, None, L, S, BLOCK_SIZE=32) if mask is not None else None
        kernels = check_call(launched, q, k, v, score_mod=score, block_mask=block_mask)
        assert len(kernels) == (2 if L <= 16 else 1)  # decoding: the split-KV kernel, then its merge
        with_lse = check_call(launched, q, k, v, score_mod=score, block_mask=block_mask, return_lse=True)
        if L > 16:
            assert "logsumexp output: yes" in with_lse[0] and "logsumexp output: no" in kernels[0]
        if i % 2 == L % 2 or L == 16:  # training: a spread of the cases (the interpreter's backward is slow)
            trained = check_call(launched, q, k, v, score_mod=score, block_mask=block_mask, train=True)
            # the generated backward reads the forward kernel's logsumexp: no decode kernel in training
            assert len(trained) == 1 and "logsumexp output: yes" in trained[0]


@pytest.mark.parametrize("L", [1, 48])
def test_kernel_source_is_the_cuda_source_launched_under_simulation(launched, L):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=L)
    _, (mask, _), (document, alibi), _ = catalogue_cases(L)
    with flexc.device.simulate("sm_90"):
        for score, mask_mod, train in ((None, mask, False), (alibi, document, True)):
            block_mask = flexc.create_block_mask(mask_mod, B, None, L, S, BLOCK_SIZE=32)
            kernels = check_call(launched, q, k, v, score_mod=score, block_mask=block_mask, return_lse=not train,
                                 train=train)
            assert all("target: cuda" in source for source in kernels)
            # the default (AUTO) is the Triton backend on a GPU: the same kernels
            options = dict(score_mod=score, block_mask=block_mask, enable_gqa=True, return_lse=not train)
            assert flexc.kernel_source(q, k, v, **options) == flexc.kernel_source(q, k, v, **options,
                                                                                  kernel_options=TRITON)


def test_captured_tensors_that_require_grad_make_the_call_training(launched):
    q, k, v = random_qkv(B, HQ, HQ, 16, S, E, seed=4)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    alibi = lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)
    launched.clear()
    flexc.flex_attention(q, k, v, score_mod=alibi, kernel_options=TRITON).sum().backward()
    forward, rows, backward = launched
    assert flexc.kernel_source(q, k, v, score_mod=alibi, kernel_options=TRITON) == forward
    assert split(flexc.kernel_source(q, k, v, score_mod=alibi, kernel_options=TRITON, backward=True)) == [rows, backward]
    assert "atomic_add" in backward
    with torch.no_grad():  # no autograd: inference, so 16 rows decode
        assert "flex_decode_split" in flexc.kernel_source(q, k, v, score_mod=alibi, kernel_options=TRITON)


@pytest.mark.parametrize("L", [1, 48])
def test_with_sinks_the_kernels_fold_them(launched, L):
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=6)
    sinks = torch.tensor([0.5, -1.0])
    kernels = check_call(launched, q, k, v, sinks=sinks)  # the forward kernel, or the decode merge, folds them
    if L == 1:  # the decode kernel is the sink-free one; its merge starts from the sink
        assert len(kernels) == 2 and "sink" not in kernels[0] and "m = sink" in kernels[1]
    else:  # no logsumexp asked for: the sink variant of the kernel without it
        assert "logsumexp output: no" in kernels[0] and "+ sink * " in kernels[0]
    check_call(launched, q, k, v, sinks=sinks.clone().requires_grad_(), train=True)  # the same backward


def test_a_backward_the_generated_kernel_cannot_run_is_named_with_what_runs(launched, monkeypatch):
    # a score_mod outside flexc.mods.derivative's rules (which ones are changes as rules are added)
    monkeypatch.setattr(plan, "generated_backward_applies", lambda score_mod: score_mod is None)
    clamp = lambda s, b, h, q_idx, kv_idx: torch.clamp(s, -1.0, 1.0)
    q, k, v = random_qkv(B, HQ, HKV, 1, S, E, seed=5)
    q.requires_grad_()
    forward = check_call(launched, q, k, v, score_mod=clamp)
    assert len(forward) == 2  # the torch backward needs no forward kernel's lse: decoding runs
    launched.clear()
    flexc.flex_attention(q, k, v, score_mod=clamp, enable_gqa=True, kernel_options=TRITON).sum().backward()
    assert launched == forward and q.grad is not None  # the backward launched no kernel
    message = flexc.kernel_source(q, k, v, score_mod=clamp, enable_gqa=True, kernel_options=TRITON, backward=True)
    assert message.startswith("# flexc: this call's backward runs no generated kernel")
    assert "torch_backward" in message and "@triton.jit" not in message


def test_calls_that_run_no_generated_kernel_say_what_runs_instead(launched):
    q, k, v = random_qkv(B, HQ, HKV, 48, S, E)
    launched.clear()
    flexc.flex_attention(q, k, v, enable_gqa=True)  # on the CPU the default is the TORCH backend
    assert launched == []
    for backward in (False, True):
        message = flexc.kernel_source(q, k, v, enable_gqa=True, backward=backward)
        assert message.startswith("# flexc: this ") and "'TORCH'" in message and "torch_cpu" in message
        assert "Fix: pass kernel_options={'BACKEND': 'TRITON'}" in message and "@triton.jit" not in message
    empty = torch.empty(B, HKV, 0, E)  # no keys: the launcher writes zeros itself
    flexc.flex_attention(q, empty, empty, enable_gqa=True, kernel_options=TRITON)
    assert launched == []
    assert "launches no kernel" in flexc.kernel_source(q, empty, empty, enable_gqa=True, kernel_options=TRITON)
    # max_scores needs the TORCH backend: kernel_source raises what the call raises
    with pytest.raises(ValueError, match="max_scores is supported by the TORCH backend only"):
        flexc.kernel_source(q, k, v, enable_gqa=True, kernel_options=TRITON,
                            return_aux=flexc.AuxRequest(max_scores=True))
