"""BlockMask's methods behave as torch's BlockMask, except where flexc deliberately fixes torch:
sparsity() is exact for ragged lengths and _adjust() drops tiles past the new edge."""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue
from torch_api import takes, torch_tile_classes

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _both(mod, B, H, Q_LEN, KV_LEN, block=128):
    return (flexc.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block),
            tfa.create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block))


def _assert_same_tables(ours, ref):
    for table in TABLES:
        a, r = getattr(ours, table), getattr(ref, table)
        if r is None:
            assert a is None, table
        else:
            assert a.dtype == r.dtype and a.shape == r.shape and torch.equal(a, r), table


def _valid_rows(num, idx):
    """Per row, the valid indices in order: what a kernel reads (entries past num are undefined)."""
    return [row[:n] for n, row in zip(num.flatten().tolist(), idx.flatten(0, -2).tolist())]


def _exact_sparsity(bm):
    """Elements outside computed tiles, counted on the element grid cropped to the real lengths."""
    (qb, kvb), (q_len, kv_len) = bm.BLOCK_SIZE, bm.seq_lengths
    tiles = bm.to_dense().to(torch.float64)
    elements = tiles.repeat_interleave(qb, dim=-2).repeat_interleave(kvb, dim=-1)[..., :q_len, :kv_len]
    return 100.0 * (1.0 - elements.sum().item() / elements.numel())


def test_to_string_draws_full_partial_and_empty_tiles_as_torch_classifies_them():
    mods = mask_catalogue(2, 3, 700, 1300)
    for name in ("causal", "sliding_window_256", "document", "per_head_window", "padding_per_batch"):
        ours, ref = _both(mods[name], 2, 3, 700, 1300, 64)
        classes = torch_tile_classes(ref)
        pictures = ours.to_string(-1, limit=6).split("\n(")
        for picture, (b, h) in zip(pictures, [(b, h) for b in range(2) for h in range(3)]):
            rows = [line[::2] for line in picture.splitlines()[1:] if line]
            drawn = [[{" ": 0, "░": 1, "█": 2}[ch] for ch in row] for row in rows]
            assert drawn == classes[b, h].tolist(), (name, b, h)


@pytest.mark.parametrize("grid_size, limit", [((20, 20), 4), (3, 4), ((4, 7), 1)])
def test_to_string_groups_leave_the_same_cells_blank_as_torch(grid_size, limit):
    mods = mask_catalogue(2, 3, 700, 1300)
    for name in ("causal", "sliding_window_256", "document", "per_head_window", "padding_per_batch"):
        ours, ref = _both(mods[name], 2, 3, 700, 1300, 64)
        mine, theirs = ours.to_string(grid_size, limit), ref.to_string(grid_size, limit)
        assert [c == " " for c in mine] == [c == " " for c in theirs], name
        assert len(mine) == len(theirs)


def test_str_and_repr_match_torch_when_lengths_are_block_multiples():
    mods = mask_catalogue(2, 2, 512, 768)
    for name in ("causal", "document_causal", "noop"):
        ours, ref = _both(mods[name], 2, 2, 512, 768)
        assert str(ours).splitlines()[0] == str(ref).splitlines()[0], name
        assert repr(ours) == repr(ref), name


def test_sparsity_equals_torch_for_block_multiples():
    for name, mod in list(mask_catalogue(2, 2, 512, 256).items())[:15]:
        ours, ref = _both(mod, 2, 2, 512, 256, 64)
        assert ours.sparsity() == pytest.approx(ref.sparsity(), abs=1e-9), name


def test_sparsity_is_exact_and_never_negative_for_ragged_lengths():
    ours, ref = _both(causal, None, None, 300, 300)
    assert ref.sparsity() < 0  # torch counts whole padded tiles
    assert 0 <= ours.sparsity() == pytest.approx(_exact_sparsity(ours), abs=1e-9)
    for name, mod in list(mask_catalogue(2, 3, 333, 1000).items())[:20]:
        bm = flexc.create_block_mask(mod, 2, 3, 333, 1000, device="cpu", BLOCK_SIZE=(128, 64))
        assert 0 <= bm.sparsity() <= 100 and bm.sparsity() == pytest.approx(_exact_sparsity(bm), abs=1e-9), name


def test_shape_numel_and_block_size_match_torch():
    ours, ref = _both(causal, 2, 3, 333, 1000, (128, 64))
    assert ours.shape == ref.shape == (2, 3, 333, 1000)
    assert ours.numel() == ref.numel() == 2 * 3 * 333 * 1000
    assert ours.BLOCK_SIZE == ref.BLOCK_SIZE == (128, 64) and ours.seq_lengths == ref.seq_lengths


@pytest.mark.parametrize("index", [0, -1, (1, 2), (slice(None), slice(1, 3)), (0, slice(None), torch.tensor([1, 3])),
                                   (slice(0, 2), 1, slice(2, 4)), torch.tensor([1, 0])])
def test_getitem_keeps_dims_and_equals_torch(index):
    mod = mask_catalogue(2, 4, 512, 512)["per_head_window"]
    ours, ref = _both(mod, 2, 4, 512, 512, 64)
    ours_sliced, ref_sliced = ours[index], ref[index]
    _assert_same_tables(ours_sliced, ref_sliced)
    assert ours_sliced.shape == ref_sliced.shape and ours_sliced.seq_lengths == ref_sliced.seq_lengths
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        ours_sliced.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(0))


def test_adjust_equals_torch_when_cropping_removes_only_empty_columns():
    ours, ref = _both(causal, 2, 2, 1024, 1024)
    for q_len, kv_len in ((512, 512), (300, 700), (1024, 1024)):
        _assert_same_tables(ours._adjust(q_len, kv_len), ref._adjust(q_len, kv_len))
        assert ours._adjust(q_len, kv_len).seq_lengths == (q_len, kv_len)
        assert ours._adjust(q_len, kv_len).mask_mod is causal


def test_adjust_drops_tiles_past_the_new_edge():
    mods = mask_catalogue(1, 2, 1000, 1000)
    for name in ("document", "global_tokens_with_window", "block_sparse_lookup_4d", "noop"):
        bm = flexc.create_block_mask(mods[name], 1, 2, 1000, 1000, device="cpu", BLOCK_SIZE=64)
        adjusted = bm._adjust(400, 250)
        rows, cols = 7, 4  # cdiv(400, 64), cdiv(250, 64)
        # the reference: the original tiles cropped to the new corner, in torch's row layout
        for prefix in ("", "full_"):
            num, idx = getattr(bm, prefix + "kv_num_blocks"), getattr(bm, prefix + "kv_indices")
            expected = [[c for c in row if c < cols] for row in _valid_rows(num[:, :, :rows], idx[:, :, :rows])]
            got = _valid_rows(getattr(adjusted, prefix + "kv_num_blocks"), getattr(adjusted, prefix + "kv_indices"))
            assert got == expected, (name, prefix)
        assert adjusted.kv_indices.shape == (1, 2, rows, cols)


def test_adjust_fixes_torch_keeping_an_out_of_range_tile():
    num, idx = torch.tensor([[[2]]], dtype=torch.int32), torch.tensor([[[[1, 3, 0, 2]]]], dtype=torch.int32)
    torch_adjusted = tfa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)._adjust(16, 48)
    assert _valid_rows(torch_adjusted.kv_num_blocks, torch_adjusted.kv_indices) == [[1, 3]]  # 3 is past 48 // 16
    ours = flexc.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)._adjust(16, 48)
    assert _valid_rows(ours.kv_num_blocks, ours.kv_indices) == [[1]]


def test_from_kv_blocks_derives_the_same_q_tables_as_torch():
    g = torch.Generator().manual_seed(0)
    occupancy = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    full = (torch.rand(2, 3, 5, 7, generator=g) < 0.3) & ~occupancy
    num, idx = flexc.analysis.tiles.dense_to_ordered(occupancy)
    fnum, fidx = flexc.analysis.tiles.dense_to_ordered(full)
    for kwargs in ({}, {"BLOCK_SIZE": (32, 16), "seq_lengths": (150, 100)}):
        ours = flexc.BlockMask.from_kv_blocks(num, idx, fnum, fidx, **kwargs)
        ref = tfa.BlockMask.from_kv_blocks(num, idx, fnum, fidx, **kwargs)
        _assert_same_tables(ours, ref)
        assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
        assert torch.equal(ours.to_dense(), occupancy.int() | full.int())
    without_q = flexc.BlockMask.from_kv_blocks(num, idx, compute_q_blocks=False)
    assert without_q.q_indices is None and without_q.full_kv_indices is None
    assert without_q.mask_mod is flexc.noop_mask


def test_to_moves_every_table_and_keeps_the_rest():
    bm = flexc.create_block_mask(causal, 2, 1, 300, 200, device="cpu", BLOCK_SIZE=64)
    moved = bm.to("meta")
    assert moved is not bm and all(getattr(moved, t).device.type == "meta" for t in TABLES)
    assert moved.mask_mod is causal and moved.seq_lengths == bm.seq_lengths and moved.BLOCK_SIZE == bm.BLOCK_SIZE
    back = bm.to("cpu")
    _assert_same_tables(back, bm)


def test_as_tuple_has_the_installed_torchs_fields_in_torchs_order():
    ours, ref = _both(causal, 2, 2, 333, 256, (128, 64))
    orders = 4 if takes(tfa.BlockMask.__init__, "dq_write_order") else 0  # torch 2.13's dQ-order fields; 2.11 has none
    for flatten, length in ((True, 13 + orders), (False, 11 + orders)):
        a, r = ours.as_tuple(flatten), ref.as_tuple(flatten)
        assert len(a) == len(r) == length
        for x, y in zip(a, r):
            assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y


def test_from_torch_and_to_torch_round_trip_bit_exactly():
    mods = mask_catalogue(2, 2, 333, 1000)
    for name in ("causal", "document_causal", "per_head_window"):
        ref = tfa.create_block_mask(mods[name], 2, 2, 333, 1000, device="cpu", BLOCK_SIZE=(128, 64))
        ours = flexc.BlockMask.from_torch(ref)
        _assert_same_tables(ours, ref)
        back = ours.to_torch()
        assert isinstance(back, tfa.BlockMask)
        for x, y in zip(back.as_tuple(), ref.as_tuple()):
            assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y
        assert back.mask_mod is mods[name]
    assert flexc.BlockMask.from_torch(tfa.BlockMask.from_kv_blocks(*flexc.analysis.tiles.dense_to_ordered(
        torch.ones(1, 1, 2, 2)))).mask_mod is flexc.noop_mask
    sliced = flexc.create_block_mask(causal, 2, 1, 256, 256, device="cpu")[0]
    assert sliced.to_torch().mask_mod is tfa._sliced_mask_mod_error


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_torch_flex_attention_gives_the_same_output_with_a_converted_mask():
    mod = mask_catalogue(1, 2, 200, 160)["document_causal"]
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float64) for n in (200, 160, 160))
    ours = flexc.create_block_mask(mod, 1, 2, 200, 160, device="cpu", BLOCK_SIZE=64).to_torch()
    ref = tfa.create_block_mask(mod, 1, 2, 200, 160, device="cpu", BLOCK_SIZE=64)
    torch.testing.assert_close(tfa.flex_attention(q, k, v, block_mask=ours),
                               tfa.flex_attention(q, k, v, block_mask=ref), rtol=0, atol=0)


def test_default_device_follows_the_captured_tensors_else_cpu_here():
    from flexc.masks.mask_arguments import resolve_device

    on_meta = torch.zeros(8, device="meta")
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: on_meta[q_idx] > 0)
    assert resolve_device(None, traced) == torch.device("meta")
    assert resolve_device("cpu", traced) == torch.device("cpu")
    expected = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    assert resolve_device(None, flexc.trace(causal)).type == torch.device(expected).type
    assert flexc.create_block_mask(causal, None, None, 128, 128).kv_indices.device.type == torch.device(expected).type
