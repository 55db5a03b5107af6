"""The backend registry is the one list of backends: a backend registered there is accepted by
validation, runs eagerly and under torch.compile, and is named by kernel_source."""
import pytest
import torch

import flexc
from flexc.backends import registry
from flexc.backends.cpu.torch_cpu import torch_forward
from reference import dense_attention, random_qkv

TOY = "TOY"


@pytest.fixture
def toy_backend():
    """A backend ``TOY`` that runs the TORCH forward and records each run; unregistered afterwards."""
    runs = []

    def toy_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse, **kw):
        runs.append(query.shape)
        return torch_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse, **kw)

    registry.register(TOY, toy_forward)
    torch._dynamo.reset()
    yield runs
    registry.BACKENDS.pop(TOY)
    torch._dynamo.reset()


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _call(q, k, v, block_mask):
    return flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "toy"})


def test_a_registered_backend_runs_eagerly_and_under_torch_compile(toy_backend):
    q, k, v = random_qkv(1, 2, 2, 64, 64, 16)
    bm = flexc.create_block_mask(_causal, None, None, 64, 64, BLOCK_SIZE=32)
    want = dense_attention(q, k, v, mask_mod=_causal)[0]
    eager = _call(q, k, v, bm)
    assert len(toy_backend) == 1
    torch.testing.assert_close(eager.double(), want, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(_call, backend="aot_eager", fullgraph=True)(q, k, v, bm)
    assert len(toy_backend) == 2  # not the TORCH forward in its place
    torch.testing.assert_close(compiled.double(), want, rtol=1e-5, atol=1e-5)


def test_kernel_source_names_a_registered_backend(toy_backend):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    text = flexc.kernel_source(q, k, v, kernel_options={"BACKEND": TOY})
    assert f"runs the {TOY!r} backend" in text


def test_an_unregistered_name_is_refused_with_the_registered_ones():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    with pytest.raises(ValueError, match=r"'AUTO', 'TORCH'.*'TRITON'"):
        _call(q, k, v, None)


def test_a_name_validation_would_not_match_is_refused_at_registration():
    with pytest.raises(ValueError, match="upper-case"):
        registry.register("toy", torch_forward)
