"""The CPU backend cuts partial blocks to the columns the mask_mod allows, in parts of fewer query
rows where that pays (flexc.backends.cpu.block_plan.trimmed_rows): only never-allowed columns go,
so every path's output and gradients stay the float64 dense reference's."""
import pytest
import torch

import flexc
from flexc.backends.cpu import block_plan, head_groups
from flexc.mods.trace import trace
from reference import dense_attention

B, H, L, E = 1, 2, 256, 16


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 10 + 4 * h)


def test_a_narrow_window_is_planned_as_a_band_of_short_rows():
    bm = flexc.create_block_mask(_window, None, None, L, L, device="cpu", BLOCK_SIZE=128)
    plain = head_groups._new_plan(bm, B, B, H, H, L, L, E)
    trimmed = head_groups._new_plan(bm, B, B, H, H, L, L, E, trace(_window))
    work = lambda plan: sum((r.q1 - r.q0) * sum(b - a for a, b, _ in r.segments) for _, rows in plan for r in rows)
    assert max(r.q1 - r.q0 for _, rows in trimmed for r in rows) == 32
    assert work(trimmed) < work(plain) / 3
    allowed = _window(torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
                      torch.arange(L).view(1, 1, -1, 1), torch.arange(L).view(1, 1, 1, -1)).any(0).any(0)
    covered = torch.zeros(L, L, dtype=torch.bool)
    for _, rows in trimmed:
        for r in rows:
            for a, b, _ in r.segments:
                covered[r.q0:r.q1, a:b] = True
    assert not (allowed & ~covered).any()  # no allowed pair is cut


@pytest.mark.parametrize("score_mod", [None, lambda s, b, h, q, kv: s + 0.1 * (kv - q),
                                       lambda s, b, h, q, kv: 5.0 * torch.tanh(s / 5.0)])
def test_trimmed_rows_match_float64_forward_and_backward(score_mod):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bm = flexc.create_block_mask(_window, None, H, L, L, device="cpu", BLOCK_SIZE=128)
    out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ref = dense_attention(q, k, v, score_mod, _window)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_rows_without_partial_blocks_are_kept_as_they_are():
    row = block_plan.Row(0, 128, (), ((0, 128, False),))
    assert block_plan.trimmed_rows([row], lambda *a: pytest.fail("no partial block to evaluate"), 128) == [row]


def test_rows_past_the_evaluation_budget_stay_whole():
    row = block_plan.Row(0, 128, (), ((0, 128, True),))
    evaluated = []
    allowed = lambda q0, q1, a, b: evaluated.append(1) or torch.ones(q1 - q0, b - a, dtype=torch.bool).tril()
    assert block_plan.trimmed_rows([row], allowed, 128, [128 * 128 - 1]) == [row] and not evaluated
    assert block_plan.trimmed_rows([row], allowed, 128, [128 * 128]) != [row] and evaluated
