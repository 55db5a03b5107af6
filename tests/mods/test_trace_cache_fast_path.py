"""The trace cache's fast path: a hit's guard, checked by identity, stands for the snapshot.

A lookup that finds the objects the last hit's snapshot read takes no snapshot (gpt-fast's new
closure each decoding step included); every change a snapshot sees still gives a fresh trace.
References: an uncached trace of the mod in its current state, and float64 dense attention.
"""
from __future__ import annotations

import sys
import types

import torch

import flexc
from flexc.mods import trace_cache
from flexc.mods.trace import trace
from catalogue import and_masks
from reference import dense_attention, random_qkv
from trace_checks import assert_current

LIMIT = 40


def window(q_idx, kv_idx):
    return q_idx - kv_idx <= LIMIT


def causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & window(q_idx, kv_idx)


# a user module whose helper a mod calls as ``USER_MASKS.rule(...)`` (a module global of the mod)
USER_MASKS = types.ModuleType("user_masks")
USER_MASKS.rule = causal


slopes = torch.rand(8)


def alibi(score, b, h, q_idx, kv_idx):  # (reads a module global tensor)
    return score + slopes[h] * (kv_idx - q_idx)


def through_module(b, h, q_idx, kv_idx):
    return USER_MASKS.rule(b, h, q_idx, kv_idx)


def shifted(mask_mod, offset):
    """gpt-fast's get_mask_mod: a new closure each step."""
    def mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    return mask


def assert_steps_take_no_snapshot(mod, input_pos, snapshots, steps=3):
    """gpt-fast's steps over ``mod`` (a new closure each, ``input_pos`` advanced in place) after a first
    two: each finds the first step's trace, and no step takes a snapshot."""
    first = trace(shifted(mod, input_pos[0]))
    trace(shifted(mod, input_pos[0]))  # (a hit by snapshot: keeps the guard)
    taken = snapshots[0]
    for _ in range(steps):
        input_pos += 1
        assert trace(shifted(mod, input_pos[0])) is first
    assert snapshots[0] == taken, getattr(mod, "__name__", mod)


def assert_lookups_take_no_snapshot(mod, snapshots, lookups=3):
    """After a first trace and a hit by snapshot (which keeps the guard), each lookup of ``mod`` finds that
    trace, and none takes a snapshot."""
    first = assert_current(mod)
    assert_current(mod)
    taken = snapshots[0]
    for _ in range(lookups):
        assert trace(mod) is first
    assert snapshots[0] == taken, getattr(mod, "__name__", mod)


def test_new_closures_over_the_same_objects_take_no_snapshot(snapshots, runs):
    input_pos = torch.tensor([5])
    assert_steps_take_no_snapshot(causal, input_pos, snapshots)
    taken = snapshots[0]
    for _ in range(3):
        assert trace(causal) is trace(causal)
    assert runs[0] == 2  # (the template and causal)
    assert snapshots[0] == taken + 2  # (causal's first lookup, a miss, and its first hit only)


def test_helpers_called_through_a_user_module_take_the_fast_path_and_their_rebinding_is_seen(snapshots, monkeypatch):
    """A mod calling ``module.helper(...)`` (the module a global, or a closure cell) is guarded like one
    calling the helper directly: new closures take no snapshot, and the helper rebound on its module,
    or a global it reads changed, gives the fresh trace."""
    cell_masks = types.ModuleType("cell_masks")
    cell_masks.rule = causal

    def through_cell(b, h, q_idx, kv_idx):
        return cell_masks.rule(b, h, q_idx, kv_idx)

    input_pos = torch.tensor([5])
    for mod, module in ((through_module, USER_MASKS), (through_cell, cell_masks)):
        assert_current(shifted(mod, input_pos[0]))
        assert_steps_take_no_snapshot(mod, input_pos, snapshots)
        monkeypatch.setattr(module, "rule", lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 3)
        assert "3" in str(assert_current(shifted(mod, input_pos[0])))
        assert_current(shifted(mod, input_pos[0]))
        monkeypatch.setattr(module, "rule", causal)
        monkeypatch.setattr(sys.modules[__name__], "LIMIT", 9)  # a global of the helper, two reads down
        assert "9" in str(assert_current(shifted(mod, input_pos[0])))
        monkeypatch.setattr(sys.modules[__name__], "LIMIT", 40)


def test_mods_reading_captured_tensors_take_the_fast_path_and_see_them_move(snapshots):
    """A mod indexing a captured tensor (ALiBi's slopes, a document mask's ids: a global or a cell, or
    a learned table that requires grad) is guarded by the tensor itself and what the snapshot keys it
    by: repeated lookups take no snapshot, and a ``.data`` swap (the same object viewing other memory,
    or of another shape) gives the fresh trace over the tensor as it is then."""
    doc = torch.arange(64) // 16
    table = torch.randn(8, requires_grad=True)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def learned(score, b, h, q_idx, kv_idx):
        return score + table[h]

    for mod, captured, swapped in ((alibi, slopes, torch.rand(8)), (document, doc, torch.arange(64) // 8),
                                   (learned, table, torch.randn(16))):
        assert_lookups_take_no_snapshot(mod, snapshots)
        with torch.no_grad():
            captured.data = swapped
        moved = assert_current(mod)
        assert moved.buffers[0].data_ptr() == swapped.data_ptr(), mod.__name__


def test_mods_reading_tuples_lists_and_dicts_take_the_fast_path_and_see_their_edits(snapshots, monkeypatch):
    """A combinator written as transformers writes its and_masks (a closure over a tuple of mods) and a
    mod reading a list and a dict are guarded by their items: repeated lookups take no snapshot, and a
    global an inner mod reads rebound, or the list or dict edited in place, gives the fresh trace."""
    trace_cache.clear()  # (the catalogue's and_masks code object may have given up its guard in earlier tests)
    windows, limits = [4, 8], {"lo": 2}

    def listed(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= windows[1]) & (kv_idx >= limits["lo"])

    combined = and_masks(causal, lambda b, h, q_idx, kv_idx: kv_idx >= 2)  # (the tests' own: a user's closure)
    for mod in (combined, listed):
        assert_lookups_take_no_snapshot(mod, snapshots)
    monkeypatch.setattr(sys.modules[__name__], "LIMIT", 9)  # read by causal's helper, inside the tuple
    assert "9" in str(assert_current(combined))
    windows[1] = 12
    assert "12" in str(assert_current(listed))
    windows.append(3)  # (another length: the same items read, a new snapshot)
    assert "12" in str(assert_current(listed))
    limits["lo"] = 5
    assert ">= 5" in str(assert_current(listed))
    assert_lookups_take_no_snapshot(listed, snapshots)
    limits["hi"] = 9  # (an item added)
    assert ">= 5" in str(assert_current(listed))


def test_mods_reading_objects_and_classes_take_the_fast_path_and_see_their_attributes_change(snapshots):
    """A mod reading its settings from an object (a model holding a window) or a class, or calling a
    callable object, is guarded by the object's class, its __call__ and the attributes the code names
    (its __call__'s included): repeated lookups take no snapshot, and an attribute rebound gives the
    fresh trace."""
    class Settings:
        limit = 6

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.window = 4

    class Shifted:
        def __init__(self, shift):
            self.shift = shift

        def __call__(self, b, h, q_idx, kv_idx):
            return q_idx + self.shift >= kv_idx

    model = Model()

    def windowed(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= model.window) & (kv_idx < q_idx + Settings.limit)

    helper = Shifted(3)

    def through_object(b, h, q_idx, kv_idx):
        return helper(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)

    for mod in (windowed, through_object):
        assert_lookups_take_no_snapshot(mod, snapshots)
    model.window = 11
    assert "11" in str(assert_current(windowed))
    Settings.limit = 13
    assert "13" in str(assert_current(windowed))
    helper.shift = 5
    assert "5" in str(assert_current(through_object))


def test_a_stored_bound_method_or_partial_is_read_through_each_call():
    """A bound method or a functools.partial kept in a cell (its object or arguments outside the mod's
    own names) is snapshotted on each lookup: its object's attribute rebound, or a list it binds edited,
    gives the fresh trace."""
    import functools

    class Limit:
        def __init__(self):
            self.limit = 4

        def allowed(self, q_idx, kv_idx):
            return q_idx - kv_idx <= self.limit

    def within(windows, q_idx, kv_idx):
        return q_idx - kv_idx <= windows[0]

    limit, windows = Limit(), [5]
    allowed, bound = limit.allowed, functools.partial(within, windows)

    def via_method(b, h, q_idx, kv_idx):
        return allowed(q_idx, kv_idx) & (q_idx >= kv_idx)

    def via_partial(b, h, q_idx, kv_idx):
        return bound(q_idx, kv_idx) & (q_idx >= kv_idx)

    for _ in range(2):
        assert_current(via_method)
        assert_current(via_partial)
    limit.limit = 9
    assert "9" in str(assert_current(via_method))
    windows[0] = 11
    assert "11" in str(assert_current(via_partial))


def test_every_change_a_snapshot_sees_is_seen(monkeypatch):
    """Rebinding a global a nested function reads, a missing global defined, a nested function's name,
    defaults and code changed, and the captured mod swapped: each gives the fresh trace."""
    input_pos = torch.tensor([5])

    def step():
        return assert_current(shifted(causal, input_pos[0]))

    step()
    step()
    monkeypatch.setattr(sys.modules[__name__], "LIMIT", 7)  # a global read two functions down
    assert "7" in str(step())
    step()

    def narrow(q_idx, kv_idx):
        return q_idx - kv_idx <= 3

    monkeypatch.setattr(sys.modules[__name__], "window", narrow)  # the helper rebound
    assert "3" in str(step())
    step()
    monkeypatch.setattr(narrow, "__code__", (lambda q_idx, kv_idx: q_idx - kv_idx <= 9).__code__)
    assert "9" in str(step())
    monkeypatch.setattr(narrow, "__defaults__", (1,))
    step()
    monkeypatch.setattr(narrow, "__defaults__", None)
    monkeypatch.setattr(narrow, "__name__", "renamed")
    step()
    other = shifted(lambda b, h, q_idx, kv_idx: q_idx <= kv_idx, input_pos[0])  # another mod captured
    assert_current(other)
    assert_current(other)


def test_a_cell_of_a_captured_closure_changed_in_place_is_seen():
    bound = 4

    def inner(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= bound

    input_pos = torch.tensor([5])
    for bound in (4, 4, 11, 11, 2):
        assert str(bound) in str(assert_current(shifted(inner, input_pos[0])))


def test_moved_memory_and_other_kinds_miss_the_fast_path():
    input_pos = torch.tensor([5])
    assert_current(shifted(causal, input_pos[0]))
    assert_current(shifted(causal, input_pos[0]))
    other = torch.tensor([9, 9])
    moved = assert_current(shifted(causal, other[1]))  # another address: the template over the new view
    assert moved.buffers[0].data_ptr() == other[1].data_ptr()
    input_pos.data = torch.tensor([7])  # the kept view no longer views what it did
    assert_current(shifted(causal, input_pos[0]))
    assert_current(shifted(causal, 3))  # a number: another template
    assert_current(shifted(causal, 3.5))
    assert_current(shifted(causal, torch.tensor(2.0, requires_grad=True)))


def test_decoding_with_the_fast_path_equals_dense_as_globals_change(monkeypatch):
    S, block = 128, 32
    q, k, v = random_qkv(1, 4, 4, 1, S, 16)
    parent = flexc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=block)
    input_pos = torch.tensor([0])
    for step, pos in enumerate((70, 71, 72, 100, 101, 102, 127)):
        if step == 4:
            monkeypatch.setattr(sys.modules[__name__], "LIMIT", 5)  # seen by the next step's mod
        input_pos.fill_(pos)
        mask = parent[:, :, input_pos // block]
        mask.mask_mod, mask.seq_lengths = shifted(causal, input_pos[0]), (1, S)
        out = flexc.flex_attention(q, k, v, block_mask=mask)
        ref = dense_attention(q, k, v, mask_mod=shifted(causal, pos))[0]
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=f"position {pos}")


def test_clear_forgets_the_store_of_the_latest_code_object_looked_up():
    """The lookup serves the latest code object's store without a dict lookup: clearing the cache forgets it too."""
    def make(n):
        return lambda score, b, h, q_idx, kv_idx: score + n
    fn = make(1)
    flexc.trace(fn)
    assert trace_cache.lookup(fn, None)[0] is not None
    assert trace_cache.lookup(lambda score, b, h, q_idx, kv_idx: score * 2, None)[0] is None  # (another code object)
    assert trace_cache.lookup(fn, None)[0] is not None and trace_cache.lookup(make(2), None)[0] is not None
    trace_cache.clear()
    assert trace_cache.lookup(fn, None)[0] is None
