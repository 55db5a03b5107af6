"""The mods inside a generated kernel: their device functions, parameter names, and the lines that
apply them to a tile of scores (shared by the forward, decode and backward generators).
"""
from __future__ import annotations

from ..mods.trace import TracedMod
from .printer import RenderedMod, python_literal, render_mod

# Parameter stems the kernels themselves use (every ``<stem>_ptr`` parameter of the forward kernel
# and attend_blocks, and of the backward and decode kernels); a captured tensor with one of these
# names is renamed.
RESERVED = {"query", "key", "value", "out", "lse", "partial_block_counts", "partial_block_indices",
            "full_block_counts", "full_block_indices", "block_counts", "block_indices", "block_count",
            "block_index",
            # the backward and decode kernels' own pointers (they name captured tensors the same way)
            "count", "index", "delta", "dq", "dk", "dv", "grad_out", "out_split", "lse_split",
            "partial_kv_counts", "partial_kv_indices", "full_kv_counts", "full_kv_indices",
            "partial_q_counts", "partial_q_indices", "full_q_counts", "full_q_indices"}


def param_stems(traced: TracedMod | None, taken: set[str], suffix: str) -> dict[int, str]:
    """Parameter stems for a mod's captured tensors: their names, made unique in the kernel."""
    stems: dict[int, str] = {}
    if traced is None:
        return stems
    for slot, name in enumerate(traced.buffer_names):
        stem = name if name.isidentifier() and not name.startswith("_") else f"buf{slot}"
        if stem in taken or stem in RESERVED:
            stem = f"{stem}_{suffix}"
        while stem in taken or stem in RESERVED:
            stem = f"{stem}_{slot}"
        taken.add(stem)
        stems[slot] = stem
    return stems


def render_mods(spec, target: str | None = None, index_dtype: str = "int32", hoist: bool = False
                ) -> tuple[RenderedMod | None, RenderedMod | None]:
    """The spec's mods as device functions (``target``/``index_dtype``/``hoist`` as in
    :func:`render_mod`, and the spec's ``float_indices`` where it has one); None for a mod that does
    nothing (absent, the identity score_mod, a mask allowing everything)."""
    float_indices = getattr(spec, "float_indices", False)
    taken: set[str] = set()
    score = mask = None
    if spec.score_mod is not None:
        score = render_mod(spec.score_mod, "score_mod", param_stems(spec.score_mod, taken, "score"),
                           target=target, index_dtype=index_dtype, float_indices=float_indices, hoist=hoist)
    if spec.mask_mod is not None:
        mask = render_mod(spec.mask_mod, "mask_mod", param_stems(spec.mask_mod, taken, "mask"),
                          target=target, index_dtype=index_dtype, float_indices=float_indices, hoist=hoist)
        if mask.is_constant and mask.literal is True:
            mask = None  # allows everything: nothing to apply
    if score is not None and spec.score_mod.root.op == "input":
        score = None  # the identity score_mod
    return score, mask


def buffer_params(score: RenderedMod | None, mask: RenderedMod | None) -> list[str]:
    """The captured-value parameter names of both mods, score_mod's first: the kernel's parameters."""
    names = []
    for r in (score, mask):
        if r is not None:
            names += [p.name for p in r.params]
    return names


def buffer_args(score: RenderedMod | None, mask: RenderedMod | None) -> list[str]:
    """What the kernel's block loops pass on to both mods, score_mod's first: their hoisted values
    and the captured-value parameters their bodies read (:attr:`RenderedMod.call_args`)."""
    names: list[str] = []
    for r in (score, mask):
        if r is not None:
            names += [name for name in r.call_args if name not in names]
    return names


def hoisted_lines(mods, indent: str) -> list[str]:
    """The lookups the ``mods`` take as values (:attr:`RenderedMod.hoisted`), each computed once where
    ``b`` and ``h`` are known, before the block loops; none if no mod has one."""
    seen: dict[str, str] = {}
    for r in mods:
        if r is not None:
            for name, text in r.hoisted:
                seen.setdefault(name, text)
    if not seen:
        return []
    return [f"{indent}# the mods' lookups indexed only by batch and head: loaded once here, not per key tile",
            *(f"{indent}{name} = {text}" for name, text in seen.items())]


def score_lines(spec, score: RenderedMod | None, indent: str) -> list[str]:
    """Apply the score_mod to ``qk`` (the scaled scores of one tile)."""
    if spec.score_mod is None or score is None:
        return []
    out = [f"{indent}# score_mod: {score.expression}"]
    if score.is_constant:
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), {python_literal(float(score.literal))}, qk.dtype)")
        return out
    args = ", ".join(["qk", "b", "h", "q_idx", "kv_idx", *score.call_args])
    call = f"score_mod({args})"
    full_tile = "score" in score.reads or {"q_idx", "kv_idx"} <= score.reads
    if full_tile:
        out.append(f"{indent}qk = {call}.to(qk.dtype)")
    else:  # the mod ignores the score and varies along at most one axis: broadcast it to the tile
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), 0.0, qk.dtype) + {call}")
    return out


def mask_lines(spec, mask: RenderedMod | None, indent: str) -> list[str]:
    """Set the scores of ``qk`` the mask_mod disallows to -inf."""
    if spec.mask_mod is None or mask is None:
        return []
    out = [f"{indent}# mask_mod: {mask.expression}"]
    if mask.is_constant:  # always False here (always True was dropped)
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), float(\"-inf\"), qk.dtype)")
        return out
    args = ", ".join(["b", "h", "q_idx", "kv_idx", *mask.call_args])
    out.append(f"{indent}qk = tl.where(mask_mod({args}), qk, float(\"-inf\"))")
    return out


__all__ = ["RESERVED", "buffer_args", "buffer_params", "hoisted_lines", "mask_lines", "param_stems", "render_mods", "score_lines"]
