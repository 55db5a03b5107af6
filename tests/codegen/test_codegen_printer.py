"""The IR -> Triton printer keeps torch's semantics for every IR op.

Each mod is printed by :func:`flexc.codegen.render_mod`, wrapped in a small grid kernel that
evaluates it at every ``(b, h, q_idx, kv_idx)``, and run through Triton's CPU interpreter. The
reference is :func:`flexc.evaluate` on int32 index grids (the kernel's index type), i.e. the torch
ops the user wrote. The every-op test checks each IR op three ways at once against torch itself:
its evaluation, its printed Triton and its derivative rule.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from flexc import trace
from flexc.backends.triton.cache import import_source
from flexc.codegen import render_mod
from flexc.codegen.triton_helpers import HELPERS
from flexc.mods import ir
from flexc.mods.evaluate import evaluate, index_grid
from flexc.mods.trace import SCORE_MOD, TracedMod

# log2(0) and friends are part of what is compared (torch gives the same inf/NaN)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from printer_mods import B, H, L, S, MASK_MODS, OP_CASES, SCORE_MODS  # noqa: E402  (the mods and the grid they are sized for)
from derivative_check import check_derivative  # noqa: E402
from strategies import PRINTER_EXPRESSIONS, compile_mod, examples, score_source  # noqa: E402

_GRID_KERNEL = '''
@triton.jit
def evaluate_grid(out_ptr, score_ptr, {params}B, H, L, S, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
{hoisted}    rows = tl.arange(0, BLOCK_L)[:, None]
    cols = tl.arange(0, BLOCK_S)[None, :]
    inside = (rows < L) & (cols < S)
    q_idx = tl.minimum(rows, L - 1)
    kv_idx = tl.minimum(cols, S - 1)
    offsets = bh * L * S + rows * S + cols
    score = tl.load(score_ptr + offsets, mask=inside, other=0.0)
    result = {call}
    result = tl.full((BLOCK_L, BLOCK_S), 0, {out_dtype}) + result.to({out_dtype})
    tl.store(out_ptr + offsets, result, mask=inside)
'''


def run_in_triton(traced: TracedMod, score: torch.Tensor, float_indices: bool = False,
                  hoist: bool = False) -> torch.Tensor:
    """The mod's value at every grid position, computed by its printed Triton function (``hoist``:
    its lookups by b and h computed once per program, as the kernels do)."""
    rendered = render_mod(traced, traced.kind, float_indices=float_indices, hoist=hoist)
    kind = traced.root.kind
    out_dtype, torch_out = {"bool": ("tl.int8", torch.int8), "int": ("tl.int64", torch.int64),
                            "float": ("tl.float64", torch.float64)}[kind]
    if rendered.is_constant:
        return torch.full((B, H, L, S), rendered.literal, dtype=torch_out)
    args = (["score"] if traced.kind == SCORE_MOD else []) + ["b", "h", "q_idx", "kv_idx"]
    args += rendered.call_args
    params = "".join(f"{p.name}, " for p in rendered.params)
    hoisted = "".join(f"    {name} = {text}\n" for name, text in rendered.hoisted)
    source = "\n".join(["import triton", "import triton.language as tl", ""]
                       + [HELPERS[h] for h in sorted(rendered.helpers)] + [rendered.source]
                       + [_GRID_KERNEL.format(params=params, hoisted=hoisted, call=f"{traced.kind}({', '.join(args)})",
                                              out_dtype=out_dtype)])
    module, _ = import_source(source, "interpreter")
    buffer_args = []
    for p in rendered.params:
        t = traced.buffers[p.slot]
        buffer_args.append(t.view(torch.uint8) if p.what == "ptr" and t.dtype == torch.bool else
                           t if p.what == "ptr" else t.stride(p.dim) if p.what == "stride" else t.shape[p.dim])
    out = torch.empty((B, H, L, S), dtype=torch_out)
    module.evaluate_grid[(B * H,)](out, score.contiguous(), *buffer_args, B, H, L, S, BLOCK_L=16, BLOCK_S=16)
    return out


def reference(traced: TracedMod, score: torch.Tensor) -> torch.Tensor:
    grid = index_grid(B, H, L, S, dtype=torch.int32)
    if traced.kind == SCORE_MOD:
        grid["score"] = score
    return evaluate(traced, **grid).expand(B, H, L, S)


def assert_same(traced: TracedMod, score: torch.Tensor | None = None, float_indices: bool = False,
                hoist: bool = False) -> None:
    if score is None:
        score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(0)) * 3
    got, want = run_in_triton(traced, score, float_indices, hoist), reference(traced, score)
    if traced.root.kind == "bool":
        assert torch.equal(got.bool(), want.bool()), f"{traced}: mismatch at {(got.bool() != want.bool()).nonzero()[:5].tolist()}"
    else:
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-5, atol=2e-5, equal_nan=True,
                                   msg=lambda m: f"{traced}: {m}")


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_printed_like_torch(name):
    assert_same(trace(SCORE_MODS[name]))


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_printed_like_torch(name):
    assert_same(trace(MASK_MODS[name]))


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_with_float_indices_printed_like_torch(name):
    # the kernels' choice for extents below 2**23: index differences read as floats print in float
    assert_same(trace(SCORE_MODS[name]), float_indices=True)


# (hoisting moves lookups only: a mod that captures no tensor prints the same with it)
_LOOKING_UP = lambda mods: sorted(name for name, mod in mods.items() if trace(mod).buffers)


@pytest.mark.parametrize("name", _LOOKING_UP(SCORE_MODS))
def test_score_mod_with_hoisted_lookups_printed_like_torch(name):
    # the kernels' choice: lookups indexed only by b, h and literals are values computed per program
    assert_same(trace(SCORE_MODS[name]), float_indices=True, hoist=True)


@pytest.mark.parametrize("name", _LOOKING_UP(MASK_MODS))
def test_mask_mod_with_hoisted_lookups_printed_like_torch(name):
    assert_same(trace(MASK_MODS[name]), hoist=True)


def test_lookups_by_batch_and_head_only_become_parameters():
    slopes, bias, idx, table = torch.rand(H), torch.rand(B, H), torch.arange(H) % 2, torch.rand(2, S)

    def mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) + bias[b, h] + bias[0, h] + table[idx[h], kv_idx]

    rendered = render_mod(trace(mod), "score_mod", float_indices=True, hoist=True)
    assert dict(rendered.hoisted) == {
        "slopes_at_h": "tl.load(slopes_ptr + h * slopes_stride_0)",
        "bias_at_b_h": "tl.load(bias_ptr + b * bias_stride_0 + h * bias_stride_1)",
        "bias_at_0_h": "tl.load(bias_ptr + h * bias_stride_1)",
        "idx_at_h": "tl.load(idx_ptr + h * idx_stride_0)",
    }
    # the function takes the values, then what its body still reads (the lookup by kv_idx)
    assert rendered.call_args == ("slopes_at_h", "bias_at_b_h", "bias_at_0_h", "idx_at_h",
                                  "table_ptr", "table_stride_0", "table_stride_1", "table_size_0")
    assert "tl.load(table_ptr + wrap_index(idx_at_h, table_size_0) * table_stride_0" in rendered.source
    assert "slopes_ptr" not in rendered.source and "bias_ptr" not in rendered.source
    # the kernel's parameters are still every pointer and stride both read
    assert {p.name for p in rendered.params} >= {"slopes_ptr", "bias_ptr", "idx_ptr", "table_ptr"}
    unhoisted = render_mod(trace(mod), "score_mod", float_indices=True)
    assert unhoisted.hoisted == () and unhoisted.call_args == tuple(p.name for p in unhoisted.params)
    assert_same(trace(mod), float_indices=True, hoist=True)


def test_index_differences_read_as_floats_print_in_float():
    slopes = torch.rand(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def doubled(score, b, h, q_idx, kv_idx):  # the difference is read by an integer product: stays int
        return score + (q_idx - kv_idx) * 2

    printed = render_mod(trace(alibi), "score_mod", float_indices=True).source
    assert "(biased_float(kv_idx) - biased_float(q_idx))" in printed
    assert "(kv_idx - q_idx)" in render_mod(trace(alibi), "score_mod").source  # extents unknown: int
    assert "q_idx - kv_idx" in render_mod(trace(doubled), "score_mod", float_indices=True).source
    assert_same(trace(alibi), float_indices=True)


def test_biased_float_is_exact_over_the_float_index_range():
    # the kernels' float index differences: 2**23 + i from the bits, exact for every index below 2**23
    source = "\n".join(["import triton", "import triton.language as tl", "", HELPERS["biased_float"], "",
                        "@triton.jit",
                        "def kernel(i_ptr, j_ptr, out_ptr, N: tl.constexpr):",
                        "    offs = tl.arange(0, N)",
                        "    i = tl.load(i_ptr + offs)",
                        "    j = tl.load(j_ptr + offs)",
                        "    tl.store(out_ptr + offs, biased_float(i) - biased_float(j))", ""])
    module, _ = import_source(source, "interpreter")
    top = 2 ** 23 - 1
    i = torch.tensor([0, 1, 5, top, top, 0, top - 1, 4096, 1 << 22, 7, 0, top, 3, 2 ** 20, 9, 12], dtype=torch.int32)
    j = torch.tensor([0, 0, 9, 0, top, top, top, 4095, (1 << 22) + 1, 7, 1, 1, 3, 2 ** 20 + 5, 2, 0], dtype=torch.int32)
    out = torch.empty(16, dtype=torch.float32)
    module.kernel[(1,)](i, j, out, N=16)
    assert torch.equal(out.double(), (i - j).double())
    i64 = i.to(torch.int64)  # indices widened to int64 for the mods' integer arithmetic
    module.kernel[(1,)](i64, j.to(torch.int64), out, N=16)
    assert torch.equal(out.double(), (i - j).double())


def test_printed_function_names_its_captured_tensor_parameters():
    rendered = render_mod(trace(SCORE_MODS["captured_1d_negative_index"]), "score_mod")
    names = [p.name for p in rendered.params]
    assert names == ["table_ptr", "table_stride_0", "table_size_0"]
    assert "# score_mod: score + table[q_idx - kv_idx]" in rendered.source
    assert "wrap_index(q_idx - kv_idx, table_size_0)" in rendered.source


def test_direct_index_inputs_are_not_wrapped():
    rendered = render_mod(trace(SCORE_MODS["captured_3d_float64"]), "score_mod")
    assert "wrap_index" not in rendered.source
    assert [p.what for p in rendered.params] == ["ptr", "stride", "stride", "stride"]


def test_constant_subexpressions_fold_to_literals():
    rendered = render_mod(trace(lambda score, b, h, q, kv: score * (2.0 ** 3 + math.log(4.0))), "score_mod")
    assert "score * " in rendered.source and "**" not in rendered.source and "tl.exp2" not in rendered.source


def test_shared_subexpressions_are_computed_once():
    rendered = render_mod(trace(SCORE_MODS["shared_subexpression"]), "score_mod")
    body = rendered.source.split("\n", 3)[3]  # after the decorator, signature and comment
    assert body.count("q_idx - kv_idx") == 1 and body.count("t0") == 4


# ---- property test: random expressions -----------------------------------------------------

def _as_score_mod(body: str) -> TracedMod:
    """The traced score_mod returning ``body`` (source text of strategies.PRINTER_EXPRESSIONS)."""
    return trace(compile_mod(score_source(body)))


@examples(30, slow=True)
@given(PRINTER_EXPRESSIONS.expressions("float"))
def test_random_score_expressions_print_like_torch(body):
    assert_same(_as_score_mod(body))


@examples(30, slow=True)
@given(PRINTER_EXPRESSIONS.expressions("int"))
def test_random_integer_expressions_print_like_torch(body):
    # integer results are checked through a score_mod that returns them as floats
    assert_same(_as_score_mod(f"as_tensor({body}).double()"))


# ---- every IR op: evaluation, printer and derivative against torch --------------------------

EVERY_OP = set(ir.UNARY_OPS) | ir.BINARY_OPS | {"where", "cast"}  # the ops a traced graph's arithmetic uses

_EVERY_OP_KERNEL = '''
@triton.jit
def every_op(out_ptr, score_ptr, B, H, L, S, BLOCK: tl.constexpr):
    # one program over the whole grid: the interpreter's cost is per operation, whatever its width
    offsets = tl.arange(0, BLOCK)
    inside = offsets < B * H * L * S
    b = offsets // (H * L * S)
    h = offsets // (L * S) % H
    q_idx = offsets // S % L
    kv_idx = offsets % S
    score = tl.load(score_ptr + offsets, mask=inside, other=0.0)
{calls}'''
_EVERY_OP_CALL = """\
    result = case_{k}(score, b, h, q_idx, kv_idx)
    result = tl.full((BLOCK,), 0, tl.float64) + result.to(tl.float64)
    tl.store(out_ptr + {k} * B * H * L * S + offsets, result, mask=inside)
"""


def _printed_every_op(traced: list[TracedMod], score: torch.Tensor) -> torch.Tensor:
    """``[case, B, H, L, S]``: every case's printed function at every grid position, all in one
    kernel launch."""
    rendered = [render_mod(t, f"case_{k}") for k, t in enumerate(traced)]
    assert not any(r.is_constant or r.params for r in rendered)
    helpers = sorted(set().union(*(r.helpers for r in rendered)))
    source = "\n".join(["import triton", "import triton.language as tl", ""] + [HELPERS[h] for h in helpers]
                       + [r.source for r in rendered]
                       + [_EVERY_OP_KERNEL.format(calls="".join(_EVERY_OP_CALL.format(k=k) for k in range(len(traced))))])
    module, _ = import_source(source, "interpreter")
    out = torch.empty((len(traced), B, H, L, S), dtype=torch.float64)
    module.every_op[(1,)](out, score.contiguous(), B, H, L, S, BLOCK=1 << (B * H * L * S - 1).bit_length())
    return out


def test_every_ir_op_has_a_case_that_uses_it():
    assert {op for op, _, _ in OP_CASES} == EVERY_OP
    for op, kind, fn in OP_CASES:
        assert any(n.op == op and n.kind == kind for n in trace(fn).root.walk()), (op, kind, str(trace(fn)))


def test_every_ir_op_evaluates_prints_and_differentiates_like_torch():
    """For each op: flexc.evaluate, the printed Triton (interpreter) and the derivative IR (float64,
    against torch.autograd) agree with torch calling the mod directly on the same inputs. An op
    missing from evaluate, the printer or the derivative rules fails here."""
    score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(0)) * 3
    grid = index_grid(B, H, L, S)
    traced = [trace(fn) for _, _, fn in OP_CASES]
    printed = _printed_every_op(traced, score)
    for k, (op, kind, fn) in enumerate(OP_CASES):
        want = torch.broadcast_to(fn(score, *grid.values()), (B, H, L, S)).double()
        close = dict(equal_nan=True, msg=lambda m: f"{op} ({kind}), {traced[k]}: {m}")
        torch.testing.assert_close(evaluate(traced[k], score=score, **grid).expand(B, H, L, S).double(), want,
                                   rtol=1e-6, atol=1e-6, **close)
        torch.testing.assert_close(printed[k], want, rtol=2e-5, atol=2e-5, **close)
        check_derivative(fn)
