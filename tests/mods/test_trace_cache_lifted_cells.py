"""Closure cells lifted out of the trace (flexc.mods.lifted_cells): one template per closure structure, the
trace of each new value by substitution, and never a stale value.

References: a fresh, uncached trace of the mod in its current state (``Tracer(fn).run()``) must
equal the cached one node for node (graphs are hash-consed, so equal graphs are the same object),
and end to end, float64 dense attention computed by calling the mod directly (tests/reference.py).
"""
from __future__ import annotations

import math

import pytest
import torch

import flexc
from flexc.mods import lifted_cells
from flexc.mods.trace import MASK_MOD, SCORE_MOD, TraceError, Tracer, mod_kind, trace
from reference import dense_attention, random_qkv


def assert_current(fn):
    """``trace(fn)`` equals a fresh trace: same graph, same captured memory, same name and sites."""
    cached, fresh = trace(fn), Tracer(fn, mod_kind(fn)).run()
    assert cached.root is fresh.root, (str(cached), str(fresh))
    # the same tensors, or views of the same memory (``table[offset]`` makes a new view per trace)
    assert [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in cached.buffers] == \
        [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in fresh.buffers]
    assert (cached.name, cached.kind, cached.buffer_names) == (fresh.name, fresh.kind, fresh.buffer_names)
    assert {str(n): s for n, s in cached.sites.items()} == {str(n): s for n, s in fresh.sites.items()}
    return cached


def offset_mask(offset):
    def causal_offset(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return causal_offset


def shifted(mask_mod, offset):
    """gpt-fast's get_mask_mod."""
    def mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    return mask


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


@pytest.mark.parametrize("base, make", [(causal, lambda pos: offset_mask(pos)),
                                        (causal, lambda pos: offset_mask(torch.tensor(pos))),
                                        (sliding, lambda pos: shifted(sliding, pos)),
                                        (causal, lambda pos: shifted(causal, torch.tensor(pos)))],
                         ids=["int", "fresh 0-d tensor", "gpt-fast int sliding", "gpt-fast tensor"])
def test_new_closure_each_decoding_step_equals_dense_across_block_boundaries(base, make, runs):
    S, block = 256, 32
    q, k, v = random_qkv(2, 8, 2, 1, S, 16)
    parent = flexc.create_block_mask(base, None, None, S, S, BLOCK_SIZE=block)
    input_pos = torch.tensor([0])
    for pos in (60, 62, 63, 64, 65, 95, 96, 130, 255, 0, 31, 32):  # either side of block boundaries
        input_pos.fill_(pos)
        mask = parent[:, :, input_pos // block]
        mask.mask_mod, mask.seq_lengths = make(pos), (1, S)
        out = flexc.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        ref = dense_attention(q, k, v, mask_mod=make(pos))[0]
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=f"position {pos}")
        assert_current(make(pos))
    assert runs[0] <= 12 + 1 + 2  # the references above, one template, and at most one more trace


def test_a_rebound_cell_of_the_same_closure_is_never_stale():
    offset = 3

    def mod(b, h, q_idx, kv_idx):
        return q_idx - offset <= kv_idx

    for offset in (3, 4, -7, 2**40, 0, 3):
        assert str(offset) in str(assert_current(mod))
    offset = 1.5  # another type: another template (a float compares as a float)
    assert "1.5" in str(assert_current(mod))
    offset = True  # a bool is never lifted
    assert assert_current(mod).root is Tracer(mod, MASK_MOD).run().root


def test_numbers_keep_their_type_and_sign():
    for value in (2, 2.0, -0.0, 0.0, 1e300, -3, float("inf")):
        def scaled(score, b, h, q_idx, kv_idx):
            return score * value + q_idx

        assert_current(scaled)


def test_nan_raises_the_tracers_error():
    value = 1.0

    def scaled(score, b, h, q_idx, kv_idx):
        return score * value

    trace(scaled)
    value = math.nan
    with pytest.raises(TraceError, match="NaN"):
        trace(scaled)


def test_changed_captured_tensor_gives_its_values_and_metadata():
    bias = torch.tensor(5)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias * kv_idx

    q, k, v = random_qkv(1, 2, 2, 8, 8, 4)
    for bias in (torch.tensor(5), torch.tensor(-2), torch.tensor(1.5), torch.tensor(2.5, dtype=torch.float64),
                 torch.tensor([3.0])[0], torch.tensor(0.5, requires_grad=True)):
        traced = assert_current(mod)
        assert traced.buffers[0] is bias
        out = flexc.flex_attention(q, k, v, score_mod=mod)
        torch.testing.assert_close(out.double(), dense_attention(q, k, v, score_mod=mod)[0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        bias.mul_(4)  # in place: the same trace reads the new value
    assert trace(mod).buffers[0] is bias
    out = flexc.flex_attention(q, k, v, score_mod=mod)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, score_mod=mod)[0], atol=1e-5, rtol=1e-5)


SHARED = torch.tensor(4)


def test_a_tensor_also_reached_another_way_is_not_lifted():
    other = torch.tensor(2)

    def mod(b, h, q_idx, kv_idx):
        return (q_idx + pos >= kv_idx) & (kv_idx < SHARED + q_idx) & (kv_idx != other)

    for pos in (SHARED, torch.tensor(7), SHARED, other, torch.tensor(1)):
        assert_current(mod)


def test_uses_other_than_operators_trace_with_the_value():
    """The cell's value shapes the graph (or Python sees it): each value must get its own trace."""
    table = torch.arange(-200, 300)  # long enough for every offset below
    small = torch.arange(-8, 8, dtype=torch.int8)

    def python_arithmetic(b, h, q_idx, kv_idx):
        return q_idx + (offset + 1) >= kv_idx

    def branch(b, h, q_idx, kv_idx):
        if offset > 3:
            return q_idx >= kv_idx
        return q_idx <= kv_idx + offset

    def index(b, h, q_idx, kv_idx):
        return table[offset] + q_idx >= kv_idx

    def where(b, h, q_idx, kv_idx):
        return torch.where(q_idx > kv_idx, offset, 0) + q_idx >= kv_idx

    def kind(b, h, q_idx, kv_idx):
        return q_idx + (offset if isinstance(offset, int) else 0) >= kv_idx

    def narrow(b, h, q_idx, kv_idx):  # a Python int next to an int8 tensor wraps to int8
        return small[kv_idx % 16] < offset

    def divide(b, h, q_idx, kv_idx):
        return q_idx // offset >= kv_idx

    def in_a_lambda(b, h, q_idx, kv_idx):
        return (lambda x: x + offset)(q_idx) >= kv_idx

    for mod in (python_arithmetic, branch, index, where, kind, narrow, divide, in_a_lambda):
        for offset in (1, 5, 2, 200, -130, 7):
            assert_current(mod)


def test_liftable_cells_reads_the_bytecode():
    a, c, d = 1, 2, 3

    def operands(b, h, q_idx, kv_idx):
        return (a + q_idx >= kv_idx) & (q_idx * c <= kv_idx)

    def mixed(b, h, q_idx, kv_idx):
        return (q_idx + a >= kv_idx) & (q_idx < d + 1) & (kv_idx != c) & (q_idx > len([a]))

    names = lambda fn: {fn.__code__.co_freevars[i] for i in lifted_cells.liftable_cells(fn.__code__)}
    assert names(operands) == {"a", "c"}
    # ``d + 1`` passes the bytecode rule (its marker refuses the int at run time); ``[a]`` does not
    assert names(mixed) == {"c", "d"}
    assert names(offset_mask(1)) == {"offset"}
    assert names(shifted(causal, 1)) == {"offset"}  # mask_mod is called, not an operand


def test_kinds_are_checked_against_the_template():
    def mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    offset = 1
    trace(mod, MASK_MOD)
    offset = 2
    with pytest.raises(TraceError, match="expected a score_mod"):
        trace(mod, SCORE_MOD)
    assert trace(mod, MASK_MOD).root is Tracer(mod, MASK_MOD).run().root
