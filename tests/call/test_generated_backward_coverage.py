"""Every op the tracer accepts has a derivative rule, so BACKEND="TRITON" trains every traceable
score_mod with its generated backward: vector reductions (sum, mean, dot, norm, prod, amax/amin with
ties, any/all) and torch.autograd.Function score_mods (their own backward, traced like a mod). The
derivative IR is checked against torch.autograd on index grids (as tests/test_derivative.py does);
training runs with the torch row-loop backward disabled, against float64 dense gradients. A
Function whose backward cannot be traced still trains, through the torch backward, with one
flexc.FallbackWarning."""
from __future__ import annotations

import warnings

import pytest
import torch

import flexc
import flexc.call.training as training_module
from flexc.mods import ir
from flexc.call.attention import generated_backward_fallback
from flexc.mods.derivative import differentiate
from flexc.mods.lowering import autograd_function
from flexc.mods.reductions import REDUCE_OPS, axis, reduce
from flexc.mods.trace import SCORE_MOD, TracedMod
from reference import dense_attention, random_qkv
from derivative_check import B, H, L, S, check_derivative

# ---- every IR op has a rule --------------------------------------------------------------------

_FLOAT_ONLY = {"lshift", "rshift"}  # integer ops, checked on integer operands


def _rooted(node: ir.Node) -> ir.Node:
    """``node`` as a float score_mod root (bools select the score, integers are cast)."""
    score = ir.input_("score")
    if node.kind == ir.BOOL:
        return ir.where(node, score, ir.const(0.0))
    return node if node.kind == ir.FLOAT else ir.cast(node, "float32", ir.FLOAT)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _every_op() -> dict[str, ir.Node]:
    score, q, kv = ir.input_("score"), ir.input_("q_idx"), ir.input_("kv_idx")
    other = ir.binary("mul", score, ir.const(0.5))
    positive = ir.binary("add", ir.binary("mul", score, score), ir.const(2.0))
    nodes = {}
    for op in ir.UNARY_OPS:
        operand = ir.binary("gt", score, ir.const(0.0)) if op == "not" else positive
        nodes[op] = ir.unary(op, operand)
    for op in ir.BINARY_OPS:
        if op in ir.LOGIC_OPS:
            nodes[op] = ir.binary(op, ir.binary("gt", score, ir.const(0.0)), ir.binary("lt", q, kv))
        elif op in _FLOAT_ONLY:
            nodes[op] = ir.binary(op, q, ir.const(2))
        else:
            nodes[op] = ir.binary(op, positive, other)
    nodes["where"] = ir.where(ir.binary("ge", q, kv), score, other)
    nodes["cast"] = ir.cast(score, "float64", ir.FLOAT)
    table = ir.buffer(0, "float32", 2, ir.FLOAT)
    nodes["load"] = ir.binary("mul", score, ir.load(table, (q, kv)))
    row = ir.buffer(1, "float32", 2, ir.FLOAT)
    for op in REDUCE_OPS:
        term = ir.binary("mul", score, ir.load(row, (q, axis(3))))
        if op in ("any", "all"):
            term = ir.binary("gt", term, ir.const(0.0))
        nodes[f"reduce {op}"] = reduce(op, term, 3)
    nodes["autograd_function"] = autograd_function(_Twice, ir.binary("mul", score, ir.const(2)), (score,))
    return nodes


@pytest.mark.parametrize("op", sorted(_every_op()))
def test_every_ir_op_has_a_derivative_rule(op):
    buffers = (torch.randn(L, S), torch.randn(L, 3))
    root = _rooted(_every_op()[op])
    d = differentiate(TracedMod(SCORE_MOD, root, buffers, ("table", "row"), op, None))
    assert d.d_score is not None
    assert generated_backward_fallback(TracedMod(SCORE_MOD, root, buffers, ("table", "row"), op, None)) is None


# ---- reductions: the derivative IR against autograd ------------------------------------------

def _vectors():
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(B, H, L, 4, generator=g)
    keys = torch.randn(B, 1, S, 4, generator=g)
    # integer-valued: amax/amin meet ties, prod meets exact zeros
    ties = torch.randint(-2, 3, (L, 4), generator=g).float()
    return rows, keys, ties


def _reduction_mods():
    rows, keys, ties = _vectors()
    return {
        "sum_of_products": lambda s, b, h, q, kv: s + (rows[b, h, q] * keys[b, 0, kv]).sum(-1),
        "mean": lambda s, b, h, q, kv: s * rows[b, h, q].mean(-1),
        "nansum_of_score": lambda s, b, h, q, kv: (s.unsqueeze(-1) * keys[b, 0, kv]).nansum(-1),
        "norm_2": lambda s, b, h, q, kv: s - (rows[b, h, q] - keys[b, 0, kv]).norm(dim=-1),
        "norm_1": lambda s, b, h, q, kv: s - (rows[b, h, q] * s.unsqueeze(-1)).norm(p=1, dim=-1),
        "prod_with_zeros": lambda s, b, h, q, kv: s + (ties[q] * rows[b, h, kv] * s.unsqueeze(-1)).prod(-1),
        "amax_with_ties": lambda s, b, h, q, kv: s + (ties[q] * (s.unsqueeze(-1) + keys[b, 0, kv])).amax(-1),
        "amin_with_ties": lambda s, b, h, q, kv: (ties[kv] + rows[b, h, q] * 0 + s.unsqueeze(-1)).amin(-1),
        "any_all": lambda s, b, h, q, kv: torch.where((rows[b, h, q] > 1).any(-1), s * 2, s)
        + (keys[b, 0, kv] > -1).all(-1) * s,
        "count_nonzero": lambda s, b, h, q, kv: s * torch.count_nonzero(ties[q] * ties[kv], dim=-1),
    }


@pytest.mark.parametrize("name", sorted(_reduction_mods()))
def test_reduction_derivatives_match_autograd(name):
    check_derivative(_reduction_mods()[name])


def test_dot_is_the_sum_of_products():
    rows, keys, _ = _vectors()
    dot = flexc.trace(lambda s, b, h, q, kv: s + torch.dot(rows[b, h, q], keys[b, 0, kv]))
    summed = flexc.trace(lambda s, b, h, q, kv: s + (rows[b, h, q] * keys[b, 0, kv]).sum(-1))
    assert dot.root is summed.root
    d = differentiate(dot)
    assert len(d.gathers) == 8  # one per element of each row, as unrolled
    assert str(d.d_score) == "1.0"


# ---- torch.autograd.Function: its own backward, traced ---------------------------------------

class SavedInput(torch.autograd.Function):
    """Old style: saves its input and a number on ctx; the backward is not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.scale = 0.5
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w * ctx.scale, grad * torch.tanh(x)


class SetupContext(torch.autograd.Function):
    """New style: setup_context saves the output; a straight-through gradient for the input."""

    @staticmethod
    def forward(x):
        return torch.clamp(x, -1.0, 1.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1.5 - out * out)


def _function_mods():
    g = torch.Generator().manual_seed(6)
    head_scale = torch.rand(H, generator=g) + 0.5
    return {
        "saved_input": lambda s, b, h, q, kv: SavedInput.apply(s, head_scale[h]),
        "setup_context": lambda s, b, h, q, kv: SetupContext.apply(s * 0.5) + (q - kv) * 0.01,
        "nested_in_math": lambda s, b, h, q, kv: torch.exp(SetupContext.apply(s / 4)) * SavedInput.apply(s, torch.full_like(s, 2.0)),
    }


@pytest.mark.parametrize("name", sorted(_function_mods()))
def test_function_derivatives_use_its_backward(name):
    check_derivative(_function_mods()[name])


# ---- TRITON training without the torch backward ----------------------------------------------

@pytest.fixture
def no_torch_backward(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the torch row-loop backward ran")
    monkeypatch.setattr(training_module, "torch_backward", refuse)


def _train(mod, leaves, dense_mod, Lq=48, E=16, seed=7):
    q, k, v = (t.requires_grad_() for t in random_qkv(1, H, H, Lq, Lq, E, seed=seed))
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)
        out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    inputs = (q, k, v, *leaves)
    grads = torch.autograd.grad(out, inputs, dout)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = dense_attention(*inputs64[:3], score_mod=dense_mod(*inputs64[3:]))[0]
    ref_grads = torch.autograd.grad(ref, inputs64, dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=1e-4)


def test_triton_trains_a_dot_score_mod_without_the_torch_backward(no_torch_backward):
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(1, H, 48, 4, generator=g).requires_grad_()
    keys = torch.randn(1, 1, 48, 4, generator=g).requires_grad_()

    def rope_dot(s, b, h, q, kv):
        return s + torch.dot(rows[b, h, q], keys[b, 0, kv])

    _train(rope_dot, (rows, keys), lambda r, k: lambda s, b, h, q, kv: s + (r[b, h, q] * k[b, 0, kv]).sum(-1))


def test_triton_trains_reductions_without_the_torch_backward(no_torch_backward):
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(1, H, 48, 3, generator=g).requires_grad_()

    def mod(s, b, h, q, kv):
        return s * 0.5 + rows[b, h, q].amax(-1) - rows[b, h, kv].mean(-1) * s + rows[b, h, kv].norm(dim=-1) * 0.1

    _train(mod, (rows,), lambda r: lambda s, b, h, q, kv: s * 0.5 + r[b, h, q].amax(-1) - r[b, h, kv].mean(-1) * s
           + r[b, h, kv].norm(dim=-1) * 0.1)


@pytest.mark.parametrize("name", ["saved_input", "setup_context"])
def test_triton_trains_a_function_score_mod_without_the_torch_backward(no_torch_backward, name):
    scale = (torch.rand(H, generator=torch.Generator().manual_seed(10)) + 0.5).requires_grad_()
    if name == "saved_input":
        def mod(s, b, h, q, kv):
            return SavedInput.apply(s, scale[h])
        dense = lambda w: lambda s, b, h, q, kv: SavedInput.apply(s, w[h])  # noqa: E731
    else:
        def mod(s, b, h, q, kv):
            return SetupContext.apply(s * scale[h]) + (q - kv) * 0.01
        dense = lambda w: lambda s, b, h, q, kv: SetupContext.apply(s * w[h]) + (q - kv) * 0.01  # noqa: E731
    _train(mod, (scale,), dense)


def test_generated_backward_source_for_vectors_and_functions():
    q, k, v = random_qkv(1, H, H, 32, 32, 16)
    rows = torch.randn(1, H, 32, 2, requires_grad=True)
    for mod in (lambda s, b, h, qi, kv: s + torch.dot(rows[b, h, qi], rows[b, h, kv]),
                lambda s, b, h, qi, kv: SetupContext.apply(s)):
        source = flexc.kernel_source(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"}, backward=True)
        assert "def flex_attention_backward" in source


# ---- what still falls back says so, once ----------------------------------------------------

class UntracedBackward(torch.autograd.Function):
    """A backward with an op flexc's tracer does not have (torch.lgamma)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.lgamma(x.abs() + 2.0)


def test_a_function_whose_backward_cannot_be_traced_warns_once_and_trains_through_torch():
    assert issubclass(flexc.FallbackWarning, UserWarning)

    def mod(s, b, h, q, kv):
        return UntracedBackward.apply(s)

    traced = flexc.trace(mod)
    assert "lgamma" in generated_backward_fallback(traced)
    q, k, v = (t.requires_grad_() for t in random_qkv(1, H, H, 32, 32, 16, seed=11))
    with pytest.warns(flexc.FallbackWarning, match="torch backward") as record:
        out = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"})
    assert len(record) == 1 and "UntracedBackward.backward" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)  # once per mod
        flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"})
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(q64, k64, v64, score_mod=mod)[0]
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), (q64, k64, v64))):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=1e-4)
    source = flexc.kernel_source(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"}, backward=True)
    assert "torch_backward" in source  # says what runs instead of raising


def test_the_torch_backend_does_not_warn():
    def mod(s, b, h, q, kv):
        return UntracedBackward.apply(s) * 2

    q, k, v = (t.requires_grad_() for t in random_qkv(1, H, H, 32, 32, 16, seed=12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexc.FallbackWarning)
        flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TORCH"}).sum().backward()


def test_a_compiled_call_that_falls_back_warns_too():
    def mod(s, b, h, q, kv):
        return UntracedBackward.apply(s) - s * 0.5

    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in random_qkv(1, H, H, 32, 32, 16, seed=13))
    call = torch.compile(lambda q, k, v: flexc.flex_attention(q, k, v, score_mod=mod,
                                                              kernel_options={"BACKEND": "TRITON"}),
                         backend="aot_eager", fullgraph=True)
    with pytest.warns(flexc.FallbackWarning, match="UntracedBackward"):
        grads = torch.autograd.grad(call(q, k, v).sum(), (q, k, v))
    torch._dynamo.reset()
    eager = flexc.flex_attention(q, k, v, score_mod=mod, kernel_options={"BACKEND": "TRITON"})
    for g, e in zip(grads, torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
