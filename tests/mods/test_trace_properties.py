"""Property: for random mod expressions, evaluating the traced graph equals calling the mod.

Hypothesis writes random mods as Python source (ints, bools and floats over the inputs, constants,
captured-tensor lookups with in-range indices, where, min/max, clamp, ``//`` and ``%`` by positive
constants), compiles each into a lambda, and compares flexc's evaluation with a direct call on
broadcast index tensors. On failure hypothesis prints the shrunk source.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flexc
from flexc.mods.evaluate import index_grid

B, H, L, S = 2, 3, 11, 13
TABLE = 16  # length of the 1-D captured tables; lookups index them with `expr % TABLE`

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

INT_INPUTS = ["b", "h", "q_idx", "kv_idx"]
INT_LEAVES = INT_INPUTS + ["(q_idx - kv_idx)", "(kv_idx - q_idx)"]  # relative positions: negatives are common
small_int = st.integers(-6, 20).map(str)
positive_int = st.integers(1, 7).map(str)
small_float = st.sampled_from(["0.5", "-1.25", "2.0", "0.1", "3.0", "-0.75"])
compare_op = st.sampled_from(["<", "<=", ">", ">=", "==", "!="])


def _pick(draw, options: list[str]) -> str:
    return draw(st.sampled_from(options))


def int_expr(draw, depth: int, score: bool) -> str:
    if depth <= 0 or draw(st.integers(0, 4)) == 0:
        return _pick(draw, INT_LEAVES)
    a = lambda: int_expr(draw, depth - 1, score)
    form = _pick(draw, ["add", "sub_const", "rsub_const", "mul_const", "floordiv", "mod", "abs", "neg",
                        "method_abs", "minimum", "maximum", "clamp", "where", "lookup", "lookup_int32",
                        "nested_lookup", "bool_times", "pow2"])
    if form == "add":
        return f"({a()} + {a()})"
    if form == "sub_const":
        return f"({a()} - {draw(small_int)})"
    if form == "rsub_const":
        return f"({draw(small_int)} - {a()})"
    if form == "mul_const":
        return f"({a()} * {draw(small_int)})"
    if form == "floordiv":
        return f"({a()} // {draw(positive_int)})"
    if form == "mod":
        return f"({a()} % {draw(positive_int)})"
    if form == "abs":
        return f"abs({a()})"
    if form == "neg":
        return f"(-{a()})"
    if form == "method_abs":
        return f"{a()}.abs()"
    if form in ("minimum", "maximum"):
        return f"torch.{form}({a()}, {a()})"
    if form == "clamp":
        return f"torch.clamp({a()}, {draw(small_int)}, {draw(small_int)})"
    if form == "where":
        return f"torch.where({bool_expr(draw, depth - 1, score)}, {a()}, {draw(st.one_of(small_int, st.just(a())))})"
    if form == "lookup":
        return f"int_table[{a()} % {TABLE}]"
    if form == "lookup_int32":
        return f"int32_table[{a()} % {TABLE}]"
    if form == "nested_lookup":
        return f"offsets[doc[{a()} % {TABLE}]]"
    if form == "bool_times":
        return f"({bool_expr(draw, depth - 1, score)} * {draw(small_int)})"
    return f"(({a()} % 5) ** 2)"


def bool_expr(draw, depth: int, score: bool) -> str:
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        return f"({_pick(draw, INT_INPUTS)} {draw(compare_op)} {draw(st.one_of(small_int, st.sampled_from(INT_INPUTS)))})"
    a = lambda: bool_expr(draw, depth - 1, score)
    form = _pick(draw, ["compare", "compare_float", "and", "or", "xor", "not", "lookup", "where",
                        "logical_and", "method_logical_or"])
    if form == "compare":
        return f"({int_expr(draw, depth - 1, score)} {draw(compare_op)} {int_expr(draw, depth - 1, score)})"
    if form == "compare_float":
        return f"({float_expr(draw, depth - 1, score)} {draw(compare_op)} {draw(small_float)})"
    if form == "and":
        return f"({a()} & {a()})"
    if form == "or":
        return f"({a()} | {a()})"
    if form == "xor":
        return f"({a()} ^ {a()})"
    if form == "not":
        return f"(~{a()})"
    if form == "lookup":
        return f"bool_table[{int_expr(draw, depth - 1, score)} % {TABLE}]"
    if form == "where":
        return f"torch.where({a()}, {a()}, {a()})"
    if form == "logical_and":
        return f"torch.logical_and({a()}, {a()})"
    return f"{a()}.logical_or({a()})"


def float_expr(draw, depth: int, score: bool) -> str:
    if depth <= 0 or draw(st.integers(0, 4)) == 0:
        leaves = [f"({_pick(draw, INT_INPUTS)} * 0.5)", f"float_table[{_pick(draw, INT_INPUTS)} % {TABLE}]"]
        return _pick(draw, leaves + ["score", "score"] if score else leaves)  # mask_mods have no score
    a = lambda: float_expr(draw, depth - 1, score)
    form = _pick(draw, ["add", "sub", "mul", "mul_const", "div_const", "rdiv", "int_div", "tanh",
                        "sigmoid", "exp", "log", "sqrt", "sin", "floor", "method_tanh", "minimum",
                        "maximum_int", "clamp", "where", "where_inf", "lookup", "head_lookup", "cast",
                        "neg", "abs"])
    if form in ("add", "sub", "mul"):
        return f"({a()} {dict(add='+', sub='-', mul='*')[form]} {a()})"
    if form == "mul_const":
        return f"({a()} * {draw(small_float)})"
    if form == "div_const":
        return f"({a()} / {draw(small_float)})"
    if form == "rdiv":
        return f"(1.0 / ({a()}.abs() + 1.0))"
    if form == "int_div":
        return f"({int_expr(draw, depth - 1, score)} / {draw(positive_int)})"
    if form in ("tanh", "sigmoid", "exp", "sin", "floor"):
        return f"torch.{form}({a()})"
    if form == "log":
        return f"torch.log(torch.abs({a()}) + 1.0)"
    if form == "sqrt":
        return f"torch.sqrt(torch.abs({a()}))"
    if form == "method_tanh":
        return f"{a()}.tanh()"
    if form == "minimum":
        return f"torch.minimum({a()}, {a()})"
    if form == "maximum_int":
        return f"torch.maximum({a()}, {int_expr(draw, depth - 1, score)})"
    if form == "clamp":
        return f"torch.clamp({a()}, -1.5, 2.5)"
    if form == "where":
        return f"torch.where({bool_expr(draw, depth - 1, score)}, {a()}, {draw(st.one_of(small_float, st.just(a())))})"
    if form == "where_inf":
        return f"torch.where({bool_expr(draw, depth - 1, score)}, {a()}, -float('inf'))"
    if form == "lookup":
        return f"float_table[{int_expr(draw, depth - 1, score)} % {TABLE}]"
    if form == "head_lookup":
        return f"head_table[h, {int_expr(draw, depth - 1, score)} % {TABLE}]"
    if form == "cast":
        return f"{int_expr(draw, depth - 1, score)}.float()"
    if form == "neg":
        return f"(-{a()})"
    return f"abs({a()})"


@st.composite
def mask_sources(draw):
    return "lambda b, h, q_idx, kv_idx: " + bool_expr(draw, draw(st.integers(1, 4)), score=False)


@st.composite
def score_sources(draw):
    body = float_expr(draw, draw(st.integers(1, 4)), score=True)
    if draw(st.integers(0, 5)) == 0:
        body = f"score + {int_expr(draw, 3, score=True)}"  # an int term promoted by the score
    return "lambda score, b, h, q_idx, kv_idx: " + body


def _check(source: str) -> None:
    mod = eval(source, dict(NAMESPACE))  # noqa: S307 - source comes from the strategies above
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
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True, msg=source)
    else:
        assert torch.equal(got, expected), source


_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
    first = flexc.trace(eval(source, dict(NAMESPACE)))  # noqa: S307
    second = flexc.trace(eval(source, dict(NAMESPACE)))  # noqa: S307
    assert first.key == second.key
    assert str(first) == str(second)
