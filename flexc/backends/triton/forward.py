"""The generated-Triton forward backend: kernel cache, launcher, and ``kernel_source``.

:func:`triton_forward` is registered as ``BACKENDS["TRITON"]`` in :mod:`flexc.call.attention`. It picks
tile sizes, finds (or generates, writes to the cache directory and imports) the kernel for the
mods' *structure*, and launches it on the BlockMask's tables. CUDA tensors run the compiled
kernel; CPU tensors run the same source through Triton's interpreter, switched on with
``triton.knobs.runtime.interpret`` while the module is imported (no environment variable).

New captured-tensor values, sequence lengths and batch sizes reuse the cached kernel: they are
kernel arguments, never part of the source. :func:`cache_info` counts hits and misses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch

from ...codegen.backward import BackwardSpec, generate_backward
from ...codegen.decode import DecodeSpec, generate_decode
from ...codegen.forward import (KERNEL_NAME, NO_BLOCK_MASK, ForwardSpec, GeneratedForward, generate_forward,
                               next_power_of_2, padded_head_dim)
from ...codegen.index_width import index_dtype as _index_dtype
from ...codegen.merge import MergeSpec, generate_merge
from ...codegen.scalars import lift_for_call
from ..layout import empty_like_reference
from ...analysis.tiles import cdiv
from ... import device as gpu
from ..nonfinite import all_finite
from ...mods.traced_mod import TracedMod
from .. import registry

_FORWARD_OPTIONS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
# torch's kernel options the forward kernel honours (False by default, as in torch)
_FLAG_OPTIONS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS")
# a tensor with this many elements or more needs int64 offsets (index * stride wraps in int32)
INT32_OFFSET_LIMIT = 2 ** 31


class CacheInfo(NamedTuple):
    """Kernel cache counters: ``misses`` is how many kernels were generated and compiled."""

    hits: int
    misses: int
    size: int


class _Kernel(NamedTuple):
    generated: Any  # GeneratedForward, or GeneratedBackward for a BackwardSpec
    fn: Any  # the imported @triton.jit kernel (an InterpretedFunction under the interpreter)
    path: str


# spec key -> kernel, least recently used first; at most _limit["kernels"] entries
_cache: "OrderedDict[tuple, _Kernel]" = OrderedDict()
_limit = {"kernels": int(os.environ.get("FLEXC_KERNEL_CACHE_SIZE", "64"))}
# spec key -> the smaller-tile spec that replaced it after the GPU ran out of shared memory
_fallbacks: dict[tuple, ForwardSpec] = {}
_stats = {"hits": 0, "misses": 0}
_cache_lock = threading.Lock()
def cache_info() -> CacheInfo:
    """``CacheInfo(hits, misses, size)`` of the generated-kernel cache (a miss generates and compiles)."""
    with _cache_lock:
        return CacheInfo(_stats["hits"], _stats["misses"], len(_cache))


def cache_clear() -> None:
    """Drop every cached kernel and reset the counters: their modules leave ``sys.modules`` and the
    source files this process wrote are deleted, so the memory is freed."""
    with _cache_lock:
        while _cache:
            _release(_cache.popitem(last=False)[1])
        _fallbacks.clear()
        _stats["hits"] = _stats["misses"] = 0


def cache_limit(kernels: int | None = None) -> int:
    """The most kernels the cache keeps (least recently used ones are dropped first); with
    ``kernels``, set it and return the previous limit. Default 64, or ``$FLEXC_KERNEL_CACHE_SIZE``."""
    with _cache_lock:
        previous = _limit["kernels"]
        if kernels is not None:
            if isinstance(kernels, bool) or not isinstance(kernels, int) or kernels < 1:
                raise ValueError(f"cache_limit: kernels must be a positive int, got {kernels!r}. Fix: pass e.g. 64.")
            _limit["kernels"] = kernels
            _evict()
        return previous


def _evict() -> None:
    """Drop least recently used kernels beyond the limit (the caller holds _cache_lock)."""
    while len(_cache) > _limit["kernels"]:
        _release(_cache.popitem(last=False)[1])


def _release(kernel: _Kernel) -> None:
    """Forget a dropped kernel's module and file, unless another cached kernel shares them."""
    if any(other.path == kernel.path for other in _cache.values()):
        return
    name = os.path.splitext(os.path.basename(kernel.path))[0]
    if getattr(sys.modules.get(name), "__file__", None) == kernel.path:
        del sys.modules[name]
    try:
        os.remove(kernel.path)
    except OSError:  # already gone (another process cleared it): nothing to free
        pass


def cache_dir() -> str:
    """Where generated sources are written: ``$FLEXC_CACHE_DIR``, else ``~/.cache/flexc/kernels``."""
    candidates = [os.environ.get("FLEXC_CACHE_DIR"), os.path.join(os.path.expanduser("~"), ".cache", "flexc", "kernels"),
                  os.path.join(tempfile.gettempdir(), f"flexc-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}")]
    for path in candidates:
        if not path:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError("flexc: no writable directory for generated kernels; set FLEXC_CACHE_DIR to one.")


# ---- configuration ------------------------------------------------------------------------

def default_config(dtype: torch.dtype, head_dim: int, v_head_dim: int, target: str) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a dtype and head dims.

    On CUDA these are torch's Hopper defaults; under the interpreter each tile costs a fixed
    overhead plus its size; 64 x 64 was fastest at L = 256 (16: 0.9 s, 32: 0.27 s, 64: 0.08 s).
    """
    if target == "interpreter":
        return 64, 64, 4, 1
    d = max(padded_head_dim(head_dim), padded_head_dim(v_head_dim))
    if dtype in (torch.float32, torch.float64):
        return (128, 32, 4, 3) if d <= 64 else (32, 64, 4, 3) if d <= 128 else (32, 32, 4, 3)
    # 16-bit: torch's Hopper tiles, but 8 warps at head dim 64: with 4 warps the 128 x 128 tile
    # spills (bench/kernel_metrics.py: 255 registers and spill traffic on every tile; 8 warps: ~210
    # registers, no spills, and fewer instructions per (query, key) pair than torch's kernel)
    return (128, 128, 8, 3) if d <= 64 else (128, 64, 8, 3) if d <= 128 else (64, 32, 4, 3)


def _forward_options(kernel_options: dict | None) -> dict:
    """The forward-pass options: ``fwd_X`` overrides ``X``; ``bwd_`` keys are not ours."""
    options: dict = {}
    for name, value in (kernel_options or {}).items():
        if name in _FORWARD_OPTIONS:
            options.setdefault(name, value)
    for name, value in (kernel_options or {}).items():
        if isinstance(name, str) and name.startswith("fwd_") and name[4:] in _FORWARD_OPTIONS:
            options[name[4:]] = value
    return options


def _check_int_option(name: str, value: Any, power_of_2: bool, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"flexc: kernel_options[{name!r}] must be an int, got {type(value).__name__} {value!r}. "
                        f"Fix: pass e.g. {name}=64.")
    if value < minimum or (power_of_2 and value & (value - 1)):
        what = f"a power of two >= {minimum}" if power_of_2 else f">= {minimum}"
        # Suggest the nearest valid value above the one given (num_warps=3 -> 4, BLOCK_M=48 -> 64).
        suggestion = max(minimum, 1 << max(0, value - 1).bit_length()) if power_of_2 else minimum
        raise ValueError(f"flexc: kernel_options[{name!r}] must be {what}, got {value}. Fix: use e.g. {suggestion}.")
    return value


def resolve_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, v_head_dim: int,
                   q_block_size: int, kv_block_size: int | None, target: str) -> tuple[int, int, int, int]:
    """Tiles and launch options: the user's ``kernel_options`` over :func:`default_config`.

    The BlockMask's block sizes must be multiples of ``BLOCK_M``/``BLOCK_N`` (as torch requires);
    a default that does not divide them is halved, a user's choice raises ``ValueError``.
    ``kv_block_size=None`` means no BlockMask.
    """
    options = _forward_options(kernel_options)
    block_m, block_n, warps, stages = default_config(dtype, head_dim, v_head_dim, target)
    chosen = {}
    for name, minimum, pow2 in (("BLOCK_M", 16, True), ("BLOCK_N", 16, True), ("num_warps", 1, True), ("num_stages", 1, False)):
        if name in options:
            chosen[name] = _check_int_option(name, options[name], pow2, minimum)
    block_m, block_n = chosen.get("BLOCK_M", block_m), chosen.get("BLOCK_N", block_n)
    for tile_name, block_size, what in (("BLOCK_M", q_block_size, "query (Q)"), ("BLOCK_N", kv_block_size, "key (KV)")):
        if block_size is None:
            continue
        tile = block_m if tile_name == "BLOCK_M" else block_n
        if block_size % tile:
            if tile_name in chosen:
                raise ValueError(
                    f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of "
                    f"kernel_options[{tile_name!r}]={tile}. Fix: pass a {tile_name} dividing {block_size} "
                    f"(e.g. {_largest_pow2_divisor(block_size, tile)}) or build the BlockMask with a "
                    f"BLOCK_SIZE that is a multiple of {tile}.")
            tile = _largest_pow2_divisor(block_size, tile)
            if tile < 16:
                raise ValueError(
                    f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of 16 for the "
                    f"Triton kernel. Fix: build the BlockMask with BLOCK_SIZE a multiple of 16 (e.g. 128).")
            if tile_name == "BLOCK_M":
                block_m = tile
            else:
                block_n = tile
    return block_m, block_n, chosen.get("num_warps", warps), chosen.get("num_stages", stages)


def _largest_pow2_divisor(n: int, at_most: int) -> int:
    tile = at_most
    while tile > 1 and n % tile:
        tile //= 2
    return tile


def _target(device: torch.device) -> str:
    return gpu.target(device)


def _fp32_precision(target: str) -> str:
    if target == "cuda" and gpu.allows_tf32():
        return "tf32"
    return "ieee"


def _block_sizes(block_mask: Any, L: int, S: int, kernel_options: dict | None = None) -> tuple[int, int]:
    """The BlockMask's (query, key) block sizes as the kernels take them for ``L`` queries, ``S`` keys.

    A block larger than the whole sequence (torch's ``1 << 30`` no-op mask from
    ``_create_empty_block_mask``, or any BLOCK_SIZE past the lengths) is that sequence's only block,
    index 0: any size covering the sequence reads the same tables. The kernels take the smallest
    power of two >= the length (at least 16, and at least a tile the user asks for in
    ``kernel_options``, which must divide it), so a key block is cdiv(S, BLOCK_N) tiles, not
    ``(1 << 30) / BLOCK_N`` of them.
    """
    size = block_mask.BLOCK_SIZE
    q_block, kv_block = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    cover_q = max(16, next_power_of_2(L), _requested_tile(kernel_options, "BLOCK_M"))
    cover_kv = max(16, next_power_of_2(S), _requested_tile(kernel_options, "BLOCK_N"))
    return min(q_block, cover_q), min(kv_block, cover_kv)  # only a block past the end is cut


def _requested_tile(kernel_options: dict | None, prefix: str) -> int:
    """The largest tile in ``kernel_options`` along one direction (BLOCK_M, fwd_BLOCK_M, BLOCK_M1, ...)."""
    largest = 1
    for name, value in (kernel_options or {}).items():
        bare = name[4:] if name.startswith(("fwd_", "bwd_")) else name
        if bare.rstrip("12") == prefix and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            largest = max(largest, next_power_of_2(value))  # a bad value raises later, in resolve_config
    return largest


def _flags(kernel_options: dict | None) -> dict[str, bool]:
    """torch's PRESCALE_QK / ROWS_GUARANTEED_SAFE / BLOCKS_ARE_CONTIGUOUS (``fwd_`` prefix overrides)."""
    options = kernel_options or {}
    flags = {}
    for name in _FLAG_OPTIONS:
        key = f"fwd_{name}" if f"fwd_{name}" in options else name
        value = options.get(key, False)
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise TypeError(f"flexc: kernel_options[{key!r}] must be a bool, got {type(value).__name__} {value!r}. "
                            f"Fix: pass {name}=True or False.")
        flags[name] = bool(value)
    return flags


def make_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, dtype: torch.dtype, head_dim: int,
              v_head_dim: int, block_size: tuple[int, int] | None, kernel_options: dict | None, target: str,
              need_lse: bool, has_full_blocks: bool = True, index_dtype: str = "int32") -> ForwardSpec:
    """The :class:`ForwardSpec` for these mods and shapes; ``block_size=None`` means no BlockMask.

    ``index_dtype`` is the mods' integer index type (see :mod:`flexc.codegen.index_width`).
    """
    if block_size is None:
        block_m, block_n, warps, stages = resolve_config(kernel_options, dtype, head_dim, v_head_dim, NO_BLOCK_MASK,
                                                         None, target)
        q_block, kv_block, mask_mod, has_full_blocks = NO_BLOCK_MASK, block_n, None, True
    else:
        q_block, kv_block = block_size
        block_m, block_n, warps, stages = resolve_config(kernel_options, dtype, head_dim, v_head_dim, q_block,
                                                         kv_block, target)
    flags = _flags(kernel_options)
    return ForwardSpec(score_mod, mask_mod, dtype, head_dim, v_head_dim, q_block, kv_block, block_m, block_n,
                       warps, stages, has_full_blocks, need_lse, target, _fp32_precision(target),
                       flags["PRESCALE_QK"], flags["ROWS_GUARANTEED_SAFE"], flags["BLOCKS_ARE_CONTIGUOUS"], index_dtype)


# ---- the kernel cache ---------------------------------------------------------------------

def require_triton() -> Any:
    """The ``triton`` module, or an ImportError saying how to install it.

    Triton is optional (the ``flexc[triton]`` extra): tracing, block masks, the CPU path and
    kernel *source* need only torch; importing and running a generated kernel needs Triton.
    """
    try:
        import triton
    except ImportError as e:
        raise ImportError("flexc: running a generated Triton kernel needs the `triton` package, which is not "
                          "installed. Fix: pip install 'flexc[triton]' (or pip install triton), or use "
                          "kernel_options={'BACKEND': 'TORCH'} on CPU tensors.") from e
    return triton


def _file_holds(path: str, text: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == text
    except OSError:
        return False


def import_source(source: str, target: str) -> tuple[Any, str]:
    """Write ``source`` to the cache directory and import it as a module; return it and its path.

    With ``target="interpreter"`` its ``@triton.jit`` functions run on CPU tensors.
    """
    require_triton()  # a clear ImportError before anything is written
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"flexc_kernel_{digest}"
    path = os.path.join(cache_dir(), name + ".py")
    if not _file_holds(path, source):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    try:
        module = _exec_module(name, path, target)
    except FileNotFoundError:  # another process's cache_clear removed the file just now
        with open(path, "w") as f:
            f.write(source)
        module = _exec_module(name, path, target)
    sys.modules.setdefault(name, module)
    return module, path


def _exec_module(name: str, path: str, target: str) -> Any:
    triton = require_triton()

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if target == "interpreter":
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "scope"):
            raise RuntimeError(f"flexc: running the Triton kernel on CPU needs triton.knobs.runtime (Triton >= 3.4), "
                               f"found Triton {triton.__version__}. Fix: upgrade Triton, or use BACKEND='TORCH' on CPU.")
        with runtime.scope():
            runtime.interpret = True  # @triton.jit now builds InterpretedFunctions
            spec.loader.exec_module(module)
    else:
        spec.loader.exec_module(module)
    return module


def _generate(spec: ForwardSpec | BackwardSpec | DecodeSpec | MergeSpec) -> Any:
    if isinstance(spec, BackwardSpec):
        return generate_backward(spec)
    if isinstance(spec, MergeSpec):
        return generate_merge(spec)
    return generate_decode(spec) if isinstance(spec, DecodeSpec) else generate_forward(spec)


def get_kernel(spec: ForwardSpec | BackwardSpec | DecodeSpec, device: torch.device | None = None) -> _Kernel:
    """The compiled kernel for ``spec`` (forward, backward or decode) launched for tensors on
    ``device``: from the cache, or generated, written and imported. One LRU cache holds all three
    kinds. CPU tensors standing in for a GPU (:mod:`flexc.backends.device`) run the interpreter
    variant of a ``"cuda"`` spec, cached apart from the compiled one."""
    runs = gpu.runnable(spec, device) if device is not None else spec
    key = spec.key() if runs is spec else (spec.key(), "interpreted")
    with _cache_lock:
        kernel = _cache.get(key)
        if kernel is not None:
            _cache.move_to_end(key)
            _stats["hits"] += 1
            return kernel
        generated = _generate(runs)
        module, path = import_source(generated.source, runs.target)
        kernel = _Kernel(generated, getattr(module, generated.kernel_name), path)
        _cache[key] = kernel
        _stats["misses"] += 1
        _evict()
        return kernel


def _smaller(spec: ForwardSpec) -> ForwardSpec | None:
    """The next configuration to try when ``spec`` needs more shared memory than the GPU has."""
    if spec.num_stages > 1:
        return dataclasses.replace(spec, num_stages=spec.num_stages - 1)
    if spec.block_n > 16:
        return dataclasses.replace(spec, block_n=spec.block_n // 2, num_stages=2)
    if spec.block_m > 16:
        return dataclasses.replace(spec, block_m=spec.block_m // 2, num_stages=2)
    return None


def resolve_fallback(spec: ForwardSpec) -> ForwardSpec:
    """``spec``, or the smaller configuration that replaced it after an out-of-resources launch."""
    with _cache_lock:
        return _fallbacks.get(spec.key(), spec)


def generated_for(spec: ForwardSpec | BackwardSpec | DecodeSpec | MergeSpec) -> Any:
    """The generated kernel (``.source``, ``.kernel_name``) that runs for ``spec``: the cached one if
    compiled already (so a kernel shared by mods of one structure shows its first mods' names), else
    generated now; compiles nothing. A forward spec replaced after running out of GPU memory gives
    its replacement."""
    spec = resolve_fallback(spec)
    with _cache_lock:
        kernel = _cache.get(spec.key())
    return kernel.generated if kernel is not None else _generate(spec)


def source_for(spec: ForwardSpec | BackwardSpec | DecodeSpec | MergeSpec) -> str:
    """The source that runs for ``spec`` (the cached one if compiled already); compiles nothing."""
    return generated_for(spec).source


# ---- launching ----------------------------------------------------------------------------

def _tables(block_mask: Any, spec: ForwardSpec, S: int, device: torch.device) -> list[torch.Tensor]:
    """``[partial counts, partial indices, (full counts, full indices)]`` as contiguous int32."""
    if block_mask is None:
        n = max(1, cdiv(S, spec.kv_block_size))
        return [torch.zeros((1, 1, 1), dtype=torch.int32, device=device),
                torch.zeros((1, 1, 1, n), dtype=torch.int32, device=device),
                torch.full((1, 1, 1), cdiv(S, spec.kv_block_size), dtype=torch.int32, device=device),
                torch.arange(n, dtype=torch.int32, device=device).view(1, 1, 1, n)]
    names = ["kv_num_blocks", "kv_indices"] + (["full_kv_num_blocks", "full_kv_indices"] if spec.has_full_blocks else [])
    tables = [getattr(block_mask, n).to(device=device, dtype=torch.int32).contiguous() for n in names]
    if spec.has_full_blocks and (tables[2].shape != tables[0].shape or tables[3].shape != tables[1].shape):
        raise ValueError(f"flexc: the BlockMask's full-block tables {tuple(tables[2].shape)}/{tuple(tables[3].shape)} "
                         f"must have the shapes of its partial tables {tuple(tables[0].shape)}/{tuple(tables[1].shape)}. "
                         f"Fix: build it with create_block_mask or BlockMask.from_kv_blocks.")
    return tables


def _buffer_arguments(traced: TracedMod | None, params, device: torch.device) -> list:
    args: list = []
    if traced is None:
        return args
    for p in params:
        if p.what == "scalar":  # a captured Python number (flexc.codegen.scalars)
            args.append(traced.scalars[p.slot])
            continue
        t = traced.buffers[p.slot]
        if p.what == "ptr":
            if t.device != device:
                raise ValueError(f"flexc: {traced.kind} {traced.name} captured tensor "
                                 f"{traced.buffer_names[p.slot]!r} is on {t.device} but the inputs are on {device}. "
                                 f"Fix: create it on {device} (e.g. `.to('{device}')`).")
            t = t.detach()
            args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        elif p.what == "stride":
            args.append(t.stride(p.dim))
        else:
            args.append(t.shape[p.dim])
    return args


def _empty_like_query(query: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    """The output ``[B, Hq, L, Ev]`` laid out as flex_attention returns it (:mod:`flexc.backends.layout`:
    the query's dimension order, the head dim innermost), so returning it copies nothing."""
    B, H, L, _ = query.shape
    return empty_like_reference((B, H, L, v_head_dim), query)


def _guards_nonfinite_values(spec: ForwardSpec, value: torch.Tensor) -> bool:
    """Whether this call compiles in the guard that keeps masked keys' NaN/inf values out of ``p @ v``.

    On the CPU (Triton's interpreter) one reduction over the values decides. On CUDA the guard stays
    off, as in torch's own kernels (a NaN in a masked key's value row gives a NaN row there too):
    deciding would cost a device sync on every call, and compiling it in always costs spills.
    """
    return spec.mask_mod is not None and gpu.is_plain_cpu(value.device) and not all_finite(value)


def _constexprs(spec: ForwardSpec, L: int, S: int, tensors: list, guard_values: bool = False) -> dict[str, int]:
    """The kernel's compile-time arguments for ``spec`` and one call's lengths and tensors.

    Whole tiles (lengths multiples of BLOCK_M, and of the key block, so of BLOCK_N), int64 offsets and the non-finite values
    guard select variants that Triton compiles once each; other lengths reuse them.
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
                GUARD_NONFINITE_VALUES=guard_values)


def _kernel_args(generated: GeneratedForward, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor | None, tables: list[torch.Tensor],
                 score_mod: TracedMod | None, mask_mod: TracedMod | None, scale: float) -> list:
    """The kernel's positional arguments, in the order of its signature (constexprs excluded)."""
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, _ = value.shape
    Bm, Hm, nQ = tables[0].shape
    if generated.needs_positive_scale and not scale > 0:
        # the kernel multiplies raw q.k by scale * log2(e) after taking the row max, so the scale
        # must be positive: q.k * scale == (-q).k * |scale|, and with scale 0 every score is 0
        query = -query if scale < 0 else torch.zeros_like(query)
        scale = abs(scale) or 1.0
    stride_kb = key.stride(0) if Bkv == B else 0
    stride_vb = value.stride(0) if Bkv == B else 0
    shapes = [float(scale), L, S, Hq // Hkv,
              *query.stride(), stride_kb, *key.stride()[1:], stride_vb, *value.stride()[1:], *out.stride()]
    if lse is not None:
        shapes += [lse.stride(0), lse.stride(1)]
    shapes += [Bm, Hm, nQ, tables[1].shape[-1]]
    buffers = (_buffer_arguments(score_mod, generated.score_params, query.device)
               + _buffer_arguments(mask_mod, generated.mask_params, query.device))
    return [query, key, value, out] + ([lse] if lse is not None else []) + tables + buffers + shapes


def launches_nothing(query: torch.Tensor, value: torch.Tensor, need_lse: bool) -> bool:
    """Whether the forward kernel's launcher fills the outputs itself and launches no kernel: no
    query rows, no keys, or nothing to write (an empty value head dim without the logsumexp)."""
    B, Hq, L, _ = query.shape
    S, Ev = value.shape[-2], value.shape[-1]
    return B * Hq * L == 0 or S == 0 or (Ev == 0 and not need_lse)


def launch(spec: ForwardSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
           lse_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel for ``spec`` on these tensors; the mods supply the captured-tensor values.

    ``lse_dtype`` float64 keeps a float64 call's logsumexp exact for its backward.
    """
    B, Hq, L, _ = query.shape
    Bkv, Hkv, S, Ev = value.shape
    device = query.device
    out = _empty_like_query(query, Ev)
    lse = torch.empty((B, Hq, L), dtype=lse_dtype, device=device) if spec.output_lse else None
    if launches_nothing(query, value, spec.output_lse):  # no rows, or no keys: rows fully masked
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    if max(B, Hq) > 65535 and spec.target == "cuda":
        raise ValueError(f"flexc: batch {B} and query heads {Hq} must each be at most 65535 (CUDA grid limit). "
                         f"Fix: split the batch into chunks.")
    spec = resolve_fallback(spec)
    tables = _tables(block_mask, spec, S, device)
    nQ = tables[0].shape[-1]
    if spec.q_block_size != NO_BLOCK_MASK and nQ < cdiv(L, spec.q_block_size):
        raise ValueError(f"flexc: the BlockMask has {nQ} query block rows but L={L} needs "
                         f"{cdiv(L, spec.q_block_size)} of size {spec.q_block_size}. Fix: build it for Q_LEN={L}.")
    guard_values = _guards_nonfinite_values(spec, value)
    while True:
        kernel = get_kernel(spec, device)
        args = _kernel_args(kernel.generated, query, key, value, out, lse, tables, score_mod, mask_mod, scale)
        constants = _constexprs(spec, L, S, args, guard_values)
        grid = (cdiv(L, spec.block_m), Hq, B)
        from triton.runtime.errors import OutOfResources

        try:
            gpu.launch(kernel.fn, grid, spec, device, args, constants)
            return out, lse
        except OutOfResources as e:
            # e.g. a score_mod that loads whole [BLOCK_M, BLOCK_N] tiles of a captured tensor:
            # pipelining them needs more shared memory than the default tiles leave.
            smaller = _smaller(spec)
            if smaller is None:
                raise
            warnings.warn(f"flexc: the kernel with BLOCK_M={spec.block_m}, BLOCK_N={spec.block_n}, "
                          f"num_stages={spec.num_stages} needs more GPU resources than available ({e}); "
                          f"retrying with BLOCK_M={smaller.block_m}, BLOCK_N={smaller.block_n}, "
                          f"num_stages={smaller.num_stages}.", RuntimeWarning, stacklevel=3)
            with _cache_lock:
                for replaced_key, replaced in list(_fallbacks.items()):
                    if replaced.key() == spec.key():
                        _fallbacks[replaced_key] = smaller
                _fallbacks[spec.key()] = smaller
            spec = smaller


def _spec_for_call(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                   mask_mod: TracedMod | None, block_mask: Any, kernel_options: dict | None,
                   need_lse: bool) -> ForwardSpec:
    """The kernel spec that a flex_attention call with these (validated) arguments runs."""
    block_size = (_block_sizes(block_mask, query.shape[-2], value.shape[-2], kernel_options)
                  if block_mask is not None else None)
    has_full = block_mask is not None and getattr(block_mask, "full_kv_num_blocks", None) is not None
    B, Hq, L, _ = query.shape
    index_dtype = _index_dtype((score_mod, mask_mod), B, Hq, L, value.shape[-2])
    return make_spec(score_mod, mask_mod, query.dtype, query.shape[-1], value.shape[-1], block_size,
                     kernel_options, _target(query.device), need_lse, has_full, index_dtype)


class ForwardPlan(NamedTuple):
    """The kernels a Triton forward launches for one call, in launch order, and the mods they take."""

    score_mod: TracedMod | None  # the call's mods, captured numbers lifted to kernel arguments
    mask_mod: TracedMod | None
    kernels: tuple  # (ForwardSpec,), (DecodeSpec, MergeSpec), or () when nothing is launched


def plan_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                 mask_mod: TracedMod | None, block_mask: Any, kernel_options: dict | None, need_lse: bool,
                 training: bool = False) -> ForwardPlan:
    """The kernels the ``"TRITON"`` forward launches for these (validated) arguments.

    The one rule :func:`triton_forward`, the training forward
    (:func:`flexc.backends.triton.backward.forward_for_training`, ``training=True``) and
    :func:`kernel_source` share: short queries (:func:`flexc.backends.triton.decode.applies`) run the
    split-KV decode kernel then its merge, except in training, whose generated backward takes the
    forward kernel's logsumexp; anything else runs the forward kernel (its logsumexp variant when
    ``need_lse`` or ``training``), or nothing when :func:`launches_nothing`.
    """
    from . import decode as triton_decode  # imports this module

    score_mod, mask_mod = lift_for_call(query, score_mod, mask_mod)  # captured numbers become arguments
    if not training and triton_decode.applies(query, key, block_mask):  # short queries: split-KV decoding
        spec = triton_decode.make_spec(score_mod, mask_mod, query, key, value, block_mask)
        return ForwardPlan(score_mod, mask_mod, (spec, triton_decode.merge_spec(spec)))
    need_lse = need_lse or training
    if launches_nothing(query, value, need_lse):
        return ForwardPlan(score_mod, mask_mod, ())
    spec = _spec_for_call(query, value, score_mod, mask_mod, block_mask, kernel_options, need_lse)
    return ForwardPlan(score_mod, mask_mod, (spec,))


def launch_plan(plan: ForwardPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                scale: float, kernel_options: dict | None, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernels of ``plan``: ``(out, lse)``, lse float64 for float64 inputs, None unless
    ``need_lse`` or the plan's forward writes it (the training forward)."""
    if plan.kernels and isinstance(plan.kernels[0], DecodeSpec):
        from . import decode as triton_decode

        decode, merge = plan.kernels
        out, lse = triton_decode.launch(decode, query, key, value, plan.score_mod, plan.mask_mod, block_mask, scale,
                                        num_splits=triton_decode.requested_splits(kernel_options), merge=merge)
        return out, (lse if need_lse else None)
    if plan.kernels:
        (spec,) = plan.kernels
    else:  # the launcher returns the empty or fully masked outputs without a kernel
        spec = _spec_for_call(query, value, plan.score_mod, plan.mask_mod, block_mask, kernel_options, need_lse)
    # a float64 call gets a float64 logsumexp, as torch returns (and as the decode kernel writes)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return launch(spec, query, key, value, plan.score_mod, plan.mask_mod, block_mask, scale, lse_dtype=lse_dtype)


def triton_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                   mask_mod: TracedMod | None, block_mask: Any, scale: float, kernel_options: dict | None,
                   need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"TRITON"`` forward backend: ``(out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] fp32 or None)``.

    Inputs are validated by :func:`flexc.flex_attention`; this checks only what the kernel adds
    (block sizes against tiles, devices of captured tensors). The kernels are :func:`plan_forward`'s.
    """
    plan = plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, need_lse)
    return launch_plan(plan, query, key, value, block_mask, scale, kernel_options, need_lse)


# between the sources of a call's kernels in kernel_source's text
KERNEL_SEPARATOR = "# ======== kernel {index}/{count}: {name} ========"


def kernel_source(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None = None,
                  block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                  return_lse: bool = False, kernel_options: dict | None = None, *, return_aux: Any = None,
                  sinks: torch.Tensor | None = None, dropout_p: float = 0.0, generator: Any = None,
                  backward: bool = False) -> str:
    """The exact Triton source of the kernels :func:`flexc.flex_attention` launches for these arguments.

    Takes ``flex_attention``'s arguments, and decides as it does: the backend from
    ``kernel_options`` and the device (under :func:`flexc.device.simulate` the GPU's choices and
    its CUDA source), the logsumexp from ``return_lse``/``return_aux``, training from the inputs'
    ``requires_grad`` (and captured tensors that require grad) under ``torch.is_grad_enabled()``.

    * inference: the forward kernel (the variant that writes the logsumexp when it is returned);
    * training: the forward kernel that writes the logsumexp, which the backward reads;
    * at most 16 query rows (decoding): two kernels, the split-KV decode kernel and the merge of its
      splits (not in training with the generated backward, which runs the forward kernel). Their
      sources are concatenated in launch order, after a comment naming both, each opening with a
      ``# ======== kernel i/n: NAME ========`` line; the text still parses as Python;
    * ``backward=True``: the backward kernel a training call launches (whether or not the inputs
      require grad now; captured tensors that require grad receive gradients).

    With ``sinks`` the call runs the kernels of the call without them that returns the logsumexp
    (the sinks are merged in torch, :mod:`flexc.call.sinks`): those are returned. With ``dropout_p > 0``
    the call runs the TORCH backend (the kernels do not drop yet), which the text says.

    When the call runs no generated kernel (the TORCH backend, the default on CPU tensors; a backward
    of a score_mod the generated backward cannot differentiate, which trains through the torch
    backward; no rows or no keys), the text is a comment saying what runs instead. Nothing is
    compiled.

    >>> print(flexc.kernel_source(q, k, v, score_mod=alibi, block_mask=causal))  # doctest: +SKIP
    """
    from ...call.plan import plan_call, prepare_call, sink_free_request

    if sinks is not None:  # the kernels of the sink-free call flex_attention makes
        _, return_aux = sink_free_request(query, sinks, enable_gqa, return_lse, return_aux)
        return_lse = False
    _, options, traced_score, traced_mask = prepare_call(query, key, value, score_mod, block_mask, scale,
                                                         enable_gqa, kernel_options, outputs=(return_lse, return_aux))
    from .. import dropout

    plan = plan_call(query, key, value, traced_score, traced_mask, options, return_lse, return_aux,
                     training=True if backward else None, dropout_p=dropout.check(dropout_p, generator))
    if plan.backend != "TRITON":
        return _runs_instead(plan.backend, query.device, backward)
    if backward:
        if plan.generated is None:
            from ...call.plan import generated_backward_fallback
            from ..registry import TRAINING

            reason = (generated_backward_fallback(traced_score) or "").replace("\n", " ")
            why = (f"the generated backward cannot differentiate its\n# score_mod ({reason})"
                   if "TRITON" in TRAINING else "no generated backward is registered\n# for the TRITON backend")
            return (f"# flexc: this call's backward runs no generated kernel: {why}, so training runs the torch "
                    f"backward\n# (flexc.backends.cpu.torch_cpu.torch_backward, per query row on {query.device}) "
                    f"after the generated forward.\n")
        from .backward import backward_source

        return backward_source(query, value, traced_score, traced_mask, block_mask, options)
    forward = plan_forward(query, key, value, traced_score, traced_mask, block_mask, options,
                           plan.want_lse or plan.training, training=plan.generated is not None)
    return sources_text(forward.kernels)


def sources_text(kernels: tuple) -> str:
    """The sources of ``kernels`` (specs in launch order) as :func:`kernel_source` presents them."""
    if not kernels:
        return ("# flexc: this call launches no kernel: it has no query rows or no keys (or nothing to write), so "
                "the launcher\n# fills the output with zeros and the logsumexp with -inf itself.\n")
    generated = [generated_for(spec) for spec in kernels]
    if len(generated) == 1:
        return generated[0].source
    names = ", then ".join(g.kernel_name for g in generated)
    parts = [f"# flexc: this call launches {len(generated)} kernels, in this order: {names}.\n"
             f"# Their sources follow, each after a '# ======== kernel i/{len(generated)}: NAME ========' line.\n"]
    for index, g in enumerate(generated, 1):
        parts.append("\n" + KERNEL_SEPARATOR.format(index=index, count=len(generated), name=g.kernel_name)
                     + "\n" + g.source)
    return "".join(parts)


def _runs_instead(backend: str, device: torch.device, backward: bool) -> str:
    """kernel_source's text for a call whose backend generates no kernel."""
    what = "backward" if backward else "call"
    if backend == "TORCH":
        runs = "flexc's block-sparse PyTorch path (flexc.backends.cpu.torch_cpu), forward and backward"
    else:
        runs = f"the {backend!r} backend"
    return (f"# flexc: this {what} runs no generated kernel: kernel_options['BACKEND'] resolves to {backend!r} for "
            f"tensors on {device},\n# so it runs {runs}.\n"
            f"# Fix: pass kernel_options={{'BACKEND': 'TRITON'}} to run (and show) the generated Triton kernels "
            f"(on CPU tensors\n# through Triton's interpreter), or wrap the call in flexc.device.simulate('sm_90') "
            f"to see the CUDA source a GPU runs.\n")


def compile_like_launcher(fn: Any, args: list, constants: dict, num_warps: int, num_stages: int,
                          capability: int = 90, warp_size: int = 32) -> Any:
    """Compile the ``@triton.jit`` kernel ``fn`` for a CUDA target as its launcher would for ``args``.

    No GPU is needed: Triton's front end, LLVM and ptxas run on the CPU. The arguments are
    specialised exactly as :meth:`JITFunction.run` does for a real launch (tensor pointers 16-byte
    aligned, integers divisible by 16 marked, integers equal to 1 made constants,
    ``do_not_specialize`` honoured), so the machine code is what a GPU would run: typing every
    integer as i32 with no attributes instead changes shared memory, loads and spills.
    ``args`` may hold CPU tensors; only their dtype and address alignment matter.
    """
    triton = require_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, warp_size)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(constants, num_warps=num_warps, num_stages=num_stages)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def offline_inputs(spec: ForwardSpec, batch: int = 1, heads: int = 16, q_len: int = 4096, kv_len: int | None = None,
                   block_mask: Any = None) -> tuple:
    """CPU stand-ins ``(query, key, value, block_mask)`` for compiling ``spec`` offline.

    Only their shapes, strides, dtypes and alignment reach the compiler; tensors are left
    uninitialised. Without ``block_mask`` the BlockMask tables are all-zero tensors of the shape
    ``create_block_mask`` gives for one batch and head (or none when ``spec`` has no BlockMask).
    """
    from types import SimpleNamespace

    kv_len = q_len if kv_len is None else kv_len
    query = torch.empty((batch, heads, q_len, spec.head_dim), dtype=spec.dtype)
    key = torch.empty((batch, heads, kv_len, spec.head_dim), dtype=spec.dtype)
    value = torch.empty((batch, heads, kv_len, spec.v_head_dim), dtype=spec.dtype)
    if block_mask is None and spec.q_block_size != NO_BLOCK_MASK:
        nq, nkv = cdiv(q_len, spec.q_block_size), cdiv(kv_len, spec.kv_block_size)
        counts, indices = torch.zeros((1, 1, nq), dtype=torch.int32), torch.zeros((1, 1, nq, nkv), dtype=torch.int32)
        block_mask = SimpleNamespace(kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=counts,
                                     full_kv_indices=indices, BLOCK_SIZE=(spec.q_block_size, spec.kv_block_size))
    return query, key, value, block_mask


def compile_offline(spec: ForwardSpec, capability: int = 90, warp_size: int = 32, inputs: tuple | None = None) -> Any:
    """Compile the CUDA kernel for ``spec`` to a cubin without a GPU, specialised like a real launch.

    ``inputs`` is ``(query, key, value, block_mask)`` (CPU tensors of the launch's shapes; default
    :func:`offline_inputs`); the mods' captured tensors are their traced values. Returns Triton's
    compiled kernel: ``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata.shared`` (bytes).
    """
    if spec.target != "cuda":
        raise ValueError(f"compile_offline: spec.target must be 'cuda', got {spec.target!r}. "
                         f"Fix: build the spec with target 'cuda'.")
    query, key, value, block_mask = inputs if inputs is not None else offline_inputs(spec)
    generated = generate_forward(spec)
    module, _ = import_source(generated.source, "cuda")
    out = _empty_like_query(query, value.shape[-1])
    lse = torch.empty(query.shape[:3], dtype=torch.float32) if spec.output_lse else None
    tables = _tables(block_mask, spec, key.shape[2], query.device)
    args = _kernel_args(generated, query, key, value, out, lse, tables, spec.score_mod, spec.mask_mod,
                        query.shape[-1] ** -0.5)
    constants = _constexprs(spec, query.shape[2], key.shape[2], args)
    return compile_like_launcher(getattr(module, KERNEL_NAME), args, constants, spec.num_warps,
                                 spec.num_stages, capability, warp_size)


registry.register("TRITON", triton_forward)

__all__ = ["CacheInfo", "cache_clear", "cache_dir", "cache_info", "cache_limit", "compile_like_launcher", "compile_offline", "default_config", "get_kernel", "import_source", "kernel_source",
           "generated_for", "launch", "launch_plan", "launches_nothing", "make_spec", "plan_forward", "offline_inputs", "require_triton", "resolve_config", "resolve_fallback", "source_for", "sources_text", "triton_forward",
           "ForwardPlan", "KERNEL_SEPARATOR"]
