"""Analytic tile classification over the shared mask catalogue: always sound, exact where promised.

"Exact" means a tile is left UNDECIDED only when it really mixes allowed and masked elements, so
create_block_mask evaluates no tile it could have skipped.
"""
import pytest
import torch

import flexc
from catalogue import mask_catalogue
from flexc.analysis.ranges import EMPTY, FULL, MIXED, UNDECIDED, classify_tiles, mark_mixed_tiles
from reference import exact_classes

SHAPES = [(2, 3, 100, 130, 16, 8), (1, 2, 256, 256, 32, 32), (2, 2, 77, 300, 16, 64)]
CATALOGUE_NAMES = sorted(mask_catalogue(1, 1, 8, 8))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_catalogue_mask_is_classified_soundly(shape):
    B, H, L, S, QB, KB = shape
    for name, mod in mask_catalogue(B, H, L, S).items():
        traced = flexc.trace(mod)
        classes = classify_tiles(traced, B, H, L, S, QB, KB)
        exact = exact_classes(traced, B, H, L, S, QB, KB)
        assert not ((classes == FULL) & (exact != FULL)).any(), name
        assert not ((classes == EMPTY) & (exact != EMPTY)).any(), name


# Masks made of affine comparisons (and //, % that do not wrap inside a tile, lookups by b or h):
# every tile must be decided exactly.
EXACT_MASKS = ["causal", "causal_lower_right", "sliding_window_256", "sliding_window_17",
               "sliding_window_lower_right_17", "bidirectional_window_9", "prefix_lm", "prefix_lm_per_batch",
               "chunked_causal_32", "block_diagonal_16", "per_head_window", "padding_per_batch",
               "batch_and_head_dependent", "leading_sink_tokens_and_window", "tensor_method_window",
               "where_prefix_then_causal", "all_true_by_comparison", "noop", "and_causal_window_local",
               "or_prefix_lm_chunked", "document", "document_causal", "cross_document"]


@pytest.mark.parametrize("name", EXACT_MASKS)
def test_affine_and_sorted_document_masks_leave_no_decidable_tile_undecided(name):
    B, H, L, S, QB, KB = 2, 2, 640, 512, 64, 32
    traced = flexc.trace(mask_catalogue(B, H, L, S)[name])
    classes = classify_tiles(traced, B, H, L, S, QB, KB)
    assert torch.equal(classes, exact_classes(traced, B, H, L, S, QB, KB))


def test_document_masks_with_logical_offsets_are_undecided_only_on_document_boundaries():
    # q_idx - offsets[doc[q_idx]] loses the link between q_idx and its document (the dependency
    # problem), so precision may be lost, but only in tiles that straddle a document boundary.
    B, H, L, S, QB, KB = 1, 1, 512, 512, 32, 32
    catalogue = mask_catalogue(B, H, L, S)
    doc = flexc.trace(catalogue["document"]).buffers[0]
    changes = torch.zeros(L, dtype=torch.int32)
    changes[1:] = (doc[1:L] != doc[:L - 1]).int()
    crosses = lambda n, block: torch.stack([changes[i * block + 1:(i + 1) * block].any() for i in range(n)])
    boundary = crosses(L // QB, QB)[:, None] | crosses(S // KB, KB)[None, :]
    for name in ("document_logical_causal", "document_logical_prefix_lm"):
        traced = flexc.trace(catalogue[name])
        classes = classify_tiles(traced, B, H, L, S, QB, KB)[0, 0]
        imprecise = (classes == UNDECIDED) & (exact_classes(traced, B, H, L, S, QB, KB)[0, 0] != UNDECIDED)
        assert not (imprecise & ~boundary).any(), name


def test_causal_at_long_length_decides_all_but_the_diagonal_without_elements():
    L, block = 1 << 17, 128
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    classes = classify_tiles(traced, 1, 1, L, L, block, block)[0, 0]
    n = L // block
    assert int((classes == UNDECIDED).sum()) == n
    assert torch.equal(torch.diagonal(classes), torch.full((n,), UNDECIDED, dtype=torch.int8))
    assert int((classes == FULL).sum()) == n * (n - 1) // 2
    # sampling proves every diagonal tile mixed: nothing is left for element-wise evaluation
    marked = mark_mixed_tiles(traced, classes[None, None].clone(), L, L, block, block)[0, 0]
    assert torch.equal(torch.diagonal(marked), torch.full((n,), MIXED, dtype=torch.int8))
