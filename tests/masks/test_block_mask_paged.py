"""Negative kv-table entries inside a row's count are empty blocks (never visited), as in the tables
torch's PagedAttention builds for a batch with no reserved pages: validation accepts them (and still
rejects the rest), and every backend (TORCH, TRITON forward, backward and decode, the simulated GPU)
matches the float64 dense reference of the mask the tables describe."""
from __future__ import annotations

import pytest
import torch

import flexc
from host_reads import counting_host_reads
from reference import dense_attention

QB = KB = 16
B, H, L, S, E = 2, 2, 48, 64, 8
BACKENDS = ["TORCH", "TRITON"]


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx + 2 * kv_idx) % 5 != 0


def _tables():
    """Partial and full tables with -1 entries inside the counts (and junk past them)."""
    g = torch.Generator().manual_seed(0)
    nq, nkv = L // QB, S // KB
    num = torch.zeros(B, H, nq, dtype=torch.int32)
    idx = torch.full((B, H, nq, nkv), 3, dtype=torch.int32)
    fnum = torch.zeros_like(num)
    fidx = torch.full_like(idx, -1)
    for b in range(B):
        for h in range(H):
            for r in range(nq):
                perm = torch.randperm(nkv, generator=g).tolist()
                n_full = r % 2
                full, part = perm[:n_full], perm[n_full:n_full + 2]
                if (b + h + r) % 3 == 0:
                    part = [-1] + part  # an empty entry before the real ones
                if b == 1 and h == 0:
                    part = [-1] * len(part)  # a row of nothing but empty entries (no reserved pages)
                num[b, h, r] = len(part)
                idx[b, h, r, :len(part)] = torch.tensor(part, dtype=torch.int32)
                if full:
                    full = full + [-1]
                fnum[b, h, r] = len(full)
                fidx[b, h, r, :len(full)] = torch.tensor(full, dtype=torch.int32) if full else fidx[b, h, r, :0]
    return num, idx, fnum, fidx


def _dense_mask(num, idx, fnum, fidx, mask_mod):
    """[B, H, L, S] bool: the mask the tables describe (non-negative entries inside the counts)."""
    allowed = torch.zeros(B, H, L, S, dtype=torch.bool)
    q = torch.arange(L).view(-1, 1)
    kv = torch.arange(S).view(1, -1)
    by_mod = mask_mod(0, 0, q, kv)
    for count, index, full in ((num, idx, False), (fnum, fidx, True)):
        for b in range(count.shape[0]):
            for h in range(count.shape[1]):
                for r in range(count.shape[2]):
                    for j in index[b, h, r, :int(count[b, h, r])].tolist():
                        if j < 0:
                            continue
                        rows, cols = slice(r * QB, (r + 1) * QB), slice(j * KB, (j + 1) * KB)
                        block = torch.ones(QB, KB, dtype=torch.bool) if full else by_mod[rows, cols]
                        allowed[b, h, rows, cols] |= block
    return allowed


def _reference(q, k, v, dense):
    return dense_attention(q, k, v, mask_mod=lambda b, h, qi, kv: dense[b, h, qi, kv])


def _qkv(L_q=L):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, H, n, E, generator=g, dtype=torch.float32) for n in (L_q, S, S)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_tables_forward_and_grads(backend):
    num, idx, fnum, fidx = _tables()
    bm = flexc.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod,
                                        seq_lengths=(L, S))
    dense = _dense_mask(num, idx, fnum, fidx, _mask_mod)
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend})
    ref = _reference(q.detach().double().requires_grad_(), k.detach().double().requires_grad_(),
                     v.detach().double().requires_grad_(), dense)[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(_reference(qq, kk, vv, dense)[0], (qq, kk, vv), g.double())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_tables_decode_row(backend):
    """A one-row query (decoding) against one query-block row of the tables, sliced as decoding does."""
    num, idx, fnum, fidx = _tables()
    bm = flexc.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod,
                                        seq_lengths=(L, S))
    dense = _dense_mask(num, idx, fnum, fidx, _mask_mod)
    q, k, v = _qkv(1)
    for row in range(L // QB):
        step = bm[:, :, row]
        step.seq_lengths = (1, S)
        pos = row * QB

        def offset_mod(b, h, q_idx, kv_idx, pos=pos):
            return _mask_mod(b, h, q_idx + pos, kv_idx)

        step.mask_mod = offset_mod
        out = flexc.flex_attention(q, k, v, block_mask=step, kernel_options={"BACKEND": backend})
        ref = _reference(q, k, v, dense[:, :, pos:pos + 1])[0]
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("checked_as", ["python lists", "tensor reductions"])
def test_validation_keeps_its_other_checks(checked_as, monkeypatch):
    if checked_as == "tensor reductions":  # (small tables are checked as Python lists)
        monkeypatch.setattr(flexc.call.validate, "_SMALL_TABLE", 0)
    num, idx, fnum, fidx = _tables()
    q, k, v = _qkv()
    flexc.flex_attention(q, k, v, block_mask=flexc.BlockMask.from_kv_blocks(
        num, idx, fnum, fidx, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod, seq_lengths=(L, S)))
    for edit, message in ((lambda n, i: i.__setitem__((0, 0, 0, 0), S // KB), "expected a key-block index"),
                          (lambda n, i: n.__setitem__((0, 0, 0), S // KB + 1), "expected a count"),
                          (lambda n, i: i[0, 0, 0, :2].copy_(torch.tensor([-1, -1])) if n[0, 0, 0] >= 2 else None,
                           None)):
        n, i = num.clone(), idx.clone()
        edit(n, i)
        bm = flexc.BlockMask.from_kv_blocks(n, i, fnum, fidx, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod,
                                            seq_lengths=(L, S))
        if message is None:  # repeated -1 entries are not a block listed twice
            flexc.flex_attention(q, k, v, block_mask=bm)
        else:
            with pytest.raises(ValueError, match=message):
                flexc.flex_attention(q, k, v, block_mask=bm)
    n, i = num.clone(), idx.clone()
    n[0, 0, 0], i[0, 0, 0, :3] = 3, torch.tensor([-1, 2, 2])
    with pytest.raises(ValueError, match="more than once"):
        flexc.flex_attention(q, k, v, block_mask=flexc.BlockMask.from_kv_blocks(
            n, i, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod, seq_lengths=(L, S)))


def test_simulated_gpu_compacts_without_host_reads():
    num, idx, fnum, fidx = _tables()
    bm = flexc.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(QB, KB), mask_mod=_mask_mod,
                                        seq_lengths=(L, S))
    dense = _dense_mask(num, idx, fnum, fidx, _mask_mod)
    q, k, v = _qkv()
    with flexc.device.simulate("sm_90"):
        out = flexc.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(out.double(), _reference(q, k, v, dense)[0], atol=2e-5, rtol=2e-5)
        with counting_host_reads() as reads:
            again = flexc.flex_attention(q, k, v, block_mask=bm)
    assert not reads, reads
    torch.testing.assert_close(again, out)


def _paged_setup():
    paged = pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    from torch.nn.attention.flex_attention import create_block_mask
    page, n_pages = 16, 8
    cache = paged.PagedAttention(n_pages, page, B, device="cpu")
    cache.reserve(torch.tensor(0), torch.tensor(S))  # batch 1 reserves no pages: its entries map to -1
    logical = create_block_mask(lambda b, h, q, kv: q >= kv, B, 1, S, S, device="cpu", BLOCK_SIZE=page)
    return cache, cache.convert_logical_block_mask(logical), page, n_pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_paged_attention_tables(backend):
    cache, bm, page, n_pages = _paged_setup()
    assert bool((bm.kv_indices[1, :, :, :1] < 0).all())  # the case at hand
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, S, H, E, generator=g).transpose(1, 2)  # [B, H, S, E] from a [B, S, H, E] layout
    k_logical, v_logical = (torch.randn(B, H, S, E, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.zeros(1, H, n_pages * page, E) for _ in range(2))
    cache.assign(torch.arange(B), torch.arange(S).expand(B, S), k_logical, v_logical, k_cache, v_cache)
    q.requires_grad_()
    out = flexc.flex_attention(q, k_cache, v_cache, block_mask=bm, kernel_options={"BACKEND": backend})
    # the reference: batch 0 causal over its own keys, batch 1 (no pages) sees nothing
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(B, H, S, S).clone()
    causal[1] = False
    ref = dense_attention(q.detach().double(), k_logical.double(), v_logical.double(),
                          mask_mod=lambda b, h, qi, kv: causal[b, h, qi, kv])[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert out.transpose(1, 2).is_contiguous()  # the query's dimension order
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and bool((q.grad[1] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_output_follows_the_query_layout(backend):
    """A decoding step's query [B, H, 1, D] from a [B, 1, H, D] tensor with a paged cache: the output
    keeps the query's stride order."""
    cache, bm, page, n_pages = _paged_setup()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 1, H, E, generator=g).transpose(1, 2)
    k_cache, v_cache = (torch.randn(1, H, n_pages * page, E, generator=g) for _ in range(2))
    step = bm[:, :, S // page - 1]
    step.seq_lengths = (1, n_pages * page)
    step.mask_mod = cache.get_mask_mod(lambda b, h, q_idx, kv_idx: q_idx + S - 1 >= kv_idx)
    out = flexc.flex_attention(q, k_cache, v_cache, block_mask=step, kernel_options={"BACKEND": backend})
    assert out.shape == q.shape and out.stride() == q.stride()
    want = torch.nn.attention.flex_attention.flex_attention(q, k_cache, v_cache, block_mask=step)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_a_decoding_slice_of_clean_tables_is_not_compacted_on_a_gpu():
    """The slice of tables found free of empty entries (read once per parent) goes to the backends as
    it is: no compaction ops per decoding step; a slice of tables with one is still compacted."""
    from flexc.masks import empty_entries

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(causal, None, None, 256, 256, BLOCK_SIZE=32)
        for row in (4, 5):
            sliced = parent[:, :, torch.tensor([row])]
            assert empty_entries.without_empty_entries(sliced) is sliced
        indices = parent.kv_indices.clone()
        indices[0, 0, 5, 0] = -1
        holed = flexc.BlockMask.from_kv_blocks(parent.kv_num_blocks, indices, parent.full_kv_num_blocks,
                                               parent.full_kv_indices, BLOCK_SIZE=32, mask_mod=causal)
        sliced = holed[:, :, torch.tensor([5])]
        assert empty_entries.without_empty_entries(sliced) is not sliced


def test_block_mask_methods_read_negative_entries_as_empty_blocks_as_the_call_does():
    """A -1 inside a row's count (PagedAttention's unowned pages) is a block never visited: _adjust,
    to_dense and sparsity read it so, and the cropped mask attends as the call on the original does."""
    num = torch.tensor([[[2, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, -1], [-1, 1]]]], dtype=torch.int32)
    bm = flexc.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 32))
    assert bm.to_dense().tolist() == [[[[1, 0], [0, 1]]]]
    cropped = bm._adjust(16, 32)
    assert cropped.kv_num_blocks.tolist() == [[[1]]] and cropped.kv_indices[..., :1].tolist() == [[[[0]]]]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, 32, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 1, 32, 8, dtype=torch.float64, generator=g) for _ in range(2))
    whole = flexc.flex_attention(q, k, v, block_mask=bm)
    top = flexc.flex_attention(q[:, :, :16], k, v, block_mask=cropped)
    torch.testing.assert_close(top, whole[:, :, :16])
