"""Property: for random mod expressions, evaluating the traced graph equals calling the mod.

Hypothesis writes random mods as Python source (strategies.TRACE_MASK and TRACE_SCORE: ints, bools
and floats over the inputs, constants, captured-tensor lookups with in-range indices, where, min/max,
clamp, ``//`` and ``%`` by positive constants), compiles each into a lambda, and compares flexc's
evaluation with a direct call on broadcast index tensors. On failure hypothesis prints the shrunk source.
"""
from __future__ import annotations

import torch
from hypothesis import given

import flexc
from flexc.mods.evaluate import index_grid
from strategies import TRACE_TABLE as TABLE, compile_mod, examples, mask_sources, score_sources

B, H, L, S = 2, 3, 11, 13

_g = torch.Generator().manual_seed(2024)
NAMESPACE = {
    "torch": torch,
    "int_table": torch.randint(-8, 9, (TABLE,), generator=_g),
    "int32_table": torch.randint(-8, 9, (TABLE,), generator=_g, dtype=torch.int32),
    "float_table": torch.randn(TABLE, generator=_g),
    "bool_table": torch.rand(TABLE, generator=_g) < 0.5,
    "head_table": torch.randn(H, TABLE, generator=_g),
    "doc": torch.randint(0, 8, (TABLE,), generator=_g).sort().values,
    "offsets": torch.arange(0, 16, 2),
}

def _check(source: str) -> None:
    mod = compile_mod(source, NAMESPACE)
    traced = flexc.trace(mod)
    grid = index_grid(B, H, L, S)
    args = (grid["b"], grid["h"], grid["q_idx"], grid["kv_idx"])
    score = None
    if traced.kind == "score_mod":
        score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(len(source)))
        expected = mod(score, *args)
    else:
        expected = mod(*args)
    expected = torch.as_tensor(expected).expand(B, H, L, S)
    got = flexc.evaluate_grid(mod, B, H, L, S, score=score, max_elements=B * H * S * 4)  # 3 query chunks
    assert got.dtype == expected.dtype, (source, got.dtype, expected.dtype)
    if expected.dtype.is_floating_point:
        # (torch's kernels may round a chunk's elements 1 ulp apart from the whole tensor's (vector lanes
        # against a scalar tail); where a result cancels to near 0, as tanh(sigmoid(s)) + s does, that
        # ulp of the operands is no fraction of the result: an absolute tolerance at their scale)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True, msg=source)
    else:
        assert torch.equal(got, expected), source


_SETTINGS = examples(100, slow=True)


@_SETTINGS
@given(mask_sources())
def test_random_mask_mod_evaluates_like_direct_call(source):
    _check(source)


@_SETTINGS
@given(score_sources())
def test_random_score_mod_evaluates_like_direct_call(source):
    _check(source)


@_SETTINGS
@given(mask_sources())
def test_retracing_a_random_mod_gives_the_same_key(source):
    first = flexc.trace(compile_mod(source, NAMESPACE))
    second = flexc.trace(compile_mod(source, NAMESPACE))
    assert first.key == second.key
    assert str(first) == str(second)


@_SETTINGS
@given(score_sources())
def test_evaluating_into_the_score_gives_the_same_bits_and_leaves_captured_tensors_alone(source):
    """``evaluate(..., overwrite_score=True)`` (the CPU forward's in-place score_mod) equals the
    allocating evaluation bit for bit, for float32 and bfloat16 scores, and never writes into a
    captured tensor."""
    traced = flexc.trace(compile_mod(source, NAMESPACE))
    if traced.kind != "score_mod":
        return
    grid = index_grid(B, H, L, S)
    tables = {name: t.clone() for name, t in NAMESPACE.items() if isinstance(t, torch.Tensor)}
    for dtype in (torch.float32, torch.bfloat16):
        score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(len(source))).to(dtype)
        expected = flexc.evaluate(traced, score=score.clone(), **grid)
        got = flexc.evaluate(traced, score=score, overwrite_score=True, **grid)
        assert got.dtype == expected.dtype and torch.equal(got.isnan(), expected.isnan()), source
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), source
    for name, before in tables.items():
        assert torch.equal(NAMESPACE[name], before), (source, name)
