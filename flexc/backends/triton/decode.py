"""The split-KV decode kernel (:mod:`flexc.codegen.decode`) and the merge of its splits: spec and launch.

:func:`applies` says when the TRITON backend runs it instead of the forward kernel: at most
:data:`MAX_ROWS` query rows whose packed heads share one BlockMask row. Kernels live in the
Triton backend's one LRU kernel cache with the forward and backward kernels (counted by
:func:`flexc.cache_info`, freed by :func:`flexc.cache_clear`).
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv
from ...constants import DECODE_MAX_ROWS as MAX_ROWS
from ...dtypes import work_dtype, work_dtype_name
from ...codegen.decode import TABLE_OFFSETS, DecodeSpec
from ...codegen.merge import MergeSpec
from ...codegen.scalars import lift_for_call
from ...codegen.spec import padded_head_dim
from ...mods.traced_mod import TracedMod
from ..dropout import Dropout
from ..layout import empty_like_reference, empty_maker_like
from . import cache, config, launcher, retry

MAX_PACKED = 128  # GQA group x query rows in one tile


def applies(query: torch.Tensor, key: torch.Tensor, block_mask: Any) -> bool:
    """True when the decode kernel serves this call (short queries, packed heads share a mask row)."""
    B, Hq, L, _ = query.shape
    if key.shape[1] == 0:  # no heads: the forward kernel's launcher returns the empty output
        return False
    G = Hq // key.shape[1]
    if not 0 < L <= MAX_ROWS or G * L > MAX_PACKED or key.shape[2] == 0:
        return False
    if block_mask is None:
        return True
    q_block, _ = config.block_sizes(block_mask, L, key.shape[2])
    return L <= q_block and (block_mask.kv_num_blocks.shape[1] == 1 or G == 1)


def make_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, block_mask: Any, target: str | None = None, dropout: bool = False,
              kernel_options: dict | None = None) -> DecodeSpec:
    """The decode kernel's spec for these tensors (``target``: their device's, unless given; ``dropout``
    compiles attention dropout in)."""
    if block_mask is None:
        mask_mod = None
    layout = config.call_layout(query, value, score_mod, mask_mod, block_mask)
    target = target or layout.target
    # without a BlockMask, 128-key blocks, all full
    kv_block, has_full = (128, True) if layout.block_size is None else (layout.block_size[1], layout.has_full_blocks)
    G = query.shape[1] // key.shape[1]
    block_m, block_n, warps, stages = config.resolve_decode_config(kv_block, G * query.shape[2], target)
    return DecodeSpec(score_mod=score_mod, mask_mod=mask_mod, dtype=query.dtype, head_dim=query.shape[-1],
                      v_head_dim=value.shape[-1], kv_block_size=kv_block, block_m=block_m, block_n=block_n,
                      num_warps=warps, num_stages=stages, has_full_blocks=has_full, target=target,
                      fp32_precision=config.fp32_precision(target, kernel_options), index_dtype=layout.index_dtype,
                      dropout=dropout)


def merge_spec(spec: DecodeSpec, sinks: bool = False) -> MergeSpec:
    """The merge kernel that follows the decode kernel of ``spec``: its partial results are fp32
    (fp64 for fp64 inputs), ``spec.block_m`` packed rows of the value head dim per split; ``sinks``:
    it folds in the call's learned attention sinks."""
    work = work_dtype_name(spec.dtype)
    return MergeSpec(work_dtype=work, v_head_dim_pad=padded_head_dim(spec.v_head_dim), block_rows=min(spec.block_m, 16),
                     target=spec.target, sinks=sinks)


def merge_splits(out_split: torch.Tensor, lse_split: torch.Tensor, query: torch.Tensor, Hq: int, L: int,
                 spec: MergeSpec, sinks: torch.Tensor | None = None, kernel_key: tuple | None = None):
    """Merge ``[B, Hkv, splits, M, Ev]`` partial outputs and their logsumexps into ``out [B, Hq, L, Ev]``
    (query's dtype, laid out like the query) and ``lse [B, Hq, L]``, in one launch of the merge kernel
    ``spec`` (:func:`merge_spec` of the decode kernel's; :mod:`flexc.codegen.merge`): each split weighs
    ``exp(lse_split - lse)``; a row dead in every split gets output 0 and lse ``-inf`` (the sink's
    logit with ``sinks``, ``[B or 1, Hq, 1]``, which a merge spec with sinks folds in; ``kernel_key``:
    the merge kernel's :func:`flexc.backends.triton.cache.kernel_key`, when the caller keeps it)."""
    B, Hkv, splits, M, Ev = out_split.shape
    out = empty_like_reference((B, Hq, L, Ev), query)
    lse = torch.empty((B, Hq, L), dtype=lse_split.dtype, device=query.device)
    kernel = cache.get_kernel(spec, query.device, kernel_key)
    args, constants = merge_arguments(spec, out_split, lse_split, out, lse, L, Hq, sinks)
    gpu.launch(kernel.fn, merge_grid(spec, out_split, L, Hq), spec, query.device, args, constants)
    return out, lse


class DecodeLaunch:
    """The decode kernel's and its merge's launches for one call signature, decided once (splits,
    specs), then launched on each call's tensors and tables (:mod:`flexc.call.plans` keeps one with a
    call's plan; :func:`launch` makes one and runs it once). Once a launch has worked, later calls
    launch with the arguments it read off (:class:`WarmDecode`), and a decoding step's gathered row
    (:mod:`flexc.masks.gathered_rows`) goes to the kernel as it is."""

    def __init__(self, spec: DecodeSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
                 num_splits: int | None = None, merge: MergeSpec | None = None, sinks: bool = False,
                 need_lse: bool = True):
        self.spec, self.score_mod, self.mask_mod, self.scale = spec, score_mod, mask_mod, scale
        self.need_lse = need_lse  # (else calls return None for the logsumexp)
        self.device = query.device
        S = value.shape[2]
        self.tables = launcher.LastTables(lambda block_mask: launcher.kv_tables(block_mask, spec, S, self.device))
        self.splits = num_splits or config.default_splits(query, key, self.tables(block_mask)[1].shape[-1])
        # (a smaller configuration keeps block_m, so the merge's spec and the partial results' shape)
        self.merge = merge if merge is not None else merge_spec(spec, sinks)
        self.merge_key = cache.kernel_key(self.merge, self.device)
        self.worked = False  # launched once with this spec, nothing replaced it: no retry needed
        self.kernel_key = cache.kernel_key(spec, self.device)
        self.n_tables = 4 if spec.has_full_blocks else 2
        self.warm: WarmDecode | None = None  # once it worked: what every later call passes alike

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                 dropout: Dropout | None = None, sinks: torch.Tensor | None = None, mods: tuple | None = None,
                 same_tables: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B,Hq,L,Ev], lse [B,Hq,L] or None unless need_lse)`` of this call (see :func:`launch`) on
        its ``block_mask``; ``mods`` and ``same_tables`` as
        :meth:`flexc.backends.triton.forward.ForwardLaunch.__call__` takes them."""
        warm = self.warm
        if warm is None:
            return self._first_calls(query, key, value, block_mask, dropout, sinks, mods, same_tables)
        # a warm call (all in this method: it runs every decoding step): what WarmDecode read off, this
        # call's tensors and tables
        spec, device = self.spec, self.device
        if spec.dropout != (dropout is not None):
            launcher.check_dropout(spec, dropout)
        gathered = getattr(block_mask, "gathered_row", None)
        if gathered is not None and warm.direct:
            # a decoding step's slice gathered on the device: the kernel reads every table from the row,
            # each where it starts (its shape is in the warm arguments), so no view of it is made
            widths = gathered.source.widths
            constants = warm.row_constants.get(widths)
            if constants is None:
                constants = warm.row_constants[widths] = dict(warm.constants,
                                                              **decode_table_offsets(spec, widths))
            tables = (gathered.row,) * self.n_tables
        else:
            constants, tables = warm.constants, self.tables(block_mask, same_tables)
        kernel = cache.get_kernel(spec, device, self.kernel_key)
        # (the partial results, and the logsumexp unless the call returns it)
        scratch = warm.scratch if threading.get_ident() == warm.thread else warm.new_scratch()
        if warm.guard_per_call:
            constants = dict(constants, GUARD_NONFINITE_VALUES=launcher.guards_nonfinite_values(spec, value))
        buffers = warm.plan_buffers if mods is None and kernel.generated is warm.generated else None
        if buffers is None:
            score_mod, mask_mod = mods if mods is not None else (self.score_mod, self.mask_mod)
            buffers = launcher.mod_arguments(kernel.generated, score_mod, mask_mod, device)
            if mods is None and warm.plan_buffers is None and _as_captured(buffers, score_mod, mask_mod):
                # the plan's own mods: their captured tensors themselves (and numbers, strides, sizes), which
                # every call of the signature passes alike (a new value or layout is another trace and plan)
                warm.plan_buffers, warm.generated = buffers, kernel.generated
        if dropout is not None:
            buffers = buffers + launcher.dropout_arguments(dropout, device)
        gpu.launch(kernel.fn, warm.grid, spec, device, [query, key, value, scratch, scratch, *tables, *buffers,
                                                        *warm.tail], constants, len(warm.tail))  # (kept scalars)
        merge = self.merge
        if merge.sinks != (sinks is not None):
            launcher.check_sinks(merge, sinks)
        out = warm.new_out()
        lse = warm.new_lse() if warm.keeps_lse else None
        merge_args = [scratch, scratch, out, scratch if lse is None else lse, *warm.merge_tail]
        fixed = len(warm.merge_tail)  # (the kept scalars last, unless the sinks follow them)
        if sinks is not None:
            merge_args += launcher.sink_arguments(sinks, warm.work)
            fixed = 0
        gpu.launch(cache.get_kernel(merge, device, self.merge_key).fn, warm.merge_grid, merge, device, merge_args,
                   warm.merge_constants, fixed)
        return out, lse

    def _first_calls(self, query, key, value, block_mask, dropout, sinks, mods, same_tables):
        """:meth:`__call__` until a launch has worked (:attr:`worked`): launched with fallbacks, and made warm."""
        launcher.check_dropout(self.spec, dropout)
        score_mod, mask_mod = mods if mods is not None else (self.score_mod, self.mask_mod)
        gathered = getattr(block_mask, "gathered_row", None)
        if gathered is not None and _direct(gathered.row, self.device):
            tables = list(gathered.tables()[:self.n_tables])
        else:
            tables = self.tables(block_mask, same_tables)

        generated = []  # (the kernel of the spec that ran)

        def attempt(spec: DecodeSpec) -> tuple[torch.Tensor, torch.Tensor]:
            kernel = cache.get_kernel(spec, self.device, self.kernel_key if spec is self.spec else None)
            generated[:] = [kernel.generated]
            args, constants, splits = decode_arguments(
                spec, kernel.generated, query, key, value, score_mod, mask_mod, None, self.scale, self.splits,
                dropout=dropout, tables=tables)
            gpu.launch(kernel.fn, decode_grid(splits[0]), spec, self.device, args, constants)
            return splits

        if self.worked:
            out_split, lse_split = attempt(self.spec)
        else:
            out_split, lse_split = retry.launch_with_fallbacks(self.spec, self.device, attempt, "decode")
            self.worked = cache.resolve_fallback(self.spec, self.device) is self.spec
        out, lse = merge_splits(out_split, lse_split, query, query.shape[1], query.shape[2], self.merge, sinks,
                                self.merge_key)
        if self.worked:
            self.warm = WarmDecode(self, generated[0], query, key, value, tables, score_mod, mask_mod, dropout, sinks,
                                   out_split, lse_split, out, lse)
            # (every call of a signature has tables of one dtype and device: a gathered row of this one's)
            self.warm.direct = block_mask is not None and _direct(block_mask.kv_num_blocks, self.device)
        return out, lse if self.need_lse else None


def _direct(table: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel reads ``table`` as it is (int32 on the launch's device), not converted."""
    return table.dtype == torch.int32 and table.device == device


def _as_captured(arguments: list, score_mod: TracedMod | None, mask_mod: TracedMod | None) -> bool:
    """Whether every tensor among a kernel's mod ``arguments`` is one of the mods' captured tensors itself
    (no copy to the device, no detached or reinterpreted view: those are made at each call)."""
    captured = [id(t) for mod in (score_mod, mask_mod) if mod is not None for t in mod.buffers]
    return all(id(a) in captured for a in arguments if isinstance(a, torch.Tensor))


class WarmDecode:
    """What every later call of a :class:`DecodeLaunch` passes alike, read off its first call's arguments:
    the decode kernel's arguments after the captured values (scale, lengths, strides, table shapes), its
    constexprs and grid, the partial results' and outputs' shapes, the merge's arguments between its
    tensors and the sinks, its constexprs and grid. A warm call (:meth:`DecodeLaunch.__call__`) allocates its
    outputs, fills in its own tensors and launches (the calls of one signature have the same shapes, strides and dtypes)."""

    def __init__(self, launch: DecodeLaunch, generated: Any, query, key, value, tables, score_mod, mask_mod, dropout,
                 sinks, out_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        spec, device = launch.spec, launch.device
        args, self.constants, _ = decode_arguments(
            spec, generated, query, key, value, score_mod, mask_mod, None, launch.scale, launch.splits,
            dropout=dropout, tables=tables)
        heads = 5 + len(tables) + len(launcher.mod_arguments(generated, score_mod, mask_mod, device)) \
            + len(launcher.dropout_arguments(dropout, device))  # (q, k, v, the partial results, tables, buffers)
        self.tail = args[heads:]
        # the CPU's non-finite guard depends on the values (:func:`launcher.guards_nonfinite_values`)
        self.guard_per_call = spec.mask_mod is not None and gpu.is_plain_cpu(device)
        self.grid = decode_grid(out_split)
        self.direct = False  # whether a gathered row's tables are passed as they are (set by the launch)
        # the constexprs of a gathered row passed as every table, by the widths of its tables
        self.row_constants: dict = {}
        # the plan's mods' arguments of the kernel ``generated``, where they are its captured tensors as they are
        self.plan_buffers: list | None = None
        self.generated = None
        self.work = out_split.dtype
        # one scratch tensor holds the partial results (both in the work dtype, contiguous, each part 16-byte
        # aligned) and, when the call returns none, the logsumexp the merge writes: one allocation, not three
        align = 16 // out_split.element_size()
        lse_split_at = -(-out_split.numel() // align) * align
        lse_at = lse_split_at + -(-lse_split.numel() // align) * align
        self.keeps_lse = launch.need_lse
        scratch = torch.empty(lse_at + (0 if self.keeps_lse else lse.numel()), dtype=self.work, device=device)
        self.constants = dict(self.constants, LSE_SPLIT_AT=lse_split_at)
        # what allocates each result as the first call's (torch.empty with its keywords costs about twice as much)
        self.new_scratch, self.new_out, self.new_lse = (empty_maker_like(t) for t in (scratch, out, lse))
        # the scratch tensor every warm call of this thread passes: the calls of one signature are queued on one
        # stream (flexc.call.signature keys it), so a call's kernels write it after the previous call's merge
        # read it (no allocation a step); another thread's calls could queue theirs in between: they make their own
        self.scratch, self.thread = scratch, threading.get_ident()
        merge_args, merge_constants = merge_arguments(launch.merge, out_split, lse_split, out, lse,
                                                               query.shape[2], query.shape[1], sinks)
        self.merge_constants = dict(merge_constants, LSE_SPLIT_AT=lse_split_at, LSE_AT=0 if self.keeps_lse else lse_at)
        self.merge_tail = merge_args[4:len(merge_args) - len(launcher.sink_arguments(sinks, lse_split.dtype))]
        self.merge_grid = merge_grid(launch.merge, out_split, query.shape[2], query.shape[1])


def launch(spec: DecodeSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
           num_splits: int | None = None, merge: MergeSpec | None = None,
           dropout: Dropout | None = None, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decode kernel and merge its splits (the merge kernel ``merge``, by default
    :func:`merge_spec`'s), folding in ``sinks`` there: ``(out [B,Hq,L,Ev], lse [B,Hq,L])``, lse in fp32
    (float64 for float64 inputs). ``dropout``: the seed and probability of a spec with dropout. A decode
    launch that runs out of GPU resources runs again with fewer stages or a smaller key tile
    (:func:`flexc.backends.triton.retry.launch_with_fallbacks`). One :class:`DecodeLaunch`, made and run once."""
    return DecodeLaunch(spec, query, key, value, score_mod, mask_mod, block_mask, scale, num_splits, merge,
                        sinks is not None)(query, key, value, block_mask, dropout, sinks)


def triton_decode(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse):
    """The TRITON backend's forward for short queries (same contract as ``triton_forward``): the decode
    kernel and its merge, as :func:`flexc.backends.triton.forward.plan_forward` plans them."""
    if not applies(query, key, block_mask):
        raise ValueError("flexc: triton_decode serves calls that applies() accepts (at most 16 query rows whose "
                         "packed heads share one BlockMask row). Fix: call triton_forward, which picks the kernel.")
    score_mod, mask_mod = lift_for_call(query, score_mod, mask_mod)  # captured numbers become arguments
    spec = make_spec(score_mod, mask_mod, query, key, value, block_mask, kernel_options=kernel_options)
    out, lse = launch(spec, query, key, value, score_mod, mask_mod, block_mask, scale,
                      num_splits=config.requested_splits(kernel_options), merge=merge_spec(spec))
    return out, (lse if need_lse else None)


# ---- the decode and merge kernels' arguments, constexprs and grids ---------------------------


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
        tables = launcher.kv_tables(block_mask, spec, S, device)
    splits = splits or config.default_splits(query, key, tables[1].shape[-1])
    work = work_dtype(query.dtype)
    out_split = torch.empty(B, Hkv, splits, spec.block_m, Ev, dtype=work, device=device)
    lse_split = torch.empty(B, Hkv, splits, spec.block_m, dtype=work, device=device)
    args = launcher.kernel_arguments(query, key, value, [out_split, lse_split], tables,
                            launcher.mod_arguments(generated, score_mod, mask_mod, device) + launcher.dropout_arguments(dropout, device),
                            [float(scale), L, S, Hq // Hkv, Hkv, splits], [])
    if guard_values is None:
        guard_values = launcher.guards_nonfinite_values(spec, value)
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


def decode_grid(out_split: torch.Tensor) -> tuple[int, int, int]:
    """One program per split, key head and batch."""
    B, Hkv, splits = out_split.shape[:3]
    return splits, Hkv, B


def merge_arguments(spec: MergeSpec, out_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, L: int, Hq: int, sinks: torch.Tensor | None = None) -> tuple[list, dict]:
    """The merge kernel's positional and constexpr arguments: ``[B, Hkv, splits, M, Ev]`` partial
    outputs and their logsumexps into ``out [B, Hq, L, Ev]`` and ``lse [B, Hq, L]``; ``sinks`` for a
    merge with sinks."""
    B, Hkv, splits, M, Ev = out_split.shape
    rows = Hq // Hkv * L
    launcher.check_sinks(spec, sinks)
    return ([out_split, lse_split, out, lse, splits, rows, L, Hq // Hkv, Ev, *out_split.stride()[:4],
             *lse_split.stride()[:3], *out.stride(), lse.stride(0), lse.stride(1),
             *launcher.sink_arguments(sinks, lse_split.dtype)],
            dict(BLOCK_ROWS=spec.block_rows, V_HEAD_DIM_PAD=spec.v_head_dim_pad, LSE_SPLIT_AT=0, LSE_AT=0))


def merge_grid(spec: MergeSpec, out_split: torch.Tensor, L: int, Hq: int) -> tuple[int, int, int]:
    """One program per ``block_rows`` packed query rows, key head and batch."""
    B, Hkv = out_split.shape[:2]
    return cdiv(Hq // Hkv * L, spec.block_rows), Hkv, B


__all__ = ["applies", "decode_arguments", "decode_grid", "decode_table_offsets", "DecodeLaunch", "launch", "make_spec", "MAX_PACKED", "MAX_ROWS", "merge_arguments", "merge_grid", "merge_spec", "merge_splits", "triton_decode"]
