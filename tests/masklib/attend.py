"""Attention with a mask and a score mod, returning the output and the logsumexp."""
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from .blocks import build_block_mask, default_kernel_options
from .mods import compose_score_mods


def attend(q, k, v, mask_mod, *score_mods):
    block_mask = build_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2])
    out, aux = flex_attention(q, k, v, score_mod=compose_score_mods(*score_mods), block_mask=block_mask,
                              kernel_options=default_kernel_options(), return_aux=AuxRequest(lse=True))
    return out, aux.lse
