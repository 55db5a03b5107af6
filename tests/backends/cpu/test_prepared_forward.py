"""The TORCH backend's forward decided once per call signature (flexc/backends/cpu/prepared_forward.py):
warm calls of a plan run the fused kernel's path it decided (unmasked, causal, one dense tile)
without deciding again, and every call equals a float64 dense reference, across in-place edits of
the inputs, of a mask_mod's captured tensor and non-finite values."""
import pytest
import torch

import flexc
from flexc.backends.cpu import causal_call, torch_cpu
from reference import dense_attention, random_qkv


def _causal(b, h, q, kv):
    return q >= kv


def _everything(b, h, q, kv):
    return kv >= 0


@pytest.fixture
def decided_again(monkeypatch):
    """How many calls decided their path again (ran forward_with_max)."""
    count = [0]
    real = torch_cpu.forward_with_max

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(torch_cpu, "forward_with_max", spy)
    return count


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv < 48)


def _window_and_dead_rows(b, h, q, kv):  # every 50th row from row 7 allows no key
    return _window(b, h, q, kv) & (q % 50 != 7)


def _distance_bias(score, b, h, q, kv):  # (the same for every head: one mask for the folded call)
    return score - 0.02 * (q - kv)


def _reference(q, k, v, mask_mod, sinks=None, score_mod=None):
    return dense_attention(q, k, v, score_mod, mask_mod, sinks=sinks)[:2]


@pytest.mark.parametrize("case", ["no mask", "every block full", "causal", "causal, sinks", "causal, [B, L, H, E] memory",
                                  "documents", "window (one dense tile)", "window, a bias score_mod",
                                  "window, rows that allow nothing"])
def test_warm_calls_take_the_decided_path_and_match_float64_dense(decided_again, case):
    B, H, L, D = 2, 2, 160, 16
    # (float32: a float64 call that returns its logsumexp takes the row path, which keeps it in float64)
    q, k, v = random_qkv(B, H, H, L, L, D, dtype=torch.float32, seed=3)
    if case == "causal, [B, L, H, E] memory":  # (not foldable: the kernel's own layout)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    doc = torch.zeros(L, dtype=torch.long)
    doc[70:] = 1

    def documents(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (qi >= kv)
    mask_mod = {"no mask": None, "every block full": _everything, "documents": documents}.get(
        case, (_window_and_dead_rows if "nothing" in case else _window) if "window" in case else _causal)
    score_mod = _distance_bias if "bias" in case else None
    bm = None if mask_mod is None else flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu",
                                                               BLOCK_SIZE=32)
    sinks = torch.tensor([0.5, -1.0]) if "sinks" in case else None
    g = torch.Generator().manual_seed(0)
    for call in range(3):
        if call:  # new values in the same tensors: the same signature
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
        before = decided_again[0]
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, sinks=sinks, return_lse=True)
        if call:
            assert decided_again[0] == before, "a warm call decided its path again"
        ref_out, ref_lse = _reference(q, k, v, mask_mod, sinks, score_mod)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)
        assert out.stride() == q.stride()


def test_sequences_a_captured_tensor_moves_are_found_again(decided_again):
    # the tables hold for both splits (the boundary stays inside one query and key block): the
    # second call's documents are the new ones, found by the warm plan without a new decision
    L = 192
    doc = torch.zeros(L, dtype=torch.long)
    doc[70:] = 1

    def documents(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (qi >= kv)
    q, k, v = random_qkv(1, 2, 2, L, L, 16, dtype=torch.float64, seed=5)
    bm = flexc.create_block_mask(documents, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    flexc.flex_attention(q, k, v, block_mask=bm)
    doc.zero_()
    doc[80:] = 1
    before = decided_again[0]
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert decided_again[0] == before
    assert causal_call.sequence_starts(bm, flexc.trace(documents), 1, 2, L, L) == ((0, 80),)
    torch.testing.assert_close(out, _reference(q, k, v, documents)[0], atol=1e-12, rtol=0)


def test_a_non_finite_value_on_a_warm_causal_plan_takes_the_block_path(decided_again):
    # the kernel's causal tiles multiply masked probabilities (0) by value rows: a NaN past the
    # diagonal would reach earlier rows. The warm plan checks finiteness at every call
    q, k, v = random_qkv(1, 1, 1, 128, 128, 8, dtype=torch.float64, seed=4)
    bm = flexc.create_block_mask(_causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    flexc.flex_attention(q, k, v, block_mask=bm)
    v[0, 0, 40] = float("nan")
    before = decided_again[0]
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert decided_again[0] == before + 1
    assert torch.isfinite(out[0, 0, :40]).all() and torch.isnan(out[0, 0, 40:]).all()
    v[0, 0, 40] = 0.25
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert decided_again[0] == before + 1
    torch.testing.assert_close(out, _reference(q, k, v, _causal)[0], atol=1e-12, rtol=0)


def test_a_dense_tiles_captured_tensor_edited_in_place_is_read_again(decided_again):
    # every listed block is partial (a window narrower than a block): the mask_mod decides every
    # pair, so the edited documents are the whole answer
    L = 192
    doc = torch.zeros(L, dtype=torch.long)
    doc[70:] = 1

    def documents_in_a_window(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (qi >= kv) & (qi - kv < 48)
    q, k, v = random_qkv(1, 2, 2, L, L, 16, dtype=torch.float64, seed=6)
    bm = flexc.create_block_mask(documents_in_a_window, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    first = flexc.flex_attention(q, k, v, block_mask=bm)
    doc.zero_()
    doc[80:] = 1
    before = decided_again[0]
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    assert decided_again[0] == before
    assert not torch.allclose(out, first)
    torch.testing.assert_close(out, _reference(q, k, v, documents_in_a_window)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("Hkv", [4, 2])
def test_a_per_head_bias_takes_the_kernels_layout_and_follows_its_captured_tensor(decided_again, Hkv):
    # ALiBi's bias differs by head: one call in the kernel's [B, L, H, E] layout (GQA's query heads
    # stacked as rows), laid out by the plan; the slopes edited in place are read again
    B, Hq, L, D = 2, 4, 160, 16
    q, k, v = random_qkv(B, Hq, Hkv, L, L, D, dtype=torch.float32, seed=8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, qi, kv):
        return score + slopes[h] * (kv - qi)
    bm = flexc.create_block_mask(_window, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    for call in range(3):
        if call == 2:
            slopes.mul_(-3.0)
        before = decided_again[0]
        out, lse = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, return_lse=True,
                                        enable_gqa=Hkv != Hq)
        if call:
            assert decided_again[0] == before, "a warm call decided its path again"
        ref_out, ref_lse = _reference(q, k, v, _window, score_mod=alibi)
        # (float32 biases up to ~70 in size: a few ulps of them)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
        assert out.stride() == q.stride() and lse.is_contiguous()


def test_a_row_a_captured_tensor_kills_later_gets_the_dead_rows_logsumexp(decided_again):
    # no dead row at the first call; the edited tensor blocks all of row 20's keys: its logsumexp
    # must be -inf (the kernel reports 0), so the plan's verdict on dead rows follows the mask
    L = 160
    cut = torch.tensor([-1])

    def window_but_a_row(b, h, qi, kv):
        return _window(b, h, qi, kv) & (qi != cut[0])
    q, k, v = random_qkv(1, 2, 2, L, L, 16, dtype=torch.float32, seed=9)
    bm = flexc.create_block_mask(window_but_a_row, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    cut.fill_(20)
    before = decided_again[0]
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert decided_again[0] == before
    assert torch.isneginf(lse[:, :, 20]).all() and (out[:, :, 20] == 0).all()
    ref_out, ref_lse = _reference(q, k, v, window_but_a_row)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize("L", [128, 512])  # (512: a call split along the diagonal, whose chunks add a -inf mask)
@pytest.mark.parametrize("tensor", ["query", "key"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_query_or_key_on_a_warm_causal_plan_stays_in_the_rows_that_see_it(decided_again, tensor, bad,
                                                                                       L):
    # where the kernel's causal mode fills the scores past the diagonal the warm plan checks only the
    # values; either way a bad key row (or query row) must leave the rows before it as float64 dense has them
    q, k, v = random_qkv(1, 2, 2, L, L, 8, dtype=torch.float64, seed=11)
    bm = flexc.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    flexc.flex_attention(q, k, v, block_mask=bm)
    row = L - 88  # (in the last of the split call's chunks)
    {"query": q, "key": k}[tensor][0, :, row] = bad
    out = flexc.flex_attention(q, k, v, block_mask=bm)
    ref = _reference(q, k, v, _causal)[0]
    torch.testing.assert_close(out[:, :, :row], ref[:, :, :row], atol=1e-12, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0, equal_nan=True)


@pytest.mark.parametrize("mask_mod", [_causal, _window], ids=["causal", "window"])
def test_compiled_calls_whose_mods_capture_nothing_take_the_decided_path(decided_again, mask_mod):
    # a compiled call's op rebuilds its mods per call; capturing no tensor, they are the plan's
    # (the op's signature holds their structure), so warm calls run the path decided once
    L = 128
    q, k, v = random_qkv(2, 2, 2, L, L, 16, dtype=torch.float32, seed=12)
    bm = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    attend = torch.compile(lambda q, k, v: flexc.flex_attention(q, k, v, block_mask=bm), backend="aot_eager",
                           fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for call in range(3):
        if call:
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g))
        before = decided_again[0]
        with torch.no_grad():
            out = attend(q, k, v)
        if call:
            assert decided_again[0] == before, "a warm compiled call decided its path again"
        torch.testing.assert_close(out.double(), _reference(q, k, v, mask_mod)[0], atol=2e-6, rtol=0)
