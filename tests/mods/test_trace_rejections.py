"""Mods the tracer must reject with a clear TraceError (mod, line, what is wrong, the fix) instead of
a raw numpy error or a silently wrong graph: random factories (their values would be frozen into one
constant), numpy functions on traced values, captured numpy arrays; and integer division by a zero
constant."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flexc
from flexc import TraceError

TABLE = np.arange(64)
SMALL = torch.arange(64, dtype=torch.uint8)

RANDOM = {
    "randn": lambda score, b, h, q_idx, kv_idx: score + torch.randn(()),
    "rand_like": lambda score, b, h, q_idx, kv_idx: score + torch.rand_like(score),
    "randint": lambda b, h, q_idx, kv_idx: q_idx >= torch.randint(0, 5, ()),
    "dropout": lambda score, b, h, q_idx, kv_idx: torch.nn.functional.dropout(score, 0.1),
    "bernoulli": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (torch.bernoulli(torch.tensor(0.5)) > 0),
}
NUMPY = {
    "np.where": (lambda b, h, q_idx, kv_idx: np.where(q_idx >= kv_idx, True, False), "np.where"),
    "np.logical_and": (lambda b, h, q_idx, kv_idx: np.logical_and(q_idx >= kv_idx, q_idx < 10), "np.logical_and"),
    "np.exp": (lambda score, b, h, q_idx, kv_idx: np.exp(score), "np.exp"),
    "numpy array indexed": (lambda b, h, q_idx, kv_idx: TABLE[q_idx] >= kv_idx, "numpy"),
    "numpy array operand": (lambda b, h, q_idx, kv_idx: q_idx + TABLE >= kv_idx, "numpy array"),
    "numpy array left operand": (lambda b, h, q_idx, kv_idx: TABLE + q_idx >= kv_idx, "np.add"),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_factories_are_rejected(name):
    with pytest.raises(TraceError) as info:
        flexc.trace(RANDOM[name])
    text = str(info.value)
    assert "random" in text and f"{name}" in text and "test_trace_rejections.py" in text
    assert "Fix: draw the tensor once outside the mod" in text


@pytest.mark.parametrize("name", sorted(NUMPY))
def test_numpy_is_rejected_with_a_fix(name):
    mod, mentioned = NUMPY[name]
    with pytest.raises(TraceError) as info:
        flexc.trace(mod)
    text = str(info.value)
    assert mentioned in text and "test_trace_rejections.py" in text
    assert "torch.as_tensor" in text


def test_numpy_scalars_and_converted_arrays_still_trace():
    table = torch.as_tensor(TABLE)
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: (table[q_idx] >= kv_idx) & (q_idx < np.int64(40)))
    b, h, q, kv = (torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((1, 1, 64, 64)))
    assert torch.equal(traced(b, h, q, kv), (table[q] >= kv) & (q < 40))
    # a random tensor drawn outside the mod is an ordinary captured tensor
    noise = torch.randn(64, 64)
    assert flexc.trace(lambda s, b, h, q_idx, kv_idx: s + noise[q_idx, kv_idx]).buffers[0] is noise


@pytest.mark.parametrize("mod", [
    lambda b, h, q_idx, kv_idx: q_idx // 0 >= kv_idx,
    lambda b, h, q_idx, kv_idx: q_idx % 0 >= 0,
    lambda b, h, q_idx, kv_idx: torch.div(q_idx, 0, rounding_mode="floor") >= kv_idx,
    lambda b, h, q_idx, kv_idx: SMALL[kv_idx] // 256 >= 1,  # 256 is 0 in uint8, as torch converts it
])
def test_integer_division_by_zero_constant_is_rejected(mod):
    with pytest.raises(TraceError, match=r"(?s)test_trace_rejections.py.*division by zero.*Fix:"):
        flexc.trace(mod)
    with pytest.raises(RuntimeError):  # torch raises too, at evaluation
        torch.arange(4) // 0
