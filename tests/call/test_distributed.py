"""Context parallelism (flexc.call.distributed) against single-process flexc.flex_attention.

Spawned gloo processes each compute the single-process result on the full sequence and the
distributed one on their shards, and compare outputs, lse and gradients (q, k, v, captured
tensors, sinks) to 1e-5, with attention dropout too (the same mask from rank 0's seed). The exchange is counted by wrapping torch.distributed.irecv, and the ranks a
rank must hear from are derived independently from the dense mask.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexc
from flexc.call import distributed as cp
from reference import random_qkv

TOL = dict(atol=1e-5, rtol=1e-5)


# ---- mask/score cases (full-sequence, global indices) ----------------------------------------

def _causal(b, h, q, kv):
    return q >= kv


def _case(name: str, L: int, block: int):
    """(mask_mod, score_mod or None, captured grad tensors) for a named case of length L."""
    if name == "causal":
        return _causal, None, []
    if name == "sliding":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv < 40)), None, []
    if name == "document_alibi":
        doc = torch.tensor([0] * 70 + [1] * 45 + [2] * (L - 115))
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)

        def mask(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        def alibi(score, b, h, q, kv):
            return score - slopes[h] * (q - kv)
        return mask, alibi, [slopes]
    if name == "temperature_softmax_slopes":  # captured tensors the mod transforms whole (flexc.mods.derived)
        log_temp = torch.tensor(0.2, requires_grad=True)
        logits = torch.tensor([0.5, -0.25, 1.0, 0.0], requires_grad=True)

        def tempered(score, b, h, q, kv):
            return score * torch.exp(log_temp) - logits.softmax(0)[h] * (q - kv).abs()
        return _causal, tempered, [log_temp, logits]
    if name == "causal_sinks":  # learned attention sinks, merged once after the ranks' merge
        return _causal, None, [torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)]
    if name == "causal_dropout":
        return _causal, None, []
    if name == "document_alibi_sinks_dropout":  # dropout with captured-tensor gradients and sinks
        mask, alibi, captured = _case("document_alibi", L, block)
        return mask, alibi, captured + [torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)]
    if name == "prefix_lm":
        return (lambda b, h, q, kv: (kv < 40) | (q >= kv)), None, []
    if name == "dead_rows":  # rows q % 5 == 3 allow nothing: output 0, lse -inf, zero gradients
        bias = torch.tensor(0.3, requires_grad=True)

        def score(s, b, h, q, kv):
            return s * bias
        return (lambda b, h, q, kv: (q >= kv) & (q % 5 != 3)), score, [bias]
    raise KeyError(name)


def _check_case(name: str, L: int, block: int, Hq: int, Hkv: int, counted: bool) -> None:
    mask_mod, score_mod, captured = _case(name, L, block)
    sinks = captured[-1] if "_sinks" in name else None
    dropout_p = 0.3 if name.endswith("_dropout") else 0.0
    _check_call(mask_mod, score_mod, captured, L, block, Hq, Hkv, counted, sinks, dropout_p)
    if captured:  # an optimizer-like step in place: the next call must read the new values
        with torch.no_grad():
            for t in captured:
                t.add_(0.5)
                t.grad = None
        _check_call(mask_mod, score_mod, captured, L, block, Hq, Hkv, counted, sinks, dropout_p)


def _check_call(mask_mod, score_mod, captured, L: int, block: int, Hq: int, Hkv: int, counted: bool,
                sinks=None, dropout_p: float = 0.0) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    bm = flexc.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=block)
    q, k, v = random_qkv(2, Hq, Hkv, L, L, 16, seed=L + Hq)
    gqa = Hq != Hkv
    g_out = torch.randn(2, Hq, L, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    g_lse = torch.randn(2, Hq, L, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()

    # single process
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    generator = torch.Generator().manual_seed(21)
    out, lse = flexc.flex_attention(*leaves, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True,
                                    sinks=sinks, dropout_p=dropout_p, generator=generator)
    next_draw = torch.randint(0, 2 ** 62, (), generator=generator)
    finite = torch.isfinite(lse)
    ((out * g_out).sum() + (torch.where(finite, lse, 0.0) * g_lse).sum()).backward()
    ref_grads = [t.grad for t in leaves]
    ref_captured = [t.grad.clone() for t in captured]
    for t in captured:
        t.grad = None

    # distributed
    plan = cp.plan_context_parallel(bm, size)
    shards = [cp.shard_sequence(t, bm, plan=plan).clone().requires_grad_() for t in (q, k, v)]
    received = []
    real_irecv = dist.irecv

    def counting_irecv(tensor, src=None, group=None, tag=0):
        received.append(src)
        return real_irecv(tensor, src=src, group=group, tag=tag)

    dist.irecv = counting_irecv
    # (another rank's generator differs: every rank drops with rank 0's seed, broadcast)
    generator = torch.Generator().manual_seed(21 + 1000 * rank)
    try:
        out_l, lse_l = cp.flex_attention(*shards, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                         return_lse=True, plan=plan, sinks=sinks, dropout_p=dropout_p,
                                         generator=generator)
        forward_sources = sorted(received)
        received.clear()
        gl_out, gl_lse = (cp.shard_sequence(g, bm, plan=plan) for g in (g_out, g_lse))
        loss = (out_l * gl_out).sum() + (torch.where(torch.isfinite(lse_l), lse_l, 0.0) * gl_lse).sum()
        loss.backward()
        backward_sources = sorted(received)
    finally:
        dist.irecv = real_irecv

    torch.testing.assert_close(out_l, cp.shard_sequence(out, bm, plan=plan), **TOL)
    torch.testing.assert_close(lse_l, cp.shard_sequence(lse, bm, plan=plan), **TOL)
    for t, ref in zip(shards, ref_grads):
        torch.testing.assert_close(t.grad, cp.shard_sequence(ref, bm, plan=plan), **TOL)
    for t, ref in zip(captured, ref_captured):
        torch.testing.assert_close(t.grad, ref, **TOL)
    torch.testing.assert_close(cp.unshard_sequence(out_l, bm, plan=plan), out.detach(), **TOL)
    if dropout_p and rank == 0:  # its generator advanced as the single call's did
        assert torch.equal(torch.randint(0, 2 ** 62, (), generator=generator), next_draw)

    # who must talk to whom, from the dense mask and the shard each token landed in
    owner = torch.empty(L, dtype=torch.int64)
    for r in range(size):
        owner[plan.token_index(r)] = r
    dense = flexc.create_mask(mask_mod, None, None, L, L)[0, 0]
    needs = torch.zeros(size, size, dtype=torch.bool)  # needs[r, s]: r's queries read a key s holds
    qi, ki = dense.nonzero(as_tuple=True)
    needs[owner[qi], owner[ki]] = True
    expect_fwd = sorted(s for s in range(size) if s != rank and needs[rank, s])
    expect_bwd = sorted(r for r in range(size) if r != rank and needs[r, rank])
    assert forward_sources == expect_fwd, ( rank, forward_sources, expect_fwd)
    assert backward_sources == expect_bwd, ( rank, backward_sources, expect_bwd)
    if counted:  # the case is chosen so that some pair is skipped
        assert needs.sum() < size * size


def _worker(rank: int, size: int, port: int, cases: list, errfile: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        for case in cases:
            _check_case(*case)
        if size == 2:
            _check_shards(rank, size)
            _check_backward_exchange_overlaps_local_backward()
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def _check_shards(rank: int, size: int) -> None:
    """Causal gives the zig-zag split; unshard puts shards back in order."""
    bm = flexc.create_block_mask(_causal, None, None, 256, 256, BLOCK_SIZE=32)
    x = torch.arange(256.0).view(1, 1, 256, 1)
    local = cp.shard_sequence(x, bm)
    chunks = torch.arange(256).view(2 * size, -1)
    expect = torch.cat([chunks[rank], chunks[2 * size - 1 - rank]]).float()
    assert torch.equal(local.flatten(), expect)
    assert torch.equal(cp.unshard_sequence(local, bm), x)


def _check_backward_exchange_overlaps_local_backward() -> None:
    """The backward posts the key/value gradients' exchange, runs the attention backward over the
    rank's own blocks, and only then waits for the peers' gradients (and still equals one process)."""
    attention = sys.modules["flexc.call.attention"]
    events = []
    real = attention.torch_backward, cp._FetchKV.backward, cp._GradsFromPeers.backward

    def recording(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call

    attention.torch_backward = recording("attention backward", real[0])
    cp._FetchKV.backward = staticmethod(recording("exchange posted", real[1]))
    cp._GradsFromPeers.backward = staticmethod(recording("exchange awaited", real[2]))
    try:
        _check_call(_causal, None, [], 128, 32, 2, 2, False)
    finally:
        attention.torch_backward = real[0]
        cp._FetchKV.backward, cp._GradsFromPeers.backward = (staticmethod(f) for f in real[1:])
    # events[0]: the single-process reference's backward; then the remote blocks' backward, the
    # exchange posted, the local blocks' backward while it is in flight, and only then the wait
    assert events == ["attention backward"] + ["attention backward", "exchange posted", "attention backward",
                                                "exchange awaited"], events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(size: int, cases: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        errfile = os.path.join(tmp, "err")
        try:
            mp.spawn(_worker, args=(size, _free_port(), cases, errfile), nprocs=size, join=True)
        except Exception:
            messages = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp))]
            pytest.fail("\n".join(messages) or "a worker failed")


def test_two_ranks_match_single_process():
    # (name, L, block, Hq, Hkv, counted): ragged lengths (200, 232), GQA, captured-tensor gradients
    _spawn(2, [("causal", 200, 32, 4, 2, False), ("sliding", 256, 32, 2, 2, False),
               ("document_alibi", 232, 32, 4, 2, False), ("prefix_lm", 224, 32, 2, 1, False),
               ("dead_rows", 200, 32, 2, 2, False), ("temperature_softmax_slopes", 160, 32, 4, 2, False),
               ("causal_sinks", 128, 32, 4, 2, False), ("causal_dropout", 200, 32, 4, 2, False),
               ("document_alibi_sinks_dropout", 232, 32, 4, 2, False)])


def test_four_ranks_skip_pairs_they_do_not_need():
    _spawn(4, [("sliding", 256, 32, 2, 1, True), ("document_alibi", 232, 32, 4, 2, False)])


# ---- the plan, without processes ---------------------------------------------------------------

def test_plan_causal_is_zigzag_and_balanced():
    bm = flexc.create_block_mask(_causal, None, None, 4096, 4096, BLOCK_SIZE=128)
    plan = cp.plan_context_parallel(bm, 4)
    assert plan.layout == "zigzag"
    assert plan.blocks[0] == (0, 1, 2, 3, 28, 29, 30, 31)
    assert plan.imbalance() == 1.0
    assert sum(plan.work) == 32 * 33 // 2


def test_plan_sliding_window_fetches_only_neighbours():
    n, w = 8192, 256
    bm = flexc.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < w), None, None, n, n, BLOCK_SIZE=128)
    plan = cp.plan_context_parallel(bm, 4)
    for r in range(4):
        # each of the rank's two chunks reads the window's worth of blocks just before it
        assert plan.recv_tokens(r) <= 2 * (w + 128)
    assert plan.total_recv_tokens() * 4 < plan.all_gather_tokens()


def test_plan_rejects_bad_masks():
    bm = flexc.create_block_mask(_causal, None, None, 256, 128, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="square"):
        cp.plan_context_parallel(bm, 2)
    bm = flexc.create_block_mask(_causal, None, None, 128, 128, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="smaller BLOCK_SIZE"):
        cp.plan_context_parallel(bm, 4)


def test_flex_attention_errors_name_the_fix():
    q = torch.randn(1, 1, 64, 8)
    with pytest.raises(ValueError, match="block_mask is required"):
        cp.flex_attention(q, q, q)
    bm = flexc.create_block_mask(_causal, None, None, 64, 64, BLOCK_SIZE=16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.flex_attention(q, q, q, block_mask=bm)
    with pytest.raises(ValueError, match=r"distributed.flex_attention: dropout_p must be in \[0, 1\), got 1.5.*Fix"):
        cp.flex_attention(q, q, q, block_mask=bm, dropout_p=1.5)
    with pytest.raises(ValueError, match="layout"):
        cp.plan_context_parallel(bm, 2, layout="ring")


def test_plan_reads_torch_block_masks():
    bm = flexc.create_block_mask(lambda b, h, q, kv: (kv < 64) | (q >= kv), None, None, 512, 512, BLOCK_SIZE=64)
    assert cp.plan_context_parallel(bm.to_torch(), 2) == cp.plan_context_parallel(bm, 2)


def test_each_call_finds_the_tile_classes_without_copying_the_tables_to_the_host_again():
    from host_reads import counting_host_reads

    with flexc.device.simulate("sm_90"):
        bm = flexc.create_block_mask(_causal, 1, 1, 128, 128, BLOCK_SIZE=32)
        first = cp._tile_classes(bm)
        with counting_host_reads() as reads:
            again = cp._tile_classes(bm)
    assert reads == [] and again is first
