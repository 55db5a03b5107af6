"""A dense float64 attention reference for tests, independent of flexc.

The mods are called directly on broadcast int64 index tensors (no tracing), the full ``[B, H, L, S]``
score matrix is materialised, and softmax is written out explicitly, so autograd through this
function gives reference gradients for q, k, v and any captured tensor.
"""
from __future__ import annotations

import math

import torch


def index_tensors(B: int, H: int, L: int, S: int):
    """Broadcastable int64 ``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q [1,1,L,1]``, ``kv [1,1,1,S]``."""
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S))


def random_qkv(B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int | None = None,
               dtype: torch.dtype = torch.float32, Bkv: int | None = None, seed: int = 0):
    """Seeded ``q [B,Hq,L,E]``, ``k [Bkv,Hkv,S,E]``, ``v [Bkv,Hkv,S,Ev]``, drawn in float64 then cast."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(Bkv or B, Hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(Bkv or B, Hkv, S, Ev or E, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def dense_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64, sinks=None):
    """``(out, lse, max_scores)`` of flex attention in ``dtype``, by dense evaluation.

    GQA (``Hq`` a multiple of ``Hkv``) and ``Bkv == 1`` broadcast follow torch's rules. Rows with no
    allowed key give output 0, lse ``-inf`` and max ``-inf``; their gradients are 0. ``sinks``
    (broadcastable to ``[B, Hq]``) join each row's softmax as one more logit with no value row, so
    the lse includes them and a row with no allowed key gets lse ``sink``; max_scores leaves them out.
    """
    B, Hq, L, E = q.shape
    Bkv, Hkv, S, _ = k.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    kk = k.to(dtype).repeat_interleave(G, dim=1).expand(B, Hq, S, E)
    vv = v.to(dtype).repeat_interleave(G, dim=1).expand(B, Hq, S, v.shape[-1])
    scores = (q.to(dtype) @ kk.transpose(-1, -2)) * scale
    b, h, qi, kv = (t.to(q.device) for t in index_tensors(B, Hq, L, S))  # (a CUDA reference on CUDA)
    if score_mod is not None:
        scores = torch.broadcast_to(score_mod(scores, b, h, qi, kv), scores.shape).to(dtype)
    if mask_mod is not None:
        allowed = torch.broadcast_to(mask_mod(b, h, qi, kv), scores.shape)
        scores = torch.where(allowed, scores, torch.tensor(-math.inf, dtype=dtype, device=q.device))
    if sinks is not None:
        sink = torch.broadcast_to(sinks.to(dtype), (B, Hq)).reshape(B, Hq, 1, 1).expand(B, Hq, L, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True)
        return torch.exp(scores - lse) @ vv, lse.squeeze(-1), scores.amax(dim=-1)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    # the logsumexp of a dead row is computed on zeros so its backward stays finite
    lse = torch.logsumexp(torch.where(dead, 0.0, scores), dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)  # exactly 0 at -inf entries
    probs = torch.where(dead, 0.0, probs)
    out = probs @ vv
    lse = torch.where(dead, -math.inf, lse).squeeze(-1)
    max_scores = scores.amax(dim=-1)
    return out, lse, max_scores


def exact_classes(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    """EMPTY/UNDECIDED(mixed)/FULL of every tile's in-range part, from the dense mask."""
    import flexc
    from flexc.analysis.tiles import EMPTY, FULL, UNDECIDED

    dense = flexc.evaluate_grid(traced, B, H, Q_LEN, KV_LEN).to(torch.int32)
    nq, nkv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    allowed = torch.zeros(B, H, nq * Q_BLOCK, nkv * KV_BLOCK, dtype=torch.int32)
    in_range = torch.zeros_like(allowed)
    allowed[:, :, :Q_LEN, :KV_LEN] = dense
    in_range[:, :, :Q_LEN, :KV_LEN] = 1
    count = allowed.view(B, H, nq, Q_BLOCK, nkv, KV_BLOCK).sum((3, 5))
    total = in_range.view(B, H, nq, Q_BLOCK, nkv, KV_BLOCK).sum((3, 5))
    return torch.where(count == 0, EMPTY, torch.where(count == total, FULL, UNDECIDED)).to(torch.int8)


def autograd_node_names(t: torch.Tensor) -> set:
    """The class names of the autograd nodes that produced ``t`` (its whole backward graph)."""
    seen, names, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def decoding_slice(parent, position: torch.Tensor, pos: int, mask_mod, kv_len: int):
    """gpt-fast's decoding-step mask: ``position`` advanced in place to ``pos``, a new closure over
    ``position[0]`` shifting ``mask_mod``'s query index, on ``parent[:, :, position // block]`` with
    ``seq_lengths (1, kv_len)``."""
    position.fill_(pos)
    offset = position[0]

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)
    sliced = parent[:, :, position // parent.BLOCK_SIZE[0]]
    sliced.mask_mod, sliced.seq_lengths = shifted, (1, kv_len)
    return sliced
