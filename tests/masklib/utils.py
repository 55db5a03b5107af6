"""Evaluate a mod over a whole [B, H, Q, KV] grid (how visualisation helpers do it)."""
import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention.flex_attention import _ModificationType, _get_mod_type, _vmap_for_bhqkv


def mod_grid(mod, B: int, H: int, M: int, N: int, scores: torch.Tensor = None) -> torch.Tensor:
    b, h, m, n = (torch.arange(size) for size in (B, H, M, N))
    mod_type = _get_mod_type(mod)
    with TransformGetItemToIndex():
        if mod_type == _ModificationType.SCORE_MOD:
            return _vmap_for_bhqkv(mod, prefix=(0,))(scores, b, h, m, n)
        return _vmap_for_bhqkv(mod, prefix=())(b, h, m, n)
