"""The trace cache's fast path keeps a guard per closure for closures of one code object that alternate.

A model whose layers alternate sliding-window and full attention calls one combinator code object
(``and_masks``) with two mask mixes, or one factory's mask with two windows, in turn. Each keeps its
fast path: lookups take no snapshot, every change a snapshot would see still gives the fresh trace
for the closure it touches, and a cell holding a new object each call still gives up the fast path.
References: an uncached trace of the mod in its current state, and float64 dense attention.
"""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import flexc
from flexc.mods import trace_cache
from flexc.mods.trace import trace
from catalogue import and_masks as closure_and_masks, or_masks as closure_or_masks
from reference import dense_attention, random_qkv
from trace_checks import assert_current

LIMIT_A, LIMIT_B = 50, 60


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def even_kv(b, h, q_idx, kv_idx):
    return kv_idx % 2 == 0


def near_a(q_idx, kv_idx):
    return q_idx - kv_idx < LIMIT_A


def near_b(q_idx, kv_idx):
    return q_idx - kv_idx < LIMIT_B


def sliding(w):
    """A factory's window: ``w`` an operator operand (a lifted cell)."""
    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < w
    return mask


def banded(bounds):
    """A factory's band: ``bounds`` a tuple read by index (a cell guarded by its items)."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= bounds[0]) & (q_idx - kv_idx < bounds[1])
    return mask


def documents(ids, bounds, near):
    """A factory over a captured tensor, a tuple and a helper that reads a global."""
    def mask(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx - kv_idx < bounds[1]) & near(q_idx, kv_idx)
    return mask


def warmed(mods):
    """Each of ``mods`` traced, then found by snapshot (which keeps its guard), in turn: their traces."""
    for mod in mods:
        assert_current(mod)
    return [assert_current(mod) for mod in mods]


PAIRS = {
    "factory windows (lifted)": lambda: (sliding(64), sliding(256)),
    "factory bands (tuple cell)": lambda: (banded((0, 64)), banded((8, 256))),
    "flexc and_masks sliding/full": lambda: (flexc.and_masks(causal, sliding(64)), flexc.and_masks(causal, even_kv)),
    "flexc or_masks": lambda: (flexc.or_masks(causal, sliding(64)), flexc.or_masks(even_kv, banded((0, 8)))),
    "closure and_masks (one name)": lambda: (closure_and_masks(causal, sliding(64)), closure_and_masks(causal, even_kv)),
    "closure or_masks (one name)": lambda: (closure_or_masks(causal, banded((0, 4))), closure_or_masks(even_kv, causal)),
}


@pytest.mark.parametrize("pair", list(PAIRS.values()), ids=list(PAIRS))
def test_alternating_closures_of_one_code_object_take_no_snapshot(pair, snapshots):
    trace_cache.clear()  # (a code object may have given up its fast path in earlier tests)
    mods = pair()
    assert mods[0].__code__ is mods[1].__code__
    traces = warmed(mods)
    assert traces[0] is not traces[1]
    taken = snapshots[0]
    for _ in range(50):
        for mod, traced in zip(mods, traces):
            assert trace(mod) is traced
    assert snapshots[0] == taken


def test_an_edit_to_one_alternating_closure_gives_its_fresh_trace_and_the_other_keeps_hitting(snapshots, monkeypatch):
    """Each change a snapshot sees (a ``.data`` swap of a captured tensor, a cell rebound, a global a helper
    reads), made to one of two alternating closures, gives that one the fresh trace whichever guard it was
    found by last; the other's lookups take no snapshot meanwhile."""
    trace_cache.clear()
    ids = {"a": torch.arange(128) // 32, "b": torch.arange(128) // 16}
    mods = {"a": documents(ids["a"], (0, 64), near_a), "b": documents(ids["b"], (0, 32), near_b)}
    module = sys.modules[__name__]

    def swap(name):
        ids[name].data = torch.arange(128) // 8

    def rebind(name):
        mods[name].__closure__[mods[name].__code__.co_freevars.index("bounds")].cell_contents = (0, 9)

    def global_(name):
        monkeypatch.setattr(module, f"LIMIT_{name.upper()}", 7)

    def check(name, edited):
        traced = assert_current(mods[name])
        if edited is swap:
            assert traced.buffers[0].data_ptr() == ids[name].data_ptr()
        elif edited is rebind:
            assert "9" in str(traced)
        else:
            assert "7" in str(traced)

    for edit in (swap, rebind, global_):
        for name, other in (("a", "b"), ("b", "a")):
            traces = dict(zip(mods, warmed(list(mods.values()))))
            edit(name)
            for _ in range(3):
                check(name, edit)
                taken = snapshots[0]
                for _ in range(3):
                    assert trace(mods[other]) is traces[other]
                assert snapshots[0] == taken, (edit.__name__, name)
            taken = snapshots[0]
            assert trace(mods[name]) is trace(mods[name])  # (its new guard kept beside the other's)
            assert snapshots[0] == taken
        monkeypatch.undo()


def test_a_cell_holding_a_new_object_each_call_gives_up_the_fast_path_keeping_few_guards(snapshots):
    """Alternating closures keep their guards, but a third closure of the code object whose cell holds a new
    tensor (a new view of the same memory) each call makes every guard made for it miss: after a few calls
    the code object gives up its fast path (every lookup takes a snapshot, as before guards), and the views
    kept alive by guards stay few meanwhile."""
    trace_cache.clear()
    base = torch.arange(128) // 32
    mods = [documents(base, (0, 64), near_a), documents(base.clone(), (0, 32), near_a)]
    traces = warmed(mods)
    taken = snapshots[0]
    for _ in range(5):
        for mod, traced in zip(mods, traces):
            assert trace(mod) is traced
    assert snapshots[0] == taken
    alive = []
    for _ in range(40):
        view = base[:]  # (a new tensor each call, viewing the same memory: the snapshot finds its trace)
        alive.append(weakref.ref(view))
        assert_current(documents(view, (0, 16), near_a))
        del view
        for mod, traced in zip(mods, traces):
            assert trace(mod) is traced
        gc.collect(1)  # (a fresh trace's cycles are young)
        assert sum(ref() is not None for ref in alive) <= 5  # (the kept guards', the first entry's)
    taken = snapshots[0]
    for mod, traced in zip(mods, traces):
        assert trace(mod) is traced
    assert snapshots[0] == taken + 2  # (given up: each lookup takes its snapshot)


def test_alternating_masks_in_flex_attention_equal_dense_as_they_change(snapshots):
    """Layers alternating a sliding-window and a full mask mix (one and_masks code object, as transformers
    builds them) on the CPU equal float64 dense attention on every call, also after a padding length written
    in place and a window rebound; steps between the changes take no snapshot."""
    trace_cache.clear()
    B, H, L, D = 1, 2, 128, 16
    q, k, v = random_qkv(B, H, H, L, L, D)
    lengths = torch.tensor([100])

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    window = sliding(32)
    layers = (flexc.and_masks(causal, window, padding), flexc.and_masks(causal, padding))
    for step in range(9):
        if step == 2:
            taken = snapshots[0]
        if step == 4:
            assert snapshots[0] == taken
            lengths.fill_(70)
        if step == 6:
            window.__closure__[0].cell_contents = 9
        for layer, mask_mod in enumerate(layers):
            block_mask = flexc.create_block_mask(mask_mod, B, H, L, L, BLOCK_SIZE=32)
            out = flexc.flex_attention(q, k, v, block_mask=block_mask)
            ref = dense_attention(q, k, v, mask_mod=mask_mod)[0]
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=f"step {step}, layer {layer}")
