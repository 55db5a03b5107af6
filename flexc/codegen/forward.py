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

from ..mods.trace import TracedMod
from .constants import LN2, LOG2E
from .emit import HEAD_DIMS, call, constexprs, jit_def, keywords, load, names_line, pad_check, preamble, store
from .printer import BufferParam, RenderedMod, python_literal, render_mod
from .spec import AttentionSpec, next_power_of_2, padded_head_dim

KERNEL_NAME = "flex_attention_forward"
NO_BLOCK_MASK = 1 << 30  # the query "block" of a missing BlockMask: one row covers every query

_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
       torch.float64: "tl.float64"}
# Parameter stems the kernels themselves use (every ``<stem>_ptr`` parameter of the forward kernel
# and attend_blocks, and of the backward and decode kernels); a captured tensor with one of these
# names is renamed.
_RESERVED = {"query", "key", "value", "out", "lse", "partial_block_counts", "partial_block_indices",
             "full_block_counts", "full_block_indices", "block_counts", "block_indices", "block_count",
             "block_index",
             # the backward and decode kernels' own pointers (they name captured tensors the same way)
             "count", "index", "delta", "dq", "dk", "dv", "grad_out", "out_split", "lse_split",
             "partial_kv_counts", "partial_kv_indices", "full_kv_counts", "full_kv_indices",
             "partial_q_counts", "partial_q_indices", "full_q_counts", "full_q_indices"}


@dataclass(frozen=True)
class ForwardSpec(AttentionSpec):
    """What one generated forward kernel is specialised for (its :meth:`key` is the cache key).

    ``q_block_size``/``kv_block_size`` are the BlockMask's block sizes (``NO_BLOCK_MASK`` and
    ``block_n`` when there is none); ``block_m``/``block_n`` the kernel's tiles, which divide them.
    """

    q_block_size: int
    kv_block_size: int
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    has_full_blocks: bool = True
    output_lse: bool = True
    target: str = "cuda"
    fp32_precision: str = "ieee"
    # torch's kernel options: PRESCALE_QK, ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS
    prescale_qk: bool = False
    rows_guaranteed_safe: bool = False
    blocks_are_contiguous: bool = False
    # integer type of the mods' index arithmetic: "int64" where int32 could overflow (torch uses int64)
    index_dtype: str = "int32"


@dataclass(frozen=True)
class GeneratedForward:
    """A generated kernel: its source, and the captured-tensor parameters of each mod in order."""

    source: str
    kernel_name: str
    score_params: tuple[BufferParam, ...]
    mask_params: tuple[BufferParam, ...]
    # no score_mod: scale * log2(e) multiplies raw q.k inside exp2 after the row max, which is
    # right only for scale > 0 (the launcher negates q for a negative scale)
    needs_positive_scale: bool = False


def _stems(traced: TracedMod | None, taken: set[str], suffix: str) -> dict[int, str]:
    """Parameter stems for a mod's captured tensors: their names, made unique in the kernel."""
    stems: dict[int, str] = {}
    if traced is None:
        return stems
    for slot, name in enumerate(traced.buffer_names):
        stem = name if name.isidentifier() and not name.startswith("_") else f"buf{slot}"
        if stem in taken or stem in _RESERVED:
            stem = f"{stem}_{suffix}"
        while stem in taken or stem in _RESERVED:
            stem = f"{stem}_{slot}"
        taken.add(stem)
        stems[slot] = stem
    return stems


def _render(spec, target: str | None = None, index_dtype: str = "int32"
            ) -> tuple[RenderedMod | None, RenderedMod | None]:
    """The spec's mods as device functions (``target``/``index_dtype`` as in :func:`render_mod`)."""
    taken: set[str] = set()
    score = mask = None
    if spec.score_mod is not None:
        score = render_mod(spec.score_mod, "score_mod", _stems(spec.score_mod, taken, "score"),
                           target=target, index_dtype=index_dtype)
    if spec.mask_mod is not None:
        mask = render_mod(spec.mask_mod, "mask_mod", _stems(spec.mask_mod, taken, "mask"),
                          target=target, index_dtype=index_dtype)
        if mask.is_constant and mask.literal is True:
            mask = None  # allows everything: nothing to apply
    if score is not None and spec.score_mod.root.op == "input":
        score = None  # the identity score_mod
    return score, mask


def _describe(traced: TracedMod | None, what: str) -> str:
    if traced is None:
        return f"#   {what:<9} none"
    name = traced.name if traced.name != "<lambda>" else "lambda"
    return f"#   {what:<9} {name}: {traced}"


def generate_forward(spec: ForwardSpec) -> GeneratedForward:
    """The Triton source of the forward kernel described by ``spec``."""
    score, mask = _render(spec, spec.target, spec.index_dtype)
    score_params = score.params if score is not None else ()
    mask_params = mask.params if mask is not None else ()

    E, Ev = spec.head_dim, spec.v_head_dim
    E_pad, Ev_pad = padded_head_dim(E), padded_head_dim(Ev)
    tiles_per_block = spec.kv_block_size // spec.block_n
    q_blocks = "none (every key is allowed)" if spec.q_block_size == NO_BLOCK_MASK else \
        f"{spec.q_block_size} x {spec.kv_block_size} (query x key)"
    dtype_name = str(spec.dtype).removeprefix("torch.")
    widen = _widens(spec)
    acc_dtype = "tl.float64" if spec.dtype == torch.float64 else "tl.float32"

    header = [
        "# flexc forward attention kernel (generated; flexc.kernel_source() returns this text).",
        _describe(spec.score_mod, "score_mod"),
        _describe(spec.mask_mod, "mask_mod"),
        f"#   dtype {dtype_name}; head dim {E} (padded to {E_pad}), value head dim {Ev} (padded to {Ev_pad})",
        f"#   BlockMask blocks: {q_blocks}",
        f"#   tiles: BLOCK_M={spec.block_m}, BLOCK_N={spec.block_n}; num_warps={spec.num_warps}, "
        f"num_stages={spec.num_stages}; logsumexp output: {'yes' if spec.output_lse else 'no'}; "
        f"target: {spec.target}",
    ]
    options = [name for name, on in (("PRESCALE_QK", spec.prescale_qk), ("ROWS_GUARANTEED_SAFE", spec.rows_guaranteed_safe),
                                     ("BLOCKS_ARE_CONTIGUOUS", spec.blocks_are_contiguous)) if on]
    if options or spec.index_dtype != "int32":
        header.append(f"#   options: {', '.join(options) or 'none'}; index arithmetic in the mods: {spec.index_dtype}")
    header += [
        "# One program per (query tile, head, batch). It visits the BlockMask's partial key blocks",
        "# (score_mod, then mask_mod) and then its full key blocks (score_mod only); empty blocks are",
        "# never visited. Softmax is online, in fp32, in base 2 (exp2). Lengths that are multiples of",
        "# the tiles (Q_LEN_DIVISIBLE, KV_LEN_DIVISIBLE) compile to a variant without bounds checks;",
        "# otherwise only the last key tile of a row is checked.",
    ]
    if widen:
        header.append("# Under Triton's CPU interpreter 16-bit tiles are widened to fp32 before tl.dot (its 16-bit")
        header.append("# dot is unreliable); products of 16-bit values are exact in fp32, so results agree.")
    lines = preamble(header, [r for r in (score, mask) if r is not None])
    if mask is not None:
        lines += [_NONFINITE_VALUES, ""]

    lines += _attend_tile(spec, score, mask, widen)
    lines += ["", ""]
    lines += _attend_blocks(spec, score, mask, tiles_per_block)
    lines += ["", ""]
    lines += _kernel(spec, score, mask, widen, acc_dtype)
    source = "\n".join(lines).rstrip() + "\n"
    return GeneratedForward(source, KERNEL_NAME, score_params, mask_params,
                            needs_positive_scale=score is None and not spec.prescale_qk)


def _buffer_args(score: RenderedMod | None, mask: RenderedMod | None) -> list[str]:
    names = []
    for r in (score, mask):
        if r is not None:
            names += [p.name for p in r.params]
    return names


# a program's key and value heads (every kernel); stride_kb/vb are 0 when key/value broadcast over batch
KV_BASES = ["    key_base = key_ptr + b * stride_kb + h_kv * stride_kh  # stride_kb is 0 when key/value broadcast over batch",
            "    value_base = value_ptr + b * stride_vb + h_kv * stride_vh"]


def _softmax_state(acc_dtype: str) -> list[str]:
    """The online softmax's starting state: row max -inf, row sum 0, output accumulator 0."""
    return [f"    m_i = tl.full((BLOCK_M,), float(\"-inf\"), {acc_dtype})",
            f"    l_i = tl.full((BLOCK_M,), 0.0, {acc_dtype})",
            f"    acc = tl.full((BLOCK_M, V_HEAD_DIM_PAD), 0.0, {acc_dtype})"]


def _widens(spec) -> bool:
    """Whether 16-bit tiles are widened to fp32 before tl.dot (Triton's interpreter: its 16-bit dot
    is unreliable)."""
    return spec.target == "interpreter" and spec.dtype in (torch.float16, torch.bfloat16)


def _padded(spec) -> tuple[bool, bool]:
    """Whether the head dim and the value head dim are padded (their tiles need bounds checks)."""
    return spec.head_dim != padded_head_dim(spec.head_dim), spec.v_head_dim != padded_head_dim(spec.v_head_dim)


def _dot(a: str, b: str, spec: ForwardSpec, acc: str = "") -> str:
    args = f"{a}, {b}" + (f", {acc}" if acc else "")
    if spec.dtype == torch.float64:
        return f"tl.dot({args}, input_precision=\"ieee\", out_dtype=tl.float64)"
    if spec.dtype == torch.float32:
        return f"tl.dot({args}, input_precision=\"{spec.fp32_precision}\")"
    return f"tl.dot({args})"


def _row_max(spec: ForwardSpec, x: str) -> str:
    # Triton's interpreter, switched on after import, cannot call tl.max (a @jit function built at
    # import); tl.reduce with the same combine function runs there, and as fast (numpy).
    if spec.target == "interpreter":
        return f"tl.reduce({x}, 1, tl.standard._elementwise_max)"
    return f"tl.max({x}, 1)"


def _row_sum(spec, x: str, axis: int = 1) -> str:
    """The sum of ``x`` along ``axis`` (rows by default); tl.reduce under the interpreter (see _row_max)."""
    if spec.target == "interpreter":
        return f"tl.reduce({x}, {axis}, tl.standard._sum_combine)"
    return f"tl.sum({x}, {axis})"


# Masked keys must add exactly 0 to the output even where their value rows hold NaN or inf, but
# tl.dot gives 0 * NaN = NaN. The launcher compiles this guard in (GUARD_NONFINITE_VALUES) only for
# calls whose values hold NaN or inf: its never-taken branch alone, with three more dots per partial
# tile, made the sm_90 compile spill ~11 KB and run ~20x the instructions per partial tile.
# Partial blocks then check each value tile; one with a non-finite entry
# (rare: padding) is multiplied without those entries, and this helper adds what the keys each
# row allows make of them. p >= 0, so counts of NaN, +inf and -inf per output element decide it.
_NONFINITE_VALUES = '''\
@triton.jit
def nonfinite_values(p, v):
    # per output element: NaN, +inf or -inf where an allowed key (p > 0) brings such a value, else 0
    live = (p > 0).to(tl.float32)
    n_nan = tl.dot(live, (v != v).to(tl.float32), input_precision="ieee")
    n_pinf = tl.dot(live, (v == float("inf")).to(tl.float32), input_precision="ieee")
    n_ninf = tl.dot(live, (v == float("-inf")).to(tl.float32), input_precision="ieee")
    inf = tl.where(n_pinf > 0, float("inf"), tl.where(n_ninf > 0, float("-inf"), 0.0))
    return tl.where((n_nan > 0) | ((n_pinf > 0) & (n_ninf > 0)), float("nan"), inf)
'''


def _value_guard_lines(spec: ForwardSpec, indent: str) -> list[str]:
    """Partial blocks: keep non-finite values of masked keys out of ``p @ v`` (see _NONFINITE_VALUES)."""
    if spec.target == "interpreter":
        any_bad = "tl.reduce(v_bad.to(tl.int32), None, tl.standard._elementwise_max) > 0"
    else:
        any_bad = "tl.max(v_bad.to(tl.int32)) > 0"
    return [
        f"{indent}# masked keys add exactly 0 even if their values hold NaN or inf (0 * NaN is NaN): a tile",
        f"{indent}# with such values (rare: padding) is multiplied without them; allowed keys' are added back",
        f"{indent}v_bad = (v != v) | (tl.abs(v) == float(\"inf\"))",
        f"{indent}if {any_bad}:",
        f"{indent}    acc = acc + nonfinite_values(p, v)",
        f"{indent}    v = tl.where(v_bad, 0.0, v)",
    ]


def _score_lines(spec: ForwardSpec, score: RenderedMod | None, indent: str) -> list[str]:
    """Apply the score_mod to ``qk`` (the scaled scores of one tile)."""
    if spec.score_mod is None or score is None:
        return []
    out = [f"{indent}# score_mod: {score.expression}"]
    if score.is_constant:
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), {python_literal(float(score.literal))}, qk.dtype)")
        return out
    args = ", ".join(["qk", "b", "h", "q_idx", "kv_idx"] + [p.name for p in score.params])
    call = f"score_mod({args})"
    full_tile = "score" in score.reads or {"q_idx", "kv_idx"} <= score.reads
    if full_tile:
        out.append(f"{indent}qk = {call}.to(qk.dtype)")
    else:  # the mod ignores the score and varies along at most one axis: broadcast it to the tile
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), 0.0, qk.dtype) + {call}")
    return out


def _mask_lines(spec: ForwardSpec, mask: RenderedMod | None, indent: str) -> list[str]:
    if spec.mask_mod is None or mask is None:
        return []
    out = [f"{indent}# mask_mod: {mask.expression}"]
    if mask.is_constant:  # always False here (always True was dropped)
        out.append(f"{indent}qk = tl.full((BLOCK_M, BLOCK_N), float(\"-inf\"), qk.dtype)")
        return out
    args = ", ".join(["b", "h", "q_idx", "kv_idx"] + [p.name for p in mask.params])
    out.append(f"{indent}qk = tl.where(mask_mod({args}), qk, float(\"-inf\"))")
    return out


def _attend_tile(spec: ForwardSpec, score, mask, widen: bool) -> list[str]:
    """The device function for one key tile: scores, mods, and the online-softmax update."""
    params = [
        "acc, l_i, m_i, q, b, h, q_idx, start_n,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd, scale, KV_LEN,",
        *names_line(_buffer_args(score, mask)),
        *constexprs(("IS_FULL_BLOCKS", "CHECK_KV", "ROWS_GUARANTEED_SAFE"), ("GUARD_NONFINITE_VALUES",),
                    ("BLOCK_M", "BLOCK_N", *HEAD_DIMS[:2]), HEAD_DIMS[2:]),
    ]
    d_pad, dv_pad = _padded(spec)
    k_ptrs = "key_ptr + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd"
    v_ptrs = "value_ptr + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd"
    widen_k = ".to(tl.float32)" if widen else ""
    k_pad = pad_check("offs_d[:, None]", "HEAD_DIM", d_pad)
    v_pad = pad_check("offs_dv[None, :]", "V_HEAD_DIM", dv_pad)
    k_checked = load(k_ptrs, "kv_in_range[None, :]", k_pad, widen=widen_k)
    v_checked = load(v_ptrs, "kv_in_range[:, None]", v_pad, widen=widen_k)
    k_plain, v_plain = load(k_ptrs, k_pad, widen=widen_k), load(v_ptrs, v_pad, widen=widen_k)
    value_dtype = _TL[spec.dtype]
    p_operand = f"p.to({value_dtype}).to(tl.float32)" if widen else f"p.to({value_dtype})"
    prescaled = spec.prescale_qk
    if prescaled:
        scores = [f"        qk = {_dot('q', 'k', spec)}  # q was scaled by scale * log2(e): already base 2"]
    elif score is not None:
        scores = [f"        qk = {_dot('q', 'k', spec)} * scale  # the score_mod sees the scaled score"]
    elif spec.dtype == torch.float64:  # nothing to gain from the fold; keep fp64 scores exact
        scores = [f"        qk = {_dot('q', 'k', spec)} * (scale * {LOG2E})  # scaled and in base 2 at once"]
    else:
        scores = [f"        qk_scale = scale * {LOG2E}  # scale and the change to base 2 (the launcher makes it > 0)",
                  f"        qk = {_dot('q', 'k', spec)}  # qk_scale is applied in the exp2 below"]
    # The factor that takes a score to base 2: folded into one FMA with the max subtraction.
    to_base2 = (None if prescaled or (score is None and spec.dtype == torch.float64)
                else LOG2E if score is not None else "qk_scale")
    row_max = _row_max(spec, "qk")
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
        f"        k = {k_checked}",
        "        kv_idx = tl.minimum(offs_n, KV_LEN - 1)[None, :]  # clamped: captured-tensor lookups stay in bounds",
        "    else:",
        f"        k = {k_plain}",
        "        kv_idx = offs_n[None, :]",
    ]
    body += [line[4:] for line in scores]
    body += [line for line in _score_lines(spec, score, "    ")]
    masked = _mask_lines(spec, mask, "        ")
    if masked:
        body += ["    if not IS_FULL_BLOCKS:  # full blocks are known to be all allowed", *masked]
    body += [
        "    if CHECK_KV:",
        "        qk = tl.where(kv_in_range[None, :], qk, float(\"-inf\"))  # keys past KV_LEN",
    ]
    if to_base2 is None:
        body.append(f"    m_new = tl.maximum(m_i, {row_max})")
    else:
        body.append(f"    m_new = tl.maximum(m_i, {row_max} * {to_base2})  # running max, base 2")
    body += [
        "    if ROWS_GUARANTEED_SAFE:  # the caller promised every row allows some key",
        "        m_safe = m_new",
        "    else:",
        "        # a row with nothing allowed yet keeps m == -inf; use 0 there so exp2 never sees -inf - -inf",
        "        m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)",
        "    alpha = tl.exp2(m_i - m_safe)",
    ]
    if to_base2 is None:
        body.append("    p = tl.exp2(qk - m_safe[:, None])")
    else:
        if spec.target == "interpreter":  # its tl.fma rounds worse than a multiply and a subtraction
            body.append(f"    p = tl.exp2(qk * {to_base2} - m_safe[:, None])  # to base 2 and minus the max")
        else:
            body.append(f"    p = tl.exp2(tl.fma(qk, {to_base2}, -m_safe[:, None]))  # to base 2 and minus the max: one FMA")
    body += [
        f"    l_i = l_i * alpha + {_row_sum(spec, 'p')}",
        "    if CHECK_KV:",
        f"        v = {v_checked}",
        "    else:",
        f"        v = {v_plain}",
        "    acc = acc * alpha[:, None]",
        *(["    if not IS_FULL_BLOCKS:", "        if GUARD_NONFINITE_VALUES:", *_value_guard_lines(spec, "            ")]
          if masked else []),
        f"    acc = {_dot(p_operand, 'v', spec, 'acc')}",
        "    return acc, l_i, m_new",
    ]
    return body


def _attend_blocks(spec: ForwardSpec, score, mask, tiles_per_block: int) -> list[str]:
    buffers = names_line(_buffer_args(score, mask))
    params = [
        "acc, l_i, m_i, q, b, h, q_idx,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd,",
        "block_count_ptr, block_index_ptr, scale, KV_LEN,",
        *buffers,
        *constexprs(("IS_FULL_BLOCKS", "KV_LEN_DIVISIBLE"),
                    ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "GUARD_NONFINITE_VALUES"),
                    ("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"), HEAD_DIMS),
    ]

    def tile(check: str, indent: str) -> list[str]:
        return call("acc, l_i, m_i", "attend_tile", [
            "acc, l_i, m_i, q, b, h, q_idx, start_n,",
            "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd, scale, KV_LEN,",
            *buffers,
            *keywords(("IS_FULL_BLOCKS", f"CHECK_KV={check}"), ("ROWS_GUARANTEED_SAFE", "GUARD_NONFINITE_VALUES"),
                      ("BLOCK_M", "BLOCK_N"), HEAD_DIMS),
        ], indent)

    count = "tl.load(block_count_ptr)" + (f" * {tiles_per_block}" if tiles_per_block > 1 else "")
    in_block = f" + (i % {tiles_per_block}) * BLOCK_N" if tiles_per_block > 1 else ""
    block_of = f"i // {tiles_per_block}" if tiles_per_block > 1 else "i"
    body = [
        *jit_def("attend_blocks", params),
        "    # Online softmax over the key tiles of the listed blocks: running row max m_i and row sum",
        "    # l_i (base 2) and the unnormalised output acc.",
        "    first_block = tl.load(block_index_ptr)  # read even when the list is empty: the table has a column",
    ]
    if tiles_per_block > 1:
        body.append(f"    # each BlockMask key block spans {tiles_per_block} tiles of BLOCK_N keys")
    body += [
        f"    for i in range({count}):",
        "        if BLOCKS_ARE_CONTIGUOUS:  # the caller promised the listed blocks follow one another",
        "            start_n = first_block * KV_BLOCK_SIZE + i * BLOCK_N",
        "        else:",
        f"            start_n = tl.load(block_index_ptr + {block_of}) * KV_BLOCK_SIZE{in_block}",
        "        start_n = tl.multiple_of(start_n, BLOCK_N)",
        "        if KV_LEN_DIVISIBLE:  # every tile is whole: no bounds work at all",
        *tile("False", "            "),
        "        elif start_n + BLOCK_N <= KV_LEN:",
        *tile("False", "            "),
        "        else:  # the tile holding the end of the keys",
        *tile("True", "            "),
        "    return acc, l_i, m_i",
    ]
    return body


def _kernel(spec: ForwardSpec, score, mask, widen: bool, acc_dtype: str) -> list[str]:
    buffers = _buffer_args(score, mask)
    params = [
        "query_ptr, key_ptr, value_ptr, out_ptr," + (" lse_ptr," if spec.output_lse else ""),
        "partial_block_counts_ptr, partial_block_indices_ptr,"
        + (" full_block_counts_ptr, full_block_indices_ptr," if spec.has_full_blocks else ""),
        *names_line(buffers),
    ]
    strides = ["stride_qb", "stride_qh", "stride_qm", "stride_qd", "stride_kb", "stride_kh", "stride_kn", "stride_kd",
               "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_ob", "stride_oh", "stride_om", "stride_od"]
    params += [
        "scale, Q_LEN, KV_LEN, GQA_GROUP,",
        *(", ".join(strides[i:i + 4]) + "," for i in range(0, 16, 4)),
    ]
    if spec.output_lse:
        params.append("stride_lb, stride_lh,")
        strides += ["stride_lb", "stride_lh"]
    params += [
        "MASK_BATCH, MASK_HEADS, MASK_Q_BLOCKS, MASK_KV_BLOCKS,",
        *constexprs(("BLOCK_M", "BLOCK_N", "Q_BLOCK_SIZE", "KV_BLOCK_SIZE"), HEAD_DIMS,
                    ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "GUARD_NONFINITE_VALUES"),
                    ("Q_LEN_DIVISIBLE", "KV_LEN_DIVISIBLE", "INT64_OFFSETS")),
    ]
    buffer_strides = [b for b in buffers if "_stride_" in b]
    # Lengths and captured-tensor sizes/strides change with the input; Triton must not specialise
    # on them, or every new length would compile again.
    unspecialised = ["Q_LEN", "KV_LEN"] + [b for b in buffers if not b.endswith("_ptr")]
    d_pad, dv_pad = _padded(spec)
    q_ptrs = "query_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd"
    o_ptrs = "out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od"
    q_pad = pad_check("offs_d[None, :]", "HEAD_DIM", d_pad)
    o_pad = pad_check("offs_dv[None, :]", "V_HEAD_DIM", dv_pad)
    widen_q = ".to(tl.float32)" if widen else ""
    out_value = "out.to(out_ptr.dtype.element_ty)"

    def blocks(kind: str, full: bool) -> list[str]:
        return call("acc, l_i, m_i", "attend_blocks", [
            "acc, l_i, m_i, q, b, h, q_idx,",
            "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,",
            f"{kind}_block_counts_ptr + mask_row, {kind}_block_indices_ptr + mask_row * MASK_KV_BLOCKS, scale, KV_LEN,",
            *names_line(buffers),
            *keywords((f"IS_FULL_BLOCKS={full}", "KV_LEN_DIVISIBLE"), ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"),
                      ("GUARD_NONFINITE_VALUES",), ("BLOCK_M", "BLOCK_N", "KV_BLOCK_SIZE"), HEAD_DIMS),
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
        "    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        "    if Q_LEN_DIVISIBLE:  # every query tile is whole",
        f"        q = {load(q_ptrs, q_pad, widen=widen_q)}",
        "        q_idx = offs_m[:, None]",
        "    else:",
        "        q_in_range = offs_m < Q_LEN",
        f"        q = {load(q_ptrs, 'q_in_range[:, None]', q_pad, widen=widen_q)}",
        "        q_idx = tl.minimum(offs_m, Q_LEN - 1)[:, None]  # clamped: captured-tensor lookups stay in bounds",
    ]
    if spec.prescale_qk:
        body += ["    # PRESCALE_QK: scale and log2(e) applied to q once (torch's option: the score_mod sees",
                 "    # scores in base 2), not to every tile of scores",
                 f"    q = (q * (scale * {LOG2E})).to({_TL[spec.dtype]}){'.to(tl.float32)' if widen else ''}"]
    body += [
        "    # this tile's row of the BlockMask tables; their batch and heads broadcast by modulo",
        "    mask_row = ((b % MASK_BATCH) * MASK_HEADS + h % MASK_HEADS) * MASK_Q_BLOCKS + (q_tile * BLOCK_M) // Q_BLOCK_SIZE",
        *KV_BASES,
        *_softmax_state(acc_dtype),
        "    # 1. partial blocks: score_mod and mask_mod",
        *blocks("partial", False),
    ]
    if spec.has_full_blocks:
        body += ["    # 2. full blocks: score_mod only", *blocks("full", True)]
    body += [
        "    # a row that saw no allowed key has l_i == 0 and m_i == -inf: its output is 0 and its lse -inf",
        "    l_safe = tl.where(l_i == 0.0, 1.0, l_i)",
        "    out = acc / l_safe[:, None]",
        "    if Q_LEN_DIVISIBLE:",
        f"        {store(o_ptrs, out_value, o_pad)}",
        "    else:",
        f"        {store(o_ptrs, out_value, 'q_in_range[:, None]', o_pad)}",
    ]
    if spec.output_lse:
        lse_ptrs = "lse_ptr + b * stride_lb + h * stride_lh + offs_m"
        body += [
            f"    lse = ((m_i + tl.log2(l_safe)) * {LN2}).to(lse_ptr.dtype.element_ty)  # natural log",
            "    if Q_LEN_DIVISIBLE:",
            f"        tl.store({lse_ptrs}, lse)",
            "    else:",
            f"        tl.store({lse_ptrs}, lse, mask=q_in_range)",
        ]
    return body


__all__ = ["ForwardSpec", "GeneratedForward", "KERNEL_NAME", "NO_BLOCK_MASK", "generate_forward",
           "next_power_of_2", "padded_head_dim"]
