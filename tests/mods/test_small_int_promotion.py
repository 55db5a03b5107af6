"""Small-integer captured tensors meeting Python constants follow torch's weak-scalar rule: the
constant is converted to the tensor's dtype with wraparound (``uint8 <= -16`` is ``<= 240``,
``int8 < 128`` is ``< -128``). Every path (create_mask, the tile analysis of create_block_mask,
the TORCH backend and the Triton kernel under the interpreter) must agree with the mod called
eagerly on torch index tensors, and with the dense float64 reference."""
from __future__ import annotations

import pytest
import torch

import flexc
from flexc.mods.promotion import wrap_to_dtype
from reference import dense_attention, index_tensors, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

L, S = 64, 48
_g = torch.Generator().manual_seed(3)
U8 = torch.randint(0, 256, (S,), dtype=torch.uint8, generator=_g)
I8 = torch.randint(-128, 128, (S,), dtype=torch.int8, generator=_g)
I16 = torch.randint(-2 ** 15, 2 ** 15, (L,), dtype=torch.int16, generator=_g)
I32 = torch.randint(-2 ** 31, 2 ** 31 - 1, (S,), dtype=torch.int32, generator=_g)

MASKS = {
    "uint8 <= -16": lambda b, h, q_idx, kv_idx: U8[kv_idx] <= -16,
    "int8 < 128": lambda b, h, q_idx, kv_idx: (I8[kv_idx] < 128) | (q_idx == kv_idx),
    "int8 > -129": lambda b, h, q_idx, kv_idx: (I8[kv_idx] > -129) | (q_idx >= kv_idx),
    "uint8 + 300 > 100": lambda b, h, q_idx, kv_idx: U8[kv_idx] + 300 > 100,
    "int16 >= 40000": lambda b, h, q_idx, kv_idx: (I16[q_idx] >= 40000) | (q_idx >= kv_idx),
    "int32 < 2**40": lambda b, h, q_idx, kv_idx: (I32[kv_idx] < 2 ** 40) | (q_idx == kv_idx),
    "where(uint8, -1)": lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, U8[kv_idx], -1) > 128,
    "clamp(uint8, max=-56)": lambda b, h, q_idx, kv_idx: U8[kv_idx].clamp(max=-56) < 150,
    "uint8 % -3": lambda b, h, q_idx, kv_idx: U8[kv_idx] % -3 < 100,
}


def eager(mask_mod, B=1, H=1):
    """The mask as torch computes it: the mod called on broadcast int64 index tensors."""
    b, h, q, kv = index_tensors(B, H, L, S)
    return torch.broadcast_to(mask_mod(b, h, q, kv), (B, H, L, S))


def test_wrap_to_dtype_is_torchs_conversion():
    for value in (-16, 128, -129, 300, 40000, 2 ** 40, -2 ** 40 - 5, 255, 0):
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
            assert wrap_to_dtype(value, dtype) == int(torch.tensor([value]).to(dtype)[0])


def test_constants_are_wrapped_in_the_graph():
    assert str(flexc.trace(MASKS["uint8 <= -16"])) == "U8[kv_idx] <= 240"
    assert "I8[kv_idx] < -128" in str(flexc.trace(MASKS["int8 < 128"]))
    # an int64 index, a bool or a float operand keeps the number as written
    assert str(flexc.trace(lambda b, h, q_idx, kv_idx: q_idx <= -16)) == "q_idx <= -16"
    assert "2.5" in str(flexc.trace(lambda b, h, q_idx, kv_idx: U8[kv_idx] < 2.5))


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_and_block_masks_agree_with_torch(name):
    mask_mod = MASKS[name]
    expected = eager(mask_mod)
    assert torch.equal(flexc.create_mask(mask_mod, 1, 1, L, S), expected)
    for block in (16, 32):
        analysed = flexc.create_block_mask(mask_mod, 1, 1, L, S, BLOCK_SIZE=block)
        exact = flexc.create_block_mask(mask_mod, 1, 1, L, S, BLOCK_SIZE=block, _analytic=False)
        for a, e in zip(analysed.as_tuple(), exact.as_tuple()):
            assert torch.equal(a, e) if isinstance(a, torch.Tensor) else a == e
        padded = torch.nn.functional.pad(expected, (0, -S % block, 0, -L % block))
        tiles = padded.unflatten(2, (-1, block)).unflatten(4, (-1, block)).any(dim=(3, 5))
        assert torch.equal(analysed.to_dense().bool(), tiles)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_attention_agrees_with_dense_reference(backend):
    q, k, v = random_qkv(1, 1, 1, L, S, 16)
    for name in ("uint8 <= -16", "int8 < 128", "uint8 + 300 > 100", "where(uint8, -1)"):
        mask_mod = MASKS[name]
        block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, S, BLOCK_SIZE=16)
        out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
        ref, _, _ = dense_attention(q, k, v, mask_mod=mask_mod)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0, msg=name)


def test_small_int_score_mod_on_triton():
    q, k, v = random_qkv(1, 1, 1, L, S, 16, seed=1)

    def bias(score, b, h, q_idx, kv_idx):
        return score + (I8[kv_idx] * 3 - 200).float() / 64  # int8 arithmetic wraps, as in torch

    for backend in ("TORCH", "TRITON"):
        out = flexc.flex_attention(q, k, v, score_mod=bias, kernel_options={"BACKEND": backend})
        ref, _, _ = dense_attention(q, k, v, score_mod=bias)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["block_count", "block_index", "block_counts", "query"])
def test_captured_tensor_named_like_a_kernel_parameter(name):
    """A captured tensor whose name is one of the kernel's own parameter stems is renamed."""
    q, k, v = random_qkv(1, 1, 1, L, S, 16, seed=2)
    table = torch.randn(S)
    score_mod = eval(f"lambda score, b, h, q_idx, kv_idx: score + {name}[kv_idx]", {name: table})
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, kernel_options={"BACKEND": "TRITON"})
    ref, _, _ = dense_attention(q, k, v, score_mod=score_mod)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["block_count", "count", "index", "delta", "dq", "grad_out", "out_split",
                                  "full_q_indices"])
def test_no_kernel_has_duplicate_parameters_whatever_the_captured_names(name):
    """Forward, backward and decode sources: every function's parameters are distinct."""
    import ast

    table = torch.randn(S)
    score_mod = eval(f"lambda score, b, h, q_idx, kv_idx: score + {name}[kv_idx]", {name: table})
    for length, backward in ((L, False), (L, True), (1, False)):
        q, k, v = random_qkv(1, 1, 1, length, S, 16)
        source = flexc.kernel_source(q, k, v, score_mod=score_mod, backward=backward,
                                     kernel_options={"BACKEND": "TRITON"})
        for fn in ast.walk(ast.parse(source)):
            if isinstance(fn, ast.FunctionDef):
                params = [a.arg for a in fn.args.args]
                assert len(params) == len(set(params)), (name, fn.name, params)
