"""Launcher of the split-KV decode kernel (:mod:`flexc.codegen.decode`) and the merge of its splits.

:func:`applies` says when the TRITON backend runs it instead of the forward kernel: at most
:data:`MAX_ROWS` query rows whose packed heads share one BlockMask row. Kernels live in the
Triton backend's one LRU kernel cache with the forward and backward kernels (counted by
:func:`flexc.cache_info`, freed by :func:`flexc.cache_clear`).
"""
from __future__ import annotations

from typing import Any

import torch

from ...codegen.decode import DecodeSpec, GeneratedDecode, generate_decode
from ...codegen.forward import next_power_of_2
from ...codegen.merge import MergeSpec
from ..layout import empty_like_reference
from ...analysis.tiles import cdiv
from ...mods.trace import TracedMod
from ... import device as gpu
from . import forward as tb

MAX_ROWS = 16  # query rows per head (as the CPU decode path)
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
    q_block, _ = tb._block_sizes(block_mask, L, key.shape[2])
    return L <= q_block and (block_mask.kv_num_blocks.shape[1] == 1 or G == 1)


def default_warps(block_m: int, target: str) -> int:
    """Warps of a decode launch. The 16-row tile (one token of up to 16 packed heads, or up to 16
    rows of one head) takes 2 on CUDA. Compiled for sm_90 as the launcher compiles it (bf16, 64-key
    tiles, bench/kernel_metrics.py --decode --warps 2 4), 2 warps issue 9-23% fewer SASS
    instructions per key tile than 4 (instructions per warp x warps), for causal, sliding window,
    document, ALiBi and soft-capping at head dim 64 and 128, with the same shared memory, no spills
    and 101-180 registers (4 warps: 64-136). Wider tiles keep 4."""
    return 2 if target == "cuda" and block_m == 16 else 4


def make_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, block_mask: Any, target: str | None = None) -> DecodeSpec:
    """The decode kernel's spec for these tensors (``target``: their device's, unless given)."""
    B, Hq, L, E = query.shape
    G = Hq // key.shape[1]
    target = target or tb._target(query.device)
    if block_mask is None:
        kv_block, has_full = 128, True
        mask_mod = None
    else:
        kv_block = tb._block_sizes(block_mask, L, key.shape[2])[1]
        has_full = getattr(block_mask, "full_kv_num_blocks", None) is not None
    # the interpreter pays per tile, so it takes whole key blocks; GPUs take 64-key tiles. Tiles are
    # powers of two (tl.arange): a 48-key block is three 16-key tiles, on either
    largest = 1 << (kv_block.bit_length() - 1)
    block_n = tb._largest_pow2_divisor(kv_block, largest if target == "interpreter" else 64)
    if block_n < 16:
        raise ValueError(f"flexc: the BlockMask's key block size {kv_block} must be a multiple of 16 for the "
                         f"Triton decode kernel. Fix: build the BlockMask with BLOCK_SIZE a multiple of 16 (e.g. 128).")
    # as the forward: int64 index arithmetic where int32 could wrap (torch computes in int64)
    index_dtype = tb._index_dtype((score_mod, mask_mod), B, Hq, L, value.shape[-2])
    block_m = max(16, next_power_of_2(G * L))
    return DecodeSpec(score_mod, mask_mod, query.dtype, E, value.shape[-1], kv_block, block_m, block_n,
                      default_warps(block_m, target), 2, has_full, target, tb._fp32_precision(target), index_dtype)


def _kernel(spec: DecodeSpec, device: torch.device):
    """``(generated, kernel)`` from the Triton backend's kernel cache (LRU-bounded, cleared by cache_clear)."""
    kernel = tb.get_kernel(spec, device)
    return kernel.generated, kernel.fn


def source_for(spec: DecodeSpec) -> str:
    """The decode source that runs for ``spec`` (the cached one if compiled already); compiles nothing."""
    return tb.source_for(spec)


def merge_spec(spec: DecodeSpec) -> MergeSpec:
    """The merge kernel that follows the decode kernel of ``spec``: its partial results are fp32
    (fp64 for fp64 inputs), ``spec.block_m`` packed rows of the value head dim per split."""
    work = "float64" if spec.dtype == torch.float64 else "float32"
    return MergeSpec(work, tb.padded_head_dim(spec.v_head_dim), min(spec.block_m, 16), spec.target)


def default_splits(query: torch.Tensor, key: torch.Tensor, n_blocks: int) -> int:
    """Splits per (batch, key head): enough programs to fill the GPU twice over, never more than
    the blocks a row can list. The interpreter uses two (any count is correct; two exercises the merge)."""
    B, Hkv = query.shape[0], key.shape[1]
    if not gpu.is_gpu(query.device):
        return max(1, min(2, n_blocks))
    sms = gpu.facts(query.device).sm_count
    return max(1, min(n_blocks, cdiv(2 * sms, B * Hkv), 64))


def merge_splits(out_split: torch.Tensor, lse_split: torch.Tensor, query: torch.Tensor, Hq: int, L: int,
                 spec: MergeSpec):
    """Merge ``[B, Hkv, splits, M, Ev]`` partial outputs and their logsumexps into ``out [B, Hq, L, Ev]``
    (query's dtype, laid out like the query) and ``lse [B, Hq, L]``, in one launch of the merge kernel
    ``spec`` (:func:`merge_spec` of the decode kernel's; :mod:`flexc.codegen.merge`): each split weighs
    ``exp(lse_split - lse)``; a row dead in every split gets output 0 and lse ``-inf``."""
    B, Hkv, splits, M, Ev = out_split.shape
    out = empty_like_reference((B, Hq, L, Ev), query)
    lse = torch.empty((B, Hq, L), dtype=lse_split.dtype, device=query.device)
    rows = Hq // Hkv * L
    kernel = tb.get_kernel(spec, query.device)
    grid = (cdiv(rows, spec.block_rows), Hkv, B)
    gpu.launch(kernel.fn, grid, spec, query.device,
               [out_split, lse_split, out, lse, splits, rows, L, Hq // Hkv, Ev, *out_split.stride()[:4],
                *lse_split.stride()[:3], *out.stride(), lse.stride(0), lse.stride(1)],
               dict(BLOCK_ROWS=spec.block_rows, V_HEAD_DIM_PAD=spec.v_head_dim_pad))
    return out, lse


def _arguments(spec: DecodeSpec, generated: GeneratedDecode, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any,
               scale: float, num_splits: int | None = None, guard_values: bool | None = None):
    """The kernel's positional and constexpr arguments for one call, and the per-split outputs
    ``(out_split, lse_split)`` it writes. ``guard_values`` defaults to the launcher's choice."""
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, Ev = value.shape
    device = query.device
    tables = tb._tables(block_mask, spec, S, device)
    splits = num_splits or default_splits(query, key, tables[1].shape[-1])
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    out_split = torch.empty(B, Hkv, splits, spec.block_m, Ev, dtype=work, device=device)
    lse_split = torch.empty(B, Hkv, splits, spec.block_m, dtype=work, device=device)
    Bm, Hm, nQ = tables[0].shape
    stride_kb = key.stride(0) if Bkv == B else 0
    stride_vb = value.stride(0) if Bkv == B else 0
    buffers = (tb._buffer_arguments(score_mod, generated.score_params, device)
               + tb._buffer_arguments(mask_mod, generated.mask_params, device))
    args = [query, key, value, out_split, lse_split, *tables, *buffers,
            float(scale), L, S, Hq // Hkv, Hkv, splits, *query.stride(), stride_kb, *key.stride()[1:],
            stride_vb, *value.stride()[1:], Bm, Hm, nQ, tables[1].shape[-1]]
    if guard_values is None:
        guard_values = tb._guards_nonfinite_values(spec, value)
    constants = dict(BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, KV_BLOCK_SIZE=spec.kv_block_size,
                     HEAD_DIM=spec.head_dim, HEAD_DIM_PAD=tb.padded_head_dim(spec.head_dim),
                     V_HEAD_DIM=spec.v_head_dim, V_HEAD_DIM_PAD=tb.padded_head_dim(spec.v_head_dim),
                     GUARD_NONFINITE_VALUES=guard_values)
    return args, constants, (out_split, lse_split)


def compile_decode_offline(spec: DecodeSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           block_mask: Any, capability: int = 90, warp_size: int = 32, num_splits: int = 8,
                           guard_values: bool = False) -> Any:
    """Compile the CUDA decode kernel for ``spec`` without a GPU, specialised like a real launch.

    ``query``/``key``/``value`` are CPU stand-ins of the launch's shapes (only shapes, dtypes and
    alignment matter); ``guard_values`` compiles the NaN/inf value guard in (CUDA launches never do).
    Returns Triton's compiled kernel, as :func:`flexc.backends.triton.forward.compile_offline`.
    """
    if spec.target != "cuda":
        raise ValueError(f"compile_decode_offline: spec.target must be 'cuda', got {spec.target!r}. "
                         f"Fix: build the spec for CUDA tensors (make_spec(..., target='cuda')).")
    generated = generate_decode(spec)
    module, _ = tb.import_source(generated.source, "cuda")
    args, constants, _ = _arguments(spec, generated, query, key, value, spec.score_mod, spec.mask_mod, block_mask,
                                    query.shape[-1] ** -0.5, num_splits, guard_values)
    return tb.compile_like_launcher(getattr(module, generated.kernel_name), args, constants, spec.num_warps,
                                    spec.num_stages, capability, warp_size)


def launch(spec: DecodeSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
           num_splits: int | None = None, merge: MergeSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decode kernel and merge its splits (the merge kernel ``merge``, by default
    :func:`merge_spec`'s): ``(out [B,Hq,L,Ev], lse [B,Hq,L])``, lse in fp32 (float64 for float64 inputs)."""
    B, Hq, L, _ = query.shape
    Hkv = value.shape[1]
    generated, fn = _kernel(spec, query.device)
    args, constants, (out_split, lse_split) = _arguments(spec, generated, query, key, value, score_mod, mask_mod,
                                                         block_mask, scale, num_splits)
    grid = (out_split.shape[2], Hkv, B)
    gpu.launch(fn, grid, spec, query.device, args, constants)
    # lse float64 for float64 inputs
    return merge_splits(out_split, lse_split, query, Hq, L, merge if merge is not None else merge_spec(spec))


def requested_splits(kernel_options: dict | None) -> int | None:
    """torch's ``SPLIT_KV`` kernel option (``fwd_SPLIT_KV`` overrides it): the number of splits per
    (batch, key head), or None for :func:`default_splits`. Splits past the listed blocks are empty."""
    options = kernel_options or {}
    name = "fwd_SPLIT_KV" if "fwd_SPLIT_KV" in options else "SPLIT_KV"
    if name not in options:
        return None
    return tb._check_int_option(name, options[name], power_of_2=False, minimum=1)


def triton_decode(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse):
    """The TRITON backend's forward for short queries (same contract as ``triton_forward``): the decode
    kernel and its merge, as :func:`flexc.backends.triton.forward.plan_forward` plans them."""
    plan = tb.plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, need_lse)
    if not (plan.kernels and isinstance(plan.kernels[0], DecodeSpec)):
        raise ValueError("flexc: triton_decode serves calls that applies() accepts (at most 16 query rows whose "
                         "packed heads share one BlockMask row). Fix: call triton_forward, which picks the kernel.")
    return tb.launch_plan(plan, query, key, value, block_mask, scale, kernel_options, need_lse)
