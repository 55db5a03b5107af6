"""Property test: for random window/stride masks, lengths and block sizes, create_block_mask's tables
equal torch's, with and without tile analysis."""
import torch
from hypothesis import given, strategies as st
from torch.nn.attention import flex_attention as tfa

import flexc
from strategies import examples

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _window_mask(shift, low, high, stride, per_head):
    def window(b, h, q_idx, kv_idx):
        diff = q_idx + shift - kv_idx + per_head * h
        return (diff >= low) & (diff <= high) & ((kv_idx % stride == 0) | (diff == low))
    return window


@examples(25)
@given(
    q_len=st.integers(1, 300), kv_len=st.integers(1, 300),
    q_block=st.sampled_from([16, 32, 64]), kv_block=st.sampled_from([16, 32, 128]),
    shift=st.integers(-100, 100), low=st.integers(-50, 50), width=st.integers(0, 200),
    stride=st.sampled_from([1, 1, 3]), heads=st.integers(1, 2), per_head=st.integers(0, 40),
    analytic=st.booleans(),
)
def test_random_window_masks_match_torch(q_len, kv_len, q_block, kv_block, shift, low, width, stride, heads,
                                         per_head, analytic):
    mod = _window_mask(shift, low, low + width, stride, per_head)
    ours = flexc.create_block_mask(mod, None, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block),
                                   _analytic=analytic)
    ref = tfa.create_block_mask(mod, None, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    for table in TABLES:
        assert torch.equal(getattr(ours, table), getattr(ref, table)), table
