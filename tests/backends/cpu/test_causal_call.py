"""Causal masks, and causal sequences packed one after another (documents), as calls of torch's
fused CPU kernel in its causal mode (flexc/backends/cpu/causal_call.py): recognised exactly (the
block tables and the mask_mod's verdicts, however the mask is written), never for a mask that
differs anywhere, decided again when a captured tensor changes, and equal to a float64 dense
reference forward and backward."""
import pytest
import torch
from hypothesis import event, given

import strategies

import flexc
from flexc.backends.cpu import causal_call
from flexc.mods.trace import trace
from reference import autograd_node_names, dense_attention, random_qkv


def _causal(b, h, q, kv):
    return q >= kv


def _causal_written_otherwise(b, h, q, kv):
    return ~(kv > q) & (q - kv >= 0)


def _causal_and_every_batch(b, h, q, kv):  # reads b, but allows every batch of the call
    return (q >= kv) & (b < 100)


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv < 40)


def _every_key(b, h, q, kv):
    return kv >= 0


def _shifted(b, h, q, kv):  # one more key per row: not torch's causal mode
    return q + 1 >= kv


def _causal_but_one_pair(b, h, q, kv):  # differs from causal at a single pair of head 1
    return (q >= kv) & ~((h == 1) & (q == 77) & (kv == 5))


@pytest.fixture
def taken(monkeypatch):
    """How many forward and backward calls ran as one causal call (a plan's prepared forward of
    plain causal attention runs forward_folded)."""
    count = {"forward": 0, "backward": 0}
    for name, counted in (("forward", "forward"), ("forward_folded", "forward"), ("backward", "backward")):
        real = getattr(causal_call, name)

        def spy(*args, _real=real, _counted=counted):
            count[_counted] += 1
            return _real(*args)
        monkeypatch.setattr(causal_call, name, spy)
    return count


def _decide(mask_mod, B=2, H=3, L=200, S=200, block=(64, 32)):
    bm = flexc.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    return causal_call.sequence_starts(bm, trace(mask_mod), B, H, L, S)


_DOCS = torch.tensor([0] * 70 + [1] * 45 + [2] * 85)  # three documents over 200 positions
_DOCS_PER_BATCH = torch.stack([_DOCS, torch.tensor([0] * 120 + [1] * 80)])


def _documents(b, h, q, kv):
    return (_DOCS[q] == _DOCS[kv]) & (q >= kv)


def _documents_per_batch(b, h, q, kv):
    return (_DOCS_PER_BATCH[b, q] == _DOCS_PER_BATCH[b, kv]) & (q >= kv)


def _documents_both_ways(b, h, q, kv):  # no causal order inside a document
    return _DOCS[q] == _DOCS[kv]


def _documents_per_head(b, h, q, kv):  # heads disagree: one call per sequence cannot serve them all
    return (_DOCS[q] == _DOCS[kv]) & (q >= kv) | ((h == 2) & (q >= kv))


def _spread_row(b, h, q, kv):  # row 150 (keys 115..150) swaps 116 and 149 for 114 and 151: same count and sum
    at = q == 150
    return ((_documents(b, h, q, kv) & ~(at & ((kv == 116) | (kv == 149))))
            | (at & ((kv == 114) | (kv == 151))))


def _tiny_documents(b, h, q, kv):  # sequences of 8 rows: left to the block path
    return (q // 8 == kv // 8) & (q >= kv)


@pytest.mark.parametrize("mask_mod, L, S, block, expected", [
    (_causal, 200, 200, (64, 32), ((0,),)),
    (_causal, 256, 256, 128, ((0,),)),
    (_causal, 130, 300, (32, 64), ((0,),)),  # more keys than queries (top-left: rows see kv <= q)
    (_causal, 300, 130, 64, ((0,),)),  # more queries than keys: the last rows see every key
    (_causal_written_otherwise, 200, 200, (64, 32), ((0,),)),
    (_causal_and_every_batch, 200, 200, (64, 32), ((0,),)),
    (_documents, 200, 200, (64, 32), ((0, 70, 115),)),
    (_documents_per_batch, 200, 200, (64, 32), ((0, 70, 115), (0, 120))),
    (_window, 200, 200, (64, 32), None),
    (_shifted, 200, 200, (64, 32), None),
    (_causal_but_one_pair, 200, 200, (64, 32), None),
    (_documents_both_ways, 200, 200, (64, 32), None),
    (_documents_per_head, 200, 200, (64, 32), None),
    (_spread_row, 200, 200, (64, 32), None),
    (_tiny_documents, 200, 200, (64, 32), None),
])
def test_causal_sequences_are_recognised_exactly(mask_mod, L, S, block, expected):
    assert _decide(mask_mod, L=L, S=S, block=block) == expected


def test_tables_that_drop_a_causal_block_are_not_causal():
    bm = flexc.create_block_mask(_causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    full_num = bm.full_kv_num_blocks.clone()
    full_num[0, 0, 3] -= 1  # the last query block forgets one of its full key blocks
    dropped = flexc.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, full_num, bm.full_kv_indices,
                                             BLOCK_SIZE=64, mask_mod=_causal, seq_lengths=(256, 256))
    assert causal_call.sequence_starts(bm, trace(_causal), 1, 1, 256, 256) == ((0,),)
    assert causal_call.sequence_starts(dropped, trace(_causal), 1, 1, 256, 256) is None


def test_a_captured_tensor_changed_in_place_is_decided_again(taken):
    # one document: causal. Two documents afterwards, with the same tables: no longer causal, and
    # the result must be the new mask's over the tables' blocks, not a remembered verdict's
    L = 192
    doc = torch.zeros(L, dtype=torch.long)

    def same_document_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    q, k, v = random_qkv(1, 2, 2, L, L, 16, dtype=torch.float64)
    bm = flexc.create_block_mask(same_document_causal, 1, 2, L, L, device="cpu", BLOCK_SIZE=64)
    flexc.flex_attention(q, k, v, block_mask=bm)
    assert taken["forward"] == 1
    doc[100:] = 1  # the tables are unchanged; the mask_mod now cuts pairs of the diagonal blocks
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert taken["forward"] == 1

    def as_the_tables_apply_it(b, h, q, kv):  # full blocks below the diagonal, the mask_mod on it
        return (kv // 64 < q // 64) | ((kv // 64 == q // 64) & same_document_causal(b, h, q, kv))
    ref = dense_attention(q, k, v, None, as_the_tables_apply_it)[0]
    assert not torch.allclose(ref, dense_attention(q, k, v, None, _causal)[0])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask_mod, B, Bkv, Hq, Hkv, L, S, layout, dtype", [
    (_causal, 2, 2, 4, 4, 200, 200, "row-major", torch.float64),
    (_causal, 2, 1, 4, 2, 130, 170, "row-major", torch.float64),  # GQA, one key batch for every query batch
    (_causal, 2, 2, 4, 4, 170, 130, "BLHE", torch.float64),  # transposed from [B, L, H, E], as models call it
    (_causal, 1, 1, 2, 2, 256, 256, "row-major", torch.float32),
    (_documents, 2, 2, 3, 3, 200, 200, "row-major", torch.float64),
    (_documents_per_batch, 2, 1, 4, 2, 200, 200, "row-major", torch.float64),
    (_documents_per_batch, 2, 2, 3, 3, 200, 200, "BLHE", torch.float32),
])
def test_causal_sequence_calls_match_float64_forward_and_backward(taken, mask_mod, B, Bkv, Hq, Hkv, L, S, layout,
                                                                  dtype):
    q, k, v = random_qkv(B, Hq, Hkv, L, S, 16, dtype=dtype, Bkv=Bkv, seed=1)
    if layout == "BLHE":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bm = flexc.create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=64)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    assert taken == {"forward": 1, "backward": 1}
    ref_out, ref_lse, _ = dense_attention(q, k, v, None, mask_mod)
    refs = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=0)
    assert out.stride() == q.stride() and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for a, b, t in zip(mine, refs, (q, k, v)):
        assert a.shape == t.shape and a.stride() == t.stride()
        torch.testing.assert_close(a.double(), b.double(), atol=10 * tol, rtol=0)


def test_sinks_join_the_one_causal_call(taken):
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 96, 96, 16, dtype=torch.float64, seed=3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    bm = flexc.create_block_mask(_causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, block_mask=bm, sinks=sinks)
    mine = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert taken == {"forward": 1, "backward": 1}
    ref_out, ref_lse, _ = dense_attention(q, k, v, None, _causal)
    total = torch.logaddexp(ref_lse, sinks.view(1, -1, 1).expand_as(ref_lse))
    ref = ref_out * torch.exp(ref_lse - total).unsqueeze(-1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(mine, torch.autograd.grad(ref.sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_a_nan_value_row_past_the_diagonal_stays_out_of_earlier_rows(taken):
    # the kernel's causal tiles multiply masked probabilities (0) by value rows: 0 * NaN. Such
    # inputs take the block path, where a key no row before it may see leaves those rows finite
    q, k, v = random_qkv(1, 1, 1, 64, 64, 8, dtype=torch.float64, seed=4)
    v[0, 0, 40] = float("nan")
    bm = flexc.create_block_mask(_causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert taken["forward"] == 0
    assert torch.isfinite(out[0, 0, :40]).all() and torch.isnan(out[0, 0, 40:]).all()


@pytest.mark.parametrize("case", ["score_mod", "gradient into lse", "max_scores"])
def test_calls_beyond_plain_causal_attention_take_the_block_path(taken, case):
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 96, 96, 16, dtype=torch.float64, seed=5))
    bm = flexc.create_block_mask(_causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    score_mod = (lambda s, b, h, qi, kv: s * 0.5) if case == "score_mod" else None
    if case == "max_scores":  # (without autograd: a training call's max_scores is a second forward)
        with torch.no_grad():
            out, aux = flexc.flex_attention(q, k, v, block_mask=bm, return_aux=flexc.AuxRequest(max_scores=True))
        ref_max = dense_attention(q, k, v, None, _causal)[2]
        torch.testing.assert_close(aux.max_scores.double(), ref_max, atol=1e-6, rtol=0)
        assert taken["forward"] == 0
        return
    out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    mine = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod, _causal)
    for a, b in zip(mine, torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert taken["backward"] == 0 and taken["forward"] == (case != "score_mod")


def _starts_by_brute_force(mask_mod, B, L, S):
    """The rows where sequences start, read row by row off the dense mask (None where a row sees
    anything but ``[start, min(q, S - 1)]``), with the same rules on batches and lengths."""
    dense = torch.broadcast_to(mask_mod(torch.arange(B).view(-1, 1, 1), torch.zeros(1, 1, 1, dtype=torch.long),
                                        torch.arange(L).view(1, -1, 1), torch.arange(S).view(1, 1, -1)), (B, L, S))
    per_batch = []
    for b in range(B):
        starts, previous = [], None
        for q in range(L):
            seen = dense[b, q].nonzero().flatten().tolist()
            if not seen or seen != list(range(seen[0], min(q, S - 1) + 1)):
                return None
            if seen[0] == q:
                starts.append(q)
            elif seen[0] != previous:
                return None
            previous = seen[0]
        per_batch.append(tuple(starts))
    if any(len(s) * causal_call.MIN_MEAN_ROWS > L for s in per_batch):
        return None
    return tuple(per_batch[:1]) if len(set(per_batch)) == 1 else tuple(per_batch)


@strategies.examples(80, slow=True)
@given(strategies.packed_causal_masks())
def test_sequence_starts_equal_a_row_by_row_reading_of_the_dense_mask(case):
    mask_mod, B, L, S, block, kind = case
    event(kind)
    bm = flexc.create_block_mask(mask_mod, B, 1, L, S, device="cpu", BLOCK_SIZE=block)
    expected = _starts_by_brute_force(mask_mod, B, L, S)
    event("causal sequences" if expected else "not")
    assert causal_call.sequence_starts(bm, trace(mask_mod), B, 2, L, S) == expected


def test_tables_made_under_inference_mode_keep_the_block_path(taken):
    # no version counter: an answer could not be remembered safely, and deciding on every call
    # costs more than it saves
    q, k, v = random_qkv(1, 2, 2, 96, 96, 16, dtype=torch.float64, seed=6)
    with torch.inference_mode():
        bm = flexc.create_block_mask(_causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
        out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert taken["forward"] == 0
    torch.testing.assert_close(out, dense_attention(q, k, v, None, _causal)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask_mod, B, Bkv, Hq, Hkv, L, S, layout, dtype, trained", [
    (_causal, 2, 2, 4, 4, 200, 200, "row-major", torch.float64, "qkv"),
    (_causal, 2, 2, 4, 2, 130, 170, "BLHE", torch.float64, "qkv"),  # GQA as models call it, from [B, L, H, E]
    (_causal, 2, 2, 4, 4, 170, 130, "BLHE", torch.float32, "qkv"),
    (_causal, 1, 1, 2, 2, 96, 96, "row-major", torch.float64, "v"),  # only the value trains
    (None, 2, 2, 4, 2, 130, 170, "BLHE", torch.float64, "qkv"),  # no block mask at all
    (None, 2, 2, 2, 2, 96, 80, "row-major", torch.float32, "qk"),
    (_every_key, 2, 2, 4, 4, 128, 192, "row-major", torch.float64, "qkv"),  # every block full: no mask either
])
def test_a_plain_training_call_is_recorded_by_torchs_own_autograd_nodes(taken, mask_mod, B, Bkv, Hq, Hkv, L, S,
                                                                        layout, dtype, trained):
    # causal with one sequence, or no mask; no lse asked for: the kernel's call itself is on the
    # tape (its backward is torch's C++ node), not flexc's autograd Function; the gradients are
    # still the mask's
    q, k, v = random_qkv(B, Hq, Hkv, L, S, 16, dtype=dtype, Bkv=Bkv, seed=7)
    if layout == "BLHE":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    leaves = [t.requires_grad_() for t, name in zip((q, k, v), "qkv") if name in trained]
    bm = flexc.create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=64) if mask_mod else None
    out = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv)
    nodes = autograd_node_names(out)
    assert any("FlashAttentionForCpuBackward" in name for name in nodes), nodes
    assert not any("FlexAttentionFunction" in name for name in nodes), nodes
    assert taken == {"forward": 0, "backward": 0}
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=dtype)
    mine = torch.autograd.grad(out, leaves, grad)
    ref_out = dense_attention(q, k, v, None, mask_mod)[0]
    refs = torch.autograd.grad(ref_out, leaves, grad.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    assert out.stride() == q.stride()
    for a, b, t in zip(mine, refs, leaves):
        assert a.shape == t.shape and a.stride() == t.stride()
        torch.testing.assert_close(a.double(), b.double(), atol=10 * tol, rtol=0)


@pytest.mark.parametrize("case", ["documents", "lse", "sinks", "NaN value row", "row-major GQA", "score_mod"])
def test_training_calls_torchs_nodes_cannot_express_keep_flexcs_function(case):
    # (row-major GQA: the kernel's gradients would come back [B, L, H, E]-strided)
    q, k, v = random_qkv(1, 2, 1 if case == "row-major GQA" else 2, 128, 128, 16, dtype=torch.float64, seed=9)
    if case == "NaN value row":
        v[0, 0, 100] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask_mod = _documents_of_128 if case == "documents" else _causal
    bm = flexc.create_block_mask(mask_mod, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    sinks = torch.zeros(2, dtype=torch.float64) if case == "sinks" else None
    out = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=case == "lse", sinks=sinks,
                               enable_gqa=case == "row-major GQA",
                               score_mod=(lambda s, b, h, qi, kv: s * 0.5) if case == "score_mod" else None)
    out = out[0] if case == "lse" else out
    assert any("FlexAttentionFunction" in name for name in autograd_node_names(out))
    if case == "NaN value row":  # the kernel's causal tiles would carry 0 * NaN into earlier rows
        assert torch.isfinite(out[0, 0, :100]).all()
        (dq,) = torch.autograd.grad(out[0, 0, :100].sum(), (q,))
        assert torch.isfinite(dq[0, 0, :100]).all()


def _documents_of_128(b, h, q, kv):  # two documents of 64 rows
    return (q // 64 == kv // 64) & (q >= kv)


@pytest.mark.parametrize("mask_mod, B, Bkv, Hq, Hkv, L, S, layout, dtype", [
    (_causal, 2, 2, 4, 4, 200, 200, "row-major", torch.float64),
    (_causal, 2, 1, 4, 2, 130, 170, "row-major", torch.float64),
    (_documents_per_batch, 2, 2, 3, 3, 200, 200, "BLHE", torch.float32),
])
def test_calls_split_over_workers_match_float64_forward_and_backward(monkeypatch, mask_mod, B, Bkv, Hq, Hkv, L, S,
                                                                      layout, dtype):
    # every call split into one per head (or batch), taken by workers as they come free
    monkeypatch.setattr(causal_call.fused_cpu, "MIN_COST_PER_WORKER", 1.0)
    runs = []
    real_run = causal_call.workers.run
    monkeypatch.setattr(causal_call.workers, "run", lambda tasks, *a, **k: runs.append(len(tasks)) or real_run(tasks, *a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = random_qkv(B, Hq, Hkv, L, S, 16, dtype=dtype, Bkv=Bkv, seed=3)
        if layout == "BLHE":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        bm = flexc.create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=64)
        out = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
        mine = torch.autograd.grad(out, (q, k, v), grad)
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 2 and min(runs) >= 2, runs  # forward and backward, several calls each
    ref_out = dense_attention(q, k, v, None, mask_mod)[0]
    refs = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    assert out.stride() == q.stride()
    for a, b, t in zip(mine, refs, (q, k, v)):
        assert a.stride() == t.stride()
        torch.testing.assert_close(a.double(), b.double(), atol=10 * tol, rtol=0)


def test_a_training_plan_records_the_kernel_only_while_its_mask_and_threads_allow(monkeypatch):
    # a plan decides once what its signature fixes; a captured tensor's values and the thread
    # count are not in a signature, so a warm call of the same plan checks them again
    L = 128
    doc = torch.zeros(L, dtype=torch.long)

    def same_document_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, L, L, 16, dtype=torch.float64, seed=10))
    bm = flexc.create_block_mask(same_document_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)

    def as_the_tables_apply_it(b, h, q, kv):  # full blocks below the diagonal, the mask_mod on it
        return (kv // 32 < q // 32) | ((kv // 32 == q // 32) & same_document_causal(b, h, q, kv))

    def step():
        out = flexc.flex_attention(q, k, v, block_mask=bm)
        ref = dense_attention(q, k, v, None, as_the_tables_apply_it)[0]
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
        nodes = autograd_node_names(out)
        return "recorded" if any("FlashAttentionForCpuBackward" in n for n in nodes) else (
            "function" if any("FlexAttentionFunction" in n for n in nodes) else nodes)

    assert step() == "recorded"  # one document: plain causal
    doc[80:] = 1  # the same tables; row 80 no longer sees the keys 64..79 of its own block: not causal,
    assert step() == "recorded"  # but a tile this small is one kernel call with its dense mask (dense_tile)
    doc[80:] = 0
    assert step() == "recorded"
    monkeypatch.setattr(causal_call.fused_cpu, "MIN_COST_PER_WORKER", 1.0)  # (a new plan: decided again)
    bm = flexc.create_block_mask(same_document_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert step() == "recorded"
        torch.set_num_threads(2)  # split over two workers: flexc's Function runs them each way
        assert step() == "function"
    finally:
        torch.set_num_threads(threads)
