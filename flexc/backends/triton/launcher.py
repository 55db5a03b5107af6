"""What a Triton kernel launch passes: BlockMask tables, positional arguments, constexprs and grid.

The forward, backward and decode kernels share the head of their signatures (query, key, value,
their outputs, the tables, the mods' captured tensors, then scale, lengths and strides), built
once by :func:`kernel_arguments`. The entry points (:mod:`.forward`, :mod:`.backward`,
:mod:`.decode`) launch with these through :func:`flexc.device.launch`; :mod:`.offline` compiles
with the same arguments, so an offline cubin is specialised as a real launch is.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv, transpose_ordered
from ...codegen.backward import BackwardSpec
from ...codegen.decode import TABLE_OFFSETS, DecodeSpec
from ...codegen.forward import NO_BLOCK_MASK, ForwardSpec
from ...codegen.merge import MergeSpec
from ...codegen.prologue import PrologueSpec
from ...codegen.spec import padded_head_dim
from ...dtypes import work_dtype
from ...mods.traced_mod import TracedMod
from ..dropout import Dropout
from ..layout import EmptyMaker, empty_like_reference, output_maker
from ..nonfinite import all_finite
from ..versioned_memo import VersionedMemo
from .config import default_splits

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


def backward_tables(block_mask: Any, spec: BackwardSpec, L: int, S: int, device: torch.device) -> list[torch.Tensor]:
    """Key-direction then query-direction tables (partial, then full when kept apart), int32."""
    if block_mask is None:
        nq, nkv = max(1, cdiv(L, spec.q_block_size)), max(1, cdiv(S, spec.kv_block_size))
        i32 = dict(dtype=torch.int32, device=device)
        return [torch.zeros((1, 1, nq), **i32), torch.zeros((1, 1, nq, nkv), **i32),
                torch.full((1, 1, nq), nkv, **i32), torch.arange(nkv, **i32).expand(1, 1, nq, nkv).contiguous(),
                torch.zeros((1, 1, nkv), **i32), torch.zeros((1, 1, nkv, nq), **i32),
                torch.full((1, 1, nkv), nq, **i32), torch.arange(nq, **i32).expand(1, 1, nkv, nq).contiguous()]
    kv = kv_tables(block_mask, spec, S, device)
    if getattr(block_mask, "q_num_blocks", None) is not None and getattr(block_mask, "q_indices", None) is not None \
            and (not spec.has_full_blocks or getattr(block_mask, "full_q_num_blocks", None) is not None):
        names = ["q_num_blocks", "q_indices"] + (["full_q_num_blocks", "full_q_indices"] if spec.has_full_blocks else [])
        q = [getattr(block_mask, n).to(device=device, dtype=torch.int32).contiguous() for n in names]
    else:  # derive the query-direction tables from the key-direction ones, as torch does
        q = list(transpose_ordered(kv[0], kv[1]))
        if spec.has_full_blocks:
            q += list(transpose_ordered(kv[2], kv[3]))
        q = [t.to(device=device, dtype=torch.int32).contiguous() for t in q]
    if spec.has_full_blocks:
        return [kv[0], kv[1], kv[2], kv[3], q[0], q[1], q[2], q[3]]
    return [kv[0], kv[1], q[0], q[1]]


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


def forward_arguments(generated: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor | None, tables: list[torch.Tensor],
                      score_mod: TracedMod | None, mask_mod: TracedMod | None, scale: float,
                      stats: torch.Tensor | None = None, dropout: Dropout | None = None,
                      sinks: torch.Tensor | None = None, tail: list | None = None) -> list:
    """The forward kernel's positional arguments, in the order of its signature (constexprs excluded);
    ``stats`` ``[2, B, Hq, L]``: the training forward's backward statistics (laid out as ``lse``);
    ``dropout`` for a kernel with dropout, ``sinks`` for one with sinks; ``tail``: the
    :func:`kernel_argument_tail` of an earlier call of the same signature, when the caller keeps it
    (the same kernel, shapes, strides and scale)."""
    if generated.needs_positive_scale and not scale > 0:
        # the kernel multiplies raw q.k by scale * log2(e) after taking the row max, so the scale
        # must be positive: q.k * scale == (-q).k * |scale|, and with scale 0 every score is 0
        query = -query if scale < 0 else torch.zeros_like(query)
    outputs = [out]
    if lse is not None:
        outputs.append(lse)
    if stats is not None:  # both contiguous [B, Hq, L] planes, as lse: they share its strides
        outputs += [stats[0], stats[1]]
    buffers = mod_arguments(generated, score_mod, mask_mod, query.device)
    if dropout is not None:
        buffers += dropout_arguments(dropout, query.device)
    if sinks is not None:
        buffers += sink_arguments(sinks, work_dtype(query.dtype))
    if tail is None:
        tail = forward_argument_tail(generated, query, key, value, out, lse, tables, scale)
    return [query, key, value, *outputs, *tables, *buffers, *tail]


def forward_argument_tail(generated: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor | None, tables: list[torch.Tensor], scale: float) -> list:
    """The forward kernel's :func:`kernel_argument_tail`: its scale, lengths, group size and strides
    (a kernel that needs a positive scale gets ``|scale|``, or 1 for 0: :func:`forward_arguments`
    negates or zeroes the query)."""
    if generated.needs_positive_scale and not scale > 0:
        scale = abs(scale) or 1.0
    output_strides = [*out.stride()] + ([lse.stride(0), lse.stride(1)] if lse is not None else [])
    return kernel_argument_tail(query, key, value, tables,
                                [float(scale), query.shape[2], value.shape[2], query.shape[1] // value.shape[1]],
                                output_strides)


def exact_in_query(spec: ForwardSpec, scale: float | None) -> bool:
    """Whether the forward kernel may fold ``scale`` into q (POW2_SCALE): where a score_mod needs the
    scaled score (without one, the scale joins the exponent anyway), and the scale is a power of
    two from 2**-20 to 1 (the default 1/sqrt(D) for D = 1, 4, 16, 64, 256...) and the inputs have
    float32's exponent range (not float16's): then q * scale and q.k * scale are exact (short of
    inputs below ~1e-32), and q.(scale * k) == (q.k) * scale."""
    if scale is None or spec.score_mod is None or spec.prescale_qk or spec.dtype == torch.float16:
        return False
    mantissa, exponent = math.frexp(float(scale))
    return mantissa == 0.5 and -19 <= exponent <= 1


def forward_constexprs(spec: ForwardSpec, L: int, S: int, tensors: list, guard_values: bool = False,
                       scale: float | None = None) -> dict[str, int]:
    """The forward kernel's compile-time arguments for ``spec`` and one call's lengths, tensors and scale.

    Whole tiles (lengths multiples of BLOCK_M, and of the key block, so of BLOCK_N), int64 offsets, the non-finite values
    guard and a power-of-two scale (:func:`exact_in_query`) select variants that Triton compiles once each; other
    lengths reuse them.
    """
    largest = max((t.numel() for t in tensors if isinstance(t, torch.Tensor)), default=0)
    return dict(BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, Q_BLOCK_SIZE=spec.q_block_size,
                KV_BLOCK_SIZE=spec.kv_block_size, HEAD_DIM=spec.head_dim,
                HEAD_DIM_PAD=padded_head_dim(spec.head_dim), V_HEAD_DIM=spec.v_head_dim,
                V_HEAD_DIM_PAD=padded_head_dim(spec.v_head_dim), ROWS_GUARANTEED_SAFE=spec.rows_guaranteed_safe,
                BLOCKS_ARE_CONTIGUOUS=spec.blocks_are_contiguous, Q_LEN_DIVISIBLE=L % spec.block_m == 0,
                # the key loop walks every tile of a listed block: a last block reaching past KV_LEN
                # has whole tiles past it even when BLOCK_N divides KV_LEN (kv_block_size is a multiple
                # of BLOCK_N, so this implies it)
                KV_LEN_DIVISIBLE=S % spec.kv_block_size == 0, INT64_OFFSETS=largest >= INT32_OFFSET_LIMIT,
                GUARD_NONFINITE_VALUES=guard_values, POW2_SCALE=exact_in_query(spec, scale))


def backward_outputs(spec: BackwardSpec, query, key, value, score_mod, makers: tuple | None = None) -> tuple:
    """``(dq, dk, dv, summed, grads)``: dk/dv per query batch, summed afterwards when ``Bkv == 1 < B``;
    ``makers``: :func:`backward_output_makers` of a call of the same signature, when the caller keeps them."""
    make_dq, make_dk, make_dv, summed = makers if makers is not None else backward_output_makers(query, key, value)
    grads = [torch.zeros(score_mod.buffers[s].shape, dtype=spec.grad_dtype(s), device=query.device)
             for s in spec.grad_slots] if spec.grad_slots else []
    return make_dq(query), make_dk(key), make_dv(value), summed, grads


def backward_output_makers(query, key, value) -> tuple:
    """``(make_dq, make_dk, make_dv, summed)`` for the calls of one signature
    (:func:`flexc.backends.layout.output_maker`): each gradient laid out like its input, as the caller
    returns it; dk and dv row-major in the work dtype when they are summed over the batch afterwards."""
    B, Hkv, S, E, Ev = query.shape[0], key.shape[1], key.shape[2], key.shape[3], value.shape[3]
    summed = key.shape[0] == 1 and B > 1
    if summed:
        acc = work_dtype(query.dtype)
        dk, dv = EmptyMaker((B, Hkv, S, E), acc, query.device), EmptyMaker((B, Hkv, S, Ev), acc, query.device)
        return output_maker(query), lambda _key: dk(), lambda _value: dv(), summed
    return output_maker(query), output_maker(key), output_maker(value), summed


def backward_arguments(spec: BackwardSpec, generated, query, key, value, grad_out, lse2, delta, stats, dq, dk, dv, tables,
                       grads, score_mod, mask_mod, scale: float, guard_inputs: bool | None = None,
                       dropout: Dropout | None = None, tail: list | None = None, constants: dict | None = None
                       ) -> tuple[list, dict]:
    """The backward kernel's positional arguments and constexprs for one launch (``guard_inputs``:
    compile the NaN/inf input guard in; by default the launcher's choice for these tensors; ``dropout``:
    the forward's, for a spec with dropout; ``tail`` and ``constants``: the :func:`backward_argument_tail`
    and :func:`backward_constexprs` of an earlier call of the same signature, ``grad_out`` strides
    and guard, when the caller keeps them)."""
    device = query.device
    buffers = mod_arguments(generated, score_mod, mask_mod, device)
    if generated.grad_params:
        by_slot = dict(zip(spec.grad_slots, grads))
        for p in generated.grad_params:
            g = by_slot[p.slot]
            buffers.append(g if p.what == "ptr" else g.stride(p.dim) if p.what == "stride" else g.shape[p.dim])
    check_dropout(spec, dropout)
    if dropout is not None:
        buffers += dropout_arguments(dropout, device)
    if tail is None:
        tail = backward_argument_tail(query, key, value, grad_out, delta, dq, dk, dv, tables, scale)
    # stats [2, B, Hq, L] (the forward's), or its two planes: both contiguous, strided as lse2 and delta
    args = [query, key, value, grad_out, lse2, delta, stats[0], stats[1], dq, dk, dv, *tables, *buffers, *tail]
    if constants is not None:
        return args, constants
    if guard_inputs is None:
        guard_inputs = guards_nonfinite_inputs(spec, query, key)
    return args, backward_constexprs(spec, query, value, grad_out, guard_inputs)


def guards_nonfinite_inputs(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the backward compiles in the guard zeroing masked NaN/inf query and key entries: only
    where it can matter (CPU calls with such entries; on CUDA as torch's kernels, see
    :func:`guards_nonfinite_values`)."""
    return spec.mask_mod is not None and gpu.is_plain_cpu(query.device) and not all_finite(query, key)


def backward_argument_tail(query, key, value, grad_out, delta, dq, dk, dv, tables, scale: float) -> list:
    """The backward kernel's :func:`kernel_argument_tail`: the same for every call of one signature
    whose ``grad_out`` has the same strides (the other tensors' strides follow from the shapes)."""
    L, S = query.shape[2], value.shape[2]
    return kernel_argument_tail(query, key, value, tables, [float(scale), L, S, query.shape[1] // value.shape[1]],
                                [*grad_out.stride(), delta.stride(0), delta.stride(1), *dq.stride(), *dk.stride(),
                                 *dv.stride()])


def backward_constexprs(spec: BackwardSpec, query, value, grad_out, guard_inputs: bool) -> dict:
    """The backward kernel's compile-time arguments for one call's shapes and its input guard."""
    L, E = query.shape[2], query.shape[3]
    S, Ev = value.shape[2], value.shape[3]
    return dict(BLOCK_M1=spec.block_m1, BLOCK_N1=spec.block_n1, BLOCK_M2=spec.block_m2, BLOCK_N2=spec.block_n2,
                Q_BLOCK_SIZE=spec.q_block_size, KV_BLOCK_SIZE=spec.kv_block_size,
                # lengths that are multiples of the blocks (so of every tile: blocks are multiples
                # of the tiles) need no bounds checks (a second variant). Tiles alone do not do:
                # the loops walk every tile of a listed block, past the end of a last, shorter one
                DIVISIBLE=L % spec.q_block_size == 0 and S % spec.kv_block_size == 0,
                GUARD_NONFINITE_INPUTS=guard_inputs, HEAD_DIM=E,
                HEAD_DIM_PAD=padded_head_dim(E), V_HEAD_DIM=Ev, V_HEAD_DIM_PAD=padded_head_dim(Ev),
                # the dK/dV programs' head offsets into query and grad_out in int64
                INT64_OFFSETS=max(query.numel(), grad_out.numel()) >= INT32_OFFSET_LIMIT)


def decode_arguments(spec: DecodeSpec, generated: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
                     splits: int | None, guard_values: bool | None = None, dropout: Dropout | None = None,
                     tables: list[torch.Tensor] | None = None):
    """The decode kernel's positional and constexpr arguments for one call, and the per-split outputs
    ``(out_split, lse_split)`` it writes. ``splits``: per (batch, key head), None for
    :func:`flexc.backends.triton.config.default_splits`; ``guard_values`` defaults to the launcher's choice;
    ``dropout`` for a kernel with dropout; ``tables``: :func:`kv_tables` of ``block_mask``, when the
    caller has them."""
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, Ev = value.shape
    device = query.device
    if tables is None:
        tables = kv_tables(block_mask, spec, S, device)
    splits = splits or default_splits(query, key, tables[1].shape[-1])
    work = work_dtype(query.dtype)
    out_split = torch.empty(B, Hkv, splits, spec.block_m, Ev, dtype=work, device=device)
    lse_split = torch.empty(B, Hkv, splits, spec.block_m, dtype=work, device=device)
    args = kernel_arguments(query, key, value, [out_split, lse_split], tables,
                            mod_arguments(generated, score_mod, mask_mod, device) + dropout_arguments(dropout, device),
                            [float(scale), L, S, Hq // Hkv, Hkv, splits], [])
    if guard_values is None:
        guard_values = guards_nonfinite_values(spec, value)
    constants = dict(BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, KV_BLOCK_SIZE=spec.kv_block_size,
                     HEAD_DIM=spec.head_dim, HEAD_DIM_PAD=padded_head_dim(spec.head_dim),
                     V_HEAD_DIM=spec.v_head_dim, V_HEAD_DIM_PAD=padded_head_dim(spec.v_head_dim),
                     # whole key blocks only (so whole tiles: the blocks are multiples of BLOCK_N): a
                     # variant without bounds checks, as the forward's KV_LEN_DIVISIBLE
                     KV_LEN_DIVISIBLE=S % spec.kv_block_size == 0,
                     # one query row per head: q_idx is the constant 0 (a second variant)
                     SINGLE_ROW=L == 1, GUARD_NONFINITE_VALUES=guard_values, LSE_SPLIT_AT=0,
                     **decode_table_offsets(spec))
    return args, constants, (out_split, lse_split)


def decode_table_offsets(spec: DecodeSpec, widths: Sequence[int] | None = None) -> dict:
    """The decode kernel's :data:`flexc.codegen.decode.TABLE_OFFSETS` constexprs: 0 for tables passed each
    at its own pointer, or, for one row passed as every table (a gathered row, each table ``widths[i]``
    entries in order), where each starts in it."""
    names = TABLE_OFFSETS[:3 if spec.has_full_blocks else 1]
    if widths is None:
        return dict.fromkeys(names, 0)
    starts = [sum(widths[:i]) for i in range(1, 4)]
    return dict(zip(names, starts))


def merge_arguments(spec: MergeSpec, out_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, L: int, Hq: int, sinks: torch.Tensor | None = None) -> tuple[list, dict]:
    """The merge kernel's positional and constexpr arguments: ``[B, Hkv, splits, M, Ev]`` partial
    outputs and their logsumexps into ``out [B, Hq, L, Ev]`` and ``lse [B, Hq, L]``; ``sinks`` for a
    merge with sinks."""
    B, Hkv, splits, M, Ev = out_split.shape
    rows = Hq // Hkv * L
    check_sinks(spec, sinks)
    return ([out_split, lse_split, out, lse, splits, rows, L, Hq // Hkv, Ev, *out_split.stride()[:4],
             *lse_split.stride()[:3], *out.stride(), lse.stride(0), lse.stride(1),
             *sink_arguments(sinks, lse_split.dtype)],
            dict(BLOCK_ROWS=spec.block_rows, V_HEAD_DIM_PAD=spec.v_head_dim_pad, LSE_SPLIT_AT=0, LSE_AT=0))


PROLOGUE_TENSORS = 7  # the prologue's tensor arguments, first in its signature (prologue_arguments)


def prologue_arguments(spec: PrologueSpec, out: torch.Tensor, grad_out: torch.Tensor, stats: torch.Tensor,
                       grad_lse: torch.Tensor | None, delta: torch.Tensor, lse2: torch.Tensor,
                       tail: tuple[list, dict] | None = None) -> tuple[list, dict]:
    """The backward prologue's positional and constexpr arguments: ``out``, ``grad_out`` ``[B, Hq, L, Ev]``,
    the forward's statistics ``stats`` ``[2, B, Hq, L]`` (or its two planes) and ``grad_lse`` (None: no gradient) ``[B, Hq, L]``
    into ``delta`` and ``lse2`` (contiguous). ``tail``: an earlier call's arguments after the first
    :data:`PROLOGUE_TENSORS` and its constexprs, for a call of the same signature and the same
    ``grad_out`` and ``grad_lse`` strides, when the caller keeps them."""
    has_grad_lse = grad_lse is not None
    grad_lse = grad_lse if has_grad_lse else delta  # an unread stand-in
    tensors = [out, grad_out, stats[0], stats[1], grad_lse, delta, lse2]
    if tail is not None:
        return tensors + tail[0], tail[1]
    return ([*tensors, out.shape[2], out.shape[3], *out.stride(), *grad_out.stride(), *stats[0].stride(),
             *grad_lse.stride(), delta.stride(0), delta.stride(1)],
            dict(BLOCK_ROWS=spec.block_rows, V_HEAD_DIM_PAD=spec.v_head_dim_pad, HAS_GRAD_LSE=has_grad_lse))


# ---- grids --------------------------------------------------------------------------------

def forward_grid(spec: ForwardSpec, query: torch.Tensor) -> tuple[int, int, int]:
    """One program per query tile, query head and batch."""
    B, Hq, L, _ = query.shape
    return cdiv(L, spec.block_m), Hq, B


def backward_grid(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int]:
    """Per key head and batch: the dK/dV programs (one per ``BLOCK_N1`` keys), then the dQ programs
    (one per ``BLOCK_M2`` queries of each query head in the group)."""
    B, Hq, L, _ = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    return cdiv(S, spec.block_n1) + (Hq // Hkv) * cdiv(L, spec.block_m2), Hkv, B


def backward_rows_grid(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int]:
    """The backward's row pass (:mod:`flexc.codegen.backward_rows`): the dQ programs' part of
    :func:`backward_grid`, one program per ``BLOCK_M2`` queries of each query head in the group."""
    B, Hq, L, _ = query.shape
    return (Hq // key.shape[1]) * cdiv(L, spec.block_m2), key.shape[1], B


def prologue_grid(spec: PrologueSpec, out: torch.Tensor) -> tuple[int, int, int]:
    """One program per ``block_rows`` query rows, query head and batch."""
    B, Hq, L, _ = out.shape
    return cdiv(L, spec.block_rows), Hq, B


def decode_grid(out_split: torch.Tensor) -> tuple[int, int, int]:
    """One program per split, key head and batch."""
    B, Hkv, splits = out_split.shape[:3]
    return splits, Hkv, B


def merge_grid(spec: MergeSpec, out_split: torch.Tensor, L: int, Hq: int) -> tuple[int, int, int]:
    """One program per ``block_rows`` packed query rows, key head and batch."""
    B, Hkv = out_split.shape[:2]
    return cdiv(Hq // Hkv * L, spec.block_rows), Hkv, B


__all__ = ["INT32_OFFSET_LIMIT", "LastTables", "PROLOGUE_TENSORS", "backward_arguments", "backward_argument_tail", "backward_constexprs", "guards_nonfinite_inputs", "backward_grid", "backward_rows_grid", "backward_outputs", "backward_output_makers",
           "backward_tables", "buffer_arguments", "check_dropout", "check_query_blocks", "check_sinks",
           "decode_arguments", "decode_grid", "decode_table_offsets",
           "dropout_arguments", "empty_output", "forward_arguments", "forward_constexprs", "forward_grid",
           "guards_nonfinite_values", "kernel_arguments", "kv_tables", "merge_arguments", "merge_grid", "mod_arguments",
           "prologue_arguments", "sink_arguments", "prologue_grid"]
