"""and_masks / or_masks / not_mask / noop_mask: same masks as torch's, and transparent to the tracer."""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import flexc
from catalogue import mask_catalogue

B, H, Q_LEN, KV_LEN = 2, 2, 90, 70


def _mods():
    return mask_catalogue(B, H, Q_LEN, KV_LEN)


def _dense(mod):
    return tfa.create_mask(mod, B, H, Q_LEN, KV_LEN, device="cpu")


@pytest.mark.parametrize("names", [("causal",), ("causal", "document"), ("per_head_window", "padding_per_batch",
                                                                         "global_tokens_with_window")])
def test_and_or_masks_equal_torchs(names):
    mods = [_mods()[n] for n in names]
    for ours, theirs in ((flexc.and_masks, tfa.and_masks), (flexc.or_masks, tfa.or_masks)):
        combined = ours(*mods)
        assert torch.equal(flexc.create_mask(combined, B, H, Q_LEN, KV_LEN, device="cpu"), _dense(theirs(*mods)))
        # the Python function itself also works on plain tensors, as torch's vmap calls it
        assert torch.equal(_dense(combined), _dense(theirs(*mods)))


def test_zero_mods_allow_everything_for_and_nothing_for_or():
    for ours, theirs in ((flexc.and_masks(), tfa.and_masks()), (flexc.or_masks(), tfa.or_masks())):
        got = flexc.create_mask(ours, B, H, Q_LEN, KV_LEN, device="cpu")
        assert torch.equal(got, _dense(theirs))
    assert flexc.create_mask(flexc.and_masks(), 1, 1, 4, 4).all()
    assert not flexc.create_mask(flexc.or_masks(), 1, 1, 4, 4).any()


def test_not_mask_is_the_complement():
    for name in ("causal", "document_logical_causal", "block_sparse_lookup_4d", "noop"):
        mod = _mods()[name]
        assert torch.equal(flexc.create_mask(flexc.not_mask(mod), B, H, Q_LEN, KV_LEN), ~_dense(mod)), name
    assert not flexc.create_mask(flexc.not_mask(lambda b, h, q_idx, kv_idx: True), 1, 1, 3, 3).any()


def test_noop_mask_allows_everything_like_torchs():
    assert torch.equal(flexc.create_mask(flexc.noop_mask, B, H, Q_LEN, KV_LEN), _dense(tfa.noop_mask))
    assert _dense(flexc.noop_mask).all()


def test_combinators_trace_to_the_combined_expression():
    mods = _mods()
    causal, document, window = mods["causal"], mods["document"], mods["bidirectional_window_9"]
    root = lambda mod: flexc.trace(mod).root
    # hash-consed nodes: the combination is the very node built from the parts' graphs
    assert root(flexc.and_masks(causal, window)) is flexc.mods.ir.binary("and", root(causal), root(window))
    assert root(flexc.or_masks(causal, document, window)) is flexc.mods.ir.binary(
        "or", flexc.mods.ir.binary("or", root(causal), root(document)), root(window))
    assert root(flexc.not_mask(document)) is flexc.mods.ir.unary("not", root(document))
    nested = flexc.and_masks(flexc.or_masks(causal, document), flexc.not_mask(window))
    assert flexc.trace(nested).buffers == flexc.trace(document).buffers  # captured tensors are seen through


def test_combined_mods_have_readable_names():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 8

    assert flexc.and_masks(causal, window).__name__ == "and_masks(causal, window)"
    assert flexc.or_masks(causal, flexc.not_mask(window)).__name__ == "or_masks(causal, not_mask(window))"
    bm = flexc.create_block_mask(flexc.and_masks(causal, window), None, None, 128, 128, device="cpu")
    assert "mask_mod=and_masks(causal, window)" in repr(bm)


@pytest.mark.parametrize("combinator", [flexc.and_masks, flexc.or_masks])
def test_non_callables_and_score_mods_are_rejected_naming_the_position(combinator):
    causal = _mods()["causal"]
    with pytest.raises(TypeError, match="argument 1 must be a mask_mod"):
        combinator(causal, torch.ones(3))
    with pytest.raises(TypeError, match="argument 0 .* is a score_mod"):
        combinator(lambda score, b, h, q_idx, kv_idx: score, causal)
    with pytest.raises(TypeError, match="argument 0 must be a mask_mod"):
        flexc.not_mask(None)
