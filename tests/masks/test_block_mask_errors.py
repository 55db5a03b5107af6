"""Bad input to the block-mask API raises TypeError/ValueError naming the argument and the fix."""
import pytest
import torch

import flexc


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_document_mask(batch, length):
    document_id = torch.arange(batch * length).view(batch, length) // 7

    def per_batch_documents(b, h, q_idx, kv_idx):
        return document_id[b, q_idx] == document_id[b, kv_idx]

    return per_batch_documents


@pytest.mark.parametrize("kwargs, error, words", [
    ({"Q_LEN": 0}, ValueError, "Q_LEN must be positive, got 0"),
    ({"KV_LEN": -5}, ValueError, "KV_LEN must be positive, got -5"),
    ({"B": 0}, ValueError, "B must be positive"),
    ({"H": 2.0}, TypeError, "H must be a positive int or None, got float"),
    ({"Q_LEN": "128"}, TypeError, "Q_LEN must be a positive int, got str"),
    ({"BLOCK_SIZE": 0}, ValueError, "BLOCK_SIZE must be positive"),
    ({"BLOCK_SIZE": (128,)}, ValueError, r"BLOCK_SIZE must be an int or a \(Q_BLOCK, KV_BLOCK\) pair"),
    ({"BLOCK_SIZE": (128, -64)}, ValueError, r"BLOCK_SIZE\[1\] \(the kv block\) must be positive"),
    ({"separate_full_blocks": None}, TypeError, "separate_full_blocks must be a bool"),
    ({"compute_dq_write_order": True}, NotImplementedError, "compute_dq_write_order"),
])
def test_create_block_mask_rejects_bad_sizes_naming_the_argument(kwargs, error, words):
    args = {"B": 1, "H": 1, "Q_LEN": 128, "KV_LEN": 128, **kwargs}
    with pytest.raises(error, match=words):
        flexc.create_block_mask(causal, args.pop("B"), args.pop("H"), args.pop("Q_LEN"), args.pop("KV_LEN"),
                                device="cpu", **args)


def test_create_block_mask_rejects_a_score_mod_and_non_callables():
    with pytest.raises(TypeError, match="mask_mod must be a mask_mod .* is a score_mod"):
        flexc.create_block_mask(lambda score, b, h, q_idx, kv_idx: score, 1, 1, 64, 64, device="cpu")
    with pytest.raises(TypeError, match="expected a mask_mod function"):
        flexc.create_block_mask(torch.ones(4, 4), 1, 1, 64, 64, device="cpu")
    with pytest.raises(TypeError, match="expected 5 for a score_mod"):
        flexc.create_block_mask(lambda q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 64, 64, device="cpu")


def test_sizes_larger_than_the_captured_tensors_are_rejected_before_evaluation():
    mod = make_document_mask(batch=2, length=100)
    flexc.create_block_mask(mod, 2, 1, 100, 100, device="cpu")  # fits
    flexc.create_block_mask(mod, None, 1, 100, 100, device="cpu")  # broadcast B is 1
    with pytest.raises(ValueError, match=r"B=4, .*`document_id` \(shape \[2, 100\]\) with `b` in dimension 0.*"
                                         r"Fix: pass B=2 or less"):
        flexc.create_block_mask(mod, 4, 1, 100, 100, device="cpu")
    with pytest.raises(ValueError, match=r"Q_LEN=101.*with `q_idx` in dimension 1"):
        flexc.create_block_mask(mod, 2, 1, 101, 100, device="cpu")
    with pytest.raises(ValueError, match=r"KV_LEN=128"):
        flexc.create_mask(mod, 2, 1, 100, 128, device="cpu")


def test_an_out_of_range_computed_index_is_reported_as_a_size_mismatch():
    shift = torch.arange(100)

    def shifted(b, h, q_idx, kv_idx):
        return shift[q_idx + 10] >= kv_idx

    with pytest.raises(ValueError, match="indexed a captured tensor out of range for B=1, H=1, Q_LEN=100"):
        flexc.create_block_mask(shifted, 1, 1, 100, 100, device="cpu", _analytic=False)


def test_create_mask_rejects_bad_input():
    with pytest.raises(TypeError, match="mod_fn must be a mask_mod or score_mod"):
        flexc.create_mask("causal", 1, 1, 8, 8)
    with pytest.raises(ValueError, match="KV_LEN must be positive"):
        flexc.create_mask(causal, 1, 1, 8, 0)


def test_block_mask_constructors_reject_inconsistent_tables():
    num, idx = flexc.analysis.tiles.dense_to_ordered(torch.ones(1, 1, 2, 3))
    with pytest.raises(ValueError, match="full_kv_num_blocks and full_kv_indices must be given together"):
        flexc.BlockMask.from_kv_blocks(num, idx, full_kv_num_blocks=num)
    with pytest.raises(ValueError, match=r"kv_num_blocks has shape \[1, 1, 3\] but kv_indices \[1, 1, 2, 3\]"):
        flexc.BlockMask.from_kv_blocks(torch.zeros(1, 1, 3, dtype=torch.int32), idx)
    with pytest.raises(ValueError, match="kv_indices must be a tensor with at least 2 dims"):
        flexc.BlockMask.from_kv_blocks(num, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="expected a torch.nn.attention.flex_attention.BlockMask, got dict"):
        flexc.BlockMask.from_torch({})
    with pytest.raises(ValueError, match="new_q_len must be positive"):
        flexc.BlockMask.from_kv_blocks(num, idx)._adjust(0, 10)
