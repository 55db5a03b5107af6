"""Ready-made mask_mods and the combinators that build new ones from old.

The combinators return plain Python mask_mods ``f(b, h, q_idx, kv_idx)`` that call the given mods
and join the results with ``&``, ``|`` or ``~``. Tracing one therefore yields the combined
expression itself, so analysis and code generation see through the combination:

>>> import flexc
>>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
>>> window = lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 256
>>> print(flexc.trace(and_masks(causal, window)))
(q_idx >= kv_idx) & (q_idx - kv_idx <= 256)
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import InvalidTypeError
from ..mods.trace import MASK_MOD, mod_kind

MaskMod = Callable[..., torch.Tensor]


def noop_mask(batch: torch.Tensor, head: torch.Tensor, token_q: torch.Tensor, token_kv: torch.Tensor) -> torch.Tensor:
    """The mask_mod that allows everything (torch's default; torch's parameter names)."""
    return batch.new_ones((), dtype=torch.bool)


def _name_of(mod: Callable) -> str:
    return getattr(mod, "__name__", None) or type(mod).__name__


def _check_mask_mods(combinator: str, mods: tuple) -> None:
    for position, mod in enumerate(mods):
        if not callable(mod):
            raise InvalidTypeError(
                f"{combinator}: All inputs should be callable mask_mods: argument {position} must be a "
                f"mask_mod function (b, h, q_idx, kv_idx), "
                f"got {type(mod).__name__} {mod!r}. Fix: pass the function itself, not its result.")
        kind = mod_kind(mod)
        if kind != MASK_MOD:
            raise TypeError(
                f"{combinator}: argument {position} ({_name_of(mod)}) is a score_mod (5 positional "
                f"parameters), expected a mask_mod (b, h, q_idx, kv_idx). Fix: combine mask_mods only; "
                f"to mask with a score_mod, return -inf from it instead.")


def _named(fn: MaskMod, name: str) -> MaskMod:
    fn.__name__ = fn.__qualname__ = name
    return fn


def _fold(mods: tuple, op: Callable, b, h, q_idx, kv_idx):
    result = mods[0](b, h, q_idx, kv_idx)
    for mod in mods[1:]:
        result = op(result, mod(b, h, q_idx, kv_idx))
    return result


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod allowing a position only where every one of ``mask_mods`` does.

    With no arguments it allows everything, as torch's does.
    """
    _check_mask_mods("and_masks", mask_mods)
    if not mask_mods:
        return _named(lambda b, h, q_idx, kv_idx: noop_mask(b, h, q_idx, kv_idx), "and_masks()")

    def and_mask(b, h, q_idx, kv_idx):
        return _fold(mask_mods, lambda x, y: x & y, b, h, q_idx, kv_idx)

    return _named(and_mask, f"and_masks({', '.join(map(_name_of, mask_mods))})")


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod allowing a position where any one of ``mask_mods`` does.

    With no arguments it allows nothing, as torch's does.
    """
    _check_mask_mods("or_masks", mask_mods)
    if not mask_mods:
        return _named(lambda b, h, q_idx, kv_idx: b.new_zeros((), dtype=torch.bool), "or_masks()")

    def or_mask(b, h, q_idx, kv_idx):
        return _fold(mask_mods, lambda x, y: x | y, b, h, q_idx, kv_idx)

    return _named(or_mask, f"or_masks({', '.join(map(_name_of, mask_mods))})")


def not_mask(mask_mod: MaskMod) -> MaskMod:
    """A mask_mod allowing exactly the positions ``mask_mod`` forbids."""
    _check_mask_mods("not_mask", (mask_mod,))

    def negated(b, h, q_idx, kv_idx):
        result = mask_mod(b, h, q_idx, kv_idx)
        # `~True` is -2 in Python: a mod returning a plain bool needs `not`.
        return (not result) if isinstance(result, bool) else ~result

    return _named(negated, f"not_mask({_name_of(mask_mod)})")
