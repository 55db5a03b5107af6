"""Decoding's ``block_mask[:, :, t]`` (t a one-element tensor): lists read once, tensors on demand.

References: torch's own BlockMask slicing of torch's create_block_mask (same tables), and the
float64 dense attention of tests/reference.py for calls made with the slices.
"""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue
from reference import dense_attention

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _assert_kv_tables_equal(ours, ref):
    for name in TABLES:
        a, r = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (r is None), name
        if r is not None:
            assert a.dtype == r.dtype and a.shape == r.shape, name
            counts = getattr(ref, name.replace("indices", "num_blocks"))
            if name.endswith("indices"):  # entries past a row's count are unused (torch leaves them as they fall)
                used = torch.arange(r.shape[-1]) < counts.unsqueeze(-1)
                assert torch.equal(a[used], r[used]), name
            else:
                assert torch.equal(a, r), name


def test_every_row_slice_equals_torchs_and_stays_lists_until_asked():
    B, H, L, S = 2, 2, 300, 520
    mods = mask_catalogue(B, H, L, S)
    for name in ("causal", "document_causal", "per_head_window", "prefix_lm", "sliding_window_256"):
        ours = flexc.create_block_mask(mods[name], B, H, L, S, BLOCK_SIZE=(64, 128))
        ref = tfa.create_block_mask(mods[name], B, H, L, S, device="cpu", BLOCK_SIZE=(64, 128))
        for row in range(ours.kv_num_blocks.shape[2]):
            index = torch.tensor([row])
            sliced = ours[:, :, index]
            assert sliced.lazy_rows is not None and sliced._kv_tables is None, name
            assert sliced.shape == ref[:, :, index].shape
            _assert_kv_tables_equal(sliced, ref[:, :, index])
            assert sliced.lazy_rows is None  # built on access; the tensors are the truth from then on


def test_a_row_slice_is_a_copy_edits_of_the_parent_do_not_reach_it():
    S = 512
    parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S)
    sliced = parent[:, :, torch.tensor([3])]
    before = (sliced.lazy_rows.counts, sliced.lazy_rows.indices)
    parent.kv_num_blocks[0, 0, 3] = 0  # an in-place edit after slicing
    again = parent[:, :, torch.tensor([3])]
    assert again.lazy_rows.counts == (0,)  # a new slice sees the edit (the tables' version changed)
    assert (sliced.lazy_rows.counts, sliced.lazy_rows.indices) == before
    assert sliced.kv_num_blocks.flatten().tolist() == list(before[0]) == [1]  # the diagonal block


def test_edits_of_a_built_slice_are_what_attention_uses():
    torch.manual_seed(0)
    S = 384
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    parent = flexc.create_block_mask(causal, None, None, S, S)
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    sliced = parent[:, :, torch.tensor([2])]
    sliced.seq_lengths = (1, S)
    sliced.mask_mod = lambda b, h, q_idx, kv_idx: q_idx + 300 >= kv_idx
    sliced.full_kv_num_blocks[0, 0, 0] = 1  # keep only key block 0 of the two full ones
    out = flexc.flex_attention(q, k, v, block_mask=sliced)
    keys = torch.cat([torch.arange(128), torch.arange(256, 301)])  # full block 0 and the diagonal's allowed keys
    ref = dense_attention(q, k[:, :, keys], v[:, :, keys])[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_inference_mode_tables_slice_and_decode():
    S = 640
    with torch.inference_mode():
        parent = flexc.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 200), None, None, S, S)
        q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
        for pos in (129, 300, S - 1):
            sliced = parent[:, :, torch.tensor([pos // 128])]
            sliced.seq_lengths = (1, S)
            sliced.mask_mod = lambda b, h, q_idx, kv_idx, p=pos: (q_idx + p >= kv_idx) & (q_idx + p - kv_idx < 200)
            out = flexc.flex_attention(q, k, v, block_mask=sliced)
            ref = dense_attention(q, k, v, mask_mod=sliced.mask_mod)[0]
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("index", [torch.tensor([-1]), torch.tensor([2, 3]), 1, slice(1, 3)])
def test_other_indices_keep_the_tensor_path(index):
    S = 512
    parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S)
    ref = tfa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cpu")  # (2.11: "cuda" otherwise)
    sliced = parent[:, :, index]
    assert sliced.lazy_rows is None
    _assert_kv_tables_equal(sliced, ref[:, :, index])


@pytest.mark.parametrize("shape", [(1, 1, 1, 32), (1, 1, 1, 1), (1, 1, 1, 0), (2, 1, 1, 0), (0, 1, 1, 5),
                                   (1, 1, 4, 1), (1, 4, 16, 16), (2, 4, 3, 5), (7,)])
def test_table_lists_read_every_layout_in_row_major_order(shape):
    """The content key of small tables (one decoding row read as lists, larger tables through
    numpy) holds their entries in torch's row-major order, whatever the shape."""
    from flexc.masks.table_lists import table_lists

    g = torch.Generator().manual_seed(len(shape))
    idx = torch.randint(0, 50, shape, dtype=torch.int32, generator=g)
    num = torch.randint(0, 5, shape[:-1], dtype=torch.int32, generator=g)
    contents = table_lists((num, idx, None, None))
    assert contents.indices == tuple(idx.reshape(-1).tolist())
    assert contents.counts == tuple(num.reshape(-1).tolist())
    assert contents.num_shape == tuple(num.shape) and contents.full_counts is None
