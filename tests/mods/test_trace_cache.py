"""The trace cache: a cached trace is reused only while it equals a fresh trace of the mod.

The reference is a fresh, uncached trace of the mod in its current state (``Tracer(fn).run()``)
and, end to end, a dense float64 attention computed from the mod called directly.
"""
from __future__ import annotations

import functools
import random
import types

import pytest
import torch

import flexc
from flexc.mods.trace import MASK_MOD, SCORE_MOD, TraceError, Tracer, mod_kind, trace
from reference import dense_attention, random_qkv


def fresh(fn):
    return Tracer(fn, mod_kind(fn)).run()


def assert_current(fn):
    """``trace(fn)`` equals a fresh trace: same graph, same captured tensors (by identity), same name."""
    cached, new = trace(fn), fresh(fn)
    assert cached.root == new.root, (str(cached), str(new))
    assert [id(t) for t in cached.buffers] == [id(t) for t in new.buffers]
    assert cached.name == new.name and cached.kind == new.kind
    return cached


# module-level state read by the mods below as globals
WINDOW = 64
OFFSET = 3
SCALE_TABLE = torch.linspace(0.5, 1.5, 4)


def helper(q_idx, kv_idx):
    return q_idx - kv_idx <= WINDOW


def global_window(b, h, q_idx, kv_idx):
    return helper(q_idx, kv_idx) & (q_idx + OFFSET >= kv_idx)


def test_same_mod_traces_once(runs):
    first = trace(global_window)
    for _ in range(5):
        assert trace(global_window) is first
    assert runs[0] == 1


def test_closure_numbers_are_compared_by_value_and_type(runs):
    c = 2

    def scaled(score, b, h, q_idx, kv_idx):
        return score * c

    assert "2" in str(assert_current(scaled))
    for value in (2, 3, 3.0, True, -0.0, 0.0):
        c = value
        assert_current(scaled)
    c = 0.0
    before = runs[0]
    assert_current(scaled), trace(scaled)
    assert runs[0] == before + 1  # only the fresh reference traced again


def test_captured_tensor_values_reuse_the_trace_and_rebinding_retraces(runs):
    bias = torch.randn(4, 16)

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]

    first = trace(add_bias)
    bias.mul_(3)  # new values, same tensor: same trace, which reads the new values
    assert trace(add_bias) is first and first.buffers[0] is bias
    q, k, v = random_qkv(1, 4, 4, 16, 16, 8)
    out = flexc.flex_attention(q, k, v, score_mod=add_bias)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, score_mod=add_bias)[0], atol=1e-5, rtol=1e-5)
    bias = torch.zeros(4, 16)  # a new tensor: a new trace whose buffer is the new tensor
    second = assert_current(add_bias)
    assert second is not first and second.buffers[0] is bias
    bias = torch.zeros(4, 16, dtype=torch.float64)
    assert assert_current(add_bias).buffers[0].dtype == torch.float64


def test_globals_helpers_and_their_globals(monkeypatch):
    module = __import__(__name__)
    assert "64" in str(assert_current(global_window))
    monkeypatch.setattr(module, "WINDOW", 10)  # a global of the helper the mod calls
    assert "10" in str(assert_current(global_window))
    monkeypatch.setattr(module, "OFFSET", 7)  # a global of the mod itself
    assert "7" in str(assert_current(global_window))
    monkeypatch.setattr(module, "helper", lambda q_idx, kv_idx: q_idx >= kv_idx)  # the helper replaced
    assert "<=" not in str(assert_current(global_window))


def test_global_defined_after_the_first_trace_shadows_a_builtin(monkeypatch):
    namespace = {"torch": torch}
    exec("def capped(score, b, h, q_idx, kv_idx):\n    return score + abs(kv_idx - q_idx)\n", namespace)
    capped = namespace["capped"]
    assert "abs" in str(assert_current(capped))
    namespace["abs"] = lambda x: x * 2  # now `abs` is a global, not the builtin
    assert "abs" not in str(assert_current(capped))


def test_defaults_kwdefaults_code_and_name():
    def windowed(b, h, q_idx, kv_idx, w=8, *, lo=0):
        return (q_idx - kv_idx <= w) & (kv_idx >= lo)

    assert_current(windowed)
    windowed.__defaults__ = (16,)
    assert "16" in str(assert_current(windowed))
    windowed.__kwdefaults__ = {"lo": 5}
    assert "5" in str(assert_current(windowed))

    def other(b, h, q_idx, kv_idx, w=8, *, lo=0):
        return q_idx >= kv_idx

    windowed.__code__ = other.__code__
    assert str(assert_current(windowed)) == "q_idx >= kv_idx"
    windowed.__name__ = "renamed"
    assert assert_current(windowed).name == "renamed"


def test_partial_and_combinators_see_their_parts():
    def window(b, h, q_idx, kv_idx, size):
        return q_idx - kv_idx <= size

    part = functools.partial(window, size=32)
    assert "32" in str(assert_current(part))
    part.keywords["size"] = 48  # partial keywords are a mutable dict
    assert "48" in str(assert_current(part))

    size = 100

    def inner(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx - size

    combined = flexc.and_masks(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, inner)
    assert "100" in str(assert_current(combined))
    size = 5  # a closure cell of a mod inside the combinator
    assert "5" in str(assert_current(combined))


def test_object_class_and_module_attributes():
    class Config:
        window = 4

    cfg = types.SimpleNamespace(offset=1)
    settings = types.ModuleType("user_settings")
    settings.limit = 9

    def mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= Config.window) & (kv_idx + cfg.offset <= q_idx + settings.limit)

    assert_current(mod)
    Config.window = 6
    assert "6" in str(assert_current(mod))
    cfg.offset = 2
    assert "2" in str(assert_current(mod))
    settings.limit = 11
    assert "11" in str(assert_current(mod))

    class Rel:
        def __init__(self):
            self.table = torch.randn(8)

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score + self.table[(q_idx - kv_idx).abs()]

    rel = Rel()
    method_mod = functools.partial(rel)  # a partial can carry the cache; the object is snapshotted
    first = assert_current(method_mod)
    rel.table = torch.zeros(8)
    assert assert_current(method_mod).buffers[0] is rel.table and first.buffers[0] is not rel.table


def test_list_and_dict_contents():
    windows = [4, 8]
    opts = {"lo": 1}

    def mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= windows[1]) & (kv_idx >= opts["lo"])

    assert_current(mod)
    windows[1] = 12
    assert "12" in str(assert_current(mod))
    opts["lo"] = 3
    assert "3" in str(assert_current(mod))


def test_container_subclass_contents():
    """An OrderedDict, a user's dict or list type (with an attribute of its own) and a namedtuple are
    read by their items, as dicts and lists are: an item changed gives the fresh trace."""
    import collections

    class Windows(list):
        pass

    class Options(dict):
        pass

    Pair = collections.namedtuple("Pair", "lo hi")
    ordered, options, windows = collections.OrderedDict(lo=1), Options(hi=30), Windows([4])
    windows.scale = 1
    pair = Pair(2, 40)

    def mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= ordered["lo"]) & (q_idx - kv_idx <= windows[0] * windows.scale)
                & (kv_idx < options["hi"]))

    def by_pair(b, h, q_idx, kv_idx):
        return kv_idx < pair.hi + pair.lo

    assert_current(mod)
    for edit, shown in ((lambda: ordered.__setitem__("lo", 3), "3"), (lambda: options.__setitem__("hi", 31), "31"),
                        (lambda: windows.__setitem__(0, 6), "6"), (lambda: setattr(windows, "scale", 7), "42")):
        edit()
        assert shown in str(assert_current(mod))
        assert_current(mod)
    assert "42" in str(assert_current(by_pair))
    assert assert_current(by_pair) is assert_current(by_pair)  # (a namedtuple's trace is kept)
    pair = Pair(2, 50)  # (a new tuple: rebinding the name)
    assert "52" in str(assert_current(by_pair))


def test_a_trace_that_read_a_tensor_value_is_never_reused(runs):
    table = torch.randn(8, 8)
    row = torch.tensor(2)
    limit = torch.tensor(5)

    def by_row(score, b, h, q_idx, kv_idx):
        return score + table[row, kv_idx] * int(limit)

    assert_current(by_row)
    row.fill_(6)  # the index value is baked into the graph as a constant
    limit.fill_(9)
    got = assert_current(by_row)
    assert "6" in str(got) and "9" in str(got)


def test_uncacheable_objects_are_traced_each_call(runs):
    holder = torch.nn.Identity()  # state of a kind the snapshot does not understand is fine...
    weird = memoryview(b"ab")  # ...and one it cannot snapshot at all disables caching

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < len(weird)) & (holder is not None)

    trace(mod)
    trace(mod)
    assert runs[0] == 2


def test_errors_are_not_cached_and_kinds_are_checked():
    def bad(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx
        return kv_idx

    for _ in range(2):
        with pytest.raises(TraceError):
            trace(bad)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    trace(causal, MASK_MOD)
    with pytest.raises(TraceError, match="expected a score_mod"):
        trace(causal, SCORE_MOD)


def test_random_mutations_never_give_a_stale_trace():
    """Random rebinds of every kind of state a mod reads; after each one the cache agrees with a fresh trace."""
    rng = random.Random(0)
    state = types.SimpleNamespace(scale=1.0)
    numbers = [3, 5]
    tensors = [torch.randn(6), torch.randn(6)]
    table = tensors[0]
    k = 2

    def bias(score, b, h, q_idx, kv_idx):
        return score * state.scale + table[kv_idx % 6] * k + numbers[0]

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= numbers[1]

    for step in range(60):
        choice = rng.randrange(6)
        if choice == 0:
            state.scale = rng.choice([1.0, 2.0, 2, 0.5])
        elif choice == 1:
            numbers[rng.randrange(2)] = rng.randrange(4)
        elif choice == 2:
            table = rng.choice(tensors)
        elif choice == 3:
            k = rng.choice([2, 2.0, 3])
        elif choice == 4:
            table.add_(1.0)  # values only: reuse is right
        else:
            bias.__defaults__ = None
        assert_current(bias)
        assert_current(mask)


def _offset_mask(mask_mod, offset):
    """gpt-fast's decoding idiom: a new closure per step that shifts q_idx by the cache position."""
    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    return shifted


def test_recreated_closures_and_fresh_views_of_the_same_memory_reuse_the_trace(runs):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    input_pos = torch.tensor([5])
    first = trace(_offset_mask(causal, input_pos[0]))
    for step in range(3):
        input_pos += 1  # in place, as a decoding loop advances
        again = trace(_offset_mask(causal, input_pos[0]))  # new closure, new 0-d view, same memory
        assert again is first
        # the kept view reads the current position
        grid = torch.arange(10)
        torch.testing.assert_close(again(torch.tensor(0), torch.tensor(0), torch.tensor(0), grid),
                                   grid <= int(input_pos))
    assert runs[0] == 1
    other = torch.tensor([5])
    view = other[0]
    moved = trace(_offset_mask(causal, view))  # other memory: the template's graph over the new tensor
    assert moved is not first and moved.root is first.root and moved.buffers[0] is view
    assert runs[0] == 1  # (flexc.lifted_cells: the cell is lifted, no new trace)
    assert trace(_offset_mask(causal, 3)).root != first.root  # a number instead of a tensor: a new template
    assert runs[0] == 2


def test_views_that_require_grad_are_matched_by_identity_only():
    slopes = torch.randn(4, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    first = trace(alibi)
    slopes = slopes.detach().requires_grad_()  # same memory, a new leaf that requires grad
    second = assert_current(alibi)
    assert second is not first and second.buffers[0] is slopes
