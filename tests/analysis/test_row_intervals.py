"""A mask_mod's allowed kv intervals along one query row equal torch's evaluation, or decline.

The reference is flexc.evaluate (torch operations on index tensors) over every key of a row, for
every catalogue mask and for random graphs of affine comparisons and logic
(strategies.AFFINE_CONDITIONS); decoding with the intervals must then equal torch's FlexAttention
and the dense reference (tests/test_attention_decode.py and the decode fuzzer cover the path too,
since it is the default for one query row).
"""
import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from catalogue import mask_catalogue
from flexc.mods.evaluate import evaluate
from flexc.analysis.row_intervals import allowed_intervals
from flexc.mods.trace import MASK_MOD, trace
from reference import dense_attention
from strategies import AFFINE_CONDITIONS, compile_mod, examples


def _row_verdicts(traced, q_value: int, S: int) -> list[bool]:
    kv = torch.arange(-5, S + 5).view(1, 1, 1, -1)  # (past both ends too: the intervals are unbounded)
    ref = evaluate(traced, b=torch.zeros(1, 1, 1, 1, dtype=torch.long), h=torch.zeros(1, 1, 1, 1, dtype=torch.long),
                   q_idx=torch.full((1, 1, 1, 1), q_value), kv_idx=kv)
    return ref.expand(1, 1, 1, kv.shape[-1]).flatten().tolist()


def _assert_same(traced, q_value: int, S: int) -> bool:
    intervals = allowed_intervals(traced, q_value, S)
    if intervals is None:
        return False
    ours = [any(lo <= kv < hi for lo, hi in intervals) for kv in range(-5, S + 5)]
    assert ours == _row_verdicts(traced, q_value, S), (str(traced), q_value, intervals)
    assert all(lo < hi for lo, hi in intervals) and all(a[1] < b[0] for a, b in zip(intervals, intervals[1:]))
    return True


@pytest.mark.parametrize("q_value", [0, 63, 199])
def test_every_catalogue_mask_matches_torch_or_declines(q_value):
    S = 200
    answered = {name for name, mod in mask_catalogue(1, 1, S, S).items() if _assert_same(trace(mod, MASK_MOD), q_value, S)}
    assert {"causal", "causal_lower_right", "sliding_window_17", "prefix_lm", "leading_sink_tokens_and_window",
            "where_prefix_then_causal"} <= answered, answered


def test_what_intervals_cannot_describe_declines():
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    small = torch.tensor(3, dtype=torch.int8)
    for mod in (lambda b, h, q, kv: doc[kv] == doc[q],         # a lookup by kv_idx
                lambda b, h, q, kv: kv // 2 >= q,                # a division of kv_idx
                lambda b, h, q, kv: kv * kv <= q + 9,            # not affine
                lambda b, h, q, kv: (kv + small) > q,            # int8 arithmetic may wrap
                lambda b, h, q, kv: kv * 3_000_000_000 > q,      # may overflow int32
                lambda b, h, q, kv: (kv.float() * 0.5) < q,      # floats
                lambda b, h, q, kv: h >= 0,                      # reads the head
                lambda b, h, q, kv: (kv < q) * 2 + kv > 5):      # a boolean used as a number
        assert allowed_intervals(trace(mod, MASK_MOD), 3, 6) is None


def test_a_captured_0d_tensor_is_read_at_each_call():
    offset = torch.tensor(100)
    traced = trace(lambda b, h, q, kv: (q + offset >= kv) & (q + offset - kv < 16), MASK_MOD)
    assert allowed_intervals(traced, 0, 300) == ((85, 101),)
    offset.fill_(40)
    assert allowed_intervals(traced, 0, 300) == ((25, 41),)


def _mod_of(body: str, offset_value: int, number: int):
    """A mask_mod from a generated body: ``off`` a captured 0-d tensor, ``n`` a captured number."""
    env = {"off": torch.tensor(offset_value), "n": number,
           "table": torch.tensor([5, -3, 200, 17, 0, 64, 9, 1], dtype=torch.int32)}
    return compile_mod(f"lambda b, h, q, kv: {body}", env)


def _assert_decodes_like_dense(mask_mod, q, k, v, pos, msg=None):
    """One query row at ``pos`` through the slicing idiom (blocks of 32) equals the float64 dense
    computation, output and logsumexp."""
    S = k.shape[2]
    bm = flexc.create_block_mask(mask_mod, None, None, S, S, BLOCK_SIZE=32)
    input_pos = torch.tensor([pos])
    mask = bm[:, :, input_pos // 32]
    mask.mask_mod = lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + input_pos[0], kv_idx)
    mask.seq_lengths = (1, S)
    out, lse = flexc.flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
                                    return_lse=True)
    want_out, want_lse, _ = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + pos, kv_idx))
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5, msg=msg)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5, msg=msg)


@examples(150)
@given(AFFINE_CONDITIONS.expressions("bool"), st.integers(-50, 400), st.integers(-20, 20), st.integers(0, 299))
def test_random_affine_masks_match_torch(body, offset_value, number, q_value):
    mod = _mod_of(body, offset_value, number)
    assert _assert_same(trace(mod, MASK_MOD), q_value, 300), body


@pytest.mark.parametrize("pos", [0, 127, 128, 300, 511])
def test_decoding_with_a_window_and_a_prefix_matches_the_dense_reference(pos):
    """A window plus an always-visible prefix (two allowed runs on a row), read through the
    sliced idiom: the intervals decide the partial blocks, including an interior one."""
    S, window, prefix = 512, 100, 40
    g = torch.Generator().manual_seed(pos)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, S, 16, generator=g) for _ in range(2))

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (q_idx - kv_idx < window)) | (kv_idx < prefix)

    _assert_decodes_like_dense(mask_mod, q, k, v, pos)


@pytest.mark.parametrize("pos", [40, 63, 100])
def test_decoding_with_holes_inside_a_block_matches_the_dense_reference(pos):
    """Keys excluded one by one inside the diagonal block: several allowed runs in one partial
    block, each of which must stay allowed."""
    g = torch.Generator().manual_seed(pos)
    q = torch.randn(1, 2, 1, 8, generator=g)
    k, v = (torch.randn(1, 2, 128, 8, generator=g) for _ in range(2))

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx != q_idx - 3) & (kv_idx != q_idx - 10) & (kv_idx != q_idx - 17)

    _assert_decodes_like_dense(mask_mod, q, k, v, pos)


@examples(60)
@given(AFFINE_CONDITIONS.expressions("bool"), st.integers(-50, 250), st.integers(-20, 20), st.integers(0, 191))
def test_decoding_random_affine_masks_matches_the_dense_reference(body, offset_value, number, pos):
    """Any interval set (several runs inside one partial block, none, all) decides the partial
    blocks of a decoding step as the elements would: output and logsumexp equal the float64 dense
    computation, fully masked rows included (0 and -inf)."""
    S = 192
    mask_mod = _mod_of(body, offset_value, number)
    g = torch.Generator().manual_seed(pos)
    q = torch.randn(1, 2, 1, 8, generator=g)
    k, v = (torch.randn(1, 2, S, 8, generator=g) for _ in range(2))
    _assert_decodes_like_dense(mask_mod, q, k, v, pos, msg=body)
