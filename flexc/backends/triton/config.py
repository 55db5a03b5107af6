"""Tile configuration of the Triton kernels: defaults, the user's ``kernel_options``, and the BlockMask.

One resolver (:func:`resolve_tiles`) fits the forward's, the backward's and the decode kernel's
tiles: the user's options over the defaults, each tile dividing the BlockMask's block size in its
direction (a default that does not is halved; a user's choice raises). :func:`call_layout` is what
a call's tensors fix in any of its specs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv
from ...codegen.forward import ForwardSpec
from ...codegen.index_width import float_indices, index_dtype
from ...codegen.spec import next_power_of_2, padded_head_dim
from ...masks.kv_tables import block_sizes_of
from ...mods.traced_mod import TracedMod

FORWARD_OPTIONS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
BACKWARD_OPTIONS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
# torch's kernel options the forward kernel honours (False by default, as in torch)
FLAG_OPTIONS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS")


# ---- defaults -----------------------------------------------------------------------------

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


def default_backward_config(dtype: torch.dtype, head_dim: int, v_head_dim: int, target: str,
                            score_grad_tile: bool = False) -> tuple[int, ...]:
    """``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)`` for a dtype and head dims.

    torch's names: dK/dV programs own ``BLOCK_N1`` keys and step over ``BLOCK_M1`` queries; dQ
    programs own ``BLOCK_M2`` queries and step over ``BLOCK_N2`` keys.

    On CUDA, torch's Hopper choices for 16-bit inputs; fp32/fp64 use smaller tiles (their
    operands take twice or four times the shared memory). Under the interpreter each tile step
    costs a fixed overhead, so 64 x 64 tiles (as the forward) take the fewest steps.

    ``score_grad_tile``: d score_mod / d score is not a constant (soft-capping's 1 - tanh²), so each
    dK/dV step keeps a tile of it (or of the scores) alive through its two dots, beside the dK and dV
    accumulators. At 16-bit head dims above 64 that spilled (soft-capping, D=128 on sm_90: 80/128
    bytes of spill stores/loads in the dK/dV loops, ``bench/kernel_metrics.py``); half the query
    tile, ``BLOCK_M1 = 32``, fits in 243 registers with no spills, at 0.73 of torch's default
    kernel's instructions per (query, key) pair (0.69 with the spilling tile).
    """
    if target == "interpreter":
        return 64, 64, 64, 64, 4, 1
    d = max(padded_head_dim(head_dim), padded_head_dim(v_head_dim))
    if dtype in (torch.float32, torch.float64):
        return (32, 32, 32, 32, 4, 1) if d <= 128 else (16, 16, 16, 16, 4, 1)
    if d < 64:
        return 64, 64, 64, 64, 4, 3
    if d <= 128:
        return 32 if score_grad_tile and d > 64 else 64, 128, 128, 64, 8, 3
    return 64, 64, 64, 64, 4, 2


def default_warps(block_m: int, target: str) -> int:
    """Warps of a decode launch. The 16-row tile (one token of up to 16 packed heads, or up to 16
    rows of one head) takes 2 on CUDA. Compiled for sm_90 as the launcher compiles it (bf16, 64-key
    tiles, bench/kernel_metrics.py --decode --warps 2 4), 2 warps issue 9-23% fewer SASS
    instructions per key tile than 4 (instructions per warp x warps), for causal, sliding window,
    document, ALiBi and soft-capping at head dim 64 and 128, with the same shared memory, no spills
    and 101-180 registers (4 warps: 64-136). Wider tiles keep 4."""
    return 2 if target == "cuda" and block_m == 16 else 4


# ---- the user's options -------------------------------------------------------------------

def pass_options(kernel_options: dict | None, names: tuple[str, ...], prefix: str) -> dict:
    """The options of one pass: ``{prefix}X`` (``fwd_`` or ``bwd_``) overrides ``X``; the other
    pass's prefixed keys are not its."""
    options: dict = {}
    for name, value in (kernel_options or {}).items():
        if name in names:
            options.setdefault(name, value)
    for name, value in (kernel_options or {}).items():
        if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):] in names:
            options[name[len(prefix):]] = value
    return options


def check_int_option(name: str, value: Any, power_of_2: bool, minimum: int) -> int:
    """``value`` of ``kernel_options[name]``, or a TypeError/ValueError suggesting a valid one."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"flexc: kernel_options[{name!r}] must be an int, got {type(value).__name__} {value!r}. "
                        f"Fix: pass e.g. {name}=64.")
    if value < minimum or (power_of_2 and value & (value - 1)):
        what = f"a power of two >= {minimum}" if power_of_2 else f">= {minimum}"
        # Suggest the nearest valid value above the one given (num_warps=3 -> 4, BLOCK_M=48 -> 64).
        suggestion = max(minimum, 1 << max(0, value - 1).bit_length()) if power_of_2 else minimum
        raise ValueError(f"flexc: kernel_options[{name!r}] must be {what}, got {value}. Fix: use e.g. {suggestion}.")
    return value


def flags(kernel_options: dict | None) -> dict[str, bool]:
    """torch's PRESCALE_QK / ROWS_GUARANTEED_SAFE / BLOCKS_ARE_CONTIGUOUS (``fwd_`` prefix overrides)."""
    options = kernel_options or {}
    result = {}
    for name in FLAG_OPTIONS:
        key = f"fwd_{name}" if f"fwd_{name}" in options else name
        value = options.get(key, False)
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise TypeError(f"flexc: kernel_options[{key!r}] must be a bool, got {type(value).__name__} {value!r}. "
                            f"Fix: pass {name}=True or False.")
        result[name] = bool(value)
    return result


def requested_splits(kernel_options: dict | None) -> int | None:
    """torch's ``SPLIT_KV`` kernel option (``fwd_SPLIT_KV`` overrides it): the decode kernel's number of
    splits per (batch, key head), or None for :func:`default_splits`. Splits past the listed blocks are empty."""
    options = kernel_options or {}
    name = "fwd_SPLIT_KV" if "fwd_SPLIT_KV" in options else "SPLIT_KV"
    if name not in options:
        return None
    return check_int_option(name, options[name], power_of_2=False, minimum=1)


def default_splits(query: torch.Tensor, key: torch.Tensor, n_blocks: int) -> int:
    """Decode splits per (batch, key head): enough programs to fill the GPU twice over, never more than
    the blocks a row can list. The interpreter uses two (any count is correct; two exercises the merge)."""
    B, Hkv = query.shape[0], key.shape[1]
    if not gpu.is_gpu(query.device):
        return max(1, min(2, n_blocks))
    sms = gpu.facts(query.device).sm_count
    return max(1, min(n_blocks, cdiv(2 * sms, B * Hkv), 64))


# ---- the resolver -------------------------------------------------------------------------

def largest_pow2_divisor(n: int, at_most: int) -> int:
    """The largest power of two ``<= at_most`` (halving from it) that divides ``n``."""
    tile = at_most
    while tile > 1 and n % tile:
        tile //= 2
    return tile


def resolve_tiles(options: dict, defaults: dict[str, int], q_block_size: int | None, kv_block_size: int | None,
                  kernel: str = "kernel") -> dict[str, int]:
    """``defaults`` (name -> value, in the kernel's order) overridden by the checked ``options``, each
    tile fitted to the BlockMask's block size in its direction (``BLOCK_M*`` query, other ``BLOCK_*``
    key; ``None``: no BlockMask there).

    A default tile that does not divide its block is halved until it does (at least 16); a
    user's tile that does not raises ``ValueError``. ``kernel`` names the kernel in the errors.
    """
    chosen = {}
    for name in defaults:
        if name in options:
            chosen[name] = check_int_option(name, options[name], name != "num_stages",
                                            16 if name.startswith("BLOCK") else 1)
    config = {**defaults, **chosen}
    for name in defaults:
        if not name.startswith("BLOCK"):
            continue
        block_size, what = (q_block_size, "query (Q)") if name.startswith("BLOCK_M") else (kv_block_size, "key (KV)")
        tile = config[name]
        if block_size is None or block_size % tile == 0:
            continue
        if name in chosen:
            which = "" if kernel == "kernel" else f" for the {kernel}"
            raise ValueError(
                f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of "
                f"kernel_options[{name!r}]={tile}{which}. Fix: pass a {name} dividing {block_size} "
                f"(e.g. {largest_pow2_divisor(block_size, tile)}) or build the BlockMask with a "
                f"BLOCK_SIZE that is a multiple of {tile}.")
        tile = largest_pow2_divisor(block_size, tile)
        if tile < 16:
            raise ValueError(
                f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of 16 for the "
                f"Triton {kernel}. Fix: build the BlockMask with BLOCK_SIZE a multiple of 16 (e.g. 128).")
        config[name] = tile
    return config


def resolve_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, v_head_dim: int,
                   q_block_size: int, kv_block_size: int | None, target: str) -> tuple[int, int, int, int]:
    """The forward's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: the user's ``kernel_options``
    over :func:`default_config`, fitted by :func:`resolve_tiles` (``kv_block_size=None``: no BlockMask)."""
    defaults = dict(zip(FORWARD_OPTIONS, default_config(dtype, head_dim, v_head_dim, target)))
    config = resolve_tiles(pass_options(kernel_options, FORWARD_OPTIONS, "fwd_"), defaults, q_block_size,
                           kv_block_size)
    return tuple(config[name] for name in FORWARD_OPTIONS)


def resolve_backward_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, v_head_dim: int,
                            q_block_size: int, kv_block_size: int, target: str,
                            score_grad_tile: bool = False) -> tuple[int, ...]:
    """The backward's ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)``: the user's
    ``kernel_options`` over :func:`default_backward_config`, fitted by :func:`resolve_tiles`."""
    defaults = dict(zip(BACKWARD_OPTIONS, default_backward_config(dtype, head_dim, v_head_dim, target,
                                                                  score_grad_tile)))
    config = resolve_tiles(pass_options(kernel_options, BACKWARD_OPTIONS, "bwd_"), defaults, q_block_size,
                           kv_block_size, "backward")
    return tuple(config[name] for name in BACKWARD_OPTIONS)


def resolve_decode_config(kv_block_size: int, rows: int, target: str, dtype: torch.dtype, head_dims: tuple[int, int],
                          shared_memory: int | None) -> tuple[int, int, int, int]:
    """The decode kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``rows`` packed query rows
    of ``dtype`` with ``head_dims`` (query/key, value), on a GPU with ``shared_memory`` bytes per block
    (None: unknown, as much as sm_90 has).

    The interpreter pays per tile, so it takes whole key blocks; GPUs take 64-key tiles. Tiles are
    powers of two (tl.arange): a 48-key block is three 16-key tiles, on either.
    """
    # at least 16, so a smaller block is halved below it and raises, as the resolver does on GPUs
    whole_block = max(16, 1 << (kv_block_size.bit_length() - 1))
    block_n = resolve_tiles({}, {"BLOCK_N": whole_block if target == "interpreter" else 64}, None, kv_block_size,
                            "decode kernel")["BLOCK_N"]
    block_m = max(16, next_power_of_2(rows))
    d, dv = (padded_head_dim(x) for x in head_dims)
    size = torch.empty((), dtype=dtype).element_size()
    stages = decode_stages(block_n * (d + dv) * size, block_m * (d + block_n) * size, shared_memory)
    return block_m, block_n, default_warps(block_m, target), stages


def decode_stages(slot_bytes: int, other_bytes: int, shared_memory: int | None) -> int:
    """The decode kernel's num_stages: its ring of key/value tiles (``slot_bytes`` a slot) as deep as
    the block's shared memory holds beside the query and probability tiles (``other_bytes``).

    Its dots have 16 to 128 rows: mma.sync, not wgmma, and for those Triton's pipeliner keeps
    num_stages - 1 tiles in flight (sm_90 compile, bench/kernel_metrics.py --decode: num_stages 2,
    3 and 4 give rings of 1, 2 and 3 slots), so 4 stages make the 3-slot ring of the forward's loops.
    """
    for stages in (4, 3):
        if shared_memory is None or (stages - 1) * slot_bytes + other_bytes <= shared_memory:
            return stages
    return 2


def smaller_config(spec: ForwardSpec) -> ForwardSpec | None:
    """The next configuration to try when ``spec`` needs more shared memory than the GPU has."""
    if spec.num_stages > 1:
        return dataclasses.replace(spec, num_stages=spec.num_stages - 1)
    if spec.block_n > 16:
        return dataclasses.replace(spec, block_n=spec.block_n // 2, num_stages=2)
    if spec.block_m > 16:
        return dataclasses.replace(spec, block_m=spec.block_m // 2, num_stages=2)
    return None


def within_shared_memory(spec: ForwardSpec, device: torch.device) -> ForwardSpec:
    """``spec`` made smaller (:func:`smaller_config`) until flexc's estimate of its shared memory
    (:func:`flexc.device.shared_memory_estimate`) fits the GPU's per-block limit, e.g. sm_80's 163 KB
    for the tiles chosen for Hopper (fp64 at head dim 128: 288 KB with 3 stages, 160 KB with 2); the
    CPU's and an estimate-free spec unchanged."""
    if not gpu.is_gpu(device) or spec.target != "cuda":
        return spec
    limit = gpu.facts(device).shared_memory
    while (gpu.shared_memory_estimate(spec) or 0) > limit:
        smaller = smaller_config(spec)
        if smaller is None:
            break
        spec = smaller
    return spec


def fp32_precision(target: str) -> str:
    """How fp32 dots run: TF32 where torch allows it on CUDA, else IEEE."""
    if target == "cuda" and gpu.allows_tf32():
        return "tf32"
    return "ieee"


# ---- what the call fixes ------------------------------------------------------------------

def block_sizes(block_mask: Any, L: int, S: int, kernel_options: dict | None = None) -> tuple[int, int]:
    """The BlockMask's (query, key) block sizes as the kernels take them for ``L`` queries, ``S`` keys.

    A block larger than the whole sequence (torch's ``1 << 30`` no-op mask from
    ``_create_empty_block_mask``, or any BLOCK_SIZE past the lengths) is that sequence's only block,
    index 0: any size covering the sequence reads the same tables. The kernels take the smallest
    power of two >= the length (at least 16, and at least a tile the user asks for in
    ``kernel_options``, which must divide it), so a key block is cdiv(S, BLOCK_N) tiles, not
    ``(1 << 30) / BLOCK_N`` of them.
    """
    q_block, kv_block = block_sizes_of(block_mask)
    cover_q = max(16, next_power_of_2(L), _requested_tile(kernel_options, "BLOCK_M"))
    cover_kv = max(16, next_power_of_2(S), _requested_tile(kernel_options, "BLOCK_N"))
    return min(q_block, cover_q), min(kv_block, cover_kv)  # only a block past the end is cut


def _requested_tile(kernel_options: dict | None, prefix: str) -> int:
    """The largest tile in ``kernel_options`` along one direction (BLOCK_M, fwd_BLOCK_M, BLOCK_M1, ...)."""
    largest = 1
    for name, value in (kernel_options or {}).items():
        bare = name[4:] if name.startswith(("fwd_", "bwd_")) else name
        if bare.rstrip("12") == prefix and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            largest = max(largest, next_power_of_2(value))  # a bad value raises later, in resolve_tiles
    return largest


class CallLayout(NamedTuple):
    """What a call's tensors and BlockMask fix in any kernel spec it runs."""

    block_size: tuple[int, int] | None  # the BlockMask's (query, key) block sizes; None without one
    has_full_blocks: bool  # the BlockMask keeps full blocks apart
    index_dtype: str  # the mods' integer index type (flexc.codegen.index_width)
    target: str  # "cuda" or "interpreter" (flexc.device.target)
    float_indices: bool = False  # every index below 2**23 (flexc.codegen.index_width.float_indices)


def call_layout(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                block_mask: Any, kernel_options: dict | None = None) -> CallLayout:
    """The :class:`CallLayout` of a call with these (validated) arguments."""
    size = block_sizes(block_mask, query.shape[-2], value.shape[-2], kernel_options) if block_mask is not None else None
    has_full = block_mask is not None and getattr(block_mask, "full_kv_num_blocks", None) is not None
    B, Hq, L, _ = query.shape
    # int64 index arithmetic where int32 could wrap (torch computes in int64)
    width = index_dtype((score_mod, mask_mod), B, Hq, L, value.shape[-2])
    return CallLayout(size, has_full, width, gpu.target(query.device), float_indices(B, Hq, L, value.shape[-2]))


__all__ = ["BACKWARD_OPTIONS", "CallLayout", "FLAG_OPTIONS", "FORWARD_OPTIONS", "block_sizes", "call_layout",
           "check_int_option", "decode_stages", "default_backward_config", "default_config", "default_splits",
           "default_warps", "flags", "fp32_precision", "largest_pow2_divisor", "pass_options", "requested_splits",
           "resolve_backward_config", "resolve_config", "resolve_decode_config", "resolve_tiles", "smaller_config",
           "within_shared_memory"]
