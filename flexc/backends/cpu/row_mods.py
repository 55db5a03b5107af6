"""The traced mods as the CPU row loop applies them: on index tensors of exactly the positions a
chunk of one group of heads visits.

:class:`Mods` holds, for one group of query heads (:class:`flexc.backends.cpu.head_groups.Group`), the
score_mod in the forms the row loop takes (a ``score +/- X`` bias added in place, a general mod
rewritten for base-2 scores, soft-capping's slope), the mask_mod evaluated only on a chunk's partial
columns, and dropout's keep decisions; the functions below write a chunk's blocked pairs into a
tile. The forward (:mod:`flexc.backends.cpu.torch_cpu`), the backward
(:mod:`flexc.backends.cpu.torch_cpu_backward`) and the fused, band and dense-tile paths read them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..dropout import Dropout, keep_scale
from ...constants import LOG2E
from ...mods import ir
from ...mods.evaluate import evaluate
from ...mods.trace import TracedMod
from .block_plan import Chunk
from .score_mod_passes import FIXED_MAX_SPAN, log2_form, tanh_cap, value_bounds

# Above this many partial spans in one chunk the mask is evaluated once over the whole chunk.
_MAX_PARTIAL_SPANS = 4
_NEG_INF = float("-inf")


def is_true(mod: TracedMod | None) -> bool:
    return mod is None or (mod.root.op == "const" and mod.root.attr is True)


def score_bias(mod: TracedMod | None):
    """``(X, sign)`` when the score_mod is ``score + X`` (sign 1) or ``score - X`` (sign -1) with ``X``
    not reading ``score`` (ALiBi, relative and learned biases), else ``(None, 0)``.

    Such a mod is applied as one in-place ``add_`` of ``X`` onto the scores.
    """
    if mod is None or mod.root.op not in ("add", "sub"):
        return None, 0
    reads_score = lambda node: "score" in ir.inputs_read(node)
    left, right = mod.root.args
    is_score = lambda node: node.op == "input" and node.attr == "score"
    if is_score(left) and not reads_score(right):
        return right, (1 if mod.root.op == "add" else -1)
    if mod.root.op == "add" and is_score(right) and not reads_score(left):
        return left, 1
    return None, 0


class Mods:
    """Evaluates the traced mods for one group on index tensors of exactly the visited positions.

    ``g`` is a :class:`flexc.backends.cpu.head_groups.Group` (its query batches ``g.b`` and heads
    ``g.qh`` are read; the type is not imported, since head_groups builds Mods).
    """

    def __init__(self, score_mod: TracedMod | None, mask_mod: TracedMod | None, g,
                 B: int, Hq: int, L: int, S: int, device: torch.device, dropout: Dropout | None = None):
        self.score_mod = score_mod
        self.dropout, self.Hq = dropout, Hq
        self.mask_mod = None if is_true(mask_mod) else mask_mod
        self.score_reads = ir.inputs_read(score_mod.root) if score_mod is not None else frozenset()
        self.bias_node, self.bias_sign = score_bias(score_mod)
        self.bias_reads = ir.inputs_read(self.bias_node) if self.bias_node is not None else frozenset()
        # the forward's general score_mod, rewritten for base-2 scores (see score_mod_passes.log2_form)
        self.log2_mod, self.pre_scale, self.log2_folded = None, 1.0, False
        if score_mod is not None and self.bias_node is None:
            root, self.pre_scale, self.log2_folded = log2_form(score_mod.root)
            self.log2_mod = dataclasses.replace(score_mod, root=root)
        # a bounded score_mod (soft-capping): the softmax offset is its bound, base 2 (see torch_cpu._forward_row)
        self.fixed_max = None
        bounds = value_bounds(score_mod.root) if self.log2_mod is not None else None
        if bounds is not None and bounds[1] - bounds[0] <= FIXED_MAX_SPAN:
            self.fixed_max = bounds[1] * LOG2E
        self.mask_reads = ir.inputs_read(self.mask_mod.root) if self.mask_mod is not None else frozenset()
        # soft-capping's (pre, cap): the backward's slope in place (see score_mod_passes.tanh_cap)
        self.tanh_cap = tanh_cap(score_mod.root) if score_mod is not None else None
        self.b = torch.arange(B, device=device)[g.b].view(-1, 1, 1, 1)
        self.h = torch.arange(Hq, device=device)[g.qh].view(1, -1, 1, 1)
        self.q_pos = torch.arange(L, device=device)
        self.kv_pos = torch.arange(S, device=device)

    def indices(self, reads: frozenset, q0: int, q1: int, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        """The index tensors among ``reads`` (``b``, ``h``, ``q_idx``, ``kv_idx``) of rows ``[q0, q1)``, keys ``kv``."""
        values = {"b": self.b, "h": self.h, "q_idx": self.q_pos[q0:q1].view(1, 1, -1, 1), "kv_idx": kv.view(1, 1, 1, -1)}
        return {name: values[name] for name in reads if name in values}

    def score(self, s4: torch.Tensor, q0: int, q1: int, kv: torch.Tensor, buffers: Sequence | None = None,
              overwrite: bool = False, mod: TracedMod | None = None) -> torch.Tensor:
        """The score_mod applied to raw scores ``s4 [b, h, r, c]`` (result may broadcast); with
        ``overwrite`` its elementwise steps may compute into ``s4`` (:func:`flexc.mods.evaluate.evaluate`)."""
        args = self.indices(self.score_reads, q0, q1, kv)
        if "score" in self.score_reads:
            args["score"] = s4
        return evaluate(mod or self.score_mod, clamp_lookups=True, buffers=buffers, overwrite_score=overwrite, **args)

    def bias(self, q0: int, q1: int, kv: torch.Tensor) -> torch.Tensor:
        """``X`` of a ``score +/- X`` score_mod at these positions (broadcastable to the scores)."""
        return evaluate(self.bias_node, clamp_lookups=True, buffers=self.score_mod.buffers,
                        **self.indices(self.bias_reads, q0, q1, kv))

    def kept(self, q0: int, q1: int, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dropout's ``1 / (1 - p)`` or 0 per pair of these rows and keys (:mod:`flexc.backends.dropout`)."""
        return keep_scale(self.dropout, self.Hq, self.b, self.h, self.q_pos[q0:q1].view(1, 1, -1, 1),
                          kv.view(1, 1, 1, -1), dtype)

    def blocked(self, chunk: Chunk, q0: int, q1: int, kv: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """``(offset, length, not_allowed)`` for the chunk's partial columns; empty when none need masking."""
        if self.mask_mod is None or not chunk.partial:
            return []
        if len(chunk.partial) <= _MAX_PARTIAL_SPANS:
            out = []
            for off, n in chunk.partial:
                allowed = evaluate(self.mask_mod, clamp_lookups=True,
                                   **self.indices(self.mask_reads, q0, q1, kv[off:off + n]))
                out.append((off, n, allowed.logical_not()))
            return out
        allowed = evaluate(self.mask_mod, clamp_lookups=True, **self.indices(self.mask_reads, q0, q1, kv))
        full_cols = torch.ones(chunk.n_cols, dtype=torch.bool, device=kv.device)
        for off, n in chunk.partial:
            full_cols[off:off + n] = False
        return [(0, chunk.n_cols, (allowed | full_cols).logical_not())]


def fill(t: torch.Tensor, blocked: list, value: float) -> None:
    for off, n, not_allowed in blocked:
        t[..., off:off + n].masked_fill_(not_allowed, value)


def zero_blocked(t: torch.Tensor, blocked: list) -> None:
    """Zero the blocked pairs of ``t``: a product with a 0/1 tile (a broadcast masked_fill_ is ~10x
    slower), then, only if that left a NaN (NaN or inf times 0), the exact fill."""
    for off, n, not_allowed in blocked:
        part = t[..., off:off + n]
        part.mul_(torch.logical_not(not_allowed).to(t.dtype))
        if bool(part.isnan().any()):
            part.masked_fill_(not_allowed, 0.0)


def add_minus_inf(t: torch.Tensor, blocked: list) -> None:
    """Mask finite scores by adding a 0/-inf bias: several times faster than a broadcast
    masked_fill_, but only right when no score can be NaN or +inf (so not after a score_mod)."""
    for off, n, not_allowed in blocked:
        t[..., off:off + n].add_(torch.where(not_allowed, _NEG_INF, 0.0).to(t.dtype))

