"""Lookups by 0-d integer index tensors as ``aten.index`` while dynamo speculates a call's mods, so a
lookup has the shape an eager call sees without reading an index's value (see
:mod:`flexc.torch_compile.under_compile`, step 1)."""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _LookupsAsIndex(TorchFunctionMode):
    """``tensor[key]`` with 0-d integer index tensors in ``key`` as ``aten.index``, while dynamo
    speculates the mods (torch's ``TransformGetItemToIndex`` does this for its own mods).

    Python indexing reads a 0-d index tensor's value (``item()``), which a fake tensor does not have:
    data-dependent, dynamo cannot speculate it. ``aten.index`` gives the same shape without the
    value: the rest of the dimensions, so ``q_rope[b, h, q_idx]`` is the row an eager call reads.
    Full slices stay free, other slices are taken first, integers become 0-d indices. The mode acts
    on the fake tensors dynamo runs each recorded operation on, not on what it records: the subgraph
    keeps the lookups as written, which the replay traces."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            out = _lookup_as_index(*args)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))


def _lookup_as_index(x: torch.Tensor, key: Any) -> torch.Tensor | None:
    keys = list(key) if isinstance(key, tuple) else [key]
    index_tensor = lambda k: isinstance(k, torch.Tensor) and not k.is_floating_point() and k.dtype != torch.bool
    if not any(index_tensor(k) and k.dim() == 0 for k in keys):
        return None  # no 0-d index: Python indexing reads no value
    if not all(index_tensor(k) or k is Ellipsis or isinstance(k, slice) or
               (isinstance(k, int) and not isinstance(k, bool)) for k in keys):
        return None  # None (a new axis), bool or float keys: as written
    ellipses = [i for i, k in enumerate(keys) if k is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses:
        keys[ellipses[0]:ellipses[0] + 1] = [slice(None)] * (x.dim() - (len(keys) - 1))
    if len(keys) > x.dim():
        return None
    indices: list = []
    for dim, k in enumerate(keys):
        if isinstance(k, slice):
            if k != slice(None):
                x = x[(slice(None),) * dim + (k,)]
            indices.append(None)
        elif isinstance(k, int):
            indices.append(torch.tensor(k, dtype=torch.int64, device=x.device))
        else:
            indices.append(k)
    while indices[-1] is None:
        indices.pop()
    return torch.ops.aten.index(x, indices)


# the mode while dynamo speculates a call's mods (pushed and popped at compile time, by comptime)
_lookup_modes: list = []


def enter_lookups_as_index(ctx) -> None:
    mode = _LookupsAsIndex()
    mode.__enter__()
    _lookup_modes.append(mode)
    # popped after the speculation, and in any case when dynamo finishes this frame (a failed one too)
    ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.add_cleanup_hook(leave_lookups_as_index)


def leave_lookups_as_index(ctx=None) -> None:
    while _lookup_modes:
        mode = _lookup_modes.pop()
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)
