"""A causal kernel call split along the diagonal (flexc/backends/cpu/causal_chunks.py): forward by
query chunks, backward by key chunks, equal to a float64 dense reference, in the inputs' layouts,
for training calls recorded as one node, forward-only calls and packed documents alike."""
import pytest
import torch

import flexc
from flexc.backends.cpu import causal_call, causal_chunks, fused_cpu
from reference import autograd_node_names, dense_attention, random_qkv


def _causal(b, h, q, kv):
    return q >= kv


_DOCS = torch.tensor([0] * 400 + [1] * 430)  # two documents, each long enough to be split


def _documents(b, h, q, kv):
    return (_DOCS[q] == _DOCS[kv]) & (q >= kv)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the fused kernel ran, forward and backward."""
    causal_call.kernel_takes(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8))  # (its GQA probe, once, uncounted)
    count = {"forward": 0, "backward": 0}
    for name, attr in (("forward", "FLASH"), ("backward", "FLASH_BACKWARD")):
        real = getattr(fused_cpu, attr)

        def spy(*args, _real=real, _name=name, **kwargs):
            count[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(fused_cpu, attr, spy)
    return count


@pytest.mark.parametrize("B, Bkv, Hq, Hkv, L, layout, dtype, lse", [
    (1, 1, 2, 2, 400, "row-major", torch.float64, False),  # 400 = 3 chunks of 128 and one of 16
    (2, 2, 4, 2, 384, "BLHE", torch.float64, False),  # GQA as models call it, from [B, L, H, E]
    (1, 1, 2, 2, 512, "row-major", torch.float32, False),
    (1, 1, 2, 2, 400, "row-major", torch.float64, True),  # the logsumexp asked for: flexc's Function
    (2, 1, 2, 1, 384, "row-major", torch.float64, True),  # one key batch for both query batches
])
def test_split_calls_match_float64_forward_and_backward(kernel_calls, B, Bkv, Hq, Hkv, L, layout, dtype, lse):
    q, k, v = random_qkv(B, Hq, Hkv, L, L, 16, dtype=dtype, Bkv=Bkv, seed=1)
    if layout == "BLHE":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bm = flexc.create_block_mask(_causal, None, None, L, L, device="cpu")
    out = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=lse)
    out, got_lse = out if lse else (out, None)
    if not lse:  # one node of flexc's, whose backward runs the split calls
        assert "RecordedChunksBackward" in autograd_node_names(out), autograd_node_names(out)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    n_chunks = -(-L // causal_chunks.FORWARD_CHUNK)
    assert kernel_calls == {"forward": n_chunks, "backward": -(-L // causal_chunks.BACKWARD_CHUNK)}
    ref_out, ref_lse, _ = dense_attention(q, k, v, None, _causal)
    refs = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    if lse:
        torch.testing.assert_close(got_lse.double(), ref_lse, atol=tol, rtol=0)
    assert out.stride() == q.stride()
    for a, b, t in zip(mine, refs, (q, k, v)):
        assert a.shape == t.shape and a.stride() == t.stride()
        torch.testing.assert_close(a.double(), b.double(), atol=10 * tol, rtol=0)


def test_an_upstream_gradient_of_any_strides_is_read_as_it_is():
    # out.sum() hands the backward a stride-0 gradient, which the kernel cannot read unless its last stride is 1
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 384, 384, 8, dtype=torch.float64, seed=3))
    bm = flexc.create_block_mask(_causal, None, None, 384, 384, device="cpu")
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    ref = dense_attention(q, k, v, None, _causal)[0]
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_documents_and_forward_only_calls_are_split_per_sequence(kernel_calls):
    L = len(_DOCS)
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 1, 1, L, L, 8, dtype=torch.float64, seed=4))
    bm = flexc.create_block_mask(_documents, None, None, L, L, device="cpu")
    with torch.no_grad():
        alone = flexc.flex_attention(q, k, v, block_mask=bm)
    assert kernel_calls["forward"] == 4 + 4  # 400 rows: 4 chunks; 430 rows: 4 chunks
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    assert kernel_calls["backward"] == 4 + 4
    ref = dense_attention(q, k, v, None, _documents)[0]
    torch.testing.assert_close(alone, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(mine, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


@pytest.mark.parametrize("L, S", [(256, 256), (1024, 1024), (512, 400)])
def test_calls_the_split_does_not_pay_for_stay_one_call(kernel_calls, L, S):
    q, k, v = random_qkv(1, 1, 1, L, S, 8, dtype=torch.float64, seed=6)
    out, lse = causal_chunks.forward(q, k, v, 0.3)
    assert kernel_calls["forward"] == 1
    ref_out, ref_lse, _ = dense_attention(q, k, v, None, _causal, scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)


def test_calls_split_over_workers_are_split_along_the_diagonal_too(monkeypatch, kernel_calls):
    monkeypatch.setattr(fused_cpu, "MIN_COST_PER_WORKER", 1.0)  # one call per head, taken by two workers
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 384, 384, 8, dtype=torch.float64, seed=7))
        bm = flexc.create_block_mask(_causal, None, None, 384, 384, device="cpu")
        out = flexc.flex_attention(q, k, v, block_mask=bm)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        mine = torch.autograd.grad(out, (q, k, v), grad)
    finally:
        torch.set_num_threads(threads)
    assert kernel_calls == {"forward": 2 * 3, "backward": 2 * 3}  # per head, 3 chunks of 128 each way
    ref = dense_attention(q, k, v, None, _causal)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(mine, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
