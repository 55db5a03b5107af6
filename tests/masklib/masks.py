"""Mask mods and mask-mod factories."""
import torch
from torch.nn.attention.flex_attention import _mask_mod_signature, and_masks, noop_mask, or_masks


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size: int) -> _mask_mod_signature:
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    return and_masks(causal_mask, sliding_window)


def generate_prefix_lm_mask(prefix_length: int) -> _mask_mod_signature:
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    return or_masks(prefix_mask, causal_mask)


def generate_doc_mask_mod(mask_mod: _mask_mod_signature, offsets: torch.Tensor) -> _mask_mod_signature:
    """Documents packed end to end; ``mask_mod`` sees positions local to each document."""
    lengths = offsets[1:] - offsets[:-1]
    document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & mask_mod(b, h, q_logical, kv_logical)

    return doc_mask_mod


def everything(b, h, q_idx, kv_idx):
    return noop_mask(b, h, q_idx, kv_idx)
