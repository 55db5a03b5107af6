"""Mods that cannot become a graph raise flexc.TraceError naming the mod, the bad line and a fix.

Each bad mod below marks its offending line with a ``# BAD`` comment; the test finds that line
number in this file and checks it appears in the message as ``file:line``.
"""
from __future__ import annotations

import functools
import inspect
import math
import re

import pytest
import torch

import flexc

VEC = torch.randn(10)
MAT = torch.randn(4, 5)
IDS = torch.arange(10)


def if_on_traced_value(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:  # BAD
        return q_idx >= 0
    return q_idx < 0


def while_on_traced_value(b, h, q_idx, kv_idx):
    while q_idx > 0:  # BAD
        q_idx = q_idx - 1
    return q_idx >= kv_idx


def conditional_expression(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx if q_idx > 3 else q_idx < kv_idx  # BAD


def bool_call(b, h, q_idx, kv_idx):
    return bool(q_idx > kv_idx)  # BAD


def int_call(score, b, h, q_idx, kv_idx):
    return score + int(q_idx)  # BAD


def float_call(score, b, h, q_idx, kv_idx):
    return score * float(h)  # BAD


def item_call(score, b, h, q_idx, kv_idx):
    return score + q_idx.item()  # BAD


def tolist_call(score, b, h, q_idx, kv_idx):
    return score + kv_idx.tolist()  # BAD


def and_between_traced(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (q_idx - kv_idx < 4)  # BAD


def or_between_traced(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) or (kv_idx < 4)  # BAD


def not_on_traced(b, h, q_idx, kv_idx):
    return not (q_idx >= kv_idx)  # BAD


def builtin_min(score, b, h, q_idx, kv_idx):
    return score + min(q_idx, kv_idx)  # BAD


def math_function_on_traced(score, b, h, q_idx, kv_idx):
    return score + math.exp(q_idx)  # BAD


def python_range_over_traced(b, h, q_idx, kv_idx):
    return kv_idx < len(range(q_idx))  # BAD


# (mod, words the message must contain: what went wrong and the suggested fix)
CONCRETE_VALUE_CASES = [
    (if_on_traced_value, ["`if`", "torch.where"]),
    (while_on_traced_value, ["`while`", "torch.where"]),
    (conditional_expression, ["conditional expression", "torch.where"]),
    (bool_call, ["bool()", "torch.where"]),
    (int_call, ["int()", ".long()"]),
    (float_call, ["float()", ".float()"]),
    (item_call, [".item()", "symbolic"]),
    (tolist_call, [".tolist()", "symbolic"]),
    (and_between_traced, ["`and`", "`&`"]),
    (or_between_traced, ["`or`", "`|`"]),
    (not_on_traced, ["`not`", "`~`"]),
    (builtin_min, ["min/max", "torch.minimum"]),
    (math_function_on_traced, ["math", "torch.exp"]),
    (python_range_over_traced, ["Python index", "index captured tensors"]),
]


def unsupported_torch_function(score, b, h, q_idx, kv_idx):
    return torch.lgamma(score)  # BAD


def unsupported_tensor_method(score, b, h, q_idx, kv_idx):
    return score.erfinv()  # BAD


def unsupported_rounding_mode(score, b, h, q_idx, kv_idx):
    return score + torch.div(q_idx, 3, rounding_mode="trunc")  # BAD


def mask_returns_int(b, h, q_idx, kv_idx):
    return q_idx - kv_idx  # BAD


def mask_returns_float(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) * 0.5  # BAD


def mask_returns_none(b, h, q_idx, kv_idx):
    q_idx >= kv_idx  # noqa: B015  (the forgotten return)
    return None  # BAD


def score_returns_bool(score, b, h, q_idx, kv_idx):
    return q_idx >= kv_idx  # BAD


def too_many_indices(score, b, h, q_idx, kv_idx):
    return score + VEC[q_idx, kv_idx]  # BAD


def too_few_indices(score, b, h, q_idx, kv_idx):
    return score + MAT[h]  # BAD


def too_few_indices_in_mask(b, h, q_idx, kv_idx):
    return MAT[h] > 0  # BAD


def whole_tensor_in_arithmetic(score, b, h, q_idx, kv_idx):
    return score + VEC  # BAD


def float_index(score, b, h, q_idx, kv_idx):
    return score + VEC[q_idx / 2]  # BAD


def bool_index(score, b, h, q_idx, kv_idx):
    return score + VEC[q_idx > kv_idx]  # BAD


def constant_index_out_of_range(score, b, h, q_idx, kv_idx):
    return score + MAT[7, kv_idx]  # BAD


def multi_element_slice(score, b, h, q_idx, kv_idx):
    return score + MAT[0:2, kv_idx]  # BAD


def setitem_on_captured(score, b, h, q_idx, kv_idx):
    VEC[q_idx] = 1.0  # BAD
    return score


def inplace_method_on_captured(score, b, h, q_idx, kv_idx):
    VEC.add_(1.0)  # BAD
    return score


def inplace_index_put_on_captured(b, h, q_idx, kv_idx):
    IDS.index_put_((q_idx,), torch.tensor(0))  # BAD
    return q_idx >= kv_idx


def inplace_method_on_traced(score, b, h, q_idx, kv_idx):
    score.mul_(2.0)  # BAD
    return score


def minus_on_bool(b, h, q_idx, kv_idx):
    return -(q_idx >= kv_idx)  # BAD


def invert_on_float(score, b, h, q_idx, kv_idx):
    return ~score  # BAD


def and_on_float(score, b, h, q_idx, kv_idx):
    return score & (q_idx >= kv_idx)  # BAD


def where_with_int_condition(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx, score, 0.0)  # BAD


def augmented_assignment_on_captured(score, b, h, q_idx, kv_idx):
    VEC[q_idx] += 1.0  # BAD
    return score


def shift_operator(score, b, h, q_idx, kv_idx):
    return score + (score >> 4)  # BAD


def where_with_one_argument(b, h, q_idx, kv_idx):
    return torch.where(q_idx > kv_idx)  # BAD


def method_with_wrong_arguments(score, b, h, q_idx, kv_idx):
    return score.clamp(0.0, 1.0, 2.0)  # BAD


def reduction_max(score, b, h, q_idx, kv_idx):
    return torch.max(score)  # BAD


def chained_comparison(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx < kv_idx + 8  # BAD


def nan_constant(score, b, h, q_idx, kv_idx):
    return score + float("nan")  # BAD


OTHER_CASES = [
    (unsupported_torch_function, ["`lgamma`", "not supported", "torch.where"]),
    (unsupported_tensor_method, ["`.erfinv()`", "not supported", "use one of"]),
    (unsupported_rounding_mode, ["rounding_mode='trunc'", "rounding_mode='floor'"]),
    (mask_returns_int, ["must return a bool", "an int", "q_idx >= kv_idx"]),
    (mask_returns_float, ["must return a bool", "a float"]),
    (mask_returns_none, ["returned None", "return"]),
    (score_returns_bool, ["must return a number", "torch.where(cond, score"]),
    (too_many_indices, ["more indices than its 1 dimension", "exactly 1 index"]),
    # one dimension left is a vector (flexc.mods.reductions); returning it unreduced is the error
    (too_few_indices, ["returns a vector of", "index every dimension"]),
    (too_few_indices_in_mask, ["returns a vector of", "index every dimension"]),
    (whole_tensor_in_arithmetic, ["returns a vector of 10 values", "index every dimension"]),
    (float_index, ["float value", "//"]),
    (bool_index, ["bool value", "torch.where"]),
    (constant_index_out_of_range, ["index 7 is out of range", "inside the tensor"]),
    (multi_element_slice, ["slice 0:2", "selects 2 elements", "integer"]),
    (setitem_on_captured, ["`__setitem__` mutates", "pure"]),
    (inplace_method_on_captured, ["`add_` mutates", "pure"]),
    (inplace_index_put_on_captured, ["`index_put_` mutates", "pure"]),
    (inplace_method_on_traced, ["`.mul_()` mutates", "`.mul()`"]),
    (minus_on_bool, ["unary minus on a bool", "`~`"]),
    (invert_on_float, ["`~` on a float", "comparison"]),
    (and_on_float, ["`&` on a float", "comparisons"]),
    (where_with_int_condition, ["condition", "is an int", "comparison"]),
    (nan_constant, ["NaN constant", "finite"]),
    (augmented_assignment_on_captured, ["`__setitem__` mutates", "pure"]),
    (shift_operator, ["`>>` on a float value", "shift integers only"]),
    (where_with_one_argument, ["`where` was called with arguments", "torch.where"]),
    (method_with_wrong_arguments, ["`clamp` was called with arguments", "torch.clamp"]),
    (reduction_max, ["`max` with one operand is a reduction", "torch.maximum"]),
    (chained_comparison, ["chained comparison", "(a < b) & (b < c)"]),
]


def _bad_line(fn) -> int:
    """The line number of the line marked ``# BAD`` in ``fn``'s source."""
    lines, start = inspect.getsourcelines(fn)
    marked = [start + i for i, text in enumerate(lines) if text.rstrip().endswith("# BAD")]
    assert len(marked) == 1, f"{fn.__name__} must mark exactly one line"
    return marked[0]


def _assert_trace_error(fn, words, line=None):
    with pytest.raises(flexc.TraceError) as info:
        flexc.trace(fn)
    message = str(info.value)
    assert isinstance(info.value, TypeError)
    assert fn.__name__ in message, message
    line = _bad_line(fn) if line is None else line
    assert f"{__file__}:{line})" in message, message
    assert "Fix:" in message, message
    for word in words:
        assert word in message, f"{word!r} not in:\n{message}"
    return message


@pytest.mark.parametrize("fn, words", CONCRETE_VALUE_CASES, ids=[f.__name__ for f, _ in CONCRETE_VALUE_CASES])
def test_needing_a_concrete_value_raises_with_line_and_fix(fn, words):
    message = _assert_trace_error(fn, words)
    assert "symbolic" in message


@pytest.mark.parametrize("fn, words", OTHER_CASES, ids=[f.__name__ for f, _ in OTHER_CASES])
def test_unsupported_code_raises_with_line_and_fix(fn, words):
    _assert_trace_error(fn, words)


def test_error_message_quotes_the_offending_source_line():
    message = _assert_trace_error(and_between_traced, [])
    assert "return (q_idx >= kv_idx) and (q_idx - kv_idx < 4)" in message


def test_error_inside_a_helper_points_at_the_helper_line():
    def helper(q_idx, kv_idx):
        return q_idx if q_idx > kv_idx else kv_idx  # BAD

    def uses_helper(score, b, h, q_idx, kv_idx):
        return score + helper(q_idx, kv_idx)

    with pytest.raises(flexc.TraceError) as info:
        flexc.trace(uses_helper)
    assert "uses_helper" in str(info.value)
    assert f"{__file__}:{_bad_line(helper)})" in str(info.value)


def three_parameters(h, q_idx, kv_idx):  # BAD
    return q_idx >= kv_idx


def six_parameters(score, b, h, q_idx, kv_idx, extra):  # BAD
    return score


def test_wrong_arity_raises_with_definition_line_and_fix():
    for fn in (three_parameters, six_parameters):
        _assert_trace_error(fn, ["positional parameters", "expected 5", "4 for a mask_mod",
                                           "functools.partial"])


def required_keyword(b, h, q_idx, kv_idx, *, window):  # BAD
    return q_idx - kv_idx <= window


def test_required_keyword_only_parameter_raises_with_fix():
    _assert_trace_error(required_keyword, ["keyword-only parameters window", "functools.partial"])
    assert flexc.trace(functools.partial(required_keyword, window=3)).kind == "mask_mod"


def test_partial_that_leaves_wrong_arity_names_the_function():
    # binding `h` by keyword makes q_idx and kv_idx keyword-only, so only 2 positional parameters remain
    bound = functools.partial(six_parameters, extra=1, h=2)
    with pytest.raises(flexc.TraceError, match=r"six_parameters.*takes 2 positional parameters"):
        flexc.trace(bound)


def test_requested_kind_must_match_the_arity():
    with pytest.raises(flexc.TraceError, match="expected a score_mod but it is a mask_mod"):
        flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, kind="score_mod")
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises(flexc.TraceError, match="expected a score_mod"):
        flexc.trace(traced, kind="score_mod")


def test_non_callable_raises_type_error():
    with pytest.raises(TypeError, match="expected a score_mod or mask_mod function, got int"):
        flexc.trace(3)


def test_trace_error_is_a_type_error():
    assert issubclass(flexc.TraceError, TypeError)
    # the failing mod's line is where the error was raised from the user's point of view
    assert re.search(r"test_trace_errors\.py:\d+\)", _assert_trace_error(bool_call, []))


def test_wrong_arity_is_also_the_assertion_error_torch_raises():
    """torch asserts 4 or 5 positional parameters; code catching its AssertionError (or flexc's
    TypeError) catches flexc's error for a mod given to create_block_mask or flex_attention."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    two = lambda a, b: a >= b  # noqa: E731
    with pytest.raises(AssertionError):
        torch_create_block_mask(two, None, None, 64, 64, device="cpu")
    with pytest.raises(AssertionError, match="takes 2 positional parameters"):
        flexc.create_block_mask(two, None, None, 64, 64, device="cpu")
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(TypeError, match="takes 2 positional parameters"):
        flexc.flex_attention(q, q, q, score_mod=two)
