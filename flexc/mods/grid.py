"""A mod over a whole ``[B, H, Q_LEN, KV_LEN]`` grid, traced on demand and evaluated in query chunks."""
from __future__ import annotations

from typing import Any

import torch

from .evaluate import evaluate, index_grid
from .trace import trace
from .traced_mod import SCORE_MOD


def evaluate_grid(mod: Any, B: int, H: int, Q_LEN: int, KV_LEN: int, device: Any = None,
                  score: torch.Tensor | None = None, max_elements: int = 1 << 24) -> torch.Tensor:
    """The mod over the full ``[B, H, Q_LEN, KV_LEN]`` grid, computed in query chunks.

    For a score_mod, ``score`` defaults to zeros (float32). Intermediates never exceed about
    ``max_elements`` elements per chunk; the output itself is dense.
    """
    traced = trace(mod)
    rows = max(1, min(Q_LEN, max_elements // max(1, B * H * KV_LEN)))
    chunks = []
    for q0 in range(0, Q_LEN, rows):
        n = min(rows, Q_LEN - q0)
        grid = index_grid(B, H, n, KV_LEN, device, q_start=q0)
        if traced.kind == SCORE_MOD:
            if score is None:
                s = torch.zeros((), device=device)
            elif score.dim() >= 2 and score.shape[-2] == Q_LEN and Q_LEN > 1:
                s = score[..., q0:q0 + n, :]
            else:  # broadcast along queries (e.g. a 0-d or [.., 1, S] score)
                s = score
            grid["score"] = s
        chunks.append(evaluate(traced, **grid).expand(B, H, n, KV_LEN))
    return torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0].contiguous()
