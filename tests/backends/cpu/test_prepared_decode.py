"""The CPU decoding step decided once per signature (decode_cpu.prepare_one_row, through
prepared_forward): gpt-fast's loop (``parent[:, :, pos // block]``, a new closure over ``pos[0]``
every step) runs the fused kernel's path without deciding again, remembers only what a signature
and the allowed keys fix, and equals a float64 dense reference at every step, across block
boundaries and in-place edits of the cache, of the parent's tables and of the position."""
import pytest
import torch

import flexc
from flexc.backends.cpu import decode_cpu, torch_cpu
from reference import decoding_slice, dense_attention, random_qkv

S, H, D, BLOCK = 200, 2, 16, 32


def _causal(b, h, q, kv):
    return q >= kv


def _causal_but_five_back(b, h, q, kv):  # (one hole inside the diagonal block: a masked column)
    return (q >= kv) & (kv != q - 5)


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv < 40)


def _step(q, k, v, parent, position, pos, mask_mod):
    """``(flexc's output, the float64 dense reference)`` of one decoding step at ``pos`` (the
    reference on the cache with non-finite entries zeroed: the masked rows holding them count for
    nothing, and its dense product would turn them into NaN)."""
    sliced = decoding_slice(parent, position, pos, mask_mod, S)
    out = flexc.flex_attention(q, k, v, block_mask=sliced)
    k, v = k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)
    expected = dense_attention(q, k, v, mask_mod=lambda b, h, qi, kv: mask_mod(b, h, qi + pos, kv))[0]
    return out, expected


@pytest.fixture
def calls(monkeypatch):
    """How many calls ran forward_with_max (decided again) and derived a row's spans from intervals."""
    count = {"decided again": 0, "spans derived": 0}

    def counting(name, real):
        def spy(*args, **kwargs):
            count[name] += 1
            return real(*args, **kwargs)
        return spy
    monkeypatch.setattr(torch_cpu, "forward_with_max", counting("decided again", torch_cpu.forward_with_max))
    monkeypatch.setattr(decode_cpu, "_masked_by_intervals", counting("spans derived", decode_cpu._masked_by_intervals))
    return count


@pytest.mark.parametrize("mask_mod", [_causal, _causal_but_five_back, _window])
def test_a_decoding_loop_across_block_boundaries_matches_float64_dense_without_deciding_again(calls, mask_mod):
    q, k, v = random_qkv(1, H, H, 1, S, D, seed=1)
    parent = flexc.create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    position = torch.tensor([0])
    positions = range(58, 134, 3)  # rows 1 to 4 of the query blocks, each entered mid-way
    for pos in positions:
        out, expected = _step(q, k, v, parent, position, pos, mask_mod)
        torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
    # a later pass meets the same rows and positions: every step is served by its row's plan and the
    # spans remembered for its allowed keys (after two passes: the loop's first step is planned
    # before its closure is traced, under its slice's own tables, which no later step brings)
    for pos in positions:
        _step(q, k, v, parent, position, pos, mask_mod)
    decided, derived = calls["decided again"], calls["spans derived"]
    for pos in positions:
        out, expected = _step(q, k, v, parent, position, pos, mask_mod)
        torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
    assert calls["decided again"] == decided
    assert calls["spans derived"] == derived


def test_the_position_moved_in_place_under_the_same_mask_is_read_again(calls):
    q, k, v = random_qkv(1, H, H, 1, S, D, seed=2)
    parent = flexc.create_block_mask(_window, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    position = torch.tensor([0])
    sliced = decoding_slice(parent, position, 100, _window, S)
    first = flexc.flex_attention(q, k, v, block_mask=sliced)
    position.fill_(110)  # the same row, the same closure and mask: only the captured value moved
    out = flexc.flex_attention(q, k, v, block_mask=sliced)
    expected = dense_attention(q, k, v, mask_mod=lambda b, h, qi, kv: _window(b, h, qi + 110, kv))[0]
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
    assert not torch.allclose(out, first)
    assert calls["decided again"] == 0


def test_cache_edits_in_place_are_read_and_a_nan_in_a_masked_row_does_not_leak(calls):
    q, k, v = random_qkv(1, H, H, 1, S, D, seed=3)
    parent = flexc.create_block_mask(_causal_but_five_back, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    position = torch.tensor([0])
    out, expected = _step(q, k, v, parent, position, 90, _causal_but_five_back)
    # the next token's key and value written into the cache; NaN in the masked row and past the position
    k[:, :, 91] = 0.5
    v[:, :, 91] = -2.0
    k[:, :, 86] = v[:, :, 86] = float("nan")  # (91 - 5: masked at position 91)
    k[:, :, 92:] = v[:, :, 92:] = float("nan")  # (the unwritten cache)
    out, expected = _step(q, k, v, parent, position, 91, _causal_but_five_back)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
    # an allowed row edited in place: read again
    v[:, :, 40] = 3.0
    out, expected = _step(q, k, v, parent, position, 91, _causal_but_five_back)
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)


def test_the_parents_tables_edited_in_place_are_read_again():
    q, k, v = random_qkv(1, H, H, 1, S, D, seed=4)
    parent = flexc.create_block_mask(_causal, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    position = torch.tensor([0])
    out, expected = _step(q, k, v, parent, position, 100, _causal)
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
    # every block full now but the ragged last one (192..199, partial: the causal mask_mod blocks it
    # at position 100): the other keys are all read, past the position too
    everything = flexc.create_block_mask(lambda b, h, q, kv: kv >= 0, None, None, S, S, device="cpu",
                                         BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(parent, name).copy_(getattr(everything, name))
    out = flexc.flex_attention(q, k, v, block_mask=decoding_slice(parent, position, 100, _causal, S))
    expected = dense_attention(q, k, v, mask_mod=lambda b, h, qi, kv: kv < 192)[0]
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("extra", ["return_lse", "sinks"])
def test_grouped_heads_with_a_logsumexp_or_sinks_take_the_kernel_path_and_match_float64_dense(calls, extra):
    q, _, _ = random_qkv(1, 2 * H, H, 1, S, D, seed=5)  # (two query heads per key head)
    _, k, v = random_qkv(1, H, H, 1, S, D, seed=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if extra == "sinks" else None
    parent = flexc.create_block_mask(_causal_but_five_back, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    position = torch.tensor([0])
    for pos in (70, 71, 70):
        sliced = decoding_slice(parent, position, pos, _causal_but_five_back, S)
        out, lse = flexc.flex_attention(q, k, v, block_mask=sliced, enable_gqa=True, return_lse=True, sinks=sinks)
        expected, expected_lse, _ = dense_attention(
            q, k, v, mask_mod=lambda b, h, qi, kv: _causal_but_five_back(b, h, qi + pos, kv), sinks=sinks)
        torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse, expected_lse.float(), atol=2e-6, rtol=1e-5)
    assert calls["decided again"] == 0
