"""Mods that read captured tensors, directly or through torch operations on them (``torch.exp(log_temp)``,
``logits.softmax(0)[h]``, ``pos + 0``), see their current contents after every in-place change
(values written, ``fill_``, optimizer steps), on both backends, forward and gradients, eager and
compiled, against a float64 dense reference that calls the same mods eagerly."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexc
from strategies import examples
from reference import dense_attention

B, H, L, S, D = 1, 2, 40, 56, 16


def _captured(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "log_temp": torch.tensor(0.3, requires_grad=True),
        "logits": torch.randn(H, generator=g).requires_grad_(),
        "table": (0.5 * torch.randn(L, S, generator=g)).requires_grad_(),
        "doc_bias": torch.randn(3, generator=g).requires_grad_(),
        "doc": torch.randint(0, 3, (S,), generator=g),
        "pos": torch.tensor(30),
        "width": torch.tensor(12.0),
    }


# score terms, each a function of the captured tensors: how a mod may transform them whole
SCORE_TERMS = {
    "temperature": lambda c, s, b, h, q, kv: s * torch.exp(c["log_temp"]) - s,
    "softmax_slopes": lambda c, s, b, h, q, kv: -c["logits"].softmax(0)[h] * (q - kv).abs() * 0.1,
    "tanh_table": lambda c, s, b, h, q, kv: torch.tanh(c["table"])[q, kv],
    "scaled_nested_gather": lambda c, s, b, h, q, kv: (c["doc_bias"] * 2)[c["doc"][kv]],
    "plain_table": lambda c, s, b, h, q, kv: c["table"][q, kv],
}
MASKS = {
    "none": None,
    "position_plus_zero": lambda c, b, h, q, kv: kv < c["pos"] + 0,
    "clamped_width": lambda c, b, h, q, kv: (q - kv).abs() <= c["width"].clamp(min=0),
    "causal": lambda c, b, h, q, kv: q >= kv,
}


def _mods(captured: dict, terms: list[str], mask: str):
    def score_mod(score, b, h, q_idx, kv_idx):
        out = score
        for name in terms:
            out = out + SCORE_TERMS[name](captured, score, b, h, q_idx, kv_idx)
        return out

    def mask_mod(b, h, q_idx, kv_idx):
        return MASKS[mask](captured, b, h, q_idx, kv_idx)

    return score_mod, (mask_mod if MASKS[mask] is not None else None)


def _mutate(captured: dict, how: str, step: int, grads: dict) -> None:
    """An in-place change of the kind a training or decoding loop makes."""
    with torch.no_grad():
        if how == "optimizer":  # a sign-SGD step (bounded, as Adam's) on the gradients flexc computed
            for name, g in grads.items():
                captured[name].sub_(0.2 * g.sign())
        elif how == "fill":
            captured["log_temp"].fill_(0.1 * step - 0.2)
            captured["pos"].fill_(10 + 15 * step)
            captured["width"].fill_(4.0 * step - 2.0)
        else:  # values written through a view
            captured["logits"][:] = torch.linspace(-1.0, 1.0 + step, H)
            captured["doc"][: S // 2] = (captured["doc"][: S // 2] + 1) % 3
            captured["table"].mul_(-1.5)
            captured["doc_bias"].add_(1.0)


def _check_steps(backend: str, terms: list[str], mask: str, how: str, seed: int, call) -> None:
    captured = _captured(seed)
    score_mod, mask_mod = _mods(captured, terms, mask)
    trainable = [n for n, t in captured.items() if t.requires_grad]
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for n in (L, S, S))
    grad_out = torch.randn(B, H, L, D, generator=g)
    for step in range(3):
        block_mask = (flexc.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=(16, 32))
                      if mask_mod is not None else None)
        out = call(q, k, v, score_mod, block_mask, backend)
        ref, _, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        where = f"{backend} {terms} {mask} {how} step {step}"
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=lambda m: f"{where}: {m}")
        inputs = [q, k, v] + [captured[n] for n in trainable]
        got = torch.autograd.grad((out * grad_out).sum(), inputs, allow_unused=True)
        want = torch.autograd.grad((ref * grad_out.double()).sum(), inputs, allow_unused=True)
        for name, a, b in zip(["q", "k", "v"] + trainable, got, want):
            if b is None:
                assert a is None or not a.any(), f"{where}: d{name} should be 0"
                continue
            assert a is not None, f"{where}: no gradient for {name}"
            torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{where}: d{name}: {m}")
        _mutate(captured, how, step + 1, {n: gr for n, gr in zip(trainable, got[3:]) if gr is not None})


def _eager(q, k, v, score_mod, block_mask, backend):
    return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                kernel_options={"BACKEND": backend})


@examples(12, slow=True)
@given(backend=st.sampled_from(["TORCH", "TRITON"]),
       terms=st.lists(st.sampled_from(sorted(SCORE_TERMS)), min_size=1, max_size=3, unique=True),
       mask=st.sampled_from(sorted(MASKS)), how=st.sampled_from(["optimizer", "fill", "values"]),
       seed=st.integers(0, 2**16))
def test_random_mods_over_mutated_captured_tensors_match_dense(backend, terms, mask, how, seed):
    _check_steps(backend, terms, mask, how, seed, _eager)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_compiled_training_reads_current_captured_tensors(backend):
    torch._dynamo.reset()
    compiled = torch.compile(_eager, fullgraph=True)
    _check_steps(backend, ["temperature", "softmax_slopes", "scaled_nested_gather"], "position_plus_zero",
                 "optimizer", 7, compiled)


def test_trace_replays_operations_on_captured_tensors_only_when_they_change():
    pos = torch.tensor(3)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < pos * 2

    flexc.trace(mask_mod)
    unchanged = flexc.trace(mask_mod)
    assert flexc.trace(mask_mod) is unchanged  # no write since: the replay is reused
    pos.fill_(5)
    assert flexc.trace(mask_mod).buffers[0].item() == 10
    assert flexc.create_mask(mask_mod, None, None, 1, 16)[0, 0, 0].sum().item() == 10
