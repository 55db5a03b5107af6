"""A catalogue of realistic mask_mods and score_mods, written the way attention-gym users write them.

Every test that needs "many kinds of mods" draws from here: the tracer, the evaluator, the block-mask
builder, the kernels. Each entry is a plain Python function that works three ways: called directly
on broadcast int64 index tensors, traced by flexc, and run by torch's own FlexAttention (vmap).

Captured tensors are made from a seeded generator, so a given (B, H, Q_LEN, KV_LEN) always yields
the same mods. Lookups stay in range for every index in ``[0, Q_LEN)`` x ``[0, KV_LEN)``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

MaskMod = Callable[..., torch.Tensor]
ScoreMod = Callable[..., torch.Tensor]


# ---- combinators ---------------------------------------------------------------------------
# Local versions so the catalogue does not depend on flexc's block-mask module; once flexc provides
# and_masks/or_masks, some entries below use those instead (see `_flexc_combinators`).

def and_masks(*mods: MaskMod) -> MaskMod:
    """A mask that allows a position only when every mod allows it."""
    def combined(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result
    return combined


def or_masks(*mods: MaskMod) -> MaskMod:
    """A mask that allows a position when any mod allows it."""
    def combined(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result
    return combined


def _flexc_combinators():
    """flexc's and_masks/or_masks when they exist, else the local ones."""
    try:
        import flexc
    except ImportError:  # pragma: no cover - the package is always importable in this repo
        return and_masks, or_masks
    return getattr(flexc, "and_masks", and_masks), getattr(flexc, "or_masks", or_masks)


# ---- torch.autograd.Functions a score_mod may call (their own backward defines the gradient) ----

class StraightThroughClamp(torch.autograd.Function):
    """clamp to [-c, c] forward; gradient passed through unchanged (not the clamp's derivative)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, c):
        return torch.clamp(x, -c, c)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScaledGrad(torch.autograd.Function):
    """Old-style (ctx in forward): x * 2 forward, gradient scaled by 0.25 instead of 2."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.25


# ---- building blocks (factories, as in attention-gym) --------------------------------------

def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window: int) -> MaskMod:
    """Causal attention to the previous ``window`` positions (and the current one)."""
    def sliding_window(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        window_mask = q_idx - kv_idx <= window
        return causal & window_mask
    sliding_window.__name__ = f"sliding_window_{window}"
    return sliding_window


def generate_prefix_lm_mask(prefix_length: int) -> MaskMod:
    """Bidirectional over the first ``prefix_length`` keys, causal afterwards."""
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length
    return or_masks(prefix_mask, causal_mask)


def generate_doc_mask_mod(mask_mod: MaskMod, document_id: torch.Tensor, offsets: torch.Tensor) -> MaskMod:
    """Apply ``mask_mod`` inside each document, in positions relative to the document's start."""
    def doc_mask_wrapper(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask
    return doc_mask_wrapper


def generate_dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        in_window = (diff >= 0) & (diff <= window)
        return in_window & (diff % dilation == 0)
    return dilated_sliding_window


def generate_chunked_causal(chunk: int) -> MaskMod:
    def chunked_causal(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)
    return chunked_causal


def generate_natten_1d(kernel_size: int, length: int) -> MaskMod:
    """NATTEN-style neighbourhood: a window of ``kernel_size`` keys centred on the query, shifted
    inward at the sequence edges so every query sees exactly ``kernel_size`` keys."""
    half = kernel_size // 2

    def natten_1d(b, h, q_idx, kv_idx):
        center = torch.clamp(q_idx, half, length - 1 - half)
        return (center - kv_idx).abs() <= half
    return natten_1d


# ---- deterministic captured data -----------------------------------------------------------

def _generator(B: int, H: int, Q_LEN: int, KV_LEN: int, salt: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(1_000_003 * salt + 7919 * B + 104_729 * H + 31 * Q_LEN + KV_LEN)
    return g


def random_documents(total: int, g: torch.Generator, max_len: int | None = None):
    """``(document_id [total], offsets [n_docs])`` for random document lengths covering ``total``."""
    max_len = max_len or max(2, total // 3)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(1, max_len + 1, (), generator=g)))
    lengths[-1] -= sum(lengths) - total
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t  # start of each document
    return document_id, offsets


# ---- the catalogues ------------------------------------------------------------------------

def mask_catalogue(B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> dict[str, MaskMod]:
    """At least 30 named mask_mods valid for a ``[B, H, Q_LEN, KV_LEN]`` problem."""
    g = _generator(B, H, Q_LEN, KV_LEN, salt=1)
    N = max(Q_LEN, KV_LEN)  # lookups indexed by q_idx or kv_idx cover both ranges
    dev = lambda t: t.to(device)

    document_id, offsets = random_documents(N, g)
    document_id, offsets = dev(document_id), dev(offsets)
    # packed cross-attention: query documents of random lengths; key documents spread evenly over
    # the same ids, so queries of document d see the keys of document d
    q_document, _ = random_documents(Q_LEN, g, max_len=max(2, Q_LEN // 2))
    last_doc = int(q_document.max())
    kv_document = dev(last_doc * torch.arange(KV_LEN) // max(1, KV_LEN - 1))
    q_document = dev(q_document)
    is_global = torch.rand(N, generator=g) < 0.05
    is_global[0] = True
    is_global = dev(is_global)
    head_windows = dev(torch.randint(1, 48, (H,), generator=g))
    causal_heads = dev(torch.arange(H) % 2 == 0)
    seq_lengths = dev(torch.randint(1, N + 1, (B,), generator=g))
    prefix_lengths = dev(torch.randint(0, KV_LEN + 1, (B,), generator=g))
    allowed_blocks = dev(torch.rand(B, H, (Q_LEN + 15) // 16, (KV_LEN + 15) // 16, generator=g) < 0.4)
    kept_kv_blocks = dev(torch.rand(H, (KV_LEN + 7) // 8, generator=g) < 0.6)
    dense_keep = dev(torch.rand(Q_LEN, KV_LEN, generator=g) < 0.3)
    prefix_length = max(1, KV_LEN // 4)
    flexc_and, flexc_or = _flexc_combinators()
    sliding_window_17 = generate_sliding_window(17)

    def causal_lower_right(b, h, q_idx, kv_idx):
        # aligned to the bottom-right corner: the last query sees every key (non-square aware)
        return q_idx + (KV_LEN - Q_LEN) >= kv_idx

    def sliding_window_lower_right_17(b, h, q_idx, kv_idx):
        diff = q_idx + (KV_LEN - Q_LEN) - kv_idx
        return (diff >= 0) & (diff <= 17)

    def bidirectional_window_9(b, h, q_idx, kv_idx):
        return torch.abs(q_idx - kv_idx) <= 9

    def prefix_lm_per_batch(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[b]) | (q_idx >= kv_idx)

    def document_mask(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def cross_document(b, h, q_idx, kv_idx):
        # separate document ids for queries and keys, as in packed cross-attention
        return q_document[q_idx] == kv_document[kv_idx]

    def global_tokens_with_window(b, h, q_idx, kv_idx):
        near = (q_idx - kv_idx).abs() <= 8
        return is_global[q_idx] | is_global[kv_idx] | near

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= head_windows[h])

    def causal_or_bidirectional_per_head(b, h, q_idx, kv_idx):
        return ~causal_heads[h] | (q_idx >= kv_idx)

    def padding_per_batch(b, h, q_idx, kv_idx):
        # rows past the batch's length are fully masked
        return (q_idx < seq_lengths[b]) & (kv_idx < seq_lengths[b])

    def block_diagonal_16(b, h, q_idx, kv_idx):
        return q_idx // 16 == kv_idx // 16

    def strided_keys_every_4(b, h, q_idx, kv_idx):
        return (kv_idx % 4 == 0) | (q_idx == kv_idx)

    def parity_checkerboard_xor(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) ^ (kv_idx % 2 == 1)

    def some_rows_fully_masked(b, h, q_idx, kv_idx):
        # every 7th query (q_idx % 7 == 3) attends to nothing
        return (q_idx % 7 != 3) & (q_idx >= kv_idx)

    def noop_mask(b, h, q_idx, kv_idx):
        return b.new_ones(size=(), dtype=torch.bool)

    def all_true_by_comparison(b, h, q_idx, kv_idx):
        return kv_idx >= 0

    def block_sparse_lookup_4d(b, h, q_idx, kv_idx):
        return allowed_blocks[b, h, q_idx // 16, kv_idx // 16]

    def head_kv_block_lookup_2d(b, h, q_idx, kv_idx):
        return kept_kv_blocks[h, kv_idx // 8] | (q_idx == kv_idx)

    def dense_mask_lookup(b, h, q_idx, kv_idx):
        return dense_keep[q_idx, kv_idx]

    def where_prefix_then_causal(b, h, q_idx, kv_idx):
        # queries in the prefix see the whole prefix; later queries are causal
        return torch.where(q_idx < prefix_length, kv_idx < prefix_length, kv_idx <= q_idx)

    def where_global_rows(b, h, q_idx, kv_idx):
        return torch.where(is_global[q_idx], True, q_idx - kv_idx <= 4) & (kv_idx <= q_idx)

    def tensor_method_window(b, h, q_idx, kv_idx):
        return q_idx.ge(kv_idx).logical_and(q_idx.sub(kv_idx).le(32))

    def batch_and_head_dependent(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 4 * (h + 1) + b) & (q_idx >= kv_idx)

    def leading_sink_tokens_and_window(b, h, q_idx, kv_idx):
        return (kv_idx < 4) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 16))

    catalogue: dict[str, MaskMod] = {
        "causal": causal_mask,
        "causal_lower_right": causal_lower_right,
        "sliding_window_256": generate_sliding_window(256),
        "sliding_window_17": sliding_window_17,
        "sliding_window_lower_right_17": sliding_window_lower_right_17,
        "bidirectional_window_9": bidirectional_window_9,
        "prefix_lm": generate_prefix_lm_mask(prefix_length),
        "prefix_lm_per_batch": prefix_lm_per_batch,
        "document": document_mask,
        "document_causal": document_causal,
        "document_logical_causal": generate_doc_mask_mod(causal_mask, document_id, offsets),
        "document_logical_prefix_lm": generate_doc_mask_mod(generate_prefix_lm_mask(3), document_id, offsets),
        "cross_document": cross_document,
        "dilated_sliding_window": generate_dilated_sliding_window(24, 3),
        "chunked_causal_32": generate_chunked_causal(32),
        "natten_1d_7": generate_natten_1d(7, KV_LEN),
        "global_tokens_with_window": global_tokens_with_window,
        "per_head_window": per_head_window,
        "causal_or_bidirectional_per_head": causal_or_bidirectional_per_head,
        "padding_per_batch": padding_per_batch,
        "block_diagonal_16": block_diagonal_16,
        "strided_keys_every_4": strided_keys_every_4,
        "parity_checkerboard_xor": parity_checkerboard_xor,
        "some_rows_fully_masked": some_rows_fully_masked,
        "noop": noop_mask,
        "all_true_by_comparison": all_true_by_comparison,
        "block_sparse_lookup_4d": block_sparse_lookup_4d,
        "head_kv_block_lookup_2d": head_kv_block_lookup_2d,
        "dense_mask_lookup": dense_mask_lookup,
        "where_prefix_then_causal": where_prefix_then_causal,
        "where_global_rows": where_global_rows,
        "tensor_method_window": tensor_method_window,
        "batch_and_head_dependent": batch_and_head_dependent,
        "leading_sink_tokens_and_window": leading_sink_tokens_and_window,
        "and_causal_window_local": and_masks(causal_mask, bidirectional_window_9),
        "or_document_global_local": or_masks(document_mask, global_tokens_with_window),
        "and_document_sliding_window": flexc_and(document_mask, sliding_window_17),
        "or_prefix_lm_chunked": flexc_or(generate_prefix_lm_mask(prefix_length), generate_chunked_causal(8)),
    }
    return catalogue


def score_catalogue(B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> dict[str, ScoreMod]:
    """At least 12 named score_mods valid for a ``[B, H, Q_LEN, KV_LEN]`` problem; all stay finite
    for finite scores except the ones that mask with ``-inf`` on purpose."""
    g = _generator(B, H, Q_LEN, KV_LEN, salt=2)
    dev = lambda t: t.to(device)
    alibi_slopes = dev(torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H))
    head_bias = dev(torch.randn(H, generator=g))
    full_bias = dev(torch.randn(B, H, Q_LEN, KV_LEN, generator=g))
    relative_table = dev(torch.randn(Q_LEN + KV_LEN, generator=g))  # index q - kv + KV_LEN is in [1, Q+KV)
    kv_bias = dev(torch.randn(KV_LEN, generator=g))
    num_buckets, max_distance = 32, 128
    t5_table = dev(torch.randn(H, num_buckets, generator=g))
    temperature = dev(torch.tensor(0.75))  # a 0-d captured scalar
    soft_cap = 20.0

    def identity(score, b, h, q_idx, kv_idx):
        return score

    def alibi_captured_slopes(score, b, h, q_idx, kv_idx):
        return score + alibi_slopes[h] * (kv_idx - q_idx)

    def alibi_exp2_formula(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        return score + (kv_idx - q_idx) * scale

    def relative_position(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    def t5_bucketed_bias(score, b, h, q_idx, kv_idx):
        # T5's bidirectional relative-position buckets: exact for small distances, log-spaced after.
        relative = kv_idx - q_idx
        half = num_buckets // 2
        bucket = (relative > 0).long() * half
        distance = torch.abs(relative)
        max_exact = half // 2
        is_small = distance < max_exact
        # clamp to 1 so log never sees 0; those positions take the `is_small` branch anyway
        log_ratio = torch.log(torch.clamp(distance, min=1).float() / max_exact) / math.log(max_distance / max_exact)
        large = max_exact + (log_ratio * (half - max_exact)).long()
        large = torch.clamp(large, max=half - 1)
        bucket = bucket + torch.where(is_small, distance, large)
        return score + t5_table[h, bucket]

    def soft_capping_tanh(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    def soft_capping_method(score, b, h, q_idx, kv_idx):
        return (score / 30.0).tanh() * 30.0

    def per_head_bias(score, b, h, q_idx, kv_idx):
        return score + head_bias[h]

    def full_4d_bias(score, b, h, q_idx, kv_idx):
        return score + full_bias[b, h, q_idx, kv_idx]

    def learned_relative_1d(score, b, h, q_idx, kv_idx):
        return score + relative_table[q_idx - kv_idx + KV_LEN]

    def causal_through_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))

    def distance_only_ignores_score(score, b, h, q_idx, kv_idx):
        return -(q_idx - kv_idx).abs() * 0.05

    def scalar_tensor_temperature(score, b, h, q_idx, kv_idx):
        return score * temperature

    def checkerboard(score, b, h, q_idx, kv_idx):
        return torch.where(torch.abs(kv_idx - q_idx) % 2 == 1, score * 0.5, score * 2.0)

    def head_index_bias(score, b, h, q_idx, kv_idx):
        return score + 2 * h

    def sigmoid_gate(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid((q_idx - kv_idx) * 0.1)

    def exp_decay(score, b, h, q_idx, kv_idx):
        return score + torch.exp(-torch.abs(q_idx - kv_idx) / 64)

    def log_distance_penalty(score, b, h, q_idx, kv_idx):
        return score - torch.log((q_idx - kv_idx).abs() + 1.0)

    def kv_position_bias(score, b, h, q_idx, kv_idx):
        return score + kv_bias[kv_idx]

    def alibi_causal(score, b, h, q_idx, kv_idx):
        biased = score - alibi_slopes[h] * (q_idx - kv_idx)
        return torch.where(kv_idx <= q_idx, biased, -float("inf"))

    def rsqrt_scaled_by_position(score, b, h, q_idx, kv_idx):
        return score * torch.rsqrt(q_idx + 1.0)

    def scaled_score(score, b, h, q_idx, kv_idx, factor=0.5):
        return score * factor

    return {
        "identity": identity,
        "alibi_captured_slopes": alibi_captured_slopes,
        "alibi_exp2_formula": alibi_exp2_formula,
        "relative_position": relative_position,
        "t5_bucketed_bias": t5_bucketed_bias,
        "soft_capping_tanh": soft_capping_tanh,
        "soft_capping_method": soft_capping_method,
        "per_head_bias": per_head_bias,
        "full_4d_bias": full_4d_bias,
        "learned_relative_1d": learned_relative_1d,
        "causal_through_score": causal_through_score,
        "distance_only_ignores_score": distance_only_ignores_score,
        "scalar_tensor_temperature": scalar_tensor_temperature,
        "checkerboard": checkerboard,
        "head_index_bias": head_index_bias,
        "sigmoid_gate": sigmoid_gate,
        "exp_decay": exp_decay,
        "log_distance_penalty": log_distance_penalty,
        "kv_position_bias": kv_position_bias,
        "alibi_causal": alibi_causal,
        "rsqrt_scaled_by_position": rsqrt_scaled_by_position,
        "scale_by_partial_factor": functools.partial(scaled_score, factor=0.25),
    }
