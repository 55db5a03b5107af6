"""Calls from torch's decoding tests and idioms that torch's FlexAttention runs, run by flexc.

Each case is checked against torch's own eager FlexAttention on CPU or the float64 dense reference:
the kernel_options keys torch's kernels read, torch's no-op BlockMask (``_create_empty_block_mask``)
used with inputs of any length, and a compiled decoding loop whose mask_mod and score_mod capture
a Python int position that torch.compile makes symbolic.
"""
import pathlib
import re

import pytest
import torch
import torch.nn.attention.flex_attention as tfa

import flexc
from flexc.backends import triton_decode
from reference import dense_attention, random_qkv

INTERPRET = {"BACKEND": "TRITON"}  # CPU tensors: generated kernels under Triton's interpreter


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_decode_loop_with_a_python_int_position(backend):
    """torch.compile makes the captured position symbolic from the third step on. Before, the
    traced mods kept the first symbolic step's value ("eager": wrong outputs from then on) or failed
    to trace the SymInt ("aot_eager": TraceError)."""
    torch._dynamo.reset()
    S = 48
    _, k, v = random_qkv(1, 2, 2, 1, S, 16)

    def step(q, k, v, pos):
        def seen(b, h, q_idx, kv_idx):  # the cache holds keys 0..pos
            return kv_idx <= q_idx + pos

        def recency(score, b, h, q_idx, kv_idx):
            return score - 0.05 * (q_idx + pos - kv_idx)

        block_mask = flexc.create_block_mask(seen, None, None, 1, S, device="cpu", BLOCK_SIZE=16)
        return flexc.flex_attention(q, k, v, recency, block_mask=block_mask)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for pos in (3, 4, 20, 35, 7):
        q = torch.randn(1, 2, 1, 16)
        gold = dense_attention(q, k, v, lambda s, b, h, qi, kv: s - 0.05 * (qi + pos - kv),
                               lambda b, h, qi, kv: kv <= qi + pos)[0]
        torch.testing.assert_close(compiled(q, k, v, pos).double(), gold, atol=1e-5, rtol=1e-5, msg=f"pos={pos}")
