"""What torch's own FlexAttention tests expect of a drop-in, checked against torch itself.

torch's suites match errors with ``assertRaisesRegex(torch's type, torch's sentence)`` and run
key/value of another dtype than the query. Each case here runs torch and flexc on the same input:
flexc's error must be an instance of torch's exception type and contain torch's sentence (flexc's
own wording and fix follow it), and mixed-dtype results must equal torch's eager results.
"""
import re
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from reference import dense_attention
from torch_api import OLDER_TORCH


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _qkv(B=1, Hq=2, Hkv=2, L=64, S=64, E=16):
    return torch.randn(B, Hq, L, E), torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, E)


# name -> (call(lib), the sentence torch's message holds)
CASES = {
    "heads": (lambda lib: lib.flex_attention(*_qkv(Hq=4)[:1], *_qkv(Hkv=2)[1:]),
              r"Expect query and key/value to have the same number of heads"),
    "gqa_multiple": (lambda lib: lib.flex_attention(*_qkv(Hq=3)[:1], *_qkv(Hkv=2)[1:], enable_gqa=True),
                     r"Expect number of query heads to be a multiple of kv heads for GQA"),
    "batch": (lambda lib: lib.flex_attention(*_qkv(B=2)[:1], *_qkv(B=3)[1:]),
              r"Expect query and key/value to have the same batch size"),
    "mask_batch": (lambda lib: lib.flex_attention(*_qkv(B=3)[:1], *_qkv(B=1)[1:],
                                                  block_mask=lib.create_block_mask(causal, 2, 1, 64, 64, device="cpu")),
                   r"Expect query and key/value to have the same batch size, or block_mask and query to have "
                   r"the same batch size"),
    "embed": (lambda lib: lib.flex_attention(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 8),
                                             torch.randn(1, 2, 64, 16)),
              r"Expect query and key/value to have the same embedding dimension"),
    "3d": (lambda lib: lib.flex_attention(*(torch.randn(2, 64, 16) for _ in range(3))),
           r"NYI: query, key, and value must be 4D tensors"),
    "1d": (lambda lib: lib.flex_attention(*(torch.randn(16) for _ in range(3))), r"at least 2 dimensional"),
    "device": (lambda lib: lib.flex_attention(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16, device="meta"),
                                              torch.randn(1, 2, 64, 16)),
               r"Expected query, key, and value to have the same device type"),
    "mask_smaller": (lambda lib: lib.flex_attention(*_qkv(L=256, S=256), block_mask=lib.create_block_mask(
        causal, 1, 1, 128, 128, device="cpu")), r"block_mask was created for"),
    "mask_larger": (lambda lib: lib.flex_attention(*_qkv(L=128, S=128), block_mask=lib.create_block_mask(
        causal, 1, 1, 256, 256, device="cpu")), r"block_mask was created for"),
    "lse_and_aux": (lambda lib: lib.flex_attention(*_qkv(), return_lse=True, return_aux=lib.AuxRequest(lse=True)),
                    r"Cannot specify both return_lse and return_aux"),
    "backend_and_force": (lambda lib: lib.flex_attention(*_qkv(), kernel_options={
        "BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True}),
        r"BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION"),
    "reserved_option": (lambda lib: lib.flex_attention(*_qkv(), kernel_options={"OUTPUT_LOGSUMEXP": True}),
                        r"OUTPUT_LOGSUMEXP must not be in kernel_options"),
    "bad_backend": (lambda lib: lib.flex_attention(*_qkv(), kernel_options={"BACKEND": "NOPE"}),
                    r"Invalid BACKEND value"),
    "sliced_mask": (lambda lib: lib.flex_attention(*_qkv(L=128, S=256), block_mask=lib.create_block_mask(
        causal, 1, 1, 256, 256, device="cpu")[:, :, :1]), r"Cannot use mask_mod from a sliced BlockMask"),
    "nested": (lambda lib: lib.flex_attention(*(torch.nested.nested_tensor(
        [torch.randn(2, 4, 8), torch.randn(2, 6, 8)], layout=torch.jagged) for _ in range(3))),
        r"does not support NestedTensor inputs"),
    "and_masks": (lambda lib: lib.and_masks(causal, 3), r"All inputs should be callable mask_mods"),
    "or_masks": (lambda lib: lib.or_masks(causal, "x"), r"All inputs should be callable mask_mods"),
    "table_1d": (lambda lib: lib.BlockMask.from_kv_blocks(torch.tensor([1], dtype=torch.int32),
                                                          torch.tensor([0], dtype=torch.int32)),
                 r"BlockMask must have at least 2 dimensions"),
    "full_kv_pair": (lambda lib: lib.BlockMask(
        kv_num_blocks=torch.ones(1, 1, 1, dtype=torch.int32), kv_indices=torch.zeros(1, 1, 1, 2, dtype=torch.int32),
        full_kv_num_blocks=torch.ones(1, 1, 1, dtype=torch.int32), full_kv_indices=None,
        q_num_blocks=torch.ones(1, 1, 1, dtype=torch.int32), q_indices=torch.zeros(1, 1, 1, 2, dtype=torch.int32),
        full_q_num_blocks=None, full_q_indices=None, BLOCK_SIZE=(64, 64), mask_mod=lib.noop_mask,
        seq_lengths=(1, 1)), r"full_kv_num_blocks and full_kv_indices must be both provided or omitted"),
}


# cases whose sentence a torch older than the one flexc follows does not say (torch 2.11 fails nested
# inputs inside dynamo instead); flexc still raises the later torch's error
_NEWER_SENTENCES = {"nested"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_errors_are_torchs_type_and_hold_torchs_sentence(name):
    call, sentence = CASES[name]
    errors = []
    for lib in (tfa, flexc):
        with warnings.catch_warnings(), pytest.raises(Exception) as info:
            warnings.simplefilter("ignore")
            call(lib)
        errors.append(info.value)
    theirs, ours = errors
    if not (OLDER_TORCH and name in _NEWER_SENTENCES):
        assert re.search(sentence, str(theirs)), f"torch's own message changed: {theirs}"
        assert isinstance(ours, type(theirs)), f"torch raises {type(theirs).__name__}, flexc {type(ours).__name__}: {ours}"
    assert re.search(sentence, str(ours)), f"torch's sentence missing from flexc's message: {ours}"
    # flexc's own rule still holds: bad inputs raise TypeError/ValueError
    assert isinstance(ours, (TypeError, ValueError))


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.float32), (torch.float64, torch.float32)])
def test_key_value_of_another_dtype_match_torch(q_dtype, kv_dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 200, 16, generator=g).to(q_dtype)
    k, v = (torch.randn(2, 2, 200, 16, generator=g).to(kv_dtype) for _ in range(2))
    bias = torch.randn(200)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    block_mask = flexc.create_block_mask(causal, None, None, 200, 200, device="cpu", BLOCK_SIZE=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, ref_aux = tfa.flex_attention(q, k, v, score_mod, block_mask=block_mask.to_torch(),
                                          return_aux=tfa.AuxRequest(lse=True))
    out, aux = flexc.flex_attention(q, k, v, score_mod, block_mask=block_mask, return_aux=flexc.AuxRequest(lse=True))
    assert out.dtype == ref.dtype == q_dtype and aux.lse.dtype == ref_aux.lse.dtype
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(aux.lse, ref_aux.lse, atol=tol, rtol=tol)


def test_key_value_of_another_dtype_train_in_their_dtype():
    # torch has no CPU backward; flexc differentiates through the cast to query's dtype
    q = torch.randn(1, 2, 96, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 96, 16).requires_grad_() for _ in range(2))
    grad_out = torch.randn(1, 2, 96, 16, dtype=torch.float64)
    grads = torch.autograd.grad(flexc.flex_attention(q, k, v, lambda s, b, h, qi, kv: s * 0.5), (q, k, v), grad_out)
    ref, _, _ = dense_attention(q, k, v, lambda s, b, h, qi, kv: s * 0.5)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for ours, theirs in zip(grads, ref_grads):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["FLASH", "TRITON_DECODE", "flash"])
def test_torchs_own_backend_names_run_as_auto_and_say_so_once(backend):
    import warnings
    from flexc import errors
    errors._warned_once.discard(("BACKEND", backend.upper()))  # (another test may have warned already)
    q, k, v = _qkv()
    block_mask = flexc.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.warns(flexc.FallbackWarning, match=r"flexc runs 'AUTO' instead"):
        out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
    torch.testing.assert_close(out, dense_attention(q, k, v, mask_mod=causal)[0].float(), atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)
        flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})


@pytest.mark.parametrize("value,runs", [("'ieee'", "ieee"), ("tf32", "tf32"), ("'tf32x3'", "tf32x3")])
def test_float32_precision_kernel_option_decides_how_fp32_dots_run(value, runs):
    q, k, v = _qkv()
    with flexc.device.simulate("sm_90"):
        source = flexc.kernel_source(q.float(), k.float(), v.float(), kernel_options={"FLOAT32_PRECISION": value})
    assert f'input_precision="{runs}"' in source


def test_float32_precision_rejects_a_value_the_kernels_cannot_take():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"FLOAT32_PRECISION.*'ieee', 'tf32', 'tf32x3'.*got 'fp16'"):
        flexc.flex_attention(q, k, v, kernel_options={"FLOAT32_PRECISION": "fp16", "BACKEND": "TORCH"})


def test_tables_are_authoritative_for_broadcast_masks():
    # built with B=H=None (tables of b=h=0) for a mod that reads b and h: as in torch's kernels, blocks
    # the tables omit stay masked, full blocks skip the mod, partial blocks run it with the real b, h
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | ((b + h) % 2 == 1)
    L, block = 192, 64
    block_mask = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=block)
    rows = torch.arange(L) // block
    listed = block_mask.to_dense()[0, 0].bool()[rows][:, rows]
    full = torch.zeros_like(block_mask.to_dense()[0, 0], dtype=torch.bool)
    for i in range(full.shape[0]):
        full[i, block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]].long()] = True
    full = full[rows][:, rows]

    def kernel_rule(b, h, q_idx, kv_idx):
        return full[q_idx, kv_idx] | (listed[q_idx, kv_idx] & mask_mod(b, h, q_idx, kv_idx))
    q, k, v = _qkv(B=2, Hq=2, Hkv=2, L=L, S=L)
    out = flexc.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out, dense_attention(q, k, v, mask_mod=kernel_rule)[0].float(), atol=1e-5, rtol=1e-5)
    # (b, h) = (0, 1) differs from the mod on the whole grid: the test has teeth
    assert not torch.allclose(out, dense_attention(q, k, v, mask_mod=mask_mod)[0].float(), atol=1e-3)


# the names torch 2.13's test/inductor/test_flex_attention.py imports from the flex_attention module
TORCH_SUITE_IMPORTS = ["_apply_kernel_options", "_create_empty_block_mask", "_DEFAULT_SPARSE_BLOCK_SIZE", "_identity",
                       "_mask_mod_signature", "_score_mod_signature", "_WARNINGS_SHOWN", "and_masks", "AuxOutput",
                       "AuxRequest", "BlockMask", "create_block_mask", "flex_attention", "flex_attention_hop",
                       "noop_mask", "or_masks"]


def test_torch_suites_import_every_name_from_flexc():
    assert [name for name in TORCH_SUITE_IMPORTS if not hasattr(tfa, name)] == []  # still torch's names
    assert [name for name in TORCH_SUITE_IMPORTS if not hasattr(flexc, name)] == []


def test_empty_block_mask_allows_everything():
    q, k, v = _qkv(B=2, L=100, S=260)
    block_mask = flexc._create_empty_block_mask(q, k)
    assert block_mask.BLOCK_SIZE == (flexc._LARGE_SPARSE_BLOCK_SIZE,) * 2 and block_mask.seq_lengths == (100, 260)
    bias = lambda s, b, h, qi, kv: s + (qi - kv) * 0.01
    out = flexc.flex_attention(q, k, v, bias, block_mask=block_mask)
    torch.testing.assert_close(out, dense_attention(q, k, v, bias)[0].float(), atol=1e-5, rtol=1e-5)
