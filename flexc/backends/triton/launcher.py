"""What every Triton kernel kind's launch shares: BlockMask tables as kernels read them, the mods'
captured tensors, dropout's and the sinks' arguments, and the head and tail of the argument list.

The forward, backward and decode kernels share the head of their signatures (query, key, value,
their outputs, the tables, the mods' captured tensors, then scale, lengths and strides), built
once by :func:`kernel_arguments` and :func:`kernel_argument_tail`. Each kind's own arguments,
constexprs and grid live with its launch (:mod:`.forward`, :mod:`.backward` with its prologue and
row pass, :mod:`.decode` with its merge), which goes through :func:`flexc.device.launch`;
:mod:`.offline` compiles with the same arguments, so an offline cubin is specialised as a real
launch is.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv
from ...codegen.backward import BackwardSpec
from ...codegen.decode import DecodeSpec
from ...codegen.forward import NO_BLOCK_MASK, ForwardSpec
from ...mods.traced_mod import TracedMod
from ..dropout import Dropout
from ..layout import empty_like_reference
from ..nonfinite import all_finite
from ..versioned_memo import VersionedMemo

# a tensor with this many elements or more needs int64 offsets (index * stride wraps in int32)
INT32_OFFSET_LIMIT = 2 ** 31


# ---- BlockMask tables ---------------------------------------------------------------------


def kv_tables(block_mask: Any, spec: ForwardSpec | DecodeSpec | BackwardSpec, S: int,
              device: torch.device) -> list[torch.Tensor]:
    """``[partial counts, partial indices, (full counts, full indices)]`` as contiguous int32; without a
    BlockMask, one row whose every key block is full."""
    if block_mask is None:
        n = max(1, cdiv(S, spec.kv_block_size))
        return [torch.zeros((1, 1, 1), dtype=torch.int32, device=device),
                torch.zeros((1, 1, 1, n), dtype=torch.int32, device=device),
                torch.full((1, 1, 1), cdiv(S, spec.kv_block_size), dtype=torch.int32, device=device),
                torch.arange(n, dtype=torch.int32, device=device).view(1, 1, 1, n)]
    names = ["kv_num_blocks", "kv_indices"] + (["full_kv_num_blocks", "full_kv_indices"] if spec.has_full_blocks else [])
    tables = [as_int32_on(getattr(block_mask, n), device) for n in names]
    if spec.has_full_blocks and (tables[2].shape != tables[0].shape or tables[3].shape != tables[1].shape):
        raise ValueError(f"flexc: the BlockMask's full-block tables {tuple(tables[2].shape)}/{tuple(tables[3].shape)} "
                         f"must have the shapes of its partial tables {tuple(tables[0].shape)}/{tuple(tables[1].shape)}. "
                         f"Fix: build it with create_block_mask or BlockMask.from_kv_blocks.")
    return tables


class LastTables:
    """A launch's tables of its last call, held weakly (``make(block_mask)`` makes them).

    A caller that vouches for a call's BlockMask holding the very tables of the launch's earlier
    calls (``same``: a plan whose signature holds their contents states) gets the last call's
    while they live, without reading the mask again. Without a BlockMask the tables are the
    launch's own and kept; a mask's are never kept alive, so a mask the caller drops is freed.
    """

    def __init__(self, make):
        self.make, self.refs, self.own = make, (), None

    def __call__(self, block_mask: Any, same: bool = False) -> list[torch.Tensor]:
        if block_mask is None:
            if self.own is None:
                self.own = self.make(None)
            return self.own
        if same and self.refs:
            tables = [ref() for ref in self.refs]
            if all(t is not None for t in tables):
                return tables
        tables = self.make(block_mask)
        self.refs = tuple(weakref.ref(t) for t in tables)
        return tables


def as_int32_on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` as a contiguous int32 tensor on ``device`` (itself when it is one already: the check
    costs less than ``.to`` parsing its arguments, on every call of a decoding loop)."""
    if table.dtype == torch.int32 and table.device == device and table.is_contiguous():
        return table
    return table.to(device=device, dtype=torch.int32).contiguous()


def check_query_blocks(tables: list[torch.Tensor], L: int, q_block_size: int) -> None:
    """Raise unless the tables have a query block row for every ``q_block_size`` queries of ``L``."""
    nQ = tables[0].shape[-1]
    if q_block_size != NO_BLOCK_MASK and nQ < cdiv(L, q_block_size):
        raise ValueError(f"flexc: the BlockMask has {nQ} query block rows but L={L} needs "
                         f"{cdiv(L, q_block_size)} of size {q_block_size}. Fix: build it for Q_LEN={L}.")


# ---- arguments ----------------------------------------------------------------------------

def buffer_arguments(traced: TracedMod | None, params, device: torch.device) -> list:
    """The arguments of one mod's captured tensors and numbers, in the order of ``params``."""
    args: list = []
    if traced is None:
        return args
    for p in params:
        if p.what == "scalar":  # a captured Python number (flexc.codegen.scalars)
            args.append(traced.scalars[p.slot])
            continue
        t = traced.buffers[p.slot]
        if p.what == "ptr":
            if not gpu.same_device(t.device, device):
                if not (t.is_cpu and t.dim() == 0):
                    raise ValueError(f"flexc: {traced.kind} {traced.name} captured tensor "
                                     f"{traced.buffer_names[p.slot]!r} is on {t.device} but the inputs are on {device}. "
                                     f"Fix: create it on {device} (e.g. `.to('{device}')`).")
                t = _device_copy(t, device)  # (detached)
            elif t.requires_grad:  # (a kernel reads memory only; no new tensor for one without grad)
                t = t.detach()
            args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        elif p.what == "stride":
            args.append(t.stride(p.dim))
        else:
            args.append(t.shape[p.dim])
    return args


# A 0-d CPU tensor captured by a mod goes with inputs on any device (validation accepts it, as torch
# does), but a kernel reads device memory. It is copied to the device once per value and the copy
# kept, keyed by the tensor's identity and version counter (an in-place write makes a new copy): a
# steady-state call then makes no host-to-device copy, which would be illegal while a CUDA graph
# captures (pageable memory) and a transfer on every call. Passing the value as a kernel scalar
# instead would type the argument by its value (int32 or int64; fp32 for a float64 tensor) and change
# the kernel; the copy keeps the kernel and the dtype. A tensor made under inference mode has no
# version counter and is copied on every call. A CUDA graph replays the copy it captured: a value
# that changes between replays belongs on the device.
_DEVICE_COPIES = VersionedMemo(64)


def _device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a 0-d CPU tensor) on ``device``, copied once per value of ``t``."""
    return _DEVICE_COPIES.get([t], device, lambda: t.detach().to(device))


def mod_arguments(generated: Any, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  device: torch.device) -> list:
    """The score_mod's then the mask_mod's captured-value arguments of a generated kernel."""
    if not (generated.score_params or generated.mask_params):
        return []
    return (buffer_arguments(score_mod, generated.score_params, device)
            + buffer_arguments(mask_mod, generated.mask_params, device))


def check_dropout(spec: ForwardSpec | BackwardSpec, dropout: Dropout | None) -> None:
    """Raise unless a launch of ``spec`` passes a dropout exactly when the spec's kernel drops."""
    if spec.dropout != (dropout is not None):
        raise ValueError(f"flexc: a kernel {'with' if spec.dropout else 'without'} dropout launched with "
                         f"dropout={dropout!r}")


def dropout_arguments(dropout: Dropout | None, device: torch.device) -> list:
    """A dropout kernel's arguments (after the mods' captured values): the int64 pair ``(seed,
    threshold)`` on ``device`` (a tensor: a Python int would type the kernel's argument by its value,
    int32, uint32 or int64, and compile it again) and ``1 / (1 - p)``; none without dropout."""
    if dropout is None:
        return []
    if dropout.q_positions is not None or dropout.kv_positions is not None:
        raise ValueError("flexc: the Triton kernels draw dropout at the call's own indices; a context-parallel "
                         "shard's positions run on the TORCH backend (flexc.call.plan.dropout_backend)")
    return [_seed_pair(dropout, device), dropout.scale]


def _seed_pair(dropout: Dropout, device: torch.device) -> torch.Tensor:
    """The int64 ``(seed, threshold)`` pair on ``device``, written there by fills (a seed drawn on the
    GPU: a device copy): ``torch.tensor([...], device=)`` would copy from pageable host memory on
    every call, a wait for the host that CUDA graph capture refuses."""
    pair = torch.full((2,), dropout.threshold, dtype=torch.int64, device=device)
    pair[0] = dropout.seed
    return pair


def check_sinks(spec, sinks: torch.Tensor | None) -> None:
    """Raise unless a launch of ``spec`` (a forward or merge spec) passes sinks exactly when its kernel folds them."""
    if spec.sinks != (sinks is not None):
        raise ValueError(f"flexc: a kernel {'with' if spec.sinks else 'without'} sinks launched with "
                         f"sinks={'a tensor' if sinks is not None else None}")


def sink_arguments(sinks: torch.Tensor | None, dtype: torch.dtype) -> list:
    """A sink kernel's arguments (after the dropout ones): the sinks ``[B or 1, Hq]`` in ``dtype`` (the
    kernel's accumulator dtype; from :func:`flexc.call.sinks.check_sinks`'s ``[B or 1, Hq, 1]``), their
    batch stride and head stride (0 along a dimension they broadcast over: one logit for every batch
    or every head); none without sinks."""
    if sinks is None:
        return []
    rows = sinks.detach().reshape(sinks.shape[0], sinks.shape[1]).to(dtype).contiguous()
    return [rows, rows.stride(0) if rows.shape[0] > 1 else 0, rows.stride(1) if rows.shape[1] > 1 else 0]


def kernel_arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, outputs: list, tables: list,
                     buffers: list, scalars: list, output_strides: list) -> list:
    """The positional arguments every attention kernel takes, in its signature's order: q, k, v, the
    kernel's ``outputs``, the tables, the mods' ``buffers``, then :func:`kernel_argument_tail`."""
    return [query, key, value, *outputs, *tables, *buffers,
            *kernel_argument_tail(query, key, value, tables, scalars, output_strides)]


def kernel_argument_tail(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: list, scalars: list,
                         output_strides: list) -> list:
    """The arguments after the tensors, the same for every call of one signature: ``scalars`` (scale,
    lengths...), the q/k/v strides (a batch-broadcast key or value has batch stride 0),
    ``output_strides``, and the tables' batch, head, query-block and key-block counts."""
    B, Bkv = query.shape[0], value.shape[0]
    stride_kb = key.stride(0) if Bkv == B else 0
    stride_vb = value.stride(0) if Bkv == B else 0
    Bm, Hm, nQ = tables[0].shape
    return [*scalars, *query.stride(), stride_kb, *key.stride()[1:], stride_vb, *value.stride()[1:], *output_strides,
            Bm, Hm, nQ, tables[1].shape[-1]]


def empty_output(query: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    """The output ``[B, Hq, L, Ev]`` laid out as flex_attention returns it (:mod:`flexc.backends.layout`:
    the query's dimension order, the head dim innermost), so returning it copies nothing."""
    B, H, L, _ = query.shape
    return empty_like_reference((B, H, L, v_head_dim), query)


def guards_nonfinite_values(spec: ForwardSpec | DecodeSpec, value: torch.Tensor) -> bool:
    """Whether this call compiles in the guard that keeps masked keys' NaN/inf values out of ``p @ v``.

    On the CPU (Triton's interpreter) one reduction over the values decides. On CUDA the guard stays
    off, as in torch's own kernels (a NaN in a masked key's value row gives a NaN row there too):
    deciding would cost a device sync on every call, and compiling it in always costs spills.
    """
    return spec.mask_mod is not None and gpu.is_plain_cpu(value.device) and not all_finite(value)


# ---- grids --------------------------------------------------------------------------------


__all__ = ["INT32_OFFSET_LIMIT", "LastTables", "buffer_arguments", "check_dropout", "check_query_blocks", "check_sinks", "dropout_arguments", "empty_output", "guards_nonfinite_values", "kernel_arguments", "kv_tables", "mod_arguments", "sink_arguments"]
