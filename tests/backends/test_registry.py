"""The backend registry is the one list of backends: a backend registered there is accepted by
validation, runs eagerly and under torch.compile (forward, logsumexp, sinks, training through the torch
backward), is named by kernel_source, and is refused again once unregistered."""
import pytest
import torch

import flexc
from flexc.backends import registry
from flexc.backends.cpu.torch_cpu import torch_forward
from reference import dense_attention, random_qkv

TOY = "TOY"
B, H, L, E = 1, 2, 64, 16


def _dense_backend(runs: list):
    """A backend that is the float64 dense reference: the block mask's mask_mod everywhere (the toy
    ignores the tables; the masks here list every tile the mask_mod allows), and the sinks, given to
    backends as a ``[B or 1, Hq, 1]`` view."""
    def dense_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse,
                      sinks=None):
        runs.append(query.shape)
        mask = block_mask.mask_mod if block_mask is not None else None
        out, lse, _ = dense_attention(query, key, value, score_mod=score_mod, mask_mod=mask, scale=scale,
                                      sinks=None if sinks is None else sinks[..., 0])
        return out.to(query.dtype), lse.float()
    return dense_forward


@pytest.fixture
def toy_backend():
    """The dense backend registered as ``TOY``, recording each run; unregistered afterwards."""
    runs = []
    registry.register(TOY, _dense_backend(runs))
    torch._dynamo.reset()
    yield runs
    registry.unregister(TOY)
    torch._dynamo.reset()


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _problem():
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E))
    bias = torch.randn(L, generator=torch.Generator().manual_seed(1), requires_grad=True)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def with_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    return (q, k, v), bias, sinks, with_bias, flexc.create_block_mask(_causal, None, None, L, L, BLOCK_SIZE=32)


def _call(q, k, v, score_mod, block_mask, sinks):
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, sinks=sinks,
                                kernel_options={"BACKEND": "toy"})


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_registered_backend_runs_and_trains_eagerly_and_under_torch_compile(toy_backend, compiled, with_sinks):
    """Its output and logsumexp, and the gradients of q, k, v, a captured bias and the sinks (the torch
    backward's), equal float64 dense attention; the toy runs once per call, not the TORCH forward in its place."""
    (q, k, v), bias, sinks, with_bias, block_mask = _problem()
    sinks = sinks if with_sinks else None
    call = torch.compile(_call, backend="aot_eager", fullgraph=True) if compiled else _call
    out, lse = call(q, k, v, with_bias, block_mask, sinks)
    assert len(toy_backend) == 1
    want, want_lse, _ = dense_attention(q, k, v, score_mod=with_bias, mask_mod=_causal, sinks=sinks)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)
    leaves = [q, k, v, bias, *([sinks] if with_sinks else [])]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((out * grad_out).sum() + lse.sum(), leaves)
    wanted = torch.autograd.grad((want * grad_out.double()).sum() + want_lse.sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "bias", "sinks"], got, wanted):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=2e-4, msg=lambda m: f"{name}: {m}")


def test_kernel_source_names_a_registered_backend_and_what_trains_it(toy_backend):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    forward = flexc.kernel_source(q, k, v, kernel_options={"BACKEND": TOY})
    assert f"runs the {TOY!r} backend" in forward
    backward = flexc.kernel_source(q, k, v, kernel_options={"BACKEND": TOY}, backward=True)
    assert f"runs the {TOY!r} backend's forward" in backward and "torch_backward" in backward, backward


def test_an_unregistered_name_is_refused_with_the_registered_ones(toy_backend):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    _call(q, k, v, None, None, None)
    registry.unregister(TOY)
    with pytest.raises(ValueError, match=r"'AUTO', 'TORCH'.*'TRITON'"):
        _call(q, k, v, None, None, None)
    registry.register(TOY, _dense_backend(toy_backend))  # (for the fixture to unregister)


def test_a_backend_registered_again_under_its_name_is_the_one_that_runs(toy_backend):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    _call(q, k, v, None, None, None)
    registry.unregister(TOY)
    again = []
    registry.register(TOY, _dense_backend(again))
    _call(q, k, v, None, None, None)
    assert (len(toy_backend), len(again)) == (1, 1)


def test_a_name_validation_would_not_match_is_refused_at_registration():
    with pytest.raises(ValueError, match="upper-case"):
        registry.register("toy", torch_forward)
    with pytest.raises(ValueError, match="built in"):
        registry.unregister("TORCH")
