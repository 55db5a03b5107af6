"""flexc inside torch.compile: one custom-op node per call, fullgraph, gradients, no recompiles.

Compiled results are compared with flexc's eager path and with the float64 dense reference;
graphs are compiled with the ``aot_eager`` backend (AOT autograd traces the custom ops exactly
as inductor does, without minutes of C++ compilation on a small machine).
"""
import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend

import flexc
from flexc.torch_compile import custom_ops
from flexc.mods.mod_key import mod_key, traced_from_key
from catalogue import mask_catalogue, score_catalogue
from models import Block
from reference import dense_attention

H, D, L = 4, 8, 96


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _document_causal(doc):
    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return flexc.create_block_mask(document_causal, None, None, L, L, BLOCK_SIZE=32)


def _step(model, x, block_mask):
    """Output and the gradients of x and every parameter for a fixed random cotangent."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    out = model(x, block_mask)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * w).sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


def test_transformer_block_fullgraph_matches_eager_without_graph_breaks_or_recompiles():
    torch.manual_seed(0)
    model = Block(flexc.flex_attention, H, D, mlp_ratio=2)
    x = torch.randn(2, L, H * D)
    block_mask = _document_causal(torch.tensor([0] * 40 + [1] * 56))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for got, want in zip(_step(compiled, x, block_mask), _step(model, x, block_mask)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert model.slopes.grad.abs().sum() > 0  # the slopes learn

    # new slope values and new document ids (same shapes): same graph, new results
    with torch.no_grad():
        model.slopes.mul_(1.7)
    block_mask = _document_causal(torch.tensor([0] * 10 + [1] * 30 + [2] * 56))
    for got, want in zip(_step(compiled, x, block_mask), _step(model, x, block_mask)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1

    explained = torch._dynamo.explain(model)(x, block_mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_compiled_gqa_bias_table_lse_against_dense_reference():
    """A captured bias table requiring grad, GQA, return_lse and a head-dependent BlockMask, compiled,
    against autograd through the float64 dense reference."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, Lq, S, E = 2, 4, 2, 40, 56, 8
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    q, k, v = make(B, Hq, Lq, E), make(B, Hkv, S, E), make(B, Hkv, S, E)
    bias = (torch.randn(Hq, S, generator=g, dtype=torch.float64) * 0.5).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5 + bias[h, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 8 + 4 * h) | (kv_idx % 7 == 0)

    bm = flexc.create_block_mask(mask_mod, None, Hq, Lq, S, BLOCK_SIZE=16)

    def f(q, k, v, bm):
        return flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)

    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, bm)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)  # float64 lse for float64 inputs, as eager
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v, bias))
    ref = torch.autograd.grad((ref_out * w).sum() + ref_lse.sum(), (q, k, v, bias))
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b)


def test_compiled_aux_max_scores_and_no_mods():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 33, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        plain = flexc.flex_attention(q, k, v)
        out, aux = flexc.flex_attention(q, k, v, return_aux=flexc.AuxRequest(lse=True, max_scores=True))
        return plain, out, aux.lse, aux.max_scores

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    for a, b in zip(got, f(q, k, v)):
        torch.testing.assert_close(a, b)


def test_custom_ops_pass_opcheck():
    """Schema, fake implementation and autograd registration agree with the real kernels."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, generator=g, requires_grad=True)
    score = flexc.trace(lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx))
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, BLOCK_SIZE=16)
    tables = [getattr(bm, name) for name in custom_ops.TABLE_NAMES]
    mask = flexc.trace(bm.mask_mod)
    args = (q, k, v, tables, [slopes], list(mask.buffers), mod_key(score), mod_key(mask), [16, 16], [32, 32],
            0.3, custom_ops.options_key({"BACKEND": "TORCH"}), False, 0.0, None, None)
    torch.library.opcheck(custom_ops.flex_attention_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[:4]) + ([slopes.detach()],) + args[5:-3]
    for need_lse in (True, False):
        torch.library.opcheck(custom_ops.flex_attention_inference_op, (*plain, need_lse),
                              test_utils=("test_schema", "test_faketensor"))
    doc = torch.tensor([0] * 20 + [1] * 25)
    mask = flexc.trace(lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx))
    torch.library.opcheck(custom_ops.create_block_mask_op,
                          (list(mask.buffers), mod_key(mask), 2, 1, 45, 45, 16, 32, torch.device("cpu")),
                          test_utils=("test_schema", "test_faketensor"))


def test_mod_key_round_trip_over_the_catalogue():
    mods = {**score_catalogue(2, 4, 64, 48), **mask_catalogue(2, 4, 64, 48)}
    for name, mod in mods.items():
        traced = flexc.trace(mod)
        rebuilt = traced_from_key(mod_key(traced), traced.buffers)
        assert rebuilt.root is traced.root and rebuilt.kind == traced.kind, name  # hash-consed: same nodes
        assert rebuilt.buffer_names == traced.buffer_names, name


def test_block_mask_is_a_pytree_node():
    doc = torch.tensor([0] * 40 + [1] * 56)
    bm = _document_causal(doc)
    lazy = bm._q_tables is None
    leaves, spec = pytree.tree_flatten({"mask": bm})
    assert (bm._q_tables is None) == lazy  # flattening does not build q tables still to be derived
    assert sum(isinstance(t, torch.Tensor) for t in leaves) >= 4
    back = pytree.tree_unflatten(leaves, spec)["mask"]
    assert back.mask_mod is bm.mask_mod and back.BLOCK_SIZE == bm.BLOCK_SIZE
    for a, b in zip(back.as_tuple()[2:10], bm.as_tuple()[2:10]):
        assert (a is None and b is None) or torch.equal(a, b)
    moved = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, bm)
    torch.testing.assert_close(moved.to_dense(), bm.to_dense())
    keys = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(bm)[0]]
    assert ".kv_indices" in keys


def test_graph_without_aot_reuses_the_trace_and_reads_new_captured_values():
    """backend="eager" runs the dynamo graph itself, so the bridge runs on every call."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    table = torch.randn(2, 40, generator=g)

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[h, ki])

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
        table.mul_(-2.0)
    assert counter.frame_count == 1


def test_block_mask_created_and_sliced_inside_the_compiled_region():
    doc = torch.tensor([0] * 40 + [1] * 56)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        bm = flexc.create_block_mask(document_causal, 2, None, L, L, BLOCK_SIZE=32)
        first = bm[:1]  # slicing keeps the tables' meaning; the mask_mod is reattached as torch requires
        first.mask_mod = document_causal
        return flexc.flex_attention(q, k, v, block_mask=bm), flexc.flex_attention(q[:1], k[:1], v[:1], block_mask=first), bm

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for _ in range(2):
        *got, bm = compiled(q, k, v)
        *want, eager_bm = f(q, k, v)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        for name in custom_ops.TABLE_NAMES:
            assert torch.equal(getattr(bm, name), getattr(eager_bm, name)), name
        torch.testing.assert_close(bm.to_dense(), eager_bm.to_dense())
        doc[30:50] = 2  # new document ids, same shape: no recompile
    assert counter.frame_count == 1


def test_new_lengths_compile_once_more_with_symbolic_sizes():
    bias = torch.randn(2, generator=torch.Generator().manual_seed(7))

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h] * (qi - ki))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter)
    for n in (32, 48, 64):
        q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n)) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
    assert counter.frame_count == 2  # the second length recompiles with symbolic sizes; the third reuses it


def test_a_block_mask_created_at_symbolic_lengths_specializes_each_length_and_says_so():
    # dynamic=True (or a length dynamo makes dynamic on a recompile, as a compiled model meeting a
    # new sequence length does) hands create_block_mask symbolic lengths; the mask node takes its
    # sizes as constants, so each length gets its own graph, with one warning, in one graph each
    def f(q, k, v):
        n = q.shape[2]
        bm = flexc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, BLOCK_SIZE=16)
        return flexc.flex_attention(q, k, v, block_mask=bm)

    flexc.errors._warned_once.discard("create_block_mask at symbolic sizes")  # (warned once per process)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    with pytest.warns(flexc.FallbackWarning, match="specializes the graph to each call's sizes"):
        for n in (32, 40, 32):
            q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n)) for _ in range(3))
            torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
            frames.append(counter.frame_count)
    assert frames[1] == frames[0] + 1 and frames[2] == frames[1]  # 40 compiles anew; 32 again reuses its graph


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_symbolic_floats_dynamic_true_and_a_changing_scale_train_like_eager(dropout_p):
    """Python floats that dynamo makes symbolic (all of them with dynamic=True, a scale that changes
    between calls otherwise) reach the op as this call's values: outputs and gradients equal the
    eager call's, with the same dropout draw, over new lengths, head dims and scales."""
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(2, generator=g)

    def f(q, k, v, bm, scale):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h] * (qi - ki),
                                    block_mask=bm, scale=scale, dropout_p=dropout_p)

    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="aot_eager", dynamic=dynamic)
        for n, e, scale in ((32, 8, None), (48, 8, 0.3), (40, 16, 0.7)):
            q, k, v = (torch.randn(1, 2, n, e, generator=g, requires_grad=True) for _ in range(3))
            bm = flexc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, BLOCK_SIZE=16)
            results = []
            for fn in (compiled, f):
                torch.manual_seed(3)  # the dropout seed is drawn from the default generator, as eager draws it
                out = fn(q, k, v, bm, scale)
                results.append([out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))])
            for a, b in zip(*results):
                torch.testing.assert_close(a, b)


_TEMPERATURE = 1.0  # a Python float the score_mod below reads as a global


def _tempered(s, b, h, q_idx, kv_idx):
    return s * _TEMPERATURE


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_captured_float_that_changes_between_compiled_calls_trains_like_eager(backend):
    """A float the score_mod reads that changes between calls, which dynamo then passes as a 0-d tensor
    and reads back with ``.item()`` (its float specialisation off), is this call's value: outputs and
    gradients equal the eager call's (the replay once met a SymFloat from that ``item()`` and raised)."""
    global _TEMPERATURE
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=_tempered, kernel_options={"BACKEND": backend})

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for _TEMPERATURE in (1.0, 1.5, 0.5):
        results = []
        for fn in (compiled, f):
            out = fn(q, k, v)
            results.append([out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)


def test_triton_backend_under_compile_trains_like_eager():
    """BACKEND="TRITON" (the generated kernels, here on Triton's CPU interpreter): forward and the
    generated backward through the custom ops equal the eager Triton call."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, generator=g, requires_grad=True)
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, BLOCK_SIZE=16)

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                                    block_mask=bm, kernel_options={"BACKEND": "TRITON"})

    results = []
    for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
        out = fn(q, k, v)
        results.append([out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v, slopes))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_autograd_function_in_a_mod_under_compile():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: _Square.apply(s) * 0.1)

    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))
    traced = flexc.trace(lambda s, b, h, qi, ki: _Square.apply(s))
    assert traced_from_key(mod_key(traced), ()).root is traced.root  # the class travels by import path


def _flexc_ops(graph: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function" and str(n.target).startswith("flexc.")]


def test_calls_without_gradients_compile_to_the_inference_op_and_match_eager():
    """No input requiring grad (or grad mode off): the op without an autograd layer, and the
    logsumexp only when asked for; a training call keeps the differentiable op."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 1, 16, generator=g) for _ in range(3))
    k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(2))
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 300, 300, BLOCK_SIZE=64)
    pos = torch.tensor([250])

    def step(q, k, v, pos, return_lse):
        mask = bm[:, :, pos // 64]
        mask.mask_mod = lambda b, h, q_idx, kv_idx: q_idx + pos[0] >= kv_idx
        mask.seq_lengths = (1, 300)
        return flexc.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=return_lse)

    for return_lse in (False, True):
        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        got, want = compiled(q, k, v, pos, return_lse), step(q, k, v, pos, return_lse)
        torch.testing.assert_close(got, want)
        assert _flexc_ops(backend.fw_graphs[0]) == ["flexc.flex_attention_inference.default"]
    out, lse = got
    dense = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + 250 >= kv_idx)
    torch.testing.assert_close(out.double(), dense[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), dense[1], atol=1e-6, rtol=1e-5)

    trained = q.clone().requires_grad_(True)
    backend = AotEagerAndRecordGraphs()
    torch.compile(step, backend=backend, fullgraph=True)(trained, k, v, pos, False).sum().backward()
    assert _flexc_ops(backend.fw_graphs[0]) == ["flexc.flex_attention.default"]
    reference = q.clone().requires_grad_(True)
    step(reference, k, v, pos, False).sum().backward()
    torch.testing.assert_close(trained.grad, reference.grad)
    with torch.no_grad():
        backend = AotEagerAndRecordGraphs()
        torch.compile(step, backend=backend, fullgraph=True)(trained, k, v, pos, False)
        assert _flexc_ops(backend.fw_graphs[0]) == ["flexc.flex_attention_inference.default"]



# [B, H, L, E] queries viewed from memory laid out other ways
_QUERY_LAYOUTS = {
    "contiguous": lambda g: torch.randn(2, 2, 24, 8, generator=g),
    "bshd": lambda g: torch.randn(2, 24, 2, 8, generator=g).transpose(1, 2),
    "channels_last": lambda g: torch.randn(2, 2, 24, 8, generator=g).to(memory_format=torch.channels_last),
    "lbhd": lambda g: torch.randn(24, 2, 2, 8, generator=g).permute(1, 2, 0, 3),
    "strided_rows": lambda g: torch.randn(2, 2, 48, 8, generator=g)[:, :, ::2],
}


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_compiled_outputs_and_gradients_are_strided_as_in_eager_for_every_query_layout(backend, grad):
    """The custom ops return what an eager call does (the query's dimension order, the head dim
    innermost, as torch's _permute_strides), and their fake implementations say so: with
    channels_last queries BACKEND="TRITON" returned (1280, 1, 32, 2)-like strides eagerly and
    contiguous ones compiled."""
    from torch._higher_order_ops.flex_attention import _permute_strides

    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 24, 24, BLOCK_SIZE=16)

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options={"BACKEND": backend})

    for name, make in _QUERY_LAYOUTS.items():
        g = torch.Generator().manual_seed(len(name))
        q = make(g).requires_grad_(grad)
        # key and value laid out like the query; the value's head dim as the query's, where the
        # output's shape is the query's (a wider one: the fake-strides test below)
        k, v = make(g).requires_grad_(grad), make(g).requires_grad_(grad)
        torch._dynamo.reset()
        results = []
        for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
            out, lse = fn(q, k, v)
            grads = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v)) if grad else ()
            results.append((out, lse, *grads))
        for compiled, eager in zip(*results):
            assert compiled.stride() == eager.stride(), name
            torch.testing.assert_close(compiled, eager)
        out, lse = results[1][:2]
        assert out.stride() == _permute_strides(torch.empty(out.shape), q.stride()).stride(), name
        assert lse.is_contiguous()
        for grad_, t in zip(results[1][2:], (q, k, v)):
            assert grad_.stride() == _permute_strides(torch.empty(t.shape), t.stride()).stride(), name


def test_custom_ops_fake_strides_equal_the_real_ones_for_permuted_inputs():
    """Each op's fake implementation promises the strides its real one returns (AOT autograd
    plans the graph around the fake ones)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 32, 8, generator=g).to(memory_format=torch.channels_last)
    k = torch.randn(1, 32, 2, 8, generator=g).transpose(1, 2)
    v = torch.randn(32, 1, 2, 16, generator=g).permute(1, 2, 0, 3)
    slopes = torch.rand(2, generator=g, requires_grad=True)
    score = flexc.trace(lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx))
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, BLOCK_SIZE=16)
    tables = [getattr(bm, name) for name in custom_ops.TABLE_NAMES]
    mask = flexc.trace(bm.mask_mod)
    for backend in ("TORCH", "TRITON"):
        common = (tables, [slopes.detach()], list(mask.buffers), mod_key(score), mod_key(mask), [16, 16], [32, 32],
                  0.3, custom_ops.options_key({"BACKEND": backend}))
        # the training op's outputs: the logsumexp and the statistics the generated backward reads
        out, lse, _, stats = custom_ops.flex_attention_op(q, k, v, *common, False, 0.0, None, None)
        grad_out = torch.randn(out.shape, generator=g)
        backward = (q, k, v, out, lse, stats, grad_out, None, *common, [0])
        real = [*custom_ops.flex_attention_inference_op(q, k, v, *common, False, True)[:2],
                *pytree.tree_leaves(custom_ops.flex_attention_backward_op(*backward))]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (q, k, v, common, backward))
            fq, fk, fv, fcommon, fbackward = fake_args
            fake = [*custom_ops.flex_attention_inference_op(fq, fk, fv, *fcommon, False, True)[:2],
                    *pytree.tree_leaves(custom_ops.flex_attention_backward_op(*fbackward))]
        assert [t.stride() for t in fake] == [t.stride() for t in real], backend
        assert real[0].stride() == (1024, 16, 32, 1)  # [B, H, L, 16] in the query's (B, L, H) order, head dim innermost


def test_a_score_mod_returning_the_score_unchanged_compiles_as_the_call_without_one(monkeypatch):
    # the op's forward and backward rebuild the mods from their keys: an identity score_mod is
    # dropped there as in eager calls (the causal mode's kernel runs), with the same gradients
    from flexc.backends.cpu import causal_call
    seen = []
    for name in ("forward", "forward_folded"):  # (forward_folded: a plan's prepared call of plain causal attention)
        monkeypatch.setattr(causal_call, name, lambda *a, _real=getattr(causal_call, name): seen.append(1) or _real(*a))
    q, k, v = (torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(13), requires_grad=True)
               for _ in range(3))
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64, BLOCK_SIZE=32)
    compiled = torch.compile(lambda q, k, v: flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s,
                                                                  block_mask=bm), backend="aot_eager")
    out = compiled(q, k, v)
    assert seen
    ref = flexc.flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_a_compiled_training_step_decides_the_causal_mode_once_not_every_backward(monkeypatch):
    # the op's backward receives autograd-saved aliases of the tables, new objects every step: the
    # decision remembered for the tables' data serves them (flexc.backends.versioned_memo)
    from flexc.backends.cpu import causal_call
    decided = []
    monkeypatch.setattr(causal_call, "_find_starts", lambda *a, _real=causal_call._find_starts: decided.append(1) or _real(*a))
    q = torch.randn(2, 2, 64, 8, generator=torch.Generator().manual_seed(14), requires_grad=True)
    padding = torch.ones(2, 64, dtype=torch.bool)
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & padding[b, kv_idx], 2, None, 64, 64,
                                 BLOCK_SIZE=32)
    compiled = torch.compile(lambda q: flexc.flex_attention(q, q, q, block_mask=bm), backend="aot_eager")
    for _ in range(3):
        (g,) = torch.autograd.grad(compiled(q).sum(), (q,))
    assert len(decided) == 1
    (ref,) = torch.autograd.grad(flexc.flex_attention(q, q, q, block_mask=bm).sum(), (q,))
    torch.testing.assert_close(g, ref)


def test_a_mod_dynamo_cannot_trace_runs_its_calls_eagerly_with_a_warning():
    # a graph break in a mod: dynamo hands the calls back to run eagerly (not fullgraph), which used to
    # crash reading the plan of a subgraph that never was ('function' object has no attribute 'graph')
    bias = torch.randn(2, generator=torch.Generator().manual_seed(15)).requires_grad_()

    def alibi(score, b, h, q_idx, kv_idx):
        torch._dynamo.graph_break()
        return score + bias[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        torch._dynamo.graph_break()
        return q_idx >= kv_idx

    def f(q, k, v):
        bm = flexc.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        return flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)

    q, k, v = (torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(16), requires_grad=True)
               for _ in range(3))
    flexc.errors._warned_once.discard("compiled call runs eagerly")  # (warned once per process)
    with pytest.warns(flexc.FallbackWarning, match="runs eagerly, outside the compiled graph"):
        out = torch.compile(f, backend="aot_eager")(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v, bias)), torch.autograd.grad(want.sum(), (q, k, v, bias))):
        torch.testing.assert_close(a, b)


def test_a_function_in_a_mod_compiles_where_no_gradient_flows_through_the_score():
    # the score requires grad only where the query's or key's gradient flows through it (it is derived
    # from them: dynamo 2.11 refuses requires_grad_() in a subgraph); elsewhere dynamo inlines the
    # Function's forward, whose backward no gradient needs
    from catalogue import ScaledGrad

    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    v.requires_grad_()  # dV does not pass through the score

    def f(q, k, v):
        return flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: ScaledGrad.apply(s) * 0.5)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), v)[0], torch.autograd.grad(want.sum(), v)[0])
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_compiled_calls_run_their_signatures_plan_and_follow_edited_tables_and_captured_tensors(backend, monkeypatch):
    """The custom ops plan once per signature (flexc.torch_compile.op_plans): repeated compiled calls
    make one forward plan, and a table edited in place or a captured tensor's new values between
    calls still give float64 dense attention (the plan keeps no tensor of a call)."""
    from flexc.torch_compile import op_plans

    made = []
    real = op_plans.OpPlan.__init__

    def counting(self, *args, **kwargs):
        made.append(kwargs.get("forward", args[10] if len(args) > 10 else True))
        real(self, *args, **kwargs)
    monkeypatch.setattr(op_plans.OpPlan, "__init__", counting)
    op_plans.clear()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    bias = torch.randn(2, generator=g)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def per_head(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    bm = flexc.create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=16)
    attend = torch.compile(lambda q, k, v, bm: flexc.flex_attention(q, k, v, score_mod=per_head, block_mask=bm,
                                                                    kernel_options={"BACKEND": backend}),
                           backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            out = attend(q, k, v, bm)
        assert made == [True]
        torch.testing.assert_close(out.double(), dense_attention(q, k, v, per_head, causal)[0], atol=2e-5, rtol=0)
        bias.mul_(-2)  # new captured values: the same plan reads them
        bm.full_kv_indices[0, 0, 3, 0] = -1  # the last row's first full block: never visited (a new plan)
        keep = torch.ones(64, 64, dtype=torch.bool)
        keep[48:, :16] = False
        out = attend(q, k, v, bm)
        want = dense_attention(q, k, v, per_head, lambda b, h, q_idx, kv_idx: causal(b, h, q_idx, kv_idx)
                               & keep[q_idx, kv_idx])[0]
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
        assert made == [True, True]
