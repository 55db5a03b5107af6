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
from ...codegen.spec import next_power_of_2, precision_option
from ...masks.kv_tables import block_sizes_of
from ...mods.traced_mod import TracedMod

FORWARD_OPTIONS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
BACKWARD_OPTIONS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
# torch's kernel options the forward kernel honours (False by default, as in torch)
FLAG_OPTIONS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS")


# ---- defaults: torch's picks ---------------------------------------------------------------
# On CUDA every default is what torch's FlexAttention picks on sm_90 (H100/H200), unless a hardware
# row in docs/hardware.md shows flexc faster with another (:data:`DEPARTURES`, docs/kernels.md
# "Defaults"). torch's picks are written out here (flexc does not import Inductor to run), from
# torch/_inductor/template_heuristics/triton.py, class CUDAConfigHeuristic, torch 2.13 (torch 2.11
# differs only in lacking the float32 head-dim-192 row); tests/backends/triton/test_config_defaults.py
# reads the installed torch's and compares. Like torch, the query's head dim picks the row (not the
# padded one, not the value's). The interpreter's defaults are flexc's own: it is no GPU of torch's.

# get_flex_attn_fwd_configs on capability (9, 0): h100_default_flex_config, in flexc's order
# (BLOCK_M, BLOCK_N, num_warps, num_stages); torch's FlexConfig order is (block_m, block_n, stages, warps)
TORCH_SM90_FORWARD = {
    (torch.float32, 64): (128, 32, 4, 3), (torch.float32, 128): (32, 64, 4, 3),
    (torch.float32, 192): (32, 64, 8, 1), (torch.float32, 256): (32, 32, 4, 3),
    (torch.bfloat16, 64): (128, 128, 4, 3), (torch.bfloat16, 128): (128, 64, 8, 3),
    (torch.bfloat16, 256): (64, 32, 4, 3),
    (torch.float16, 64): (128, 128, 4, 3), (torch.float16, 128): (128, 64, 8, 3),
    (torch.float16, 256): (64, 32, 4, 3),
}
TORCH_FORWARD_FALLBACK = (64, 64, 4, 3)  # any other dtype and head dim up to 256
TORCH_FORWARD_OVER_256 = {torch.float32: (32, 16, 4, 3)}  # else (64, 32, 4, 3)


def torch_forward_pick(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """torch's sm_90 forward ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the query's dtype and head dim."""
    if head_dim > 256:
        return TORCH_FORWARD_OVER_256.get(dtype, (64, 32, 4, 3))
    return TORCH_SM90_FORWARD.get((dtype, head_dim), TORCH_FORWARD_FALLBACK)


def torch_backward_pick(dtype: torch.dtype, head_dim: int) -> tuple[int, ...]:
    """torch's sm_90 backward ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)``:
    get_flex_attn_bwd_configs' "float32" class for float32, its "sm90" class for every other dtype
    (float64 included: torch tests ``dtype == torch.float32`` only), 16 x 16 tiles past head dim 256."""
    if dtype == torch.float32 or head_dim > 256:
        return 16, 16, 16, 16, 4, 1
    if head_dim < 64:
        return 64, 64, 64, 64, 4, 3
    if head_dim <= 128:
        return 64, 128, 128, 64, 8, 3
    return 64, 64, 64, 64, 4, 2


# get_flex_decode_configs on capability (9, 0): (BLOCK_N, num_warps, num_stages). Its table says 3
# stages for sm_90, but the test for sm_110 that follows overwrites it in its else: 1 stage is what runs.
TORCH_SM90_DECODE = (64, 2, 1)


class Departure(NamedTuple):
    """A default that differs from torch's pick on sm_90, and the hardware row that shows it faster."""

    kernel: str  # "forward", "backward", "decode", or "all" (an option of the call's every kernel)
    option: str  # "BLOCK_M", "num_warps", "USE_TMA", "FAST_MATH", ...
    dtypes: tuple  # the input dtypes it applies to
    head_dims: tuple[int, ...] | None  # the query head dims it applies to (None: every one)
    value: Any  # flexc's pick
    torch: Any  # torch's pick
    row: str  # "docs/hardware.md, <table heading, verbatim>: <the figures that show it>"


# the H200 table that times one kernel option at a time (bench/gpu_defaults.py)
OPTION_TABLE = "One kernel option at a time (`bench/gpu_defaults.py`, flexc against flexc, bf16, ms)"
FORWARD_TABLE = "Forward and forward+backward, B=2, H=16, L=8192, D=128, bf16 (ms; ratio = flexc time / torch time)"

# Every departure from torch's picks on CUDA (docs/kernels.md "Defaults" says what each row shows and
# what it does not). The other candidates the offline instruction count favoured (8 warps for the
# 16-bit D=64 forward, BLOCK_M1=32 for soft-capping's backward above D=64, 4 decode warps past 16
# rows, a 4-stage decode ring, TMA) were measured only inside flexc-against-torch rows that change
# several things at once, or not at all: they come back with a row that isolates them.
DEPARTURES: tuple[Departure, ...] = (
    # fp32 tanh and sigmoid as one exp2 and one reciprocal (flexc.codegen.triton_helpers: within 6e-7)
    # instead of libdevice's tanh and tl.sigmoid. Within each implementation the three rows differ
    # only in the score_mod (flexc's ran with TMA on in all three alike): over causal, ALiBi costs
    # flexc +0.08 ms and torch +0.14, soft-capping flexc +0.51 ms and torch +1.55. The ~1 ms more
    # that soft-capping costs torch's kernel is in computing its score, where tanh's lowering is the
    # operation that differs. No row ran flexc with FAST_MATH=False.
    Departure("all", "FAST_MATH", (torch.float16, torch.bfloat16, torch.float32), None, True, False,
              f"docs/hardware.md, {OPTION_TABLE}: soft-cap + causal forward, D=128, L=8192, FAST_MATH off 2.882 ms, "
              f"on 1.950 ms"),
)


def departure(kernel: str, option: str, dtype: torch.dtype, head_dim: int) -> Departure | None:
    """The listed departure for this kernel, option, dtype and query head dim, or None."""
    for d in DEPARTURES:
        if d.kernel in (kernel, "all") and d.option == option and dtype in d.dtypes and \
                (d.head_dims is None or head_dim in d.head_dims):
            return d
    return None


def _with_departures(kernel: str, names: tuple[str, ...], picks: tuple, dtype: torch.dtype, head_dim: int) -> tuple:
    chosen = []
    for name, pick in zip(names, picks):
        found = departure(kernel, name, dtype, head_dim)
        chosen.append(found.value if found is not None else pick)
    return tuple(chosen)


def default_config(dtype: torch.dtype, head_dim: int, target: str) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a dtype and query head dim.

    On CUDA torch's sm_90 pick (:func:`torch_forward_pick`) with the listed :data:`DEPARTURES`; under
    the interpreter each tile costs a fixed overhead plus its size; 64 x 64 was fastest at L = 256
    (16: 0.9 s, 32: 0.27 s, 64: 0.08 s).
    """
    if target == "interpreter":
        return 64, 64, 4, 1
    return _with_departures("forward", FORWARD_OPTIONS, torch_forward_pick(dtype, head_dim), dtype, head_dim)


def default_backward_config(dtype: torch.dtype, head_dim: int, target: str) -> tuple[int, ...]:
    """``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)`` for a dtype and query head dim.

    torch's names: dK/dV programs own ``BLOCK_N1`` keys and step over ``BLOCK_M1`` queries; dQ
    programs own ``BLOCK_M2`` queries and step over ``BLOCK_N2`` keys.

    On CUDA torch's sm_90 pick (:func:`torch_backward_pick`) with the listed :data:`DEPARTURES`.
    Under the interpreter each tile step costs a fixed overhead, so 64 x 64 tiles (as the forward)
    take the fewest steps.
    """
    if target == "interpreter":
        return 64, 64, 64, 64, 4, 1
    return _with_departures("backward", BACKWARD_OPTIONS, torch_backward_pick(dtype, head_dim), dtype, head_dim)


def default_warps(block_m: int, target: str) -> int:
    """Warps of a decode launch of ``block_m`` packed rows: torch's 2 on CUDA at every tile
    (:data:`TORCH_SM90_DECODE`; the H200 measured 2 against 4 warps for the 16-row tile as a tie,
    docs/hardware.md), 4 under the interpreter. ``block_m`` is there for bench/gpu.py's 2-vs-4 A/B,
    which replaces this function."""
    return TORCH_SM90_DECODE[1] if target == "cuda" else 4


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


def resolve_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, q_block_size: int,
                   kv_block_size: int | None, target: str) -> tuple[int, int, int, int]:
    """The forward's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: the user's ``kernel_options``
    over :func:`default_config`, fitted by :func:`resolve_tiles` (``kv_block_size=None``: no BlockMask)."""
    defaults = dict(zip(FORWARD_OPTIONS, default_config(dtype, head_dim, target)))
    config = resolve_tiles(pass_options(kernel_options, FORWARD_OPTIONS, "fwd_"), defaults, q_block_size,
                           kv_block_size)
    return tuple(config[name] for name in FORWARD_OPTIONS)


def resolve_backward_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, q_block_size: int,
                            kv_block_size: int, target: str) -> tuple[int, ...]:
    """The backward's ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)``: the user's
    ``kernel_options`` over :func:`default_backward_config`, fitted by :func:`resolve_tiles`."""
    defaults = dict(zip(BACKWARD_OPTIONS, default_backward_config(dtype, head_dim, target)))
    config = resolve_tiles(pass_options(kernel_options, BACKWARD_OPTIONS, "bwd_"), defaults, q_block_size,
                           kv_block_size, "backward")
    return tuple(config[name] for name in BACKWARD_OPTIONS)


def resolve_decode_config(kv_block_size: int, rows: int, target: str) -> tuple[int, int, int, int]:
    """The decode kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``rows`` packed query rows.

    GPUs take torch's sm_90 pick (:data:`TORCH_SM90_DECODE`: 64-key tiles, 2 warps, 1 stage) and,
    as torch, the packed rows rounded up to a power of two, at least 16. The interpreter pays per
    tile, so it takes whole key blocks, 4 warps and 1 stage. Tiles are powers of two (tl.arange): a
    48-key block is three 16-key tiles, on either.
    """
    # at least 16, so a smaller block is halved below it and raises, as the resolver does on GPUs
    whole_block = max(16, 1 << (kv_block_size.bit_length() - 1))
    block_n = resolve_tiles({}, {"BLOCK_N": whole_block if target == "interpreter" else TORCH_SM90_DECODE[0]},
                            None, kv_block_size, "decode kernel")["BLOCK_N"]
    block_m = max(16, next_power_of_2(rows))
    return block_m, block_n, default_warps(block_m, target), TORCH_SM90_DECODE[2]


def smaller_config(spec: Any) -> Any:
    """The next configuration to try when ``spec`` (a forward, backward or decode kernel's) needs more
    shared memory, registers or threads than the GPU has, or None when nothing is left to shrink.

    First one pipeline stage fewer (each stage holds a copy of the loop's tiles), then half the key
    tile (the forward's and decode's ``BLOCK_N``; every backward tile above 16) at two stages. Halving
    keeps each tile a power of two that divides its BlockMask block. The decode kernel's query tile
    holds all its packed rows and stays."""
    if spec.num_stages > 1:
        return dataclasses.replace(spec, num_stages=spec.num_stages - 1)
    for group in spec.SHRINK_ORDER:  # (the spec kind's own order, codegen.spec.KernelSpec.SHRINK_ORDER)
        tiles = {name: getattr(spec, name) // 2 for name in group if getattr(spec, name) > 16}
        if tiles:
            return dataclasses.replace(spec, **tiles, num_stages=2)
    return None


def tiles_text(spec: Any) -> str:
    """A kernel spec's tiles and stages as its kernel_options name them (for messages)."""
    return ", ".join([f"{name.upper()}={getattr(spec, name)}" for name in spec.TILES] + [f"num_stages={spec.num_stages}"])


def fp32_precision(target: str, kernel_options: dict | None = None) -> str:
    """How fp32 dots run: torch's ``FLOAT32_PRECISION`` kernel option where given (``"ieee"``,
    ``"tf32"`` or ``"tf32x3"``, quoted or not, as torch's kernels splice it), else TF32 where torch
    allows it on CUDA, else IEEE. The interpreter computes in IEEE whatever is asked."""
    asked = precision_option(kernel_options)
    if target != "cuda":
        return "ieee"
    if asked is not None:
        return asked
    return "tf32" if gpu.allows_tf32() else "ieee"

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


__all__ = ["BACKWARD_OPTIONS", "DEPARTURES", "FORWARD_TABLE", "TORCH_SM90_DECODE", "TORCH_SM90_FORWARD", "CallLayout",
           "Departure", "FLAG_OPTIONS", "FORWARD_OPTIONS", "block_sizes", "call_layout", "check_int_option",
           "default_backward_config", "default_config", "default_splits", "default_warps", "departure", "flags",
           "fp32_precision", "largest_pow2_divisor", "pass_options", "requested_splits", "resolve_backward_config",
           "resolve_config", "resolve_decode_config", "resolve_tiles", "smaller_config", "tiles_text",
           "torch_backward_pick", "torch_forward_pick", "within_shared_memory"]
