"""Fast tanh and sigmoid (one exp2 and one reciprocal, CUDA's default) against torch in fp32.

The printed fast forms run through Triton's interpreter (``render_mod(..., fast_math=True)``: the
same expression the CUDA kernels print, with a correctly rounded reciprocal where the GPU has
``rcp.approx``) on random inputs and on the edges: signed zeros, tiny values, +-1e-3, +-9 (where
libdevice saturates), +-20, +-88 (where ``exp`` overflows in fp32), +-1e4, infinities and NaN. The
hardware's approximations are covered by the documented bounds, checked here by perturbing the
formula's two approximate steps by their worst-case relative errors.
"""
from __future__ import annotations

import math

import pytest
import torch

import flexc
from flexc.backends.triton.cache import import_source
from flexc.codegen.printer import PRECISE, keep_precise_math, render_mod
from flexc.codegen.triton_helpers import FAST_SIGMOID_ERROR, FAST_TANH_ERROR, HELPERS, LOG2E, TWO_LOG2E
from flexc.codegen.scalars import lift_scalars

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 1e-3, -1e-3, 0.5, -0.5, 0.55, -0.55, 9.0, -9.0, 9.1, -9.1, 20.0,
         -20.0, 44.0, -44.0, 88.0, -88.0, 89.0, -89.0, 1e4, -1e4, 3e38, -3e38, math.inf, -math.inf, math.nan]

_KERNEL = '''
@triton.jit
def apply(out_ptr, x_ptr, {params}N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    score = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    zero = offsets * 0
    tl.store(out_ptr + offsets, score_mod(score, zero, zero, zero, zero, {params}).to(tl.float32), mask=inside)
'''


def inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    dense = torch.linspace(-12.0, 12.0, 24001)  # where tanh and sigmoid bend: every step of 1e-3
    wide = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 8, (4000,), generator=g).float())
    return torch.cat([torch.tensor(EDGES), dense, wide]).float()


def run_fast(score_mod, x: torch.Tensor, fast_math: bool = True, lift: bool = False) -> torch.Tensor:
    """``score_mod`` printed as CUDA prints it (fast forms) and run by the interpreter on ``x``
    (``lift``: its captured numbers are kernel arguments, as in a real call)."""
    traced = flexc.trace(score_mod)
    if lift:
        traced = lift_scalars(traced)
    rendered = render_mod(traced, "score_mod", target="interpreter", fast_math=fast_math)
    assert all(p.what == "scalar" for p in rendered.params)
    scalars = [traced.scalars[p.slot] for p in rendered.params]
    source = "\n".join(["import triton", "import triton.language as tl", ""]
                       + [HELPERS[h] for h in sorted(rendered.helpers)] + [rendered.source, _KERNEL.format(
                           params="".join(f"{p.name}, " for p in rendered.params))])
    module, _ = import_source(source, "interpreter")
    out = torch.empty_like(x)
    block = 1024
    module.apply[(triton_cdiv(x.numel(), block),)](out, x, *scalars, x.numel(), BLOCK=block)
    return out, rendered.source


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_fast_tanh_is_within_its_bound_and_saturates():
    x = inputs()
    fast, source = run_fast(lambda score, b, h, q_idx, kv_idx: torch.tanh(score), x)
    assert "portable_fast_tanh(score, score * 2.8853900817779268)" in source
    exact = torch.tanh(x.double())
    finite = ~x.isnan()
    assert (fast[finite] - exact[finite]).abs().max().item() <= FAST_TANH_ERROR
    assert (fast - torch.tanh(x))[finite].abs().max().item() <= FAST_TANH_ERROR  # torch's fp32 tanh
    assert fast[x.isnan()].isnan().all() and not fast[finite].isnan().any()
    saturated = x.abs() >= 9.1  # exactly +-1, never inf / inf
    assert torch.equal(fast[saturated], torch.sign(x[saturated]))
    assert fast[x == 0].abs().max() == 0
    assert fast[finite].abs().max() <= 1.0


def test_fast_sigmoid_is_within_its_bound_and_saturates():
    x = inputs()
    fast, source = run_fast(lambda score, b, h, q_idx, kv_idx: torch.sigmoid(score), x)
    assert "portable_fast_sigmoid(score, score * -1.4426950408889634)" in source
    exact = torch.sigmoid(x.double())
    finite = ~x.isnan()
    normal = finite & (exact >= 2.0 ** -126)
    relative = ((fast.double() - exact) / exact).abs() - x.double().abs() * 2.0 ** -24  # exponent rounding
    assert relative[normal].max().item() <= FAST_SIGMOID_ERROR
    assert (fast.double() - exact)[finite].abs().max().item() <= FAST_SIGMOID_ERROR
    assert fast[x.isnan()].isnan().all()
    assert torch.equal(fast[x == math.inf], torch.ones(1)) and torch.equal(fast[x == -math.inf], torch.zeros(1))
    assert torch.equal(fast[x >= 17.0], torch.ones_like(fast[x >= 17.0]))  # 1 - 2^-24 rounds to 1
    assert ((fast >= 0) & (fast <= 1))[finite].all()


def test_gelu_tanh_and_soft_cap_fold_their_constants_and_match_torch():
    x = inputs()
    gelu = lambda score, b, h, q_idx, kv_idx: torch.nn.functional.gelu(score, approximate="tanh")
    fast, source = run_fast(gelu, x)
    assert source.count("portable_fast_tanh(") == 1  # the tracer writes gelu with tanh: fast too
    reference = torch.nn.functional.gelu(x.double(), approximate="tanh")
    finite = x.isfinite()
    # 0.5 x (1 + tanh): the tanh error scaled by |x| / 2, plus fp32 rounding of the rest
    allowed = 0.5 * x.double().abs() * FAST_TANH_ERROR + 4 * 2.0 ** -24 * reference.abs() + 1e-38
    assert ((fast.double() - reference).abs() <= allowed)[finite].all()
    assert fast[x == math.inf].item() == math.inf and fast[x.isnan()].isnan().all()
    assert torch.allclose(fast[finite], torch.nn.functional.gelu(x, approximate="tanh")[finite], rtol=1e-5,
                          atol=1e-6)

    cap = 20.0
    soft_cap = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)
    fast, source = run_fast(soft_cap, x)
    assert f"score * {TWO_LOG2E / cap!r})" in source  # s / 20 folded into the power: one multiply
    reference = cap * torch.tanh(x.double() / cap)
    finite = ~x.isnan()
    assert (fast.double() - reference)[finite].abs().max().item() <= cap * FAST_TANH_ERROR
    assert torch.equal(fast[x.abs() >= 200], cap * torch.sign(x[x.abs() >= 200]))
    # a real call passes the captured cap as a kernel argument: folded the same way, once per program
    lifted, source = run_fast(soft_cap, x, lift=True)
    assert f"score * tl.math.div_rn({TWO_LOG2E!r}, score_mod_cap))" in source
    assert (lifted.double() - reference)[finite].abs().max().item() <= cap * FAST_TANH_ERROR
    assert torch.equal(lifted[x.abs() >= 200], cap * torch.sign(x[x.abs() >= 200]))


def test_fast_forms_are_odd_and_monotone_enough_on_a_fine_grid():
    # no wiggles bigger than the bound: tanh(-x) ~ -tanh(x), sigmoid(-x) ~ 1 - sigmoid(x)
    x = torch.linspace(0.0, 12.0, 12001)
    xx = torch.cat([x, -x])
    tanh, _ = run_fast(lambda score, b, h, q_idx, kv_idx: torch.tanh(score), xx)
    assert (tanh[:x.numel()] + tanh[x.numel():]).abs().max().item() <= 2 * FAST_TANH_ERROR
    sigmoid, _ = run_fast(lambda score, b, h, q_idx, kv_idx: torch.sigmoid(score), xx)
    assert (sigmoid[:x.numel()] + sigmoid[x.numel():] - 1).abs().max().item() <= 2 * FAST_SIGMOID_ERROR
    assert (tanh[1:x.numel()] - tanh[:x.numel() - 1]).min().item() >= -FAST_TANH_ERROR


def test_documented_bounds_cover_the_gpu_approximations():
    # ex2.approx.ftz.f32: relative error below 2^-22; rcp.approx.ftz.f32: within 1 ulp (2^-23 relative).
    # The formula with each step pushed to its worst case, in float64 around fp32 roundings.
    x = torch.cat([torch.linspace(-12.0, 12.0, 48001), torch.tensor([1e-3, -1e-3, 1e-6, 0.0])]).double()
    exact_tanh, exact_sigmoid = torch.tanh(x), torch.sigmoid(x)
    worst_tanh = worst_sigmoid = 0.0
    for e_err in (-2.0 ** -22, 0.0, 2.0 ** -22):
        for r_err in (-2.0 ** -23, 0.0, 2.0 ** -23):
            power = torch.exp2((x.float() * TWO_LOG2E).double()).float().double() * (1 + e_err)
            denominator = (power.float() + 1.0).double()
            r = (1.0 / denominator).float().double() * (1 + r_err)
            tanh = (1.0 - 2.0 * r).float().double()
            worst_tanh = max(worst_tanh, (tanh - exact_tanh).abs().max().item())
            power = torch.exp2((x.float() * -LOG2E).double()).float().double() * (1 + e_err)
            sigmoid = (1.0 / (1.0 + power.float()).double()).float().double() * (1 + r_err)
            relative = (sigmoid.float().double() - exact_sigmoid).abs() / exact_sigmoid - x.abs() * 2.0 ** -24
            worst_sigmoid = max(worst_sigmoid, relative.max().item())
    assert worst_tanh <= FAST_TANH_ERROR and worst_sigmoid <= FAST_SIGMOID_ERROR


def test_interpreter_keeps_its_accurate_helpers_unless_asked():
    soft_cap = lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0) + torch.sigmoid(score)
    rendered = render_mod(flexc.trace(soft_cap), "score_mod", target="interpreter")
    assert {"tanh", "sigmoid"} <= rendered.helpers and "rcp" not in rendered.helpers
    x = inputs()
    accurate, _ = run_fast(soft_cap, x, fast_math=False)
    fast, _ = run_fast(soft_cap, x)
    finite = ~x.isnan()
    assert (accurate - fast)[finite].abs().max().item() <= 30 * FAST_TANH_ERROR + 2 * FAST_SIGMOID_ERROR


def test_float64_never_takes_the_fast_forms():
    table = torch.rand(8, dtype=torch.float64)
    mod = lambda score, b, h, q_idx, kv_idx: torch.tanh(table[h] * 0.5) + torch.sigmoid(table[b])
    source = render_mod(flexc.trace(mod), "score_mod", target="cuda").source
    assert "libdevice.tanh(" in source and "tl.sigmoid(" in source and "approx_rcp" not in source


def test_float64_scores_take_the_accurate_functions():
    # the printer cannot know a kernel's score dtype: the fast helpers choose when Triton compiles them
    x = inputs().double()
    mod = lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0) + torch.sigmoid(score)
    fast, source = run_fast(mod, x)
    accurate, _ = run_fast(mod, x, fast_math=False)
    assert "portable_fast_tanh(" in source
    assert torch.equal(fast.isnan(), accurate.isnan()) and torch.equal(fast[~fast.isnan()], accurate[~fast.isnan()])


def test_keep_precise_math_marks_tanh_and_sigmoid_only():
    mod = lambda score, b, h, q_idx, kv_idx: torch.tanh(score) * torch.sigmoid(score) + torch.exp(score)
    traced = flexc.trace(mod)
    precise = keep_precise_math(traced)
    assert precise is keep_precise_math(traced)  # memoised: one kernel key per mod
    assert {n.op for n in precise.root.walk() if n.attr == PRECISE} == {"tanh", "sigmoid"}
    assert str(precise) == str(traced) and precise.key != traced.key
    x = torch.randn(64)
    assert torch.equal(precise(x, 0, 0, 0, 0), traced(x, 0, 0, 0, 0))  # evaluation ignores the mark
    plain = flexc.trace(lambda score, b, h, q_idx, kv_idx: score * 2)
    assert keep_precise_math(plain) is plain and keep_precise_math(None) is None
    source = render_mod(precise, "score_mod", target="cuda").source
    assert "libdevice.tanh(score)" in source and "tl.sigmoid(score)" in source


def test_fast_math_kernel_option():
    from flexc.call.attention import prepare_call

    q = torch.randn(1, 2, 64, 16)
    soft_cap = lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0)
    _, _, fast, _ = prepare_call(q, q, q, soft_cap, None, None, False, {"FAST_MATH": True})
    _, _, precise, _ = prepare_call(q, q, q, soft_cap, None, None, False, {"FAST_MATH": False})
    assert not any(n.attr == PRECISE for n in fast.root.walk())
    assert any(n.op == "tanh" and n.attr == PRECISE for n in precise.root.walk())
    options = {"BACKEND": "TRITON"}
    out = flexc.flex_attention(q, q, q, score_mod=soft_cap, kernel_options=options)
    precise_out = flexc.flex_attention(q, q, q, score_mod=soft_cap, kernel_options={**options, "FAST_MATH": False})
    torch.testing.assert_close(out, precise_out)
    with pytest.raises(TypeError, match="FAST_MATH"):
        flexc.flex_attention(q, q, q, kernel_options={"FAST_MATH": "no"})
    with pytest.raises(ValueError, match="no fwd_/bwd_ prefix"):
        flexc.flex_attention(q, q, q, kernel_options={"bwd_FAST_MATH": False})
    with pytest.raises(ValueError, match="did you mean 'FAST_MATH'"):
        flexc.flex_attention(q, q, q, kernel_options={"FAST_MAHT": False})
