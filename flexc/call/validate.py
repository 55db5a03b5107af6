"""Input checks for :func:`flexc.flex_attention`, run before any work.

Each check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (right kind, wrong value)
naming the argument, what was expected, what was given, and how to fix it. Where torch's
FlexAttention rejects the same input, the message opens with torch's sentence (code written for torch
matches on it) and, where torch raises another type, the error is also of that type
(:mod:`flexc.errors`).
"""
from __future__ import annotations

import difflib
import math
import numbers
import weakref
from typing import Any

import torch

from ..backends import registry
from ..device import assert_async, fit_message, is_gpu, same_device
from ..codegen.spec import precision_option
from ..errors import AssertedValueError, InvalidValueError, UnsupportedInputError, UnsupportedTypeError, warn_once
from ..mods.traced_mod import check_captured  # noqa: F401  (validation of a call's mods)
from ..masks.kv_tables import KV_TABLE_NAMES, block_sizes_of, kv_tables
from ..masks.table_lists import LIMIT as TABLE_LIST_LIMIT, TableContents, table_lists
from ..versions import pinned, table_states

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# torch's names for its own kernels (CuTe flash, split-KV decode), which flexc does not have: code
# written for torch passes them unchanged and flexc chooses its own path, as for "AUTO", saying so once
# (FallbackWarning).
TORCH_ONLY_BACKENDS = ("FLASH", "TRITON_DECODE")

# torch 2.13's documented FlexKernelOptions keys (each may also carry a fwd_/bwd_ prefix).
KNOWN_OPTIONS = frozenset({
    "num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
    "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
    "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu",
})
# The undocumented keys torch 2.13's kernels read from kernel_options (its Triton forward, backward and
# split-KV decode templates, and its compiled CPU kernel), which torch accepts from users too. flexc
# accepts them as tuning hints; SPLIT_KV sets the Triton decode kernel's split count, the others are
# ignored (flexc derives them from the inputs, as torch does when they are absent).
TORCH_KERNEL_OPTIONS = frozenset({
    "SPLIT_KV", "GQA_SHARED_HEADS", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "IS_DIVISIBLE",
    "SAFE_HEAD_DIM", "SAFE_M_BOUNDARY", "SAFE_N_BOUNDARY", "SM_SCALE", "HAS_FULL_BLOCKS", "QK_HEAD_DIM",
    "QK_HEAD_DIM_ROUNDED", "V_HEAD_DIM", "V_HEAD_DIM_ROUNDED", "FLOAT32_PRECISION", "num_consumer_groups",
    "num_buffers_warp_spec", "PARTITION_SIZE", "SKIP_MASK_SCORE",
})
# flexc's own keys. FAST_MATH (default True): on CUDA, fp32 tanh and sigmoid lower to one exp2 and one
# reciprocal (flexc.codegen.triton_helpers); False keeps libdevice's tanh and tl.sigmoid. It applies to
# every kernel of a call (forward, backward, decode), so it takes no fwd_/bwd_ prefix.
# PRECISE_GRADIENTS (default True for fp32/fp64 inputs, False for 16-bit ones): the TRITON backward takes
# delta and the probabilities' sum from its own probabilities (a row pass), and 16-bit dS enters the
# dq/dk dots as two operands (flexc.codegen.backward_rows).
FLEXC_OPTIONS = frozenset({"FAST_MATH", "PRECISE_GRADIENTS"})


def check_tensors(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    """Shapes, dtypes and devices of query ``[B,Hq,L,E]``, key ``[B,Hkv,S,E]``, value ``[B,Hkv,S,Ev]``."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: `{name}` must be a torch.Tensor, got {type(t).__name__}. "
                            f"Fix: pass a tensor of shape [batch, heads, length, head_dim].")
        if t.dim() != 4:
            torch_says = ("Expected query, key, and value to all be  at least 2 dimensional" if t.dim() < 2
                          else "NYI: query, key, and value must be 4D tensors")
            error = ValueError if t.dim() < 2 else UnsupportedInputError
            raise error(f"flex_attention: {torch_says}: `{name}` must be 4-D [batch, heads, length, head_dim], "
                        f"got {t.dim()}-D shape {tuple(t.shape)}. Fix: reshape it, e.g. add a batch "
                        f"dimension with `.unsqueeze(0)`.")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"flex_attention: `{name}` has dtype {t.dtype}; expected one of float16, bfloat16, "
                            f"float32, float64. Fix: convert it with `.float()` or `.to(torch.bfloat16)`.")
        if t.is_nested:
            raise UnsupportedTypeError(f"flex_attention: flex_attention does not support NestedTensor inputs: "
                                       f"`{name}` is a nested tensor; expected a dense tensor. "
                                       f"Fix: pad the sequences and mask the padding with a mask_mod.")
    # key/value may have another dtype than query (as in torch): flex_attention computes in query's dtype
    # (CPU tensors first: reading .device builds an object, three per call)
    if not (query.is_cpu and key.is_cpu and value.is_cpu) and not (query.device == key.device == value.device):
        raise ValueError(f"flex_attention: Expected query, key, and value to have the same device type, but got "
                         f"query.device: "
                         f"{query.device}, key.device: {key.device}, and value.device: {value.device} instead. "
                         f"Fix: move them with `.to(query.device)`.")
    B, Hq, L, E = query.shape
    Bk, Hkv, S, Ek = key.shape
    Bv, Hv, Sv, _ = value.shape
    if E == 0:
        raise ValueError(f"flex_attention: `query` and `key` head dim must be at least 1, got 0 (query "
                         f"{tuple(query.shape)}). Fix: pass tensors with a non-empty last dimension; only "
                         f"`value` may have head dim 0.")
    if Ek != E:
        raise ValueError(f"flex_attention: Expect query and key/value to have the same embedding dimension "
                         f"but got E={E} and E={Ek}: `key` head dim must equal query's (E={E}), got {Ek} "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)}). Fix: project both to the same head dim.")
    if Sv != S:
        raise ValueError(f"flex_attention: `value` length must equal key's (S={S}), got {Sv} "
                         f"(key {tuple(key.shape)}, value {tuple(value.shape)}). Fix: pass one value row per key row.")
    if (Bv, Hv) != (Bk, Hkv):
        raise ValueError(f"flex_attention: `value` batch and heads must equal key's ({Bk}, {Hkv}), got ({Bv}, {Hv}). "
                         f"Fix: key and value must come from the same [batch, heads] layout.")
    if Bk not in (B, 1):
        raise ValueError(f"flex_attention: Expect query and key/value to have the same batch size (or key/value "
                         f"batch 1, broadcast): `key`/`value` batch must equal query's (B={B}) or be 1, got {Bk}. "
                         f"Fix: expand or slice key/value to batch {B}.")
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(f"flex_attention: Expect query and key/value to have the same number of heads but "
                             f"got Hq={Hq} and Hkv={Hkv}. Try setting enable_gqa=True for GQA. Fix: pass "
                             f"enable_gqa=True for grouped-query attention.")
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"flex_attention: Expect number of query heads to be a multiple of kv heads for GQA "
                             f"but got Hq={Hq} and Hkv={Hkv}. Fix: choose Hkv dividing Hq.")


def check_block_mask(block_mask: Any, query: torch.Tensor, key: torch.Tensor) -> None:
    """A flexc or torch BlockMask built for exactly ``(L, S)`` and no more batches/heads than the input."""
    if block_mask is None:
        return
    needed = ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths")
    rows = getattr(block_mask, "lazy_rows", None)  # a one-row slice whose tables are still lists
    if rows is None and not all(hasattr(block_mask, a) for a in needed):
        raise TypeError(f"flex_attention: `block_mask` must be a BlockMask (flexc's or torch's), got "
                        f"{type(block_mask).__name__}. Fix: build one with flexc.create_block_mask(mask_mod, B, H, L, S).")
    if _is_sliced_stub(getattr(block_mask, "mask_mod", None)):
        raise InvalidValueError("flex_attention: Cannot use mask_mod from a sliced BlockMask: slicing with [] "
                                "replaces the mask_mod. Fix: set `sliced.mask_mod` from the original BlockMask's "
                                "mask_mod (adjusted for the slice), or build a BlockMask for these inputs.")
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    lengths = block_mask.seq_lengths
    if lengths != (L, S):  # (usually a tuple of these ints: no conversion needed)
        lengths = tuple(int(x) for x in lengths)
    # torch skips this check for its no-op mask (BLOCK_SIZE _LARGE_SPARSE_BLOCK_SIZE = 1 << 30, one block
    # covering any lengths, seq_lengths (1, 1)): such a mask serves inputs of every length
    if lengths != (L, S) and tuple(block_mask.BLOCK_SIZE) != (1 << 30, 1 << 30):
        raise ValueError(_lengths_message(block_mask, rows, lengths, L, S))
    Bm, Hm = rows.num_shape[:2] if rows is not None else block_mask.kv_num_blocks.shape[:2]
    if Bm not in (1, B):
        raise ValueError(f"flex_attention: Expect query and key/value to have the same batch size, or block_mask "
                         f"and query to have the same batch size: `block_mask` has batch {Bm}; expected 1 "
                         f"(broadcast) or the query's batch {B}. Fix: build it with B=None (broadcast) or B={B}.")
    if Hm not in (1, Hq):
        raise ValueError(f"flex_attention: `block_mask` has {Hm} heads; expected 1 (broadcast) or the query's "
                         f"{Hq} heads. Fix: build it with H=None (broadcast) or H={Hq}.")
    device = _CPU if rows is not None else block_mask.kv_num_blocks.device  # (lists are read from CPU rows only)
    if (not query.is_cpu) if device is _CPU else not same_device(device, query.device):
        raise InvalidValueError(f"flex_attention: Expect q/k/v and block_mask to be on the same device: "
                                f"`block_mask` is on {device} but the inputs are on "
                                f"{query.device}. Fix: `block_mask.to({str(query.device)!r})`.")
    if not torch.compiler.is_compiling():  # compiled calls check the tables' values in the custom op
        check_block_tables(block_mask, L, S)


def _lengths_message(block_mask: Any, rows: Any, lengths: tuple, L: int, S: int) -> str:
    """Why a BlockMask's ``seq_lengths`` do not fit the inputs' ``(L, S)``, and how to set them."""
    opening = (f"flex_attention: block_mask was created for (Q_LEN, KV_LEN)={lengths} but got q_len={L} and "
               f"kv_len={S}: `block_mask.seq_lengths` must be the inputs' (L, S)=({L}, {S}).")
    n_rows = int(rows.num_shape[-1] if rows is not None else block_mask.kv_num_blocks.shape[-1])
    q_block = int(block_mask.BLOCK_SIZE[0])
    if n_rows != -(-int(lengths[0]) // q_block):  # fewer query-block rows than its Q_LEN needs: a slice
        return (f"{opening} It has {n_rows} query-block row{'s' if n_rows != 1 else ''} of {q_block}, not the "
                f"{-(-int(lengths[0]) // q_block)} its seq_lengths {lengths} need: a slice "
                f"(block_mask[:, :, row]) keeps the seq_lengths of the mask it was sliced from. Fix: set "
                f"`block_mask.seq_lengths = ({L}, {S})` on the slice (as torch's decoding examples do), or pass "
                f"seq_lengths=({L}, {S}) to BlockMask.from_kv_blocks when building a mask from tables.")
    return (f"{opening} Fix: build it for these lengths with create_block_mask(mask_mod, B, H, {L}, {S}); a mask "
            f"built from tables takes them as BlockMask.from_kv_blocks(..., seq_lengths=({L}, {S})).")


# id(kv_indices) -> (a weak reference to it, the (id, version) of every table and (L, S) when it was
# last found valid). Tensors compare elementwise, so they cannot be dictionary keys themselves.
_valid_tables: dict[int, tuple] = {}
_MAX_REMEMBERED = 256
_REBUILD = "Fix: build the BlockMask with flexc.create_block_mask or BlockMask.from_kv_blocks and do not edit its tables."


def check_block_tables(block_mask: Any, L: int, S: int) -> None:
    """The kv tables of ``block_mask`` are consistent, so no backend reads out of bounds or double counts.

    Checked: table shapes agree (``num_blocks [B, H, nQ]`` against ``indices [B, H, nQ, nKV]``, the
    full tables like the partial ones), integer dtypes, a row for every query block of ``L``, counts in
    ``[0, nKV]``, entries inside the counts below ``nKV`` (a negative one is an empty block, never
    visited, as torch's PagedAttention writes for unreserved pages: :mod:`flexc.masks.empty_entries`), and
    no key block listed twice in a row (partial and full tables together). A few reductions over the tables (one entry per block); tables unchanged
    since they were last found valid are not checked again, nor are small tables (a decoding
    step's sliced mask) with the contents of tables found valid before.
    """
    contents = state = None
    rows = getattr(block_mask, "lazy_rows", None)
    if rows is not None and (rows is _last_valid[0] or rows in _valid_contents):  # a row of tables found valid
        _check_rows_cover(block_mask, rows.num_shape[-1], L)
        _last_valid[0] = rows  # (the same lists object next step: no hashing)
        return
    tables = list(kv_tables(block_mask))
    provenance = getattr(block_mask, "sliced_from", None)
    if provenance is not None and _slice_of_valid_tables(tables, provenance):
        _check_structure(block_mask, tables, L)  # rows of valid tables: their entries are valid
        return
    if isinstance(tables[1], torch.Tensor) and tables[1].numel() <= _SMALL_TABLE and not is_gpu(tables[1].device):
        contents = table_lists(tables)  # (on a GPU, reading them would be a sync)
    if contents is not None:
        if contents in _valid_contents:
            _check_rows_cover(block_mask, contents.num_shape[-1], L)
            return
    else:
        states = table_states(tables)
        state = (states, L, S)
        seen = _valid_tables.get(id(tables[1]))
        if seen is not None and seen[0]() is tables[1] and seen[1] == state:
            return
    _check_structure(block_mask, tables, L)
    n_kv = tables[1].shape[-1]
    if contents is not None:  # Python on a few lists beats a dozen kernels
        _check_entries_in_python(contents)
        if len(_valid_contents) >= _MAX_REMEMBERED:
            _valid_contents.clear()
        _valid_contents.add(contents)
        return
    _check_entries(tables, n_kv)
    _remember_valid(tables, (pinned(states, tables), L, S))


def _remember_valid(tables: list, state: tuple) -> None:
    if len(_valid_tables) >= _MAX_REMEMBERED:
        _valid_tables.clear()
    _valid_tables[id(tables[1])] = (weakref.ref(tables[1]), state)


def _slice_of_valid_tables(tables: list, provenance: tuple) -> bool:
    """Whether ``tables`` are unedited rows of tables that are valid as they are now (validated here
    once, when first met: a decoding loop slices the same parent every step). No contents are
    read after that, so a decoding step on a GPU needs no sync."""
    parent, parent_state, own_state = provenance
    if table_states(tables) != own_state or table_states(parent) != parent_state:
        return False  # edited since slicing
    seen = _valid_tables.get(id(parent[1]))
    state = (parent_state, None, None)
    if seen is not None and seen[0]() is parent[1] and seen[1] == state:
        return True
    if not all(t is None or isinstance(t, torch.Tensor) for t in parent) or parent[1].dim() != 4:
        return False  # not tables flexc can vouch for: the slice is checked itself
    parent = list(parent)
    _check_types_and_shapes(parent)
    _check_entries(parent, parent[1].shape[-1])
    _remember_valid(parent, state)
    return True


def _check_structure(block_mask: Any, tables: list, L: int) -> None:
    """Dtypes and shapes of the kv tables, and a row for every query block of ``L``: metadata only."""
    _check_types_and_shapes(tables)
    _check_rows_cover(block_mask, tables[0].shape[-1], L)


def _check_types_and_shapes(tables: list) -> None:
    for name, t in zip(KV_TABLE_NAMES, tables):
        if t is not None and (not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex()
                              or t.dtype == torch.bool):
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"flex_attention: `block_mask.{name}` must be an integer tensor (int32), got {what}. "
                            f"{_REBUILD}")
    if (tables[2] is None) != (tables[3] is None):
        raise ValueError("flex_attention: `block_mask` has only one of full_kv_num_blocks and full_kv_indices; "
                         f"expected both or neither. {_REBUILD}")
    num, idx = tables[0], tables[1]
    if num.dim() != 3 or idx.dim() != 4 or tuple(idx.shape[:3]) != tuple(num.shape):
        raise ValueError(f"flex_attention: `block_mask.kv_num_blocks` must be [B, H, nQ] and `kv_indices` "
                         f"[B, H, nQ, nKV] with the same B, H, nQ; got {tuple(num.shape)} and {tuple(idx.shape)}. "
                         f"{_REBUILD}")
    if tables[2] is not None and (tables[2].shape != num.shape or tables[3].shape != idx.shape):
        raise ValueError(f"flex_attention: `block_mask.full_kv_num_blocks`/`full_kv_indices` must have the shapes of "
                         f"kv_num_blocks/kv_indices {tuple(num.shape)}/{tuple(idx.shape)}; got "
                         f"{tuple(tables[2].shape)}/{tuple(tables[3].shape)}. {_REBUILD}")


def _check_rows_cover(block_mask: Any, n_q: int, L: int) -> None:
    q_block = block_sizes_of(block_mask)[0]
    if n_q * q_block < L:
        raise ValueError(f"flex_attention: `block_mask` has {n_q} query-block rows of {q_block} but Q_LEN={L} needs "
                         f"{-(-L // q_block)}. {_REBUILD}")


_CPU = torch.device("cpu")
_SMALL_TABLE = TABLE_LIST_LIMIT  # table entries up to which the entries are checked as Python lists
# contents (flexc.masks.table_lists) of small tables found valid: a decoding step's one-row mask has the
# entries of its predecessor while decoding stays in one query-block row
_valid_contents: set = set()
_last_valid: list = [None]


def _bad_count(prefix: str, at: tuple, value: int, n_kv: int) -> ValueError:
    return ValueError(f"flex_attention: `block_mask.{prefix}_num_blocks`{list(at)} is {value}; expected a count in "
                      f"[0, {n_kv}] (the width of {prefix}_indices). {_REBUILD}")


def _bad_index(prefix: str, at: tuple, value: int, n_kv: int) -> ValueError:
    return ValueError(f"flex_attention: `block_mask.{prefix}_indices`{list(at)} is {value}; expected a key-block "
                      f"index in [0, {n_kv}) (or a negative one: an empty block). {_REBUILD}")


def _listed_twice(at: tuple, col: int) -> ValueError:
    return ValueError(f"flex_attention: `block_mask` lists key block {col} more than once in query-block row "
                      f"{list(at)} (counting kv_indices and full_kv_indices); it would be counted twice. {_REBUILD}")


def _check_entries(tables: list, n_kv: int) -> None:
    """Counts in range, listed entries below nKV (negative ones are empty blocks), no block listed twice
    in a row: reductions over the tables."""
    num, idx = tables[0], tables[1]
    if is_gpu(idx.device):
        _assert_entries_on_device(tables, n_kv)
        return
    used = torch.zeros(*idx.shape[:3], n_kv + 1, dtype=torch.int32, device=idx.device)
    columns = torch.arange(n_kv, dtype=num.dtype, device=idx.device)
    for prefix, count, index in (("kv", num, idx), ("full_kv", tables[2], tables[3])):
        if count is None or count.numel() == 0:
            continue
        low, high = torch.aminmax(count)
        if int(low) < 0 or int(high) > n_kv:
            at = tuple(((count < 0) | (count > n_kv)).nonzero()[0].tolist())
            raise _bad_count(prefix, at, int(count[at]), n_kv)
        if n_kv == 0:
            continue
        # entries past the count are unused (torch leaves them undefined); negative ones inside it are empty
        valid = (columns < count.unsqueeze(-1)) & (index >= 0)
        listed = torch.where(valid, index, 0)
        if int(listed.max()) >= n_kv:
            at = tuple((valid & (index >= n_kv)).nonzero()[0].tolist())
            raise _bad_index(prefix, at, int(index[at]), n_kv)
        # count each listed block once per row; unused entries land in the spare last column
        used.scatter_add_(-1, listed.masked_fill_(~valid, n_kv).long(), valid.to(torch.int32))
    twice = used[..., :n_kv] > 1
    if bool(twice.any()):
        b, h, row, col = twice.nonzero()[0].tolist()
        raise _listed_twice((b, h, row), col)


def _assert_entries_on_device(tables: list, n_kv: int) -> None:
    """:func:`_check_entries` without a sync: the same conditions reduced on the device and asserted
    there (``torch._assert_async``), so a bad table stops the stream with this message instead of
    raising at the call (reading the verdict on the host would stall the launch queue every time)."""
    num, idx = tables[0], tables[1]
    bad = torch.zeros((), dtype=torch.bool, device=idx.device)
    used = torch.zeros(*idx.shape[:3], n_kv + 1, dtype=torch.int32, device=idx.device)
    columns = torch.arange(n_kv, dtype=num.dtype, device=idx.device)
    for count, index in ((num, idx), (tables[2], tables[3])):
        if count is None or count.numel() == 0:
            continue
        bad = bad | ((count < 0) | (count > n_kv)).any()
        valid = (columns < count.unsqueeze(-1)) & (index >= 0)  # (negative entries: empty blocks)
        bad = bad | (valid & (index >= n_kv)).any()
        listed = torch.where(valid, index, n_kv).clamp(0, n_kv)
        used.scatter_add_(-1, listed.long(), valid.to(torch.int32))
    bad = bad | (used[..., :n_kv] > 1).any()
    assert_async(~bad, fit_message("flex_attention: `block_mask` has a count outside [0, nKV], an index outside "
                                   f"[0, nKV) (or negative) or a key block listed twice in a row. {_REBUILD}"))


def _check_entries_in_python(contents: TableContents) -> None:
    """:func:`_check_entries` on the tables' contents as Python lists (the same checks and messages)."""
    shape, n_kv = contents.num_shape, contents.n_kv
    listed_by_row = [[] for _ in contents.counts]
    for prefix, row_counts, entries in (("kv", contents.counts, contents.indices),
                                        ("full_kv", contents.full_counts, contents.full_indices)):
        if row_counts is None:
            continue
        for r, c in enumerate(row_counts):
            at = _unravel(r, shape)
            if not 0 <= c <= n_kv:
                raise _bad_count(prefix, at, c, n_kv)
            row = entries[r * n_kv: r * n_kv + c]
            for col, block in enumerate(row):
                if block >= n_kv:
                    raise _bad_index(prefix, (*at, col), block, n_kv)
            listed_by_row[r] += [block for block in row if block >= 0] if min(row, default=0) < 0 else row
    for r, listed in enumerate(listed_by_row):
        if len(set(listed)) != len(listed):
            twice = min(b for b in listed if listed.count(b) > 1)
            raise _listed_twice(_unravel(r, shape), twice)


def _unravel(flat: int, shape: tuple) -> tuple:
    at = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        at.append(i)
    return tuple(reversed(at))


def _is_sliced_stub(mask_mod: Any) -> bool:
    """Whether ``mask_mod`` is the stand-in that flexc's or torch's ``BlockMask.__getitem__`` attaches."""
    # by name: the stand-in is torch's or flexc's, and either module may be absent from this call
    return (getattr(mask_mod, "__name__", None) == "_sliced_mask_mod_error"
            and getattr(mask_mod, "__module__", None) in ("flexc.masks.block_mask", "torch.nn.attention.flex_attention"))


def check_scale(scale: Any, query: torch.Tensor) -> float:
    """The softmax scale: ``1/sqrt(E)`` by default, else a finite real number."""
    if scale is None:
        E = query.shape[-1]
        return 1.0 / math.sqrt(E) if E > 0 else 1.0
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and not scale.requires_grad:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"flex_attention: `scale` must be a number (float) or None, got {type(scale).__name__} "
                        f"{scale!r}. Fix: pass e.g. scale=1/math.sqrt(head_dim), or None for that default.")
    if not math.isfinite(scale):
        raise ValueError(f"flex_attention: `scale` must be finite, got {scale}. Fix: pass a finite float or None.")
    return float(scale)


def check_kernel_options(kernel_options: Any) -> dict:
    """A copy of ``kernel_options`` with known keys only and ``BACKEND`` upper-cased ("AUTO" by default)."""
    if kernel_options is None:
        return {"BACKEND": registry.AUTO}
    if not isinstance(kernel_options, dict):
        raise TypeError(f"flex_attention: `kernel_options` must be a dict or None, got {type(kernel_options).__name__}. "
                        f"Fix: pass e.g. {{'BACKEND': 'TORCH'}}.")
    options = dict(kernel_options)
    for name in options:
        base = name[4:] if isinstance(name, str) and name.startswith(("fwd_", "bwd_")) else name
        if name in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):  # torch sets these itself from return_lse/return_aux
            raise AssertedValueError(f"flex_attention: {name} must not be in kernel_options. Fix: ask for the "
                                     f"output with return_aux=AuxRequest(lse=True) or AuxRequest(max_scores=True).")
        if base in FLEXC_OPTIONS and base != name:
            raise ValueError(f"flex_attention: kernel_options key {name!r}: {base} applies to every kernel of a "
                             f"call (forward, backward and decode) and takes no fwd_/bwd_ prefix. Fix: pass "
                             f"{base!r}.")
        if name in FLEXC_OPTIONS and not (isinstance(options[name], (bool, int)) and options[name] in (0, 1)):
            raise TypeError(f"flex_attention: kernel_options[{name!r}] must be a bool, got "
                            f"{type(options[name]).__name__} {options[name]!r}. Fix: pass {name}=True or False.")
        if name != "BACKEND" and base not in KNOWN_OPTIONS | TORCH_KERNEL_OPTIONS | FLEXC_OPTIONS:
            by_lower = {known.lower(): known for known in KNOWN_OPTIONS | TORCH_KERNEL_OPTIONS | FLEXC_OPTIONS}
            close = difflib.get_close_matches(str(base).lower(), sorted(by_lower), n=1)
            hint = f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
            raise ValueError(f"flex_attention: unknown kernel_options key {name!r}{hint}; expected BACKEND, "
                             f"{', '.join(sorted(FLEXC_OPTIONS))} or one of {sorted(KNOWN_OPTIONS)}, torch's kernel "
                             f"keys {sorted(TORCH_KERNEL_OPTIONS)} (optionally prefixed fwd_/bwd_). Fix: remove or "
                             f"correct the key.")
    if "BACKEND" in options and options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise InvalidValueError("flex_attention: BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION. "
                                "Fix: drop FORCE_USE_FLEX_ATTENTION and only specify the desired BACKEND.")
    precision_option(options)  # FLOAT32_PRECISION: a value the kernels can take, on every backend
    backend = options.get("BACKEND", registry.AUTO)
    if isinstance(backend, str) and backend.upper() in TORCH_ONLY_BACKENDS:
        warn_once(("BACKEND", backend.upper()),
                  f"flex_attention: kernel_options['BACKEND']={backend!r} names one of torch's own kernels, which "
                  f"flexc does not have; flexc runs 'AUTO' instead (its generated Triton kernels on CUDA, the "
                  f"TORCH block-sparse path on the CPU). Fix: pass 'AUTO', 'TRITON' or 'TORCH' to choose.",
                  stacklevel=4)
        backend = registry.AUTO
    if not isinstance(backend, str) or backend.upper() not in registry.names():
        raise ValueError(f"flex_attention: Invalid BACKEND value {backend!r}: kernel_options['BACKEND'] must be one "
                         f"of {list(registry.names())} (or torch's {list(TORCH_ONLY_BACKENDS)}, run as 'AUTO'), got "
                         f"{backend!r}. Fix: use 'TORCH' for the CPU block-sparse path, 'TRITON' for generated "
                         f"kernels, or 'AUTO'.")
    options["BACKEND"] = backend.upper()
    return options


def check_flags(enable_gqa: Any, return_lse: Any, return_aux: Any) -> None:
    """``enable_gqa``/``return_lse`` are bools; ``return_aux`` is an AuxRequest and excludes return_lse."""
    for name, flag in (("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"flex_attention: `{name}` must be a bool, got {type(flag).__name__} {flag!r}. "
                            f"Fix: pass True or False.")
    if return_aux is not None:
        if not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
            raise TypeError(f"flex_attention: `return_aux` must be an AuxRequest or None, got "
                            f"{type(return_aux).__name__}. Fix: pass flexc.AuxRequest(lse=True).")
        if return_lse:
            raise ValueError("flex_attention: Cannot specify both return_lse and return_aux; got both. "
                             "Fix: use return_aux=AuxRequest(lse=True) alone.")


def check_mod(score_mod: Any) -> None:
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex_attention: `score_mod` must be a function (score, b, h, q_idx, kv_idx) -> score or "
                        f"None, got {type(score_mod).__name__}. Fix: pass a callable.")
