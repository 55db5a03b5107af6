"""The backward's row pass (``PRECISE_GRADIENTS``, flexc.codegen.backward_rows): which calls run it
and what their sources hold. What it buys is measured by tests/call/test_dropin_grad_accuracy.py
(every gradient within its bound over 20 seeds, which the prologue's delta is not)."""
from __future__ import annotations

import pytest
import torch

import flexc
from reference import random_qkv


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _backward_source(dtype, **options):
    q, k, v = (t.to(dtype).requires_grad_() for t in random_qkv(1, 2, 2, 64, 64, 16))
    block_mask = flexc.create_block_mask(_causal, None, None, 64, 64)
    return flexc.kernel_source(q, k, v, block_mask=block_mask, backward=True,
                               kernel_options={"BACKEND": "TRITON", **options})


@pytest.mark.parametrize("dtype, options, rows, split", [
    (torch.float32, {}, True, False),
    (torch.float64, {}, True, False),
    (torch.bfloat16, {}, False, False),
    (torch.float16, {"PRECISE_GRADIENTS": True}, True, True),
    (torch.float32, {"PRECISE_GRADIENTS": False}, False, False),
])
def test_precise_gradients_by_default_for_fp32_and_fp64_and_on_request_for_16_bit(dtype, options, rows, split):
    source = _backward_source(dtype, **options)
    first = "flex_attention_backward_rows" if rows else "flex_attention_backward_prologue"
    assert f"2 kernels, in this order: {first}, then flex_attention_backward." in source
    assert ("ds_hi" in source) == split  # 16-bit dS as its rounding plus the remainder
    assert ("inv_sum" in source) == rows  # the dK/dV programs normalise by the row pass's sum
