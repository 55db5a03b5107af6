"""``flexc.create_block_mask`` inside a compiled region: one ``flexc::create_block_mask`` node, its
mask_mod through dynamo to flexc's tracer as a call's mods are (:mod:`flexc.torch_compile.under_compile`);
eagerly, :func:`flexc.masks.create.create_block_mask`."""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper

from .. import device as gpu
from ..errors import warn_once
from ..masks import create
from ..masks.block_mask import DEFAULT_BLOCK_SIZE, DERIVED, BlockMask
from ..mods.mod_key import mod_key
from ..mods.trace import trace
from ..mods.traced_mod import MASK_MOD
from . import custom_ops
from .index_lookups import enter_lookups_as_index, leave_lookups_as_index
from .mod_replay import name_of, replayed_mod, warn_call_runs_eagerly
from .subgraph_plan import plans, read_plan, with_numbers


@functools.wraps(create.create_block_mask)
def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device: Any = None,
                      BLOCK_SIZE: Any = DEFAULT_BLOCK_SIZE, _compile: bool = False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True, *, _analytic: bool = True) -> BlockMask:
    # flexc.create_block_mask: inside torch.compile one custom-op node, eagerly the block-mask builder
    if torch.compiler.is_compiling():
        return _compiled_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full_blocks)
    return create.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                    separate_full_blocks, compute_dq_write_order, dq_kv_order,
                                    _analytic=_analytic)


def _compiled_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device: Any,
                         BLOCK_SIZE: Any, separate_full_blocks: bool):
    """:func:`flexc.create_block_mask` as one ``flexc::create_block_mask`` node (the bridge of :mod:`flexc.torch_compile.under_compile`)."""
    block = tuple(BLOCK_SIZE) if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
    # eager's rule (flexc.device.default_device) where dynamo can read it: the captured tensors are
    # not known before the mod is speculated, so unnamed, the device is a usable accelerator, else the CPU
    device = gpu.usable(device, "create_block_mask") if device is not None else gpu.default_device()
    from torch._dynamo.comptime import comptime  # (here, not at import: dynamo imports sympy)

    comptime(_warn_if_sizes_are_symbolic)
    # the node takes its sizes as constants (the tables' shapes follow from them): operator.index
    # makes a symbolic size (dynamic=True, or a length made dynamic after a recompile) this call's
    # value under a guard, so each new length compiles its own graph
    sizes = (*(operator.index(n) for n in (B or 1, H or 1, Q_LEN, KV_LEN)), int(block[0]), int(block[1]))
    b0, h0, q0, kv0 = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]

    def inner(b, h, q_idx, kv_idx):
        if not torch.compiler.is_compiling():  # dynamo could not trace the mod (_mask_wrapper, as for a call)
            warn_call_runs_eagerly()
            traced = trace(mask_mod, MASK_MOD)
            return (*custom_ops.create_block_mask_op(list(traced.buffers), mod_key(traced), *sizes, device), None)
        torch.stack([b, h, q_idx, kv_idx])  # finds the mod arguments for the wrapper, as for a call
        return (*_tables_meta(sizes, device), mask_mod(b, h, q_idx, kv_idx))

    spec = (name_of(mask_mod, "mask_mod"), sizes, device)
    comptime(enter_lookups_as_index)
    num, indices, full_num, full_indices, _ = dynamo_bypassing_wrapper(
        functools.partial(_mask_wrapper, spec), inner, b0, h0, q0, kv0)
    comptime(leave_lookups_as_index)
    full = (full_num, full_indices) if separate_full_blocks else (None, None)
    return BlockMask((Q_LEN, KV_LEN), num, indices, *full, DERIVED, DERIVED, DERIVED, DERIVED,
                     BLOCK_SIZE=(sizes[4], sizes[5]), mask_mod=mask_mod)


def _warn_if_sizes_are_symbolic(ctx) -> None:
    """At trace time (dynamo reads a symbolic size as an int in the traced code; only its own view
    of the locals tells): say once that the graph is specialized to each length."""
    if any(ctx.get_local(name).is_dynamic() for name in ("B", "H", "Q_LEN", "KV_LEN")):
        _warn_symbolic_sizes()


def _warn_symbolic_sizes() -> None:
    warn_once("create_block_mask at symbolic sizes",
              "flexc: create_block_mask inside torch.compile at symbolic (dynamic) sizes specializes the graph "
              "to each call's sizes: every new length compiles anew, up to torch._dynamo's recompile limit. "
              "Fix: build the mask outside the compiled region and pass it in to keep one dynamic graph.")


def _tables_meta(sizes: tuple, device: torch.device):
    B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK = sizes
    nq, nkv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    num = torch.empty((B, H, nq), dtype=torch.int32, device=device)
    indices = torch.empty((B, H, nq, nkv), dtype=torch.int32, device=device)
    return num, indices, torch.empty_like(num), torch.empty_like(indices)


def _mask_wrapper(spec: tuple, gm: torch.fx.GraphModule) -> Callable:
    if not isinstance(gm, torch.fx.GraphModule):  # the inner function, run eagerly (as under_compile's _wrapper)
        return gm
    name, sizes, device = spec
    plan = plans.get(gm)
    if plan is None:
        plan = plans[gm] = read_plan(gm, 4, 0)

    def run(*inputs):
        key, buffers = replayed_mod(gm, plan, with_numbers(gm, plan, inputs, device), MASK_MOD, name)
        tables = custom_ops.create_block_mask_op(buffers, key, *sizes, device)
        meta = plan.mod_outs[MASK_MOD].meta["example_value"]
        return (*tables, torch.zeros(meta.shape, dtype=meta.dtype, device=device))

    return run
