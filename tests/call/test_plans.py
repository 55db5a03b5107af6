"""One plan per call signature (flexc.call.plans): a warm call reuses the plan its signature names,
and whatever a plan decided from (tables, captured tensors, layouts, grad mode) makes a new plan when
it changes, so every call still equals float64 dense attention."""
from __future__ import annotations

import pytest
import torch

import flexc
from flexc import device as gpu
from flexc import errors
from flexc.call import plans
from flexc.call.signature import call_signature
from reference import decoding_slice, dense_attention, random_qkv

B, H, L, E = 1, 2, 64, 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def counted(monkeypatch):
    """How many plans calls made (each a cold call of its signature)."""
    made = []
    real = plans.Plan.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        real(self, *args, **kwargs)
    monkeypatch.setattr(plans.Plan, "__init__", counting)
    plans.clear()
    return made


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_warm_call_runs_its_signatures_plan_and_a_new_layout_makes_another(backend, counted):
    q, k, v = random_qkv(B, H, H, L, L, E, dtype=torch.float32)
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    options = {"BACKEND": backend}
    for _ in range(3):
        out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options=options)
    assert len(counted) == 1
    _close(out, dense_attention(q, k, v, mask_mod=causal)[0], "warm call")
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides: another plan
    _close(flexc.flex_attention(qt, k, v, block_mask=bm, kernel_options=options), dense_attention(q, k, v, mask_mod=causal)[0],
           "other strides")
    assert len(counted) == 2
    q2 = torch.randn_like(q)  # new values, the same layout: the same plan
    _close(flexc.flex_attention(q2, k, v, block_mask=bm, kernel_options=options),
           dense_attention(q2, k, v, mask_mod=causal)[0], "new values")
    assert len(counted) == 2


def _listed(bm) -> torch.Tensor:
    """``[L, L]``: the pairs whose block ``bm``'s tables list (partial or full, negative entries never)."""
    allowed = torch.zeros(L // 16, L // 16, dtype=torch.bool)
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        for row in range(L // 16):
            for col in idx[0, 0, row, :int(num[0, 0, row])].tolist():
                if col >= 0:
                    allowed[row, col] = True
    return allowed.repeat_interleave(16, 0).repeat_interleave(16, 1)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_table_edited_in_place_or_swapped_makes_a_new_plan(backend, counted):
    """An empty entry (-1, a block never visited) written into a table, in place and then by a
    ``.data`` swap: each call follows the tables it is given (a stale plan would visit block -1)."""
    q, k, v = random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=1)
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    options = {"BACKEND": backend}
    flexc.flex_attention(q, k, v, block_mask=bm, kernel_options=options)
    bm.full_kv_indices[0, 0, 3, 0] = -1  # the last row's first full block: never visited
    listed = _listed(bm)
    want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & listed[q_idx, kv_idx])[0]
    _close(flexc.flex_attention(q, k, v, block_mask=bm, kernel_options=options), want, "a table edited in place")
    fresh = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    fresh.full_kv_indices[0, 0, 2, 1] = -1
    listed = _listed(fresh)
    bm.full_kv_indices.data = fresh.full_kv_indices.clone()
    want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & listed[q_idx, kv_idx])[0]
    _close(flexc.flex_attention(q, k, v, block_mask=bm, kernel_options=options), want, "a table swapped by .data")
    assert len(counted) == 3


@pytest.mark.parametrize("rows", [L, 1], ids=["forward", "decode"])
def test_a_captured_tensor_swapped_by_data_or_edited_is_read_at_each_call(rows, counted):
    """The captured tensor edited in place or swapped by ``.data`` between warm calls: each call reads it as
    it is then (the decode launch keeps the plan's captured tensors as its arguments: the same objects)."""
    q, k, v = random_qkv(B, H, H, rows, L, E, dtype=torch.float32, seed=2)
    bias = torch.randn(H)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    for step in range(4):
        if step == 2:
            bias.mul_(3)
        elif step == 3:
            bias.data = torch.randn(H)
        got = flexc.flex_attention(q, k, v, score_mod=per_head, kernel_options={"BACKEND": "TRITON"})
        _close(got, dense_attention(q, k, v, score_mod=per_head)[0], f"step {step}")


def test_a_lookup_checked_against_captured_values_is_checked_at_every_call(counted):
    """A mod indexing one captured tensor with another's values: the bounds depend on the values,
    so a warm call with an out-of-range index raises as the first call would."""
    q, k, v = random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=3)
    doc = torch.zeros(L, dtype=torch.int64)
    bias = torch.randn(4)

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + bias[doc[kv_idx]]
    flexc.flex_attention(q, k, v, score_mod=doc_bias)
    doc[5] = 9
    with pytest.raises(IndexError, match="bias"):
        flexc.flex_attention(q, k, v, score_mod=doc_bias)
    assert len(counted) == 1


def test_decoding_slices_share_a_plan_and_each_step_reads_its_own_row(counted):
    """gpt-fast's step: a new slice of the same mask and a new closure over the position every
    step. One plan per query-block row layout; each step equals dense attention at its position."""
    S = 128
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, H, S, E, generator=g), torch.randn(1, H, S, E, generator=g)
    parent = flexc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=32)
    position = torch.tensor([0])
    with gpu.simulate("sm_90"), torch.no_grad():
        for pos in (40, 41, 70, 100):
            mask = decoding_slice(parent, position, pos, causal, S)
            q = torch.randn(1, H, 1, E, generator=g)
            got = flexc.flex_attention(q, k, v, block_mask=mask)
            want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= pos)[0]
            _close(got, want, f"position {pos}")
    assert len(counted) == 1


def test_training_steps_share_a_plan_and_their_gradients_equal_dense(counted):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float64, seed=5))
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    grads = None
    for _ in range(2):
        out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": "TRITON"})
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(dense_attention(q, k, v, mask_mod=causal)[0].sum(), (q, k, v))
    for g, w, name in zip(grads, want, "qkv"):
        _close(g, w, f"d{name}")
    assert len(counted) == 1
    with torch.no_grad():  # grad mode is part of the signature
        flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": "TRITON"})
    assert len(counted) == 2


def test_a_cpu_training_plan_outlives_query_table_edits_that_only_a_triton_backward_reads(counted):
    """A plain CPU call with default options trains on TORCH, whose backward reads no query-direction
    table: writing one in place keeps the plan (its gradients still dense's), while the signature of a
    call that may take Triton's backward (kernel_options, a simulated GPU) still changes with it."""
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float64, seed=6))
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    want = torch.autograd.grad(dense_attention(q, k, v, mask_mod=causal)[0].sum(), (q, k, v))

    def signatures():
        arguments = dict(score_mod=None, block_mask=bm, scale=None, enable_gqa=False, return_lse=False,
                         return_aux=None, dropout=None, sinks=None)
        with gpu.simulate("sm_90"):
            simulated = call_signature(q, k, v, kernel_options=None, **arguments)[0]
        return (call_signature(q, k, v, kernel_options=None, **arguments)[0],
                call_signature(q, k, v, kernel_options={"BACKEND": "TRITON"}, **arguments)[0], simulated)

    for step in range(2):
        if step:
            before = signatures()
            bm.q_indices.add_(0)  # an in-place write: the table's state changes
            after = signatures()
            assert before[0] == after[0], "a CPU call's signature keys no query-direction table"
            assert before[1] != after[1] and before[2] != after[2], "a Triton-capable call's signature keys them"
        grads = torch.autograd.grad(flexc.flex_attention(q, k, v, block_mask=bm).sum(), (q, k, v))
        for g, w, name in zip(grads, want, "qkv"):
            _close(g, w, f"step {step}: d{name}")
    assert len(counted) == 1


@pytest.mark.parametrize("precise", [True, False])
def test_a_training_plans_backward_takes_each_calls_gradient_layouts(precise, counted):
    """A kept backward launch keeps its argument lists per gradient layout: a stride-0 dO, a
    transposed dO and a logsumexp gradient in turn, on one plan, each give the dense gradients."""
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=6))
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    options = {"BACKEND": "TRITON", "PRECISE_GRADIENTS": precise}
    weight = torch.randn(B, H, E, L, dtype=torch.float32).transpose(-1, -2)  # a dO laid out [B, H, E, L]
    losses = [lambda out, lse: out.sum(), lambda out, lse: (out * weight).sum(),
              lambda out, lse: (out * weight).sum() + (lse * lse).sum()]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_d, lse_d, _ = dense_attention(qd, kd, vd, mask_mod=causal)
    for loss in losses:
        out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=options)
        grads = torch.autograd.grad(loss(out, lse), (q, k, v))
        want = torch.autograd.grad(loss(out_d, lse_d), (qd, kd, vd), retain_graph=True)
        for g, w, name in zip(grads, want, "qkv"):
            torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")
    assert len(counted) == 1


def test_a_kept_training_plan_keeps_no_output_or_gradient_of_its_calls(counted):
    """What a training plan keeps for later calls (argument tails, grids, constexprs) holds no tensor
    of a call: the output and the gradient fed to the backward are freed once the caller drops them."""
    import gc
    import weakref
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=7))
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    options = {"BACKEND": "TRITON", "PRECISE_GRADIENTS": False}  # (the prologue path)
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options=options)
    grad_out = torch.randn(out.shape)
    torch.autograd.grad(out, (q, k, v), grad_out)
    dropped = [weakref.ref(out), weakref.ref(grad_out)]
    del out, grad_out
    gc.collect()
    assert [ref() for ref in dropped] == [None, None]
    assert len(counted) == 1


def test_tables_without_write_counts_are_planned_at_every_call(counted):
    """Tables made under inference mode have no version counter: an in-place edit cannot be seen,
    so no plan is kept for them (each call decides again, and follows the edit), and flexc says so once."""
    q, k, v = random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=6)
    with torch.inference_mode():
        bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    errors._warned_once.discard("plans of tables without write counts")  # (said once per process)
    with pytest.warns(flexc.FallbackWarning, match="planned from scratch every time"):
        flexc.flex_attention(q, k, v, block_mask=bm)
    flexc.flex_attention(q, k, v, block_mask=bm)
    assert len(counted) == 2


@pytest.mark.parametrize("backend,simulated", [("TORCH", False), ("TRITON", False), ("TRITON", True)])
def test_a_kept_plan_keeps_no_table_of_a_mask_the_caller_dropped(backend, simulated, counted):
    """A training loop's new mask every step must not pile up in kept plans: once the caller drops a
    BlockMask its tables are freed (the plan holds their states weakly; on a GPU, where the tables are
    compacted on the device, the compacted copy goes with them), and a new mask gets a new plan."""
    import contextlib
    import gc
    import weakref

    with gpu.simulate("sm_90") if simulated else contextlib.nullcontext():
        _drop_a_mask_and_plan_another(backend, counted, gc, weakref)


def _drop_a_mask_and_plan_another(backend, counted, gc, weakref):
    q, k, v = (t.requires_grad_() for t in random_qkv(B, H, H, L, L, E, dtype=torch.float32, seed=7))
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    out = flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend})
    out.sum().backward()
    from flexc.masks.empty_entries import without_empty_entries

    compacted = without_empty_entries(bm)  # (on a GPU: a copy compacted on the device, kept with the mask)
    tables = [weakref.ref(t) for m in {id(bm): bm, id(compacted): compacted}.values()
              for t in (m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices)]
    del bm, out, compacted
    gc.collect()
    assert all(ref() is None for ref in tables)
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 20)  # noqa: E731
    bm = flexc.create_block_mask(window, None, None, L, L, BLOCK_SIZE=16)
    _close(flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend}),
           dense_attention(q, k, v, mask_mod=window)[0], "a new mask after the first was freed")
    assert len(counted) == 2


def test_alternating_signatures_each_run_their_own_plan_and_odd_option_values_are_not_keyed(counted):
    """The store compares the last plan's signature first: calls alternating between two signatures
    (scale, options) still run each its own plan, and an option value of no plain type (a tensor, which
    ``==`` would compare by value) is planned at each call, never matched to another's plan."""
    q, k, v = random_qkv(B, H, H, L, L, E, dtype=torch.float32)
    bm = flexc.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    for _ in range(2):
        for scale in (0.25, 0.5, 0.25):
            _close(flexc.flex_attention(q, k, v, block_mask=bm, scale=scale),
                   dense_attention(q, k, v, mask_mod=causal, scale=scale)[0], f"scale {scale}")
    assert len(counted) == 2
    store = plans._PLANS
    found = store.get(next(iter(store._plans)))  # (the last plan found is now that one)
    assert found is not None
    for blocks in (True, torch.tensor(True), torch.tensor(True)):
        flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={"PRESCALE_QK": blocks})
    assert len(counted) == 2 + 1 + 2  # (True once; each tensor value planned at its call)
