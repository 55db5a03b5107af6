"""Output and gradient layouts and the logsumexp dtype, as torch's FlexAttention returns them."""
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexc
from torch._higher_order_ops.flex_attention import _permute_strides
from reference import dense_attention


def _torch_flex(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(*args, **kwargs)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# (name, a [B, H, L, E]-shaped view of memory laid out another way)
_LAYOUTS = {
    "contiguous": lambda g: torch.randn(2, 3, 40, 8, generator=g),
    "bshd": lambda g: torch.randn(2, 40, 3, 8, generator=g).transpose(1, 2),
    "lbhd": lambda g: torch.randn(40, 2, 3, 8, generator=g).permute(1, 2, 0, 3),
    "head_dim_outer": lambda g: torch.randn(2, 3, 8, 40, generator=g).transpose(2, 3),
    "strided_rows": lambda g: torch.randn(2, 3, 80, 8, generator=g)[:, :, ::2],
}


@pytest.mark.parametrize("layout,backend", [(name, "TORCH") for name in sorted(_LAYOUTS)]
                         + [("bshd", "TRITON"), ("head_dim_outer", "TRITON")])
def test_output_strides_equal_torch(layout, backend):
    g = torch.Generator().manual_seed(0)
    q = _LAYOUTS[layout](g)
    k, v = torch.randn(2, 3, 40, 8, generator=g), torch.randn(2, 3, 40, 16, generator=g)
    bm = flexc.create_block_mask(_causal, None, None, 40, 40, BLOCK_SIZE=16)
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend})
    ref = _torch_flex(q, k, v, block_mask=torch_flex.create_block_mask(_causal, None, None, 40, 40, device="cpu"))
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_gradient_strides_follow_their_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 40, 2, 8, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 40, 2, 8, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 40, 1, 8, generator=g).permute(2, 0, 1, 3).requires_grad_()
    out = flexc.flex_attention(q, k, v)
    assert out.stride() == (640, 8, 16, 1)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))
    for grad, t in zip(grads, (q, k, v)):  # torch's rule, from its own FlexAttention backward
        assert grad.stride() == _permute_strides(torch.empty(t.shape), t.stride()).stride()
        assert [s for s, n in zip(grad.stride(), t.shape) if n > 1] == [s for s, n in zip(t.stride(), t.shape) if n > 1]
    ref = dense_attention(q.detach().double().requires_grad_(), k.detach().double(), v.detach().double())[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_lse_dtype_equals_torch(dtype, grad):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))
    _, aux = flexc.flex_attention(q, k, v, return_aux=flexc.AuxRequest(lse=True))
    _, ref = _torch_flex(q.detach(), k.detach(), v.detach(), return_aux=torch_flex.AuxRequest(lse=True))
    assert aux.lse.dtype == ref.lse.dtype
    _, lse = flexc.flex_attention(q, k, v, return_lse=True)
    assert lse.dtype == ref.lse.dtype
    if dtype == torch.float64:  # float64 all the way: equal to the dense reference to 1e-12
        torch.testing.assert_close(aux.lse, dense_attention(q.detach(), k.detach(), v.detach())[1],
                                   atol=1e-12, rtol=1e-12)


def test_gradcheck_through_lse_in_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 12, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    bm = flexc.create_block_mask(_causal, None, None, 12, 12, BLOCK_SIZE=4)

    def fn(q, k, v):
        out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v))
