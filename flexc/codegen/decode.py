"""Generate the split-KV decode kernel: attention for a few query rows against a long KV cache.

With one query row per head, the forward kernel's grid (query tiles x heads x batch) has only
``B * Hq`` programs, each a 128-row tile holding one valid row. This kernel, modelled on torch's
flex_decode, instead

- packs the ``G = Hq / Hkv`` query heads that share a key head, times the ``L`` query rows, into
  the rows of one tile (``BLOCK_M >= G * L``, at least 16 for ``tl.dot``), so each key tile is
  loaded once per key head and the mods see vectors of ``h`` and ``q_idx``;
- splits each row of the BlockMask (its partial blocks, then its full blocks) into ``NUM_SPLITS``
  contiguous ranges, one program each: the grid is ``(NUM_SPLITS, Hkv, B)``;
- writes per split the normalised output and logsumexp; the launcher merges the splits by
  logsumexp (:func:`flexc.backends.triton.decode.merge_splits`). A row that allows no key in a
  split writes 0 and ``-inf`` there, so a fully masked row ends as output 0, logsumexp ``-inf``.

With attention dropout (``DecodeSpec.dropout``, flexc's ``dropout_p > 0``) each packed row draws its
keep mask at its own query head and row, so a seed keeps the pairs the forward kernel and the TORCH
backend keep; as there, only ``p @ v`` is dropped, never the row sum behind the logsumexp the merge
weighs splits by.

The packed rows share one row of the BlockMask's tables, so the kernel applies when the mask
does not vary by query head within a group (``Hm == 1`` or ``G == 1``) and the ``L`` rows lie in
its first query block; the launcher checks that and otherwise runs the forward kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..constants import LN2, LOG2E
from .emit import HEAD_DIMS, bounds, call, constexprs, jit_def, keywords, names_line
from .header import describe_dims, describe_mods, index_note, widen_note
from .kernel_mods import buffer_args, mask_lines, render_mods, score_lines
from .parts import (KEY_TILE, KV_BASES, VALUE_TILE, attention_source, dot, dropout_args, dropout_head, dropout_params,
                    float_param, head_check, online_softmax, softmax_state, tile_load, tile_walk, widen_suffix)
from .spec import AttentionSpec, GeneratedKernel, generates, padded_head_dim

KERNEL_NAME = "flex_decode_split"
# where the kv tables after the partial counts start, in entries past their pointers (constexprs): 0 for a
# BlockMask's own tables; a decoding step's gathered row (flexc.masks.gathered_rows) is passed as the
# pointer of every table, each table at its offset in the row, so the launch makes no view of it
TABLE_OFFSETS = ("PARTIAL_INDICES_AT", "FULL_COUNTS_AT", "FULL_INDICES_AT")


@dataclass(frozen=True, kw_only=True)
class DecodeSpec(AttentionSpec):
    """What one generated decode kernel is specialised for (its :meth:`key` is the cache key).

    ``block_m`` holds the packed rows (``G * L`` padded to a power of two, at least 16);
    ``block_n`` divides the BlockMask's key block size ``kv_block_size``.
    """

    KIND = ("decode",)
    TILES = ("block_m", "block_n")
    SHRINK_ORDER = (("block_n",),)  # the query tile holds all the packed rows and stays

    kv_block_size: int
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    has_full_blocks: bool = True
    target: str = "cuda"
    fp32_precision: str = "ieee"
    # integer type of the mods' index arithmetic, as the forward's (flexc.codegen.index_width)
    index_dtype: str = "int32"
    # attention dropout (flexc's dropout_p > 0), drawn per packed row at its real (b, h, q_idx) as
    # the forward kernel draws it (codegen.parts.dropout_keep): the same seed keeps the same pairs
    dropout: bool = False


@dataclass(frozen=True)
class GeneratedDecode(GeneratedKernel):
    """A generated decode kernel (see :class:`GeneratedKernel`)."""


@generates(DecodeSpec)
def generate_decode(spec: DecodeSpec) -> GeneratedDecode:
    """The Triton source of the split-KV decode kernel described by ``spec``."""
    score, mask = render_mods(spec, spec.target, spec.index_dtype)
    header = [
        "# flexc split-KV decode kernel (generated; flexc.kernel_source() returns this text).",
        *describe_mods(spec),
        describe_dims(spec),
        f"#   BlockMask key blocks of {spec.kv_block_size}; tiles: BLOCK_M={spec.block_m} packed query rows, "
        f"BLOCK_N={spec.block_n} keys; num_warps={spec.num_warps}, num_stages={spec.num_stages}; "
        f"target: {spec.target}",
        *index_note(spec),
        *_dropout_note(spec),
        "# One program per (split, key head, batch). Its tile's rows are the GQA_GROUP query heads that",
        "# share the key head times the Q_LEN query rows (row r: head h_kv * GQA_GROUP + r // Q_LEN,",
        "# q_idx r % Q_LEN). It walks its share of the BlockMask row's listed key blocks (partial: score_mod",
        "# and mask_mod; full: score_mod only) with an online softmax in base 2, and writes its normalised",
        "# output and logsumexp; the launcher merges the splits by logsumexp.",
        *widen_note(spec),
    ]
    source = attention_source(header, score, mask, _attend_range(spec, score, mask), _kernel(spec, score, mask),
                              dropout=spec.dropout)
    return GeneratedDecode(source, KERNEL_NAME,
                           score.params if score is not None else (), mask.params if mask is not None else ())


def _dropout_note(spec: DecodeSpec) -> list[str]:
    """The header's dropout line, for a spec with ``dropout``; else none."""
    if not spec.dropout:
        return []
    return ["#   dropout: each (b, h, q_idx, kv_idx) pair kept with probability 1 - p (Philox, keyed by the call's "
            "seed, at each packed row's own query head and row: the forward kernel's mask), kept ones scaled by "
            "1 / (1 - p)"]


def _dropout_rows(spec: DecodeSpec) -> list[str]:
    """For a spec with ``dropout``, the per-row Philox head counter: each packed row draws at its own
    query head and row, so the kept pairs are the forward kernel's; else none."""
    if not spec.dropout:
        return []
    return ["    # dropout: each packed row draws at its own query head h and row q_idx (the forward kernel's mask)",
            *dropout_head(spec, "    ", heads="(KV_HEADS * GQA_GROUP)")]


def _attend_range(spec: DecodeSpec, score, mask) -> list[str]:
    """The online-softmax loop over listed blocks ``[first, last)`` of one table row."""
    tiles = spec.kv_block_size // spec.block_n
    params = [
        "acc, l_i, m_i, q, b, h, q_idx,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd,",
        "block_index_ptr, first, last, scale, KV_LEN,",
        *names_line(buffer_args(score, mask)),
        *dropout_args(spec),
        *constexprs(("IS_FULL_BLOCKS", "KV_LEN_DIVISIBLE", "GUARD_NONFINITE_VALUES", "BLOCK_M", "BLOCK_N"),
                    ("KV_BLOCK_SIZE", *HEAD_DIMS[:2]), HEAD_DIMS[2:]),
    ]
    head, tail = tile_walk("block_index_ptr", tiles, "KV_BLOCK_SIZE", "BLOCK_N", "start_n", span=("first", "last"),
                           clamp=True)
    body = [
        *jit_def("attend_range", params),
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        *_tile_offsets(spec),
        *head,
        "        offs_n = start_n + tl.arange(0, BLOCK_N)",
        *_tile_pointers(spec),
        *_key_tile(spec),
        *([f"        qk = {dot('q', 'k', spec)} * scale"] if score is not None else
          [f"        qk = {dot('q', 'k', spec)} * (scale * {LOG2E})  # scaled and in base 2 at once: no score_mod"]),
        *score_lines(spec, score, "        "),
    ]
    masked = mask_lines(spec, mask, "            ")
    if masked:
        body += ["        if not IS_FULL_BLOCKS:  # full blocks are known to be all allowed", *masked]
    body += [
        "        if not KV_LEN_DIVISIBLE:",
        "            qk = tl.where(kv_in_range[None, :], qk, float(\"-inf\"))  # keys past KV_LEN",
        *([f"        qk = qk * {LOG2E}  # to base 2"] if score is not None else []),
    ]
    v_load = [
        "        if KV_LEN_DIVISIBLE:",
        f"            v = {tile_load(spec, 'v_tile', None, '[None, :]', value=True)}",
        "        else:",
        f"            v = {tile_load(spec, 'v_tile', 'kv_in_range[:, None]', '[None, :]', value=True)}",
    ]
    body += online_softmax(spec, "        ", v_load, guard=bool(masked), fold_rescale=True,
                           guard_note="  # compiled in only for CPU calls whose values hold NaN/inf",
                           dropout=spec.dropout)
    body += [
        "        m_i = m_new",
        *tail,
        "    return acc, l_i, m_i",
    ]
    return body


def _hoists_offsets(spec: DecodeSpec) -> bool:
    """Whether the key loop adds each tile's start to offsets computed once before it (see
    :func:`_tile_offsets`): where each thread copies at most 16 vectors of 16 bytes per tile, with
    16-bit inputs. The offsets stay in registers (64-bit each) across the loop; more of them (head
    dims past 128, fp32) made the sm_90 compile spill."""
    vectors = spec.block_n * padded_head_dim(max(spec.head_dim, spec.v_head_dim)) * spec.dtype.itemsize
    return spec.dtype.itemsize == 2 and vectors // (16 * 32 * spec.num_warps) <= 16


def _tile_offsets(spec: DecodeSpec) -> list[str]:
    """Before the key loop, for a spec that :func:`_hoists_offsets`: a tile's key and value offsets."""
    if not _hoists_offsets(spec):
        return []
    return [
        "    # a tile's keys and values lie at these offsets from its first key's row: the same in every",
        "    # tile, so they are computed once and each tile adds only its start, a scalar (one 64-bit add",
        "    # per copied vector instead of a multiply by the runtime stride as well)",
        "    k_offs = tl.arange(0, BLOCK_N)[None, :] * stride_kn + offs_d[:, None] * stride_kd",
        "    v_offs = tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_dv[None, :] * stride_vd",
    ]


def _tile_pointers(spec: DecodeSpec) -> list[str]:
    """In the key loop: the pointers ``k_tile`` (head dim down, keys across) and ``v_tile`` (keys down)."""
    if _hoists_offsets(spec):
        return ["        k_tile = key_ptr + start_n * stride_kn + k_offs",
                "        v_tile = value_ptr + start_n * stride_vn + v_offs"]
    return [f"        k_tile = {KEY_TILE}", f"        v_tile = {VALUE_TILE}"]


def _key_tile(spec: DecodeSpec) -> list[str]:
    """The lines that load a tile's keys ``k`` and set ``kv_idx``, the key indices the mods see.

    With KV_LEN a multiple of the BlockMask's key blocks (the launcher's KV_LEN_DIVISIBLE) every
    listed tile is whole, so this variant has no bounds work at all: torch's template has none there
    either (its static KV_LEN folds the checks into one predicate per tile). Otherwise keys past
    KV_LEN load as 0, score -inf, and ``kv_idx`` is clamped so captured-tensor lookups stay in bounds.
    """
    return [
        "        if KV_LEN_DIVISIBLE:  # every tile is whole: no bounds checks",
        f"            k = {tile_load(spec, 'k_tile', None, '[:, None]')}",
        "            kv_idx = offs_n[None, :]",
        "        else:",
        "            kv_in_range = offs_n < KV_LEN",
        f"            k = {tile_load(spec, 'k_tile', 'kv_in_range[None, :]', '[:, None]')}",
        "            kv_idx = tl.minimum(offs_n, KV_LEN - 1)[None, :]  # clamped: captured-tensor lookups stay in bounds",
    ]


def _kernel(spec: DecodeSpec, score, mask) -> list[str]:
    buffers = buffer_args(score, mask)
    params = [
        "query_ptr, key_ptr, value_ptr, out_split_ptr, lse_split_ptr,",
        "partial_block_counts_ptr, partial_block_indices_ptr,"
        + (" full_block_counts_ptr, full_block_indices_ptr," if spec.has_full_blocks else ""),
        *names_line(buffers),
        *dropout_params(spec),
        f"{float_param('scale', spec)}, Q_LEN, KV_LEN, GQA_GROUP, KV_HEADS, NUM_SPLITS,",
        "stride_qb, stride_qh, stride_qm, stride_qd,",
        "stride_kb, stride_kh, stride_kn, stride_kd,",
        "stride_vb, stride_vh, stride_vn, stride_vd,",
        "MASK_BATCH, MASK_HEADS, MASK_Q_BLOCKS, MASK_KV_BLOCKS,",
        *constexprs(("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"), HEAD_DIMS,
                     ("SINGLE_ROW", "KV_LEN_DIVISIBLE", "GUARD_NONFINITE_VALUES"),
                     TABLE_OFFSETS[:3 if spec.has_full_blocks else 1], ("LSE_SPLIT_AT",)),
    ]
    unspecialised = ["Q_LEN", "KV_LEN", "NUM_SPLITS"] + [b for b in buffers if not b.endswith("_ptr")]

    def attend(kind: str, first: str, last: str, full: bool) -> list[str]:
        return call("acc, l_i, m_i", "attend_range", [
            "acc, l_i, m_i, q, b, h, q_idx,",
            "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,",
            f"{kind}_block_indices_ptr + {kind.upper()}_INDICES_AT + mask_row * MASK_KV_BLOCKS, {first}, {last}, scale, KV_LEN,",
            *names_line(buffers),
            *dropout_args(spec),
            *keywords((f"IS_FULL_BLOCKS={full}", "KV_LEN_DIVISIBLE", "GUARD_NONFINITE_VALUES"), ("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"),
                      HEAD_DIMS),
        ], "    ")

    full_count = "tl.load(full_block_counts_ptr + FULL_COUNTS_AT + mask_row)" if spec.has_full_blocks else "0"
    body = [
        *jit_def(KERNEL_NAME, params, f"@triton.jit(do_not_specialize={unspecialised!r})"),
        "    split = tl.program_id(0)",
        "    h_kv = tl.program_id(1)",
        "    b = tl.program_id(2)  # the batch index the mods see",
        "    # the packed rows: GQA_GROUP query heads x Q_LEN query rows (padding rows repeat the last one)",
        "    rows = tl.arange(0, BLOCK_M)",
        "    packed = GQA_GROUP * Q_LEN",
        "    row_in_range = rows < packed",
        "    r = tl.minimum(rows, packed - 1)",
        "    if SINGLE_ROW:  # one query row per head (a decode step): the rows are the heads, q_idx is 0, a",
        "        # constant the mods fold (a mask_mod of q_idx and kv_idx then varies along the keys only)",
        "        h = (h_kv * GQA_GROUP + r)[:, None]",
        "        q_idx = tl.full((BLOCK_M, 1), 0, tl.int32)",
        "    else:",
        "        h = (h_kv * GQA_GROUP + r // Q_LEN)[:, None]  # the query head of each row, as the mods see it",
        "        q_idx = (r % Q_LEN)[:, None]",
        *_dropout_rows(spec),
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        "    q = tl.load(query_ptr + b * stride_qb + h * stride_qh + q_idx * stride_qm + offs_d[None, :] * stride_qd,",
        f"                mask={bounds('row_in_range[:, None]', head_check(spec, '[None, :]'))}, "
        f"other=0.0){widen_suffix(spec)}",
        "    # the group's row of the BlockMask tables (shared by its heads: MASK_HEADS is 1 or GQA_GROUP is 1); each",
        "    # table starts *_AT entries past its pointer (a decoding step's gathered row: one row holds them all)",
        "    mask_row = ((b % MASK_BATCH) * MASK_HEADS + (h_kv * GQA_GROUP) % MASK_HEADS) * MASK_Q_BLOCKS",
        "    n_partial = tl.load(partial_block_counts_ptr + mask_row)",
        f"    n_full = {full_count}",
        "    # this split's share of the row's listed blocks: partial ones first, then full ones",
        "    per_split = (n_partial + n_full + NUM_SPLITS - 1) // NUM_SPLITS",
        "    first = split * per_split",
        "    last = tl.minimum(first + per_split, n_partial + n_full)",
        *KV_BASES,
        *softmax_state(spec),
        "    # 1. partial blocks: score_mod and mask_mod",
        *attend("partial", "tl.minimum(first, n_partial)", "tl.minimum(last, n_partial)", False),
    ]
    if spec.has_full_blocks:
        body += ["    # 2. full blocks: score_mod only",
                 *attend("full", "tl.maximum(first - n_partial, 0)", "tl.maximum(last - n_partial, 0)", True)]
    body += [
        "    # a row with nothing allowed in this split has l_i == 0, m_i == -inf: output 0, lse -inf",
        "    l_safe = tl.where(l_i == 0.0, 1.0, l_i)",
        "    out = acc / l_safe[:, None]",
        f"    lse = tl.where(l_i == 0.0, float(\"-inf\"), (m_i + tl.log2(l_safe)) * {LN2})  # natural log",
        "    # per-split results: out_split [B, Hkv, NUM_SPLITS, BLOCK_M, V_HEAD_DIM], lse_split [B, Hkv, NUM_SPLITS, BLOCK_M]",
        "    # from LSE_SPLIT_AT entries past its pointer (a warm launch passes one scratch tensor for both)",
        "    slot = (b * KV_HEADS + h_kv) * NUM_SPLITS + split",
        "    tl.store(out_split_ptr + (slot * BLOCK_M + rows[:, None]) * V_HEAD_DIM + offs_dv[None, :],",
        f"             out.to(out_split_ptr.dtype.element_ty), "
        f"mask={bounds('row_in_range[:, None]', head_check(spec, '[None, :]', value=True))})",
        "    tl.store(lse_split_ptr + LSE_SPLIT_AT + slot * BLOCK_M + rows, lse.to(lse_split_ptr.dtype.element_ty),",
        "             mask=row_in_range)",
    ]
    return body


__all__ = ["DecodeSpec", "GeneratedDecode", "KERNEL_NAME", "TABLE_OFFSETS", "generate_decode"]
