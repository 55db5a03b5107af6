"""Score mods and score-mod factories."""
import torch
from torch.nn.attention.flex_attention import _identity, _score_mod_signature


def generate_alibi_bias(H: int) -> _score_mod_signature:
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        return score + (kv_idx - q_idx) * scale

    return alibi_mod


def generate_tanh_softcap(soft_cap: float) -> _score_mod_signature:
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    return tanh_softcap


def compose_score_mods(*mods: _score_mod_signature) -> _score_mod_signature:
    """Apply ``mods`` in order; no mods is the identity."""
    if not mods:
        return _identity

    def composed(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return composed
