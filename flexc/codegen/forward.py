"""Generate the forward attention kernel for one pair of traced mods.

The kernel follows torch's FlexAttention template: one program per (query tile, head, batch)
walks the BlockMask's *partial* key blocks (score_mod and mask_mod) and then its *full* key blocks
(score_mod only) through the index tables, so empty blocks are never visited; scores go through an
online softmax in fp32 with ``exp2``. Everything the generator knows (block sizes, head dims,
dtypes, the mods) is written into the source, which opens with a comment saying what it computes.

:class:`ForwardSpec` is everything that shapes the source; its key (derived from its fields,
:mod:`flexc.codegen.spec`) is the kernel cache key. :func:`generate_forward` returns the source
and the parameter plan the launcher follows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import LN2, LOG2E
from .emit import HEAD_DIMS, call, constexprs, jit_def, keywords, names_line, store
from .header import describe_dims, describe_mods, widen_note
from .kernel_mods import buffer_args, buffer_params, hoisted_lines, mask_lines, render_mods, score_lines
from .parts import (KEY_TILE, KV_BASES, VALUE_TILE, attention_source, dot, dropout_args, dropout_head, dropout_params,
                    float_param, head_check, online_softmax, sink_params, softmax_state, tile_load, tile_walk, widen_suffix)
from .spec import AttentionSpec, GeneratedKernel, generates, next_power_of_2, padded_head_dim
from . import tma

KERNEL_NAME = "flex_attention_forward"
NO_BLOCK_MASK = 1 << 30  # the query "block" of a missing BlockMask: one row covers every query

@dataclass(frozen=True, kw_only=True)
class ForwardSpec(AttentionSpec):
    """What one generated forward kernel is specialised for (its :meth:`key` is the cache key).

    ``q_block_size``/``kv_block_size`` are the BlockMask's block sizes (``NO_BLOCK_MASK`` and
    ``block_n`` when there is none); ``block_m``/``block_n`` the kernel's tiles, which divide them.
    """

    TILES = ("block_m", "block_n")
    SHRINK_ORDER = (("block_n",), ("block_m",))  # the key tile first; the query tile after it

    q_block_size: int
    kv_block_size: int
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    has_full_blocks: bool = True
    output_lse: bool = True
    # training: also the backward's per-row statistics (the final online-softmax state, see _kernel)
    output_stats: bool = False
    target: str = "cuda"
    fp32_precision: str = "ieee"
    # torch's kernel options: PRESCALE_QK, ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS
    prescale_qk: bool = False
    rows_guaranteed_safe: bool = False
    blocks_are_contiguous: bool = False
    # integer type of the mods' index arithmetic: "int64" where int32 could overflow (torch uses int64)
    index_dtype: str = "int32"
    # attention dropout (flexc's dropout_p > 0): p @ v sees the kept pairs only (codegen.parts.dropout_keep)
    dropout: bool = False
    # learned attention sinks (flexc's sinks=): the online softmax starts from each row's sink logit
    # (codegen.parts.softmax_state); the kernel then takes the sinks after the dropout values
    sinks: bool = False
    # torch's USE_TMA: key and value tiles through tensor descriptors (TMA on sm_90; codegen.tma)
    tma: bool = False
    # every index below 2**23: index differences the mods read as floats print in float32, exactly
    # (flexc.codegen.printer, flexc.codegen.index_width.float_indices)
    float_indices: bool = False


@dataclass(frozen=True)
class GeneratedForward(GeneratedKernel):
    """A generated forward kernel (see :class:`GeneratedKernel`)."""

    # no score_mod: scale * log2(e) multiplies raw q.k inside exp2 after the row max, which is
    # right only for scale > 0 (the launcher negates q for a negative scale)
    needs_positive_scale: bool = False


@generates(ForwardSpec)
def generate_forward(spec: ForwardSpec) -> GeneratedForward:
    """The Triton source of the forward kernel described by ``spec``."""
    score, mask = render_mods(spec, spec.target, spec.index_dtype, hoist=True)
    score_params = score.params if score is not None else ()
    mask_params = mask.params if mask is not None else ()

    tiles_per_block = spec.kv_block_size // spec.block_n
    q_blocks = "none (every key is allowed)" if spec.q_block_size == NO_BLOCK_MASK else \
        f"{spec.q_block_size} x {spec.kv_block_size} (query x key)"

    header = [
        "# flexc forward attention kernel (generated; flexc.kernel_source() returns this text).",
        *describe_mods(spec),
        describe_dims(spec),
        f"#   BlockMask blocks: {q_blocks}",
        f"#   tiles: BLOCK_M={spec.block_m}, BLOCK_N={spec.block_n}; num_warps={spec.num_warps}, "
        f"num_stages={spec.num_stages}; logsumexp output: {'yes' if spec.output_lse else 'no'}"
        f"{' (and the backward statistics)' if spec.output_stats else ''}; "
        f"target: {spec.target}",
    ]
    options = [name for name, on in (("PRESCALE_QK", spec.prescale_qk), ("ROWS_GUARANTEED_SAFE", spec.rows_guaranteed_safe),
                                     ("BLOCKS_ARE_CONTIGUOUS", spec.blocks_are_contiguous)) if on]
    if options or spec.index_dtype != "int32":
        header.append(f"#   options: {', '.join(options) or 'none'}; index arithmetic in the mods: {spec.index_dtype}")
    if spec.dropout:
        header.append("#   dropout: each (b, h, q_idx, kv_idx) pair kept with probability 1 - p (Philox, keyed by the "
                      "call's seed), kept ones scaled by 1 / (1 - p)")
    if spec.sinks:
        header.append("#   sinks: each row's softmax starts from its head's learned sink logit (a key with no value "
                      "row); the logsumexp includes it")
    if spec.tma:
        header.append(tma.HEADER)
    header += [
        "# One program per (query tile, head, batch). It visits the BlockMask's partial key blocks",
        "# (score_mod, then mask_mod) and then its full key blocks (score_mod only); empty blocks are",
        "# never visited. Softmax is online, in fp32, in base 2 (exp2). Lengths that are multiples of",
        "# the tiles (Q_LEN_DIVISIBLE, KV_LEN_DIVISIBLE) compile to a variant without bounds checks;",
        "# otherwise only the last key tile of a row is checked.",
        *widen_note(spec),
    ]
    source = attention_source(header, score, mask, _attend_tile(spec, score, mask),
                              _attend_blocks(spec, score, mask, tiles_per_block), _kernel(spec, score, mask),
                              dropout=spec.dropout)
    return GeneratedForward(source, KERNEL_NAME, score_params, mask_params,
                            needs_positive_scale=score is None and not spec.prescale_qk)


def _attend_tile(spec: ForwardSpec, score, mask) -> list[str]:
    """The device function for one key tile: scores, mods, and the online-softmax update."""
    params = [
        "acc, l_i, m_i, q, b, h, q_idx, start_n,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd, scale, KV_LEN,",
        *names_line(buffer_args(score, mask)),
        *dropout_args(spec),
        *constexprs(("IS_FULL_BLOCKS", "CHECK_KV", "ROWS_GUARANTEED_SAFE"), ("GUARD_NONFINITE_VALUES", "POW2_SCALE"),
                    ("BLOCK_M", "BLOCK_N", *HEAD_DIMS[:2]), HEAD_DIMS[2:]),
    ]
    prescaled = spec.prescale_qk
    if prescaled:
        scores = [f"        qk = {dot('q', 'k', spec)}  # q was scaled by scale * log2(e): already base 2"]
    elif score is not None:
        scores = ["        if POW2_SCALE:",
                  f"            qk = {dot('q', 'k', spec)}  # the scaled score: q carries the scale (see the kernel)",
                  "        else:",
                  f"            qk = {dot('q', 'k', spec)} * scale  # the score_mod sees the scaled score"]
    elif spec.dtype == torch.float64:  # nothing to gain from the fold; keep fp64 scores exact
        scores = [f"        qk = {dot('q', 'k', spec)} * (scale * {LOG2E})  # scaled and in base 2 at once"]
    else:
        scores = [f"        qk_scale = scale * {LOG2E}  # scale and the change to base 2 (the launcher makes it > 0)",
                  f"        qk = {dot('q', 'k', spec)}  # qk_scale is applied in the exp2 below"]
    # The factor that takes a score to base 2: folded into one FMA with the max subtraction.
    to_base2 = (None if prescaled or (score is None and spec.dtype == torch.float64)
                else LOG2E if score is not None else "qk_scale")
    body = [
        *jit_def("attend_tile", params),
        "    # One BLOCK_N tile of keys starting at start_n: scores, the mods, the online-softmax update.",
        "    # Only the tile that holds the end of the keys (CHECK_KV) pays for bounds: masked loads,",
        "    # clamped indices and -inf past KV_LEN.",
        "    offs_n = start_n + tl.arange(0, BLOCK_N)",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        "    if CHECK_KV:",
        "        kv_in_range = offs_n < KV_LEN",
        f"        k = {tile_load(spec, KEY_TILE, 'kv_in_range[None, :]', '[:, None]')}",
        "        kv_idx = tl.minimum(offs_n, KV_LEN - 1)[None, :]  # clamped: captured-tensor lookups stay in bounds",
        "    else:",
        f"        k = {tile_load(spec, KEY_TILE, None, '[:, None]')}",
        "        kv_idx = offs_n[None, :]",
    ]
    body += [line[4:] for line in scores]
    body += [line for line in score_lines(spec, score, "    ")]
    masked = mask_lines(spec, mask, "        ")
    if masked:
        body += ["    if not IS_FULL_BLOCKS:  # full blocks are known to be all allowed", *masked]
    body += [
        "    if CHECK_KV:",
        "        qk = tl.where(kv_in_range[None, :], qk, float(\"-inf\"))  # keys past KV_LEN",
    ]
    v_load = ["    if CHECK_KV:",
              f"        v = {tile_load(spec, VALUE_TILE, 'kv_in_range[:, None]', '[None, :]', value=True)}",
              "    else:",
              f"        v = {tile_load(spec, VALUE_TILE, None, '[None, :]', value=True)}"]
    body += [
        *online_softmax(spec, "    ", v_load, to_base2=to_base2, rows_option=True, guard=bool(masked),
                        dropout=spec.dropout),
        "    return acc, l_i, m_new",
    ]
    if spec.tma:
        body = tma.tile_lines(spec, body)
    return body


def _attend_blocks(spec: ForwardSpec, score, mask, tiles_per_block: int) -> list[str]:
    buffers = names_line(buffer_args(score, mask))
    params = [
        "acc, l_i, m_i, q, b, h, q_idx,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd,",
        "block_count_ptr, block_index_ptr, scale, KV_LEN,",
        *buffers,
        *dropout_args(spec),
        *constexprs(("IS_FULL_BLOCKS", "KV_LEN_DIVISIBLE"),
                    ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"), ("GUARD_NONFINITE_VALUES", "POW2_SCALE"),
                    ("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"), HEAD_DIMS),
    ]

    def tile(check: str, indent: str) -> list[str]:
        return call("acc, l_i, m_i", "attend_tile", [
            "acc, l_i, m_i, q, b, h, q_idx, start_n,",
            "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd, scale, KV_LEN,",
            *buffers,
            *dropout_args(spec),
            *keywords(("IS_FULL_BLOCKS", f"CHECK_KV={check}"),
                      ("ROWS_GUARANTEED_SAFE", "GUARD_NONFINITE_VALUES", "POW2_SCALE"),
                      ("BLOCK_M", "BLOCK_N"), HEAD_DIMS),
        ], indent)

    head, tail = tile_walk("block_index_ptr", tiles_per_block, "KV_BLOCK_SIZE", "BLOCK_N", "start_n",
                           count_ptr="block_count_ptr", contiguous=True, clamp=True)
    body = [
        *jit_def("attend_blocks", params),
        "    # Online softmax over the key tiles of the listed blocks: running row max m_i and row sum",
        "    # l_i (base 2) and the unnormalised output acc.",
        *head,
        "        if KV_LEN_DIVISIBLE:  # every tile is whole: no bounds work at all",
        *tile("False", "            "),
        "        elif start_n + BLOCK_N <= KV_LEN:",
        *tile("False", "            "),
        "        else:  # the tile holding the end of the keys",
        *tile("True", "            "),
        *tail,
        "    return acc, l_i, m_i",
    ]
    if spec.tma:
        body = tma.blocks_lines(body)
    return body


def _kernel(spec: ForwardSpec, score, mask) -> list[str]:
    buffers = buffer_params(score, mask)
    params = [
        "query_ptr, key_ptr, value_ptr, out_ptr," + (" lse_ptr," if spec.output_lse else "")
        + (" row_max_ptr, row_sum_ptr," if spec.output_stats else ""),
        "partial_block_counts_ptr, partial_block_indices_ptr,"
        + (" full_block_counts_ptr, full_block_indices_ptr," if spec.has_full_blocks else ""),
        *names_line(buffers),
        *dropout_params(spec),
        *sink_params(spec),
    ]
    strides = ["stride_qb", "stride_qh", "stride_qm", "stride_qd", "stride_kb", "stride_kh", "stride_kn", "stride_kd",
               "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_ob", "stride_oh", "stride_om", "stride_od"]
    params += [
        f"{float_param('scale', spec)}, Q_LEN, KV_LEN, GQA_GROUP,",
        *(", ".join(strides[i:i + 4]) + "," for i in range(0, 16, 4)),
    ]
    if spec.output_lse:
        params.append("stride_lb, stride_lh,")
        strides += ["stride_lb", "stride_lh"]
    params += [
        "MASK_BATCH, MASK_HEADS, MASK_Q_BLOCKS, MASK_KV_BLOCKS,",
        *constexprs(("BLOCK_M", "BLOCK_N", "Q_BLOCK_SIZE", "KV_BLOCK_SIZE"), HEAD_DIMS,
                    ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "GUARD_NONFINITE_VALUES"),
                    ("Q_LEN_DIVISIBLE", "KV_LEN_DIVISIBLE", "INT64_OFFSETS"), ("POW2_SCALE",)),
    ]
    buffer_strides = [b for b in buffers if "_stride_" in b]
    # Lengths and captured-tensor sizes/strides change with the input; Triton must not specialise
    # on them, or every new length would compile again.
    unspecialised = ["Q_LEN", "KV_LEN"] + [b for b in buffers if not b.endswith("_ptr")]
    q_ptrs = "query_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd"
    o_ptrs = "out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od"
    o_pad = head_check(spec, "[None, :]", value=True)
    out_value = "out.to(out_ptr.dtype.element_ty)"

    def blocks(kind: str, full: bool) -> list[str]:
        return call("acc, l_i, m_i", "attend_blocks", [
            "acc, l_i, m_i, q, b, h, q_idx,",
            "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,",
            f"{kind}_block_counts_ptr + mask_row, {kind}_block_indices_ptr + mask_row * MASK_KV_BLOCKS, scale, KV_LEN,",
            *names_line(buffer_args(score, mask)),
            *dropout_args(spec),
            *keywords((f"IS_FULL_BLOCKS={full}", "KV_LEN_DIVISIBLE"), ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"),
                      ("GUARD_NONFINITE_VALUES", "POW2_SCALE"), ("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"), HEAD_DIMS),
        ], "    ")

    widened = strides + buffer_strides + ["MASK_KV_BLOCKS"]
    body = [
        *jit_def(KERNEL_NAME, params, f"@triton.jit(do_not_specialize={unspecialised!r})"),
        "    q_tile = tl.program_id(0)",
        "    h = tl.program_id(1)  # the query head the mods see",
        "    b = tl.program_id(2)  # the batch index the mods see",
        "    if INT64_OFFSETS:  # a tensor holds 2**31 elements or more: every index * stride in int64",
        *(f"        {name} = tl.cast({name}, tl.int64)" for name in widened),
        "    h_kv = h // GQA_GROUP  # grouped-query attention: GQA_GROUP query heads share a key head",
        *dropout_head(spec, "    "),
        *hoisted_lines((score, mask), "    "),
        "    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        "    if Q_LEN_DIVISIBLE:  # every query tile is whole",
        f"        q = {tile_load(spec, q_ptrs, None, '[None, :]')}",
        "        q_idx = offs_m[:, None]",
        "    else:",
        "        q_in_range = offs_m < Q_LEN",
        f"        q = {tile_load(spec, q_ptrs, 'q_in_range[:, None]', '[None, :]')}",
        "        q_idx = tl.minimum(offs_m, Q_LEN - 1)[:, None]  # clamped: captured-tensor lookups stay in bounds",
    ]
    if score is not None and not spec.prescale_qk:
        body += ["    if POW2_SCALE:",
                 "        # the scale is a power of two (the launcher's check): q * scale is exact in q's dtype, and",
                 "        # so is q.k then, so q carries the scale once instead of every score paying a multiply",
                 "        q = (q * scale).to(q.dtype)"]
    if spec.prescale_qk:
        body += ["    # PRESCALE_QK: scale and log2(e) applied to q once (torch's option: the score_mod sees",
                 "    # scores in base 2), not to every tile of scores",
                 f"    q = (q * (scale * {LOG2E})).to({spec.tl_dtype}){widen_suffix(spec)}"]
    body += [
        "    # this tile's row of the BlockMask tables; their batch and heads broadcast by modulo",
        "    mask_row = ((b % MASK_BATCH) * MASK_HEADS + h % MASK_HEADS) * MASK_Q_BLOCKS + (q_tile * BLOCK_M) // Q_BLOCK_SIZE",
        *KV_BASES,
        *softmax_state(spec),
        "    # 1. partial blocks: score_mod and mask_mod",
        *blocks("partial", False),
    ]
    if spec.has_full_blocks:
        body += ["    # 2. full blocks: score_mod only", *blocks("full", True)]
    body += [
        *_dead_rows_note(spec),
        "    l_safe = tl.where(l_i == 0.0, 1.0, l_i)",
        "    out = acc / l_safe[:, None]",
        "    if Q_LEN_DIVISIBLE:",
        f"        {store(o_ptrs, out_value, o_pad)}",
        "    else:",
        f"        {store(o_ptrs, out_value, 'q_in_range[:, None]', o_pad)}",
    ]
    if spec.output_lse:
        body += [f"    lse = ((m_i + tl.log2(l_safe)) * {LN2}).to(lse_ptr.dtype.element_ty)  # natural log",
                 *_row_store("lse", "lse")]
    if spec.output_stats:
        body += [
            "    # the backward's statistics (training): the row's base-2 max and its sum of exp2(score - max),",
            "    # the online softmax's final state. Its probabilities exp2(score - max) / sum then sum to 1",
            "    # as this kernel's did; exp2(score - lse) from a rounded logsumexp is off by a factor per row",
            "    # (a few ulps of |lse|), a bias in every dS of the row. The max is +inf on rows that allow",
            "    # nothing, so their probabilities are exactly 0 (the sum is 1 there).",
            "    row_max = tl.where(m_i == float(\"-inf\"), float(\"inf\"), m_i)",
            *_row_store("row_max", "row_max"),
            *_row_store("row_sum", "l_safe"),
        ]
    if spec.tma:
        body = tma.kernel_lines(body)
    return body


def _dead_rows_note(spec: ForwardSpec) -> list[str]:
    """The comment on rows that allow no key (with sinks, only those whose sink is -inf have l_i == 0)."""
    if spec.sinks:
        return ["    # a row that saw no allowed key keeps the sink's state: output 0, lse the sink (l_i == 0 and",
                "    # m_i == -inf only where the sink is -inf too: output 0, lse -inf)"]
    return ["    # a row that saw no allowed key has l_i == 0 and m_i == -inf: its output is 0 and its lse -inf"]


def _row_store(name: str, value: str) -> list[str]:
    """Store a per-row value at ``{name}_ptr`` (laid out as the logsumexp: [B, Hq, L], L contiguous)."""
    ptrs = f"{name}_ptr + b * stride_lb + h * stride_lh + offs_m"
    return ["    if Q_LEN_DIVISIBLE:",
            f"        tl.store({ptrs}, {value})",
            "    else:",
            f"        tl.store({ptrs}, {value}, mask=q_in_range)"]


__all__ = ["ForwardSpec", "GeneratedForward", "KERNEL_NAME", "NO_BLOCK_MASK", "generate_forward",
           "next_power_of_2", "padded_head_dim"]
