"""Every bad input to flexc.flex_attention raises before any work, naming the argument, the
expected and actual values, and a fix."""
import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc

causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx


def _qkv(B=1, Hq=2, Hkv=2, L=32, S=32, E=8, Ev=8, dtype=torch.float32):
    return torch.randn(B, Hq, L, E, dtype=dtype), torch.randn(B, Hkv, S, E, dtype=dtype), torch.randn(B, Hkv, S, Ev, dtype=dtype)


def _raises(exc, *words, **kwargs):
    """Call flex_attention and check the error type and that each word is in the message."""
    args = kwargs.pop("args")
    with pytest.raises(exc) as info:
        flexc.flex_attention(*args, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    assert "Fix" in message
    return message


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_non_4d_inputs_are_rejected(which):
    q, k, v = _qkv()
    tensors = {"query": q, "key": k, "value": v}
    tensors[which] = tensors[which][0]
    _raises(ValueError, f"`{which}`", "4-D", "3-D", args=(tensors["query"], tensors["key"], tensors["value"]))


def test_non_tensor_input_is_a_type_error():
    q, k, v = _qkv()
    _raises(TypeError, "`key`", "list", args=(q, k.tolist(), v))


def test_head_dim_mismatch_between_query_and_key():
    q, _, v = _qkv()
    k = torch.randn(1, 2, 32, 6)
    _raises(ValueError, "`key`", "E=8", "got 6", args=(q, k, v))


def test_key_value_length_mismatch():
    q, k, _ = _qkv()
    v = torch.randn(1, 2, 31, 8)
    _raises(ValueError, "`value`", "S=32", "got 31", args=(q, k, v))


def test_batch_mismatch():
    q, k, v = _qkv(B=3)
    _raises(ValueError, "batch", "B=3", "got 2", args=(q, k[:2], v[:2]))


def test_unequal_heads_without_enable_gqa():
    q, k, v = _qkv(Hq=4, Hkv=2)
    _raises(ValueError, "Hq=4", "Hkv=2", "enable_gqa=True", args=(q, k, v))


def test_query_heads_not_a_multiple_of_key_heads():
    q, k, v = _qkv(Hq=3, Hkv=2)
    _raises(ValueError, "Hq=3", "Hkv=2", "multiple", args=(q, k, v), enable_gqa=True)


def test_unsupported_dtype():
    q, k, v = _qkv()
    _raises(TypeError, "`query`", "torch.int64", args=(q.long(), k.long(), v.long()))


def test_mixed_devices():
    q, k, v = _qkv()
    meta = torch.empty_like(k, device="meta")
    _raises(ValueError, "device", "meta", args=(q, meta, v))


@pytest.mark.parametrize("make", [flexc.create_block_mask, torch_flex.create_block_mask])
def test_block_mask_for_other_lengths_names_seq_lengths_and_how_to_build_for_the_inputs(make):
    q, k, v = _qkv()
    bm = make(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    message = _raises(ValueError, "block_mask was created for", "`block_mask.seq_lengths`", "(64, 64)", "(32, 32)",
                      "create_block_mask(mask_mod, B, H, 32, 32)", "seq_lengths=(32, 32)",
                      args=(q, k, v), block_mask=bm)
    assert "_adjust" not in message  # torch's private helper is no advice


@pytest.mark.parametrize("make", [flexc.create_block_mask, torch_flex.create_block_mask])
@pytest.mark.parametrize("index", [(slice(None), slice(None), 1), (0, 0, 1), (slice(None), slice(None), [3])])
def test_a_sliced_block_mask_without_seq_lengths_says_set_seq_lengths_on_the_slice(make, index):
    q, k, v = _qkv(L=1, S=64)
    sliced = make(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)[index]
    sliced.mask_mod = causal
    message = _raises(ValueError, "block_mask was created for (Q_LEN, KV_LEN)=(64, 64)", "1 query-block row of 16",
                      "a slice", "`block_mask.seq_lengths = (1, 64)`", "seq_lengths=(1, 64)",
                      args=(q, k, v), block_mask=sliced)
    assert "_adjust" not in message
    sliced.seq_lengths = (1, 64)  # the fix the message gives works
    flexc.flex_attention(q, k, v, block_mask=sliced)


def test_block_mask_with_more_heads_than_the_input():
    q, k, v = _qkv(Hq=2)
    bm = flexc.create_block_mask(causal, None, 4, 32, 32, device="cpu", BLOCK_SIZE=16)
    _raises(ValueError, "`block_mask`", "4 heads", "2 heads", args=(q, k, v), block_mask=bm)


def test_block_mask_with_more_batches_than_the_input():
    q, k, v = _qkv(B=1)
    bm = flexc.create_block_mask(causal, 3, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    _raises(ValueError, "`block_mask`", "batch 3", "batch 1", args=(q, k, v), block_mask=bm)


def test_block_mask_of_the_wrong_type():
    q, k, v = _qkv()
    _raises(TypeError, "`block_mask`", "Tensor", args=(q, k, v), block_mask=torch.ones(32, 32, dtype=torch.bool))


@pytest.mark.parametrize("scale", ["0.5", [0.5], True])
def test_scale_not_a_number(scale):
    q, k, v = _qkv()
    _raises(TypeError, "`scale`", type(scale).__name__, args=(q, k, v), scale=scale)


def test_scale_not_finite():
    q, k, v = _qkv()
    _raises(ValueError, "`scale`", "inf", args=(q, k, v), scale=float("inf"))


def test_unknown_kernel_option_key():
    q, k, v = _qkv()
    _raises(ValueError, "'BLOCK_Q'", "kernel_options", args=(q, k, v), kernel_options={"BLOCK_Q": 64})


@pytest.mark.parametrize("backend", ["CUDNN", "FLASHY", 3])
def test_unknown_backend_value(backend):
    q, k, v = _qkv()
    _raises(ValueError, "BACKEND", repr(backend), "'TORCH'", args=(q, k, v), kernel_options={"BACKEND": backend})


def test_documented_kernel_options_and_prefixed_forms_are_accepted():
    q, k, v = _qkv()
    options = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "PRESCALE_QK": False,
               "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True,
               "FORCE_USE_FLEX_ATTENTION": False, "USE_TMA": False, "fwd_BLOCK_M": 32, "bwd_num_warps": 8,
               "BACKEND": "torch"}
    out = flexc.flex_attention(q, k, v, kernel_options=options)
    assert out.shape == q.shape


def test_kernel_options_not_a_dict():
    q, k, v = _qkv()
    _raises(TypeError, "`kernel_options`", "list", args=(q, k, v), kernel_options=["BACKEND"])


def test_return_lse_together_with_return_aux():
    q, k, v = _qkv()
    _raises(ValueError, "return_lse", "return_aux", args=(q, k, v), return_lse=True,
            return_aux=flexc.AuxRequest(lse=True))


def test_score_mod_not_callable():
    q, k, v = _qkv()
    _raises(TypeError, "`score_mod`", "int", args=(q, k, v), score_mod=3)


def test_validation_happens_before_tracing_or_work():
    """A broken score_mod is never traced when an input is wrong: the input error comes first."""
    q, k, v = _qkv()
    calls = []

    def spy(score, b, h, q_idx, kv_idx):
        calls.append(1)
        return score

    with pytest.raises(ValueError):
        flexc.flex_attention(q, k, v[:, :, :5], score_mod=spy)
    assert calls == []


def test_backend_dispatch_uses_the_registered_forward_and_trains_through_the_torch_backward(monkeypatch):
    from flexc.backends import registry
    from flexc.backends.cpu.torch_cpu import torch_forward

    calls = []

    def fake_triton(*args):
        calls.append(args[-1])  # need_lse
        return torch_forward(*args)

    monkeypatch.setitem(registry.BACKENDS, "TRITON", fake_triton)
    monkeypatch.delitem(registry.PREPARE, "TRITON", raising=False)  # (else its forward prepared per signature runs)
    monkeypatch.delitem(registry.TRAINING, "TRITON", raising=False)  # no generated backward: the torch one
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    out = flexc.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON"})
    assert calls == [True]  # training always asks the forward for lse
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    flexc.flex_attention(q.detach(), k.detach(), v.detach())  # AUTO on CPU tensors: the torch path
    assert calls == [True]
