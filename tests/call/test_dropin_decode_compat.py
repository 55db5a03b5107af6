"""Calls from torch's decoding tests and idioms that torch's FlexAttention runs, run by flexc.

Each case is checked against torch's own eager FlexAttention on CPU or the float64 dense reference:
the kernel_options keys torch's kernels read, torch's no-op BlockMask (``_create_empty_block_mask``)
used with inputs of any length, and a compiled decoding loop whose mask_mod and score_mod capture
a Python int position that torch.compile makes symbolic.
"""
import math
import pathlib
import re

import pytest
import torch
import torch.nn.attention.flex_attention as tfa

import flexc
from flexc.backends.triton import decode as triton_decode
from reference import dense_attention, random_qkv

INTERPRET = {"BACKEND": "TRITON"}  # CPU tensors: generated kernels under Triton's interpreter


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _torch_kernel_option_keys() -> set:
    """The keys torch's installed FlexAttention kernels read from kernel_options (its source, not a copy)."""
    folder = pathlib.Path(torch.__file__).parent / "_inductor" / "kernel" / "flex"
    pattern = re.compile(r"""(?:kernel_options|cur_kernel_options)\s*(?:\.setdefault\(\s*|\.get\(\s*|\[)"(\w+)\"""")
    keys = set()
    for path in folder.glob("*.py"):
        keys |= set(pattern.findall(path.read_text()))
    # torch asserts these two are absent (it sets them from return_lse/return_aux); flexc does too
    return keys - {"OUTPUT_LOGSUMEXP", "OUTPUT_MAX"}


def test_every_kernel_options_key_torch_reads_is_accepted_and_changes_nothing():
    keys = _torch_kernel_option_keys()
    assert {"SPLIT_KV", "GQA_SHARED_HEADS", "BLOCK_M", "IS_DIVISIBLE"} <= keys  # the scan found torch's keys
    q, k, v = random_qkv(1, 4, 2, 24, 40, 16)
    values = {key: "ieee" if key == "FLOAT32_PRECISION" else 64 if key.startswith("BLOCK") else 1 for key in keys}
    ref = tfa.flex_attention(q, k, v, causal_score, enable_gqa=True)
    torch_out = tfa.flex_attention(q, k, v, causal_score, enable_gqa=True, kernel_options=dict(values))
    torch.testing.assert_close(torch_out, ref, atol=0, rtol=0)  # torch's eager path ignores them too
    for key, value in sorted(values.items()):
        for name in (key, f"fwd_{key}", f"bwd_{key}"):
            options = {name: value}
            out = flexc.flex_attention(q, k, v, causal_score, enable_gqa=True, kernel_options=options)
            assert options == {name: value}  # not mutated
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6, msg=name)


def causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx + 16 >= kv_idx, score, -float("inf"))


@pytest.mark.parametrize("typo, suggestion", [("SPLIT_KVV", "SPLIT_KV"), ("fwd_BLOCK_MM", "BLOCK_M"),
                                              ("gqa_shared_heads", "GQA_SHARED_HEADS"), ("NOT_A_KEY", None)])
def test_a_misspelt_kernel_options_key_is_still_rejected_by_name(typo, suggestion):
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match=f"unknown kernel_options key '{typo}'") as error:
        flexc.flex_attention(q, q, q, kernel_options={typo: 2})
    if suggestion:
        assert f"did you mean '{suggestion}'" in str(error.value)
    else:
        assert "did you mean" not in str(error.value)


def test_split_kv_sets_the_triton_decode_kernels_splits(monkeypatch):
    """SPLIT_KV (fwd_SPLIT_KV over it) is the number of key splits of the decode kernel, as in torch."""
    seen = []
    merge = triton_decode.merge_splits
    monkeypatch.setattr(triton_decode, "merge_splits", lambda out_split, *a: seen.append(out_split.shape[2])
                        or merge(out_split, *a))
    q, k, v = random_qkv(2, 4, 2, 1, 160, 16)
    window = lambda b, h, q_idx, kv_idx: kv_idx > 20
    block_mask = flexc.create_block_mask(window, None, None, 1, 160, device="cpu", BLOCK_SIZE=32)
    gold = dense_attention(q, k, v, mask_mod=window)[0]
    for options, splits in (({"SPLIT_KV": 3}, 3), ({"SPLIT_KV": 7, "fwd_SPLIT_KV": 1}, 1), ({"SPLIT_KV": 9}, 9)):
        out = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                   kernel_options={**INTERPRET, **options})
        assert seen[-1] == splits  # 9 splits of 5 listed blocks: the last splits are empty
        torch.testing.assert_close(out.double(), gold, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match=r"kernel_options\['SPLIT_KV'\] must be >= 1, got 0"):
        flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options={**INTERPRET, "SPLIT_KV": 0})


def _no_op_masks(q, k):
    """torch's no-op BlockMask (seq_lengths (1, 1)) and flexc's, each built for other lengths than q/k's."""
    return {"torch": tfa._create_empty_block_mask(q, k),
            "flexc_other_lengths": flexc._create_empty_block_mask(q[:, :, :5], k[:, :, :9]),
            "causal_at_large_block": flexc.BlockMask.from_kv_blocks(
                torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                BLOCK_SIZE=flexc._LARGE_SPARSE_BLOCK_SIZE, mask_mod=causal, seq_lengths=(1, 1))}


def test_torchs_no_op_block_mask_serves_inputs_of_any_length_as_in_torch():
    q, k, v = random_qkv(2, 2, 2, 100, 70, 16)
    for name, block_mask in _no_op_masks(q, k).items():
        mask_mod = causal if name.startswith("causal") else None
        gold = dense_attention(q, k, v, mask_mod=mask_mod)[0]
        torch_out = tfa.flex_attention(q, k, v, block_mask=block_mask)  # torch accepts every one of them
        torch.testing.assert_close(torch_out.double(), gold, atol=1e-5, rtol=1e-5)
        for options in ({"BACKEND": "TORCH"}, INTERPRET):
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options=options)
            torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5, msg=f"{name} {options}")
    # a mask of ordinary block size still has to be built for the inputs' lengths, as in torch
    smaller = flexc.create_block_mask(causal, None, None, 64, 70, device="cpu")
    with pytest.raises(ValueError, match="block_mask was created for"):
        flexc.flex_attention(q, k, v, block_mask=smaller)


def test_no_op_block_mask_in_the_triton_decode_kernel_and_backward():
    """A key block of 1 << 30 runs as one block covering the keys (before: 2**24 tiles, a hang)."""
    q, k, v = random_qkv(1, 4, 2, 3, 70, 16)
    block_mask = _no_op_masks(q, k)["causal_at_large_block"]
    gold = dense_attention(q, k, v, mask_mod=causal)[0]
    out = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=INTERPRET)
    torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5)
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 40, 48, 16))
    grad_out = torch.randn(1, 2, 40, 16)
    out = flexc.flex_attention(q, k, v, block_mask=tfa._create_empty_block_mask(q, k), kernel_options=INTERPRET)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    dense = dense_attention(q, k, v)[0]
    for got, want in zip(grads, torch.autograd.grad(dense, (q, k, v), grad_out.double())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_block_past_a_short_sequence_keeps_the_users_tile():
    """A block longer than the sequence is cut to cover it, never below a tile kernel_options asks for.

    Before, keys of length 1 in 32-key blocks were cut to a 16-key block and BLOCK_N=32 raised
    ValueError (a fuzzer case); torch's 1 << 30 blocks with BLOCK_N=64 on 20 keys did the same.
    """
    q, k, v = random_qkv(1, 2, 1, 1, 1, 16)
    # a mask per head under GQA: the forward kernel serves it, not the decode kernel
    block_mask = flexc.create_block_mask(causal, None, 2, 1, 1, device="cpu", BLOCK_SIZE=(16, 32))
    gold = dense_attention(q, k, v, mask_mod=causal)[0]
    out = flexc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                               kernel_options={**INTERPRET, "BLOCK_N": 32})
    torch.testing.assert_close(out.double(), gold, atol=1e-6, rtol=1e-6)
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 12, 20, 16))
    options = {**INTERPRET, "BLOCK_M": 32, "BLOCK_N": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 32}
    out = flexc.flex_attention(q, k, v, block_mask=tfa._create_empty_block_mask(q, k), kernel_options=options)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v)[0], atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    dense = dense_attention(q, k, v)[0]
    for got, want in zip(grads, torch.autograd.grad(dense, (q, k, v), grad_out.double())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_decode_loop_with_a_python_int_position(backend):
    """torch.compile makes the captured position symbolic from the third step on. Before, the
    traced mods kept the first symbolic step's value ("eager": wrong outputs from then on) or failed
    to trace the SymInt ("aot_eager": TraceError); a number computed from it (a temperature
    math.sqrt(pos + 1)) was baked in from the first call that computed it."""
    torch._dynamo.reset()
    S = 48
    _, k, v = random_qkv(1, 2, 2, 1, S, 16)

    def step(q, k, v, pos):
        def seen(b, h, q_idx, kv_idx):  # the cache holds keys 0..pos
            return kv_idx <= q_idx + pos

        def recency(score, b, h, q_idx, kv_idx):  # numbers derived from pos (dynamo's sym_float, sym_sqrt)
            return score * (2 / math.sqrt(float(pos) + 1)) - 0.05 * (q_idx + pos - kv_idx)

        block_mask = flexc.create_block_mask(seen, None, None, 1, S, device="cpu", BLOCK_SIZE=16)
        return flexc.flex_attention(q, k, v, recency, block_mask=block_mask)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for pos in (3, 4, 20, 35, 7):
        q = torch.randn(1, 2, 1, 16)
        gold = dense_attention(q, k, v, lambda s, b, h, qi, kv: s * (2 / math.sqrt(pos + 1)) - 0.05 * (qi + pos - kv),
                               lambda b, h, qi, kv: kv <= qi + pos)[0]
        torch.testing.assert_close(compiled(q, k, v, pos).double(), gold, atol=1e-5, rtol=1e-5, msg=f"pos={pos}")
