"""Out-of-range lookups and integer division by zero in a mod raise one clear IndexRangeError on
every path (TORCH, TRITON under the interpreter, create_block_mask, create_mask), naming the mod,
its line, the tensor and the index range, where torch's FlexAttention raises IndexError too;
negative indices count from the end as in torch; lookups the interval analysis proves in range
are never evaluated by the check."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch.nn.attention import flex_attention as torch_flex

import flexc
from strategies import examples
from flexc.analysis import bounds
from flexc.analysis.bounds import IndexRangeError
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

L, S = 64, 48
TABLE = torch.randn(64)
IDS = torch.arange(64) // 16  # 0..3
RELATIVE = torch.randn(L + S - 1)  # one entry per q_idx - kv_idx

BAD_SCORE_MODS = {
    "table[kv_idx + 17]": (lambda score, b, h, q_idx, kv_idx: score + TABLE[kv_idx + 17], "[17, 64]"),
    "table[q_idx - 1000]": (lambda score, b, h, q_idx, kv_idx: score + TABLE[q_idx - 1000], "[-1000, -937]"),
    "table[ids[q_idx] * 100]": (lambda score, b, h, q_idx, kv_idx: score + TABLE[IDS[q_idx] * 100], "[0, 300]"),
}


def flexc_call(q, k, v, backend, score_mod=None, block_mask=None):
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                kernel_options={"BACKEND": backend})


@pytest.mark.parametrize("name", sorted(BAD_SCORE_MODS))
def test_out_of_range_lookup_raises_the_same_clear_error_on_every_backend(name):
    score_mod, index_range = BAD_SCORE_MODS[name]
    q, k, v = random_qkv(1, 1, 1, L, S, 16)
    with pytest.raises(IndexError):  # torch's own FlexAttention rejects the same mod
        torch_flex.flex_attention(q, k, v, score_mod=score_mod)
    messages = set()
    for backend in ("TORCH", "TRITON"):
        with pytest.raises(IndexRangeError) as info:
            flexc_call(q, k, v, backend, score_mod=score_mod)
        messages.add(str(info.value))
    assert len(messages) == 1
    text = messages.pop()
    for part in ("flex_attention: score_mod <lambda>", "test_bounds.py", f"`{name.replace('table', 'TABLE').replace('ids', 'IDS')}`",
                 "`TABLE` (shape [64])", index_range, "valid indices are -64..63", "Fix:"):
        assert part in text, (part, text)


def test_out_of_range_mask_lookup_in_block_masks_and_dense_masks():
    def shifted(b, h, q_idx, kv_idx):
        return TABLE[kv_idx + 20] > 0

    for build in (flexc.create_block_mask, flexc.create_mask):
        with pytest.raises(IndexRangeError, match=r"(?s)mask_mod shifted.*\[20, 67\].*e\.g\. 64 at kv_idx=44"):
            build(shifted, 1, 1, L, S)
    with pytest.raises(IndexError):
        torch_flex.create_mask(shifted, 1, 1, L, S, device="cpu")


def test_mask_lookup_by_batch_is_checked_against_the_call_not_the_block_mask():
    """A BlockMask built for B=None evaluates the mask at b=0 only; the kernel calls it with every b."""
    doc = torch.zeros(1, L, dtype=torch.int64)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx % L]

    block_mask = flexc.create_block_mask(same_doc, None, None, L, S, BLOCK_SIZE=16)
    q, k, v = random_qkv(2, 1, 1, L, S, 16)
    for backend in ("TORCH", "TRITON"):
        with pytest.raises(IndexRangeError, match=r"for B=2.*`doc\[b, q_idx\]`.*\[0, 1\].*b=1"):
            flexc_call(q, k, v, backend, block_mask=block_mask)


def test_integer_division_by_a_zero_lookup():
    def by_document(score, b, h, q_idx, kv_idx):
        return score + (q_idx // IDS[kv_idx]).float()

    q, k, v = random_qkv(1, 1, 1, L, S, 16)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch_flex.flex_attention(q, k, v, score_mod=by_document)
    for backend in ("TORCH", "TRITON"):
        with pytest.raises(IndexRangeError, match=r"(?s)divides by zero.*`IDS\[kv_idx\]`.*kv_idx=0.*Fix:"):
            flexc_call(q, k, v, backend, score_mod=by_document)


def test_negative_indices_count_from_the_end_as_in_torch():
    def previous(score, b, h, q_idx, kv_idx):
        return score + TABLE[q_idx - 1] - TABLE[-1 - kv_idx]

    q, k, v = random_qkv(1, 1, 1, L, S, 16, seed=1)
    expected = torch_flex.flex_attention(q, k, v, score_mod=previous)
    ref, _, _ = dense_attention(q, k, v, score_mod=previous)
    torch.testing.assert_close(expected.double(), ref, atol=2e-5, rtol=0)
    for backend in ("TORCH", "TRITON"):
        torch.testing.assert_close(flexc_call(q, k, v, backend, score_mod=previous).double(), ref, atol=2e-5, rtol=0)


IN_RANGE = {
    "direct": lambda b, h, q_idx, kv_idx: TABLE[kv_idx] > 0,
    "relative": lambda b, h, q_idx, kv_idx: RELATIVE[q_idx - kv_idx + S - 1] > 0,
    "nested": lambda b, h, q_idx, kv_idx: TABLE[IDS[q_idx] * 16 + IDS[kv_idx]] > 0,
    "modulo": lambda b, h, q_idx, kv_idx: TABLE[(q_idx * 7 + kv_idx) % 64] > 0,
    "clamped": lambda b, h, q_idx, kv_idx: TABLE[(kv_idx + 30).clamp(max=63)] > 0,
    "divisor": lambda b, h, q_idx, kv_idx: q_idx // (IDS[kv_idx] + 1) >= 1,
}


@pytest.mark.parametrize("name", sorted(IN_RANGE))
def test_in_range_lookups_are_proven_without_evaluation(name, monkeypatch):
    def no_evaluation(*args):
        raise AssertionError("the bounds check evaluated an index the analysis should prove")

    monkeypatch.setattr(bounds, "_exact_check", no_evaluation)
    mask_mod = IN_RANGE[name]
    bounds.check_mod(flexc.trace(mask_mod), 2, 2, L, S, "test")
    b, h, q_idx, kv_idx = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1), \
        torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    assert torch.equal(flexc.create_mask(mask_mod, 2, 2, L, S), mask_mod(b, h, q_idx, kv_idx).expand(2, 2, L, S))


def test_a_captured_index_table_changed_in_place_is_checked_again():
    ids = IDS.clone()

    def by_document(b, h, q_idx, kv_idx):
        return TABLE[ids[q_idx] * 16] > 0

    traced = flexc.trace(by_document)
    bounds.check_mod(traced, 1, 1, L, S, "test")  # proven (and remembered) for these values
    ids[5] = 4  # 4 * 16 = 64 is past the end of TABLE
    with pytest.raises(IndexRangeError, match=r"\[0, 64\] \(e\.g\. 64 at q_idx=5\)"):
        bounds.check_mod(traced, 1, 1, L, S, "test")


@examples(60)
@given(a=st.integers(-2, 2), c=st.integers(-2, 2), d=st.integers(-60, 60), size=st.integers(1, 80),
       lengths=st.tuples(st.integers(1, 40), st.integers(1, 40)), nested=st.booleans())
def test_the_check_raises_exactly_when_torch_does(a, c, d, size, lengths, nested):
    """Random affine (optionally looked-up) indices: flexc raises iff torch's eager indexing does,
    and otherwise computes torch's mask."""
    Q, K = lengths
    table = torch.arange(size) % 7
    inner = torch.arange(40) % 5 - 2  # values -2..2: a nested, data-dependent index

    def mod(b, h, q_idx, kv_idx):
        index = a * q_idx + c * kv_idx + d
        if nested:
            index = index + inner[kv_idx] * 3
        return table[index] >= 3

    q_idx, kv_idx = torch.arange(Q).view(1, 1, Q, 1), torch.arange(K).view(1, 1, 1, K)
    try:
        expected = mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                       q_idx, kv_idx).expand(1, 1, Q, K)
    except IndexError:
        expected = None
    if expected is None:
        with pytest.raises(IndexRangeError):
            flexc.create_mask(mod, 1, 1, Q, K)
    else:
        assert torch.equal(flexc.create_mask(mod, 1, 1, Q, K), expected)


# ---- only the tiles a BlockMask lists are checked (torch's PagedAttention, test_load_rel_bias) ----

def _paged_rel_bias_call(backend, train=False):
    """torch's test_load_rel_bias, paged half: a relative bias read at logical positions through
    a page table; the tables of pages a batch row does not own map far outside the bias."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    B, H, length, D, page = 2, 2, 64, 16, 16
    n_pages = 2 * B * length // page  # half the cache is never owned by anyone
    g = torch.Generator().manual_seed(4)
    rel_bias = torch.randn(2 * length, dtype=torch.float64, generator=g)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel_bias[q_idx - kv_idx + length]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = (torch.randn(B, H, length, D, dtype=torch.float64, generator=g) for _ in range(3))
    cache = PagedAttention(n_pages, page, B, device="cpu")
    for b in range(B):
        cache.reserve(torch.tensor(b), torch.tensor(length))
    k_cache, v_cache = (torch.zeros(1, H, n_pages * page, D, dtype=torch.float64) for _ in range(2))
    cache.assign(torch.arange(B), torch.arange(length).expand(B, length), k, v, k_cache, v_cache)
    logical = flexc.create_block_mask(causal, B, H, length, length, device="cpu", BLOCK_SIZE=page)
    physical = cache.convert_logical_block_mask(logical)
    if train:
        q.requires_grad_()
    out = flexc_call(q, k_cache, v_cache, backend, cache.get_score_mod(relative), physical)
    ref = dense_attention(q.detach(), k, v, score_mod=relative, mask_mod=causal)[0]
    return q, out, ref, (k, v, relative, causal)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_lookup_out_of_range_only_in_tiles_the_block_mask_skips_is_no_error(backend):
    q, out, ref, _ = _paged_rel_bias_call(backend)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_paged_rel_bias_trains_like_the_logical_call():
    q, out, ref, (k, v, relative, causal) = _paged_rel_bias_call("TORCH", train=True)
    out.sum().backward()
    q_ref = q.detach().clone().requires_grad_()
    dense_attention(q_ref, k, v, score_mod=relative, mask_mod=causal)[0].sum().backward()
    torch.testing.assert_close(q.grad, q_ref.grad, atol=1e-10, rtol=1e-10)


def _page_table_case():
    """score_mod ``s + bias[table[b, kv_idx // 16]]`` and a block mask that lists kv tiles 0 and 1
    of batch 0 and tile 0 of batch 1 (tile 2, and tile 1 of batch 1, are never visited)."""
    table = torch.tensor([[0, 1, 2], [0, 1, 2]])
    bias = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def paged_bias(score, b, h, q_idx, kv_idx):
        return score + bias[table[b, kv_idx // 16]]

    num = torch.tensor([[[2]], [[1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2]]], [[[0, 1, 2]]]], dtype=torch.int32)
    bm = flexc.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(16, 48))
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 16, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 1, 48, 8, dtype=torch.float64, generator=g) for _ in range(2))

    def check():
        out = flexc.flex_attention(q, k, v, score_mod=paged_bias, block_mask=bm)
        listed = lambda b, h, q_idx, kv_idx: kv_idx < torch.where(b == 0, 32, 16)
        safe = lambda score, b, h, q_idx, kv_idx: score + bias[table[b, kv_idx // 16].clamp(0, 2)]
        torch.testing.assert_close(out, dense_attention(q, k, v, score_mod=safe, mask_mod=listed)[0],
                                   atol=1e-10, rtol=1e-10)
    return table, check


def test_a_lookup_out_of_range_in_a_listed_tile_still_raises_and_one_in_a_skipped_tile_does_not():
    table, check = _page_table_case()
    table[1, 1] = 99  # read only by a tile batch 1 never visits
    check()
    table[0, 1] = 7  # read by a tile batch 0 visits
    with pytest.raises(IndexRangeError, match=r"takes values in \[0, 7\]"):
        check()


def test_the_device_side_recheck_also_skips_unlisted_tiles():
    table, check = _page_table_case()
    with flexc.device.simulate("sm_90"):
        check()  # proven on the host once
        table[1, 1] = 99  # new values: asserted on the device, over the listed tiles only
        check()
        table[0, 1] = 7
        with pytest.raises(RuntimeError):
            check()
