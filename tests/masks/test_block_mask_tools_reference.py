"""sparsity(), to_string(), str() and repr() read the tables' counts (never a dense tile grid) and
give exactly what the dense-grid implementation gave, kept here as the reference: on random tables
at ragged lengths, several batches and heads, with and without full tiles, for masks from
create_block_mask and torch's, and for tables that are not ordered (repeated or unsorted columns, a
tile both partial and full), which fall back to the dense grid."""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue
from flexc.masks import block_mask as bm_module
from flexc.masks import ordered_rows
from flexc.analysis.tiles import cdiv, dense_to_ordered, ordered_to_dense

GRIDS = ((20, 20), 3, (4, 7), -1, (1, 50), (50, 1), 0)
LIMITS = (4, 1, 0, -1, 100)


# ---- the reference: the dense-grid implementation as it was --------------------------------------

def _reference_dense(bm):
    dense = ordered_to_dense(bm.kv_num_blocks, bm.kv_indices, bm.kv_indices.shape[-1])
    if bm.full_kv_num_blocks is not None:
        dense = dense | ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
    return dense


def reference_sparsity(bm):
    total = bm.numel()
    if total == 0:
        return 0.0
    dense = _reference_dense(bm).to(torch.int64)
    (q_block, kv_block), (q_len, kv_len) = bm.BLOCK_SIZE, bm.seq_lengths
    rows = (q_len - torch.arange(dense.shape[-2]) * q_block).clamp(0, q_block)
    cols = (kv_len - torch.arange(dense.shape[-1]) * kv_block).clamp(0, kv_block)
    computed = int((dense * rows[:, None] * cols[None, :]).sum())
    return 100.0 * (1.0 - computed / total)


def _reference_draw(classes, row_step, col_step):
    rows, cols = classes.shape
    r, c = cdiv(rows, row_step), cdiv(cols, col_step)
    pad = (0, c * col_step - cols, 0, r * row_step - rows)
    grouped = lambda value: torch.nn.functional.pad(classes, pad, value=value).view(r, row_step, c, col_step)
    some = grouped(0).amax(dim=(1, 3))
    all_full = grouped(2).amin(dim=(1, 3)) == 2
    chars = [["█" if full else ("░" if s else " ") for s, full in zip(srow, frow)]
             for srow, frow in zip(some.tolist(), all_full.tolist())]
    return "".join("".join(ch * 2 for ch in line) + "\n" for line in chars)


def reference_to_string(bm, grid_size=(20, 20), limit=4):
    classes = ordered_to_dense(bm.kv_num_blocks, bm.kv_indices, bm.kv_indices.shape[-1]).to(torch.int64)
    if bm.full_kv_num_blocks is not None:
        full = ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
        classes = classes + 2 * full.to(torch.int64)
    *batch_dims, rows, cols = classes.shape
    if grid_size == -1 or grid_size == (-1, -1):
        max_rows, max_cols = rows, cols
    elif isinstance(grid_size, int):
        max_rows = max_cols = grid_size
    else:
        max_rows, max_cols = grid_size
    row_step, col_step = max(1, cdiv(rows, max(1, max_rows))), max(1, cdiv(cols, max(1, max_cols)))
    indices = [()]
    for n in batch_dims:
        indices = [(*i, j) for i in indices for j in range(n)]
    pictures = []
    for count, index in enumerate(indices):
        if count == limit:
            pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                         "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
            break
        pictures.append(f"{index}\n" + _reference_draw(classes[index], row_step, col_step))
    return "\n".join(pictures)


def reference_str(bm):
    return (f"BlockMask(shape={bm.shape}, sparsity={reference_sparsity(bm):.2f}%, \n"
            f"{reference_to_string(bm).strip()}\n)")


def assert_same_as_reference(bm, grids=GRIDS, limits=LIMITS, what=""):
    assert bm.sparsity() == reference_sparsity(bm), what
    assert str(bm) == reference_str(bm), what
    for grid in grids:
        for limit in limits:
            assert bm.to_string(grid, limit) == reference_to_string(bm, grid, limit), (what, grid, limit)
    assert f"\n    sparsity={reference_sparsity(bm):.2f}%,\n" in repr(bm), what


# ---- random tables ------------------------------------------------------------------------------

def _random_classes(g, batch, nq, nkv, style):
    """0 empty / 1 partial / 2 full per tile."""
    shape = (*batch, nq, nkv)
    if style == "dense":
        return torch.randint(0, 3, shape, generator=g)
    if style == "sparse":
        classes = torch.randint(0, 3, shape, generator=g)
        return torch.where(torch.rand(shape, generator=g) < 0.15, classes, 0)
    if style == "band":  # a window around the diagonal, partial edges, full inside, per-head offsets
        q = torch.arange(nq)[:, None]
        kv = torch.arange(nkv)[None, :]
        width = int(torch.randint(0, 4, (), generator=g))
        offset = torch.randint(-2, 3, (*batch, 1, 1), generator=g)
        diff = q - kv + offset
        return torch.where((diff > 0) & (diff < width), 2, torch.where((diff == 0) | (diff == width), 1, 0))
    if style == "blocky":  # whole rows and columns of one class, so grouped cells are all full or empty
        rows = torch.randint(0, 3, (*batch, nq, 1), generator=g)
        cols = torch.randint(0, 2, (*batch, 1, nkv), generator=g)
        return rows * cols
    raise ValueError(style)


def _scramble_unused(g, num, idx):
    """Entries past a row's count are undefined: overwrite them with anything, out-of-range included."""
    width = idx.shape[-1]
    unused = torch.arange(width) >= num.unsqueeze(-1)
    noise = torch.randint(-3, width + 4, idx.shape, generator=g, dtype=idx.dtype)
    return torch.where(unused, noise, idx)


def _random_block_mask(g, style, full_tables=True, batch=(2, 3), scramble=True):
    nq, nkv = (int(x) for x in torch.randint(1, 12, (2,), generator=g))
    q_block, kv_block = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
    # ragged lengths: anywhere in the last block, or shorter than the tables cover
    ragged = lambda n, block: max(1, n * block - int(torch.randint(0, 2 * block, (), generator=g)))  # noqa: E731
    seq_lengths = (ragged(nq, q_block), ragged(nkv, kv_block))
    classes = _random_classes(g, batch, nq, nkv, style)
    if not full_tables:
        classes = classes.clamp(max=1)
    num, idx = dense_to_ordered((classes == 1).to(torch.int32))
    full = dense_to_ordered((classes == 2).to(torch.int32)) if full_tables else (None, None)
    if scramble:
        idx = _scramble_unused(g, num, idx)
        if full_tables:
            full = (full[0], _scramble_unused(g, *full))
    return flexc.BlockMask.from_kv_blocks(num, idx, *full, BLOCK_SIZE=(q_block, kv_block),
                                          seq_lengths=seq_lengths)


STYLES = ("dense", "sparse", "band", "blocky")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("full_tables", [True, False])
def test_random_tables_give_the_dense_grid_results(style, full_tables):
    g = torch.Generator().manual_seed(2 * STYLES.index(style) + full_tables)
    for trial in range(12):
        batch = [(2, 3), (1, 1), (3,), (), (2, 1, 2)][trial % 5]
        bm = _random_block_mask(g, style, full_tables, batch, scramble=trial % 3 != 0)
        assert_same_as_reference(bm, grids=GRIDS[:4], limits=LIMITS[:3], what=(style, trial))


def test_wide_tables_with_few_entries_give_the_dense_grid_results():
    # many columns and few entries a row: the disjointness check searches instead of marking
    g = torch.Generator().manual_seed(7)
    for trial in range(6):
        nq, nkv = 9, 200 + trial
        classes = _random_classes(g, (2, 2), nq, nkv, "band" if trial % 2 else "sparse")
        classes = torch.where(torch.rand(classes.shape, generator=g) < 0.02, 2, classes)
        num, idx = dense_to_ordered((classes == 1).to(torch.int32))
        full_num, full_idx = dense_to_ordered((classes == 2).to(torch.int32))
        bm = flexc.BlockMask.from_kv_blocks(num, _scramble_unused(g, num, idx), full_num, full_idx,
                                            BLOCK_SIZE=(16, 4), seq_lengths=(nq * 16 - 5, nkv * 4 - trial))
        assert_same_as_reference(bm, grids=GRIDS[:4], limits=LIMITS[:2], what=trial)


@pytest.mark.parametrize("block", [128, 64, (128, 64), (32, 48)])
def test_create_block_mask_results_at_ragged_lengths_give_the_dense_grid_results(block):
    mods = mask_catalogue(2, 3, 333, 1000)
    for name, mod in list(mods.items())[:24]:
        bm = flexc.create_block_mask(mod, 2, 3, 333, 1000, device="cpu", BLOCK_SIZE=block)
        assert_same_as_reference(bm, grids=((20, 20), -1, 3), limits=(4, -1), what=name)
        no_full = flexc.create_block_mask(mod, 2, 3, 333, 1000, device="cpu", BLOCK_SIZE=block,
                                          separate_full_blocks=False)
        assert_same_as_reference(no_full, grids=((20, 20),), limits=(4,), what=name)


def test_torch_block_masks_and_their_slices_give_the_dense_grid_results():
    mods = mask_catalogue(2, 2, 700, 1300)
    for name in ("causal", "sliding_window_256", "document", "per_head_window", "padding_per_batch", "noop"):
        ref = tfa.create_block_mask(mods[name], 2, 2, 700, 1300, device="cpu", BLOCK_SIZE=64)
        ours = flexc.BlockMask.from_torch(ref)
        assert_same_as_reference(ours, grids=((20, 20), -1), limits=(4,), what=name)
        assert_same_as_reference(ours[1], grids=((20, 20),), limits=(4,), what=name)
        assert_same_as_reference(ours[:, :, 3:7], grids=((20, 20), -1), limits=(4,), what=name)


def test_blocks_longer_than_the_sequence_give_the_dense_grid_results():
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    for q_len, kv_len, block in ((5, 7, 128), (100, 3, (16, 128)), (130, 250, 64)):
        bm = flexc.create_block_mask(causal, None, 2, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
        assert_same_as_reference(bm, what=(q_len, kv_len, block))
    # tables that cover more blocks than the lengths: columns past kv_len hold no elements
    g = torch.Generator().manual_seed(3)
    classes = _random_classes(g, (1, 2), 6, 9, "dense")
    num, idx = dense_to_ordered((classes == 1).to(torch.int32))
    full = dense_to_ordered((classes == 2).to(torch.int32))
    bm = flexc.BlockMask.from_kv_blocks(num, idx, *full, BLOCK_SIZE=8, seq_lengths=(20, 19))
    assert_same_as_reference(bm)


def _edit(bm, **tables):
    kw = {name: getattr(bm, name) for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                "full_kv_indices")}
    kw.update(tables)
    return flexc.BlockMask.from_kv_blocks(kw["kv_num_blocks"], kw["kv_indices"], kw["full_kv_num_blocks"],
                                          kw["full_kv_indices"], BLOCK_SIZE=bm.BLOCK_SIZE,
                                          seq_lengths=bm.seq_lengths)


def test_tables_that_are_not_ordered_fall_back_to_the_dense_grid():
    g = torch.Generator().manual_seed(11)
    base = _random_block_mask(g, "dense", True, (2, 2), scramble=False)
    while (int(base.kv_num_blocks.min()) < 2 or int(base.full_kv_num_blocks.min()) < 1
           or int(base.full_kv_num_blocks.max()) < 2):
        base = _random_block_mask(g, "dense", True, (2, 2), scramble=False)
    num, idx = base.kv_num_blocks, base.kv_indices
    full_num, full_idx = base.full_kv_num_blocks, base.full_kv_indices
    width = idx.shape[-1]
    not_ordered, ordered = {}, {}
    repeated = idx.clone()
    repeated[0, 1, 0, 1] = repeated[0, 1, 0, 0]
    not_ordered["repeated column"] = dict(kv_indices=repeated)
    unsorted = idx.clone()
    unsorted[1, 0, -1, :2] = unsorted[1, 0, -1, :2].flip(0)
    not_ordered["unsorted row"] = dict(kv_indices=unsorted)
    last_two = full_idx.clone()
    row = last_two.view(-1, width)[int(full_num.argmax())]  # the longest full row
    count = int(full_num.max())
    if count >= 2:
        row[count - 2:count] = row[count - 2:count].flip(0)
        not_ordered["last two entries swapped"] = dict(full_kv_indices=last_two)
    both = full_idx.clone()
    both[0, 0, 0, 0] = idx[0, 0, 0, 0]
    not_ordered["tile both partial and full"] = dict(full_kv_indices=both)
    spare = idx.clone()
    spare[1, 1, 0, int(num[1, 1, 0]) - 1] = width  # the dense grid's spare column: ignored there
    not_ordered["column one past the last"] = dict(kv_indices=spare)
    negative = full_idx.clone()
    negative[1, 0, 0, 0] = -1
    not_ordered["negative column"] = dict(full_kv_indices=negative)
    either = {"count past the width": dict(kv_num_blocks=num + width)}  # every entry counts, the unused ones too
    ordered["negative count"] = dict(kv_num_blocks=num - width)
    ordered["int64 tables"] = dict(kv_num_blocks=num.long(), kv_indices=idx.long())
    ordered["mixed index dtypes"] = dict(full_kv_indices=full_idx.long())
    ordered["int16 indices"] = dict(kv_indices=idx.to(torch.int16))
    for expect_ordered, cases in ((False, not_ordered), (True, ordered), (None, either)):
        for what, tables in cases.items():
            bm = _edit(base, **tables)
            if expect_ordered is not None:
                assert (bm._ordered_tables() is not None) == expect_ordered, what
            if what == "negative column":  # an empty block, as every call reads it: the same as the
                from flexc.masks.empty_entries import without_empty_entries  # tables without that entry
                compacted = without_empty_entries(bm)
                assert bm.sparsity() == reference_sparsity(compacted)
                assert bm.to_string() == reference_to_string(compacted)
                continue
            assert_same_as_reference(bm, grids=((20, 20), -1, 2), limits=(4, -1), what=what)


def test_tables_edited_in_place_are_read_as_they_are_now():
    bm = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, 2, 2, 300, 300, device="cpu", BLOCK_SIZE=32)
    assert_same_as_reference(bm)
    bm.full_kv_indices[0, 0, 5, 0] = bm.kv_indices[0, 0, 5, 0]  # now also full: the dense grid decides
    assert_same_as_reference(bm)
    bm.kv_num_blocks.zero_()
    assert_same_as_reference(bm)


def test_empty_dims_give_the_dense_grid_results():
    for batch, nq, nkv in (((0, 2), 3, 4), ((2, 1), 0, 4)):
        num = torch.zeros(*batch, nq, dtype=torch.int32)
        idx = torch.zeros(*batch, nq, nkv, dtype=torch.int32)
        bm = flexc.BlockMask.from_kv_blocks(num, idx, num.clone(), idx.clone(), BLOCK_SIZE=4,
                                            seq_lengths=(max(1, nq * 4), nkv * 4))
        assert bm.sparsity() == reference_sparsity(bm)
        assert bm.to_string() == reference_to_string(bm)


def test_ordered_tables_are_read_without_a_dense_tile_grid(monkeypatch):
    def no_grid(*args, **kwargs):
        raise AssertionError("a dense tile grid was built")

    bm = flexc.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 300), 2, 2, 4000, 3000,
                                 device="cpu", BLOCK_SIZE=(64, 32))
    expected = (reference_sparsity(bm), reference_to_string(bm), reference_str(bm))
    monkeypatch.setattr(bm_module, "ordered_to_dense", no_grid)
    assert (bm.sparsity(), bm.to_string(), str(bm)) == expected


def test_disjointness_by_search_and_by_marks_agree_with_sets():
    g = torch.Generator().manual_seed(5)
    strategies = set()
    for trial in range(40):
        rows, width = 7, int(torch.randint(1, 300, (), generator=g))
        density_a, density_b = (float(x) for x in torch.rand(2, generator=g) * 0.3)
        a = (torch.rand(rows, width, generator=g) < density_a).to(torch.int32)
        b = (torch.rand(rows, width, generator=g) < density_b).to(torch.int32)
        expected = not bool((a & b).any())
        ordered = [ordered_rows.ascending_rows(*dense_to_ordered(t)) for t in (a, b)]
        assert ordered_rows.disjoint(*ordered, width) == expected, trial
        narrow, wide = sorted(o[0].shape[1] for o in ordered)
        if narrow:
            strategies.add("search" if narrow * wide.bit_length() * 4 <= width else "marks")
            # a width past every column makes it search, whatever it chose above
            assert ordered_rows.disjoint(*ordered, 1 << 40) == expected, trial
    assert strategies == {"search", "marks"}
