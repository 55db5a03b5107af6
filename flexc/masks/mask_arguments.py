"""The arguments of the mask builders checked, each error naming the argument and the fix: lengths and
block sizes, the device, sizes a captured tensor cannot serve, and the mod traced as a mask_mod."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import device as gpu
from ..mods.trace import trace
from ..mods.traced_mod import TracedMod, mod_kind


def positive_int(where: str, name: str, value: Any, allow_none: bool = False) -> int | None:
    """``value`` as a positive int (a 0-d integer tensor is read); None passes when ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
            value = int(value)
        else:
            expected = "a positive int or None" if allow_none else "a positive int"
            raise TypeError(f"{where}: {name} must be {expected}, got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{where}: {name} must be positive, got {value}. Fix: pass a length or "
                         f"size of at least 1{' (or None to broadcast)' if allow_none else ''}.")
    return value


def block_sizes(where: str, BLOCK_SIZE: Any) -> tuple[int, int]:
    """``(Q_BLOCK, KV_BLOCK)`` from an int or a pair of positive ints."""
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"{where}: BLOCK_SIZE must be an int or a (Q_BLOCK, KV_BLOCK) pair, got "
                             f"{len(BLOCK_SIZE)} values {tuple(BLOCK_SIZE)!r}.")
        return (positive_int(where, "BLOCK_SIZE[0] (the q block)", BLOCK_SIZE[0]),
                positive_int(where, "BLOCK_SIZE[1] (the kv block)", BLOCK_SIZE[1]))
    size = positive_int(where, "BLOCK_SIZE", BLOCK_SIZE)
    return size, size


def resolve_device(device: Any, traced: TracedMod, where: str = "create_block_mask") -> torch.device:
    """``device`` as torch means it (``"cuda"``: the current CUDA device), checked usable; None: the
    device of the tensors the mod captured, else a usable accelerator, else the CPU
    (:func:`flexc.device.default_device`, which the compiled ``create_block_mask`` follows too).
    (torch picks the accelerator even when the mod's tensors live elsewhere, which then fails;
    following the captured tensors builds the mask where its data is.)"""
    return gpu.default_device(traced.buffers) if device is None else gpu.usable(device, where)


def check_captured_sizes(where: str, traced: TracedMod, extents: dict[str, tuple[str, int]]) -> None:
    """Reject sizes a captured tensor cannot serve, e.g. ``B=4`` with ``doc_ids[b, q_idx]`` of 2 rows.

    Only direct indexing by a mod argument is checked; computed indices are left to evaluation.
    """
    for node in traced.root.walk():
        if node.op != "load":
            continue
        slot = node.args[0].attr[0]
        tensor = traced.buffers[slot]
        for dim, index in enumerate(node.args[1:]):
            if index.op != "input" or index.attr not in extents:
                continue
            arg, extent = extents[index.attr]
            size = tensor.shape[dim]
            if extent > size:
                name = traced.buffer_names[slot] if slot < len(traced.buffer_names) else f"buf{slot}"
                raise ValueError(
                    f"{where}: {arg}={extent}, but {traced.name} indexes the captured tensor `{name}` "
                    f"(shape {list(tensor.shape)}) with `{index.attr}` in dimension {dim}, which has only "
                    f"{size} entries. Fix: pass {arg}={size} or less"
                    f"{' (None broadcasts as 1)' if arg in ('B', 'H') else ''}, or capture a tensor sized for "
                    f"{arg}={extent}.")


def trace_as(where: str, mod: Callable, kinds: tuple[str, ...]) -> TracedMod:
    """``mod`` traced, checked to be one of ``kinds`` (a score_mod passed as a mask_mod is named as one)."""
    if isinstance(mod, TracedMod):
        traced = mod
    else:
        if not callable(mod):
            raise TypeError(f"{where}: expected a mask_mod function (b, h, q_idx, kv_idx), got "
                            f"{type(mod).__name__} {mod!r}.")
        kind = mod_kind(mod)
        if kind not in kinds:
            raise TypeError(
                f"{where}: mask_mod must be a mask_mod (b, h, q_idx, kv_idx) -> bool, but "
                f"{getattr(mod, '__name__', mod)!r} is a score_mod (score, b, h, q_idx, kv_idx). Fix: "
                f"write the condition as a mask_mod, or use create_mask(score_mod, ...) for a dense mask.")
        traced = trace(mod, kind=kind)
    if traced.kind not in kinds:
        raise TypeError(f"{where}: expected a mask_mod, got a traced {traced.kind} {traced.name}.")
    return traced
