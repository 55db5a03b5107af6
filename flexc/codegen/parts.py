"""Shared parts of the generated attention kernels: dots, row reductions, masked tile loads, the
online softmax (state and per-tile update, as torch's templates share one ``forward_inner``), the
guard that keeps non-finite values of masked keys out of ``p @ v``, attention dropout's device helpers
and lines (only in the kernels of calls with ``dropout_p > 0``), and the source's assembly.

The forward and decode generators share the online softmax; the backward uses the tile parts.
"""
from __future__ import annotations

import torch

from ..constants import LOG2E
from .emit import load, pad_check, preamble
from .printer import RenderedMod
from .spec import AttentionSpec

# the forward and decode kernels' key tile (head dim down, keys across) and value tile (keys down)
KEY_TILE = "key_ptr + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd"
VALUE_TILE = "value_ptr + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd"
# a program's key and value heads (every kernel); stride_kb/vb are 0 when key/value broadcast over batch
KV_BASES = ["    key_base = key_ptr + b * stride_kb + h_kv * stride_kh  # stride_kb is 0 when key/value broadcast over batch",
            "    value_base = value_ptr + b * stride_vb + h_kv * stride_vh"]


def dot(a: str, b: str, spec: AttentionSpec, acc: str = "") -> str:
    """``tl.dot`` of two tiles (plus ``acc``) at the precision the spec's dtype asks for."""
    args = f"{a}, {b}" + (f", {acc}" if acc else "")
    if spec.dtype == torch.float64:
        return f"tl.dot({args}, input_precision=\"ieee\", out_dtype=tl.float64)"
    if spec.dtype == torch.float32:
        return f"tl.dot({args}, input_precision=\"{spec.fp32_precision}\")"
    return f"tl.dot({args})"


def row_max(spec: AttentionSpec, x: str) -> str:
    # Triton's interpreter, switched on after import, cannot call tl.max (a @jit function built at
    # import); tl.reduce with the same combine function runs there, and as fast (numpy).
    if spec.target == "interpreter":
        return f"tl.reduce({x}, 1, tl.standard._elementwise_max)"
    return f"tl.max({x}, 1)"


def row_sum(spec: AttentionSpec, x: str, axis: int = 1) -> str:
    """The sum of ``x`` along ``axis`` (rows by default); tl.reduce under the interpreter (see row_max)."""
    if spec.target == "interpreter":
        return f"tl.reduce({x}, {axis}, tl.standard._sum_combine)"
    return f"tl.sum({x}, {axis})"


def widen_suffix(spec: AttentionSpec) -> str:
    """What follows a loaded tile: a widening to fp32 where the spec widens (see AttentionSpec.widens)."""
    return ".to(tl.float32)" if spec.widens else ""


def operand(spec: AttentionSpec, x: str) -> str:
    """A probability/gradient tile as a tl.dot operand: in the input dtype, as torch's templates do."""
    return f"{x}.to({spec.tl_dtype}){widen_suffix(spec)}"


def head_check(spec: AttentionSpec, axis: str, value: bool = False) -> str | None:
    """The bounds check of the head dim (the value head dim if ``value``) along ``axis`` (``"[:, None]"``
    or ``"[None, :]"``); None where the dim is not padded."""
    if value:
        return pad_check(f"offs_dv{axis}", "V_HEAD_DIM", spec.padded[1])
    return pad_check(f"offs_d{axis}", "HEAD_DIM", spec.padded[0])


def tile_load(spec: AttentionSpec, ptrs: str, in_range: str | None, axis: str, value: bool = False) -> str:
    """A tile of queries, keys or values (``value``): masked by ``in_range`` (None: whole) and the padded
    head dim along ``axis``, widened where the spec widens."""
    return load(ptrs, in_range, head_check(spec, axis, value), widen=widen_suffix(spec))


def _tile_start(index_ptr: str, i: str, end: str, tiles: int, block: str, tile: str, clamp: bool = False) -> str:
    """The first key (or query) of tile ``i`` of the listed blocks, ``tiles`` tiles of ``tile`` per block of
    ``block``; its index is read under ``i < end`` (past the last tile: 0, never read), or with ``clamp``
    at tile ``min(i, end - 1)`` (past the last tile: the last block's index, read again, in bounds and
    unused), one instruction where the mask costs a compare and the move of its ``other`` value."""
    if clamp:
        at = f"tl.minimum({i}, {end} - 1)"
        if tiles == 1:
            return f"tl.load({index_ptr} + {at}) * {block}"
        return f"tl.load({index_ptr} + {at} // {tiles}) * {block} + ({i} % {tiles}) * {tile}"
    if tiles == 1:
        return f"tl.load({index_ptr} + {i}, mask={i} < {end}, other=0) * {block}"
    return f"tl.load({index_ptr} + {i} // {tiles}, mask={i} < {end}, other=0) * {block} + ({i} % {tiles}) * {tile}"


def tile_walk(index_ptr: str, tiles: int, block: str, tile: str, start: str, *, count_ptr: str = "",
              span: tuple[str, str] = ("", ""), contiguous: bool = False,
              clamp: bool = False) -> tuple[list[str], list[str]]:
    """The loop over the tiles of a row (or column) of the BlockMask's listed blocks, ``tiles`` tiles of
    ``tile`` per block of ``block``: the lines that open it (indented one level) and the lines that end
    each iteration (two levels). It walks every listed block (their count at ``count_ptr``) or the
    listed blocks ``[first, last)`` of ``span``.

    The loop carries ``start``, the first key (query) of its tile, and each iteration reads the next
    tile's block index, as torch's template does: then the loads of a tile depend on nothing read in
    their own iteration, and the software pipeliner can copy the next tiles ahead into a ring of
    ``num_stages`` slots. Read in the iteration that uses it, the index delays its tile's copy by a
    stage: the ring loses a slot. ``contiguous`` compiles in torch's BLOCKS_ARE_CONTIGUOUS (the next
    tile follows this one: no index is read). ``clamp``: the next index is read at a clamped tile, not
    under a mask (:func:`_tile_start`); in the forward's loops the clamp took 0-13 instructions per
    tile (ALiBi D=128 partial 577 -> 575); in decode's it took 34-35 from the worst loops (sliding
    window D=128 partial 507 -> 473, 1.00 -> 0.94 of torch at flexc's tile) and added 1-5 to others,
    all below 0.96; in the backward's it added 3 to ALiBi D=128's dK/dV loops: the backward keeps the mask.
    """
    per_block = f" * {tiles}" if tiles > 1 else ""
    if count_ptr:
        head = [f"    n_tiles = tl.load({count_ptr}){per_block}"]
        loop, end = "range(n_tiles)", "n_tiles"
        first = f"tl.load({index_ptr}, mask=n_tiles > 0, other=0) * {block}"
    else:
        head = []
        loop, end = f"range({span[0]}{per_block}, {span[1]}{per_block})", f"{span[1]}{per_block}"
        first = f"tl.load({index_ptr} + {span[0]}, mask={span[0]} < {span[1]}, other=0) * {block}"
    if tiles > 1:
        head.append(f"    # each listed block spans {tiles} tiles of {tile}")
    head += [
        "    # the loop carries its tile's start and reads the next one's block index a tile ahead, so the",
        "    # pipeliner can copy the next tiles while this one computes",
        f"    {start} = {first}  # the first tile's",
        f"    for i in {loop}:",
        f"        {start} = tl.multiple_of({start}, {tile})",
    ]
    past_last = ("past the last tile: the last block's index, read again and unused" if clamp
                 else "its index is not read past the last tile")
    next_start = [f"        # the next tile's start ({past_last})",
                  "        after = i + 1",
                  f"        {start} = {_tile_start(index_ptr, 'after', end, tiles, block, tile, clamp)}"]
    if not contiguous:
        return head, next_start
    return head, ["        if BLOCKS_ARE_CONTIGUOUS:  # the caller promised the listed blocks follow one another",
                  f"            {start} = {start} + {tile}",
                  "        else:",
                  *("    " + line for line in next_start)]


def softmax_state(spec: AttentionSpec) -> list[str]:
    """The online softmax's starting state: row max -inf, row sum 0, output accumulator 0; for a
    spec with ``sinks`` (a ``sinks`` field, true) the row's sink logit instead, as a key already seen
    with no value row (:func:`sink_params`)."""
    acc_dtype = spec.acc_dtype
    acc = [f"    acc = tl.full((BLOCK_M, V_HEAD_DIM_PAD), 0.0, {acc_dtype})"]
    if getattr(spec, "sinks", False):
        return [
            "    # the learned attention sink (flexc's sinks=): the softmax starts from it as from a key already",
            "    # seen, so m_i is its logit (base 2) and l_i its exp2(sink - m_i) = 1; it has no value row, so",
            "    # acc stays 0. A -inf sink is no sink: m_i -inf, l_i 0. The output's normalisation and the",
            "    # logsumexp then include the sink, and a row with nothing allowed gets output 0, lse the sink",
            f"    sink = tl.load(sinks_ptr + b * stride_sink_b + h * stride_sink_h).to({acc_dtype})",
            f"    m_i = tl.full((BLOCK_M,), 0.0, {acc_dtype}) + sink * {LOG2E}",
            f"    l_i = tl.where(m_i == float(\"-inf\"), 0.0, 1.0).to({acc_dtype})",
            *acc]
    return [f"    m_i = tl.full((BLOCK_M,), float(\"-inf\"), {acc_dtype})",
            f"    l_i = tl.full((BLOCK_M,), 0.0, {acc_dtype})",
            *acc]


# the kernel parameters of the sinks (a [B or 1, Hq] tensor in the accumulator's dtype; its batch
# stride is 0 when the sinks broadcast over the batch), after the dropout ones
SINK_PARAMS = "sinks_ptr, stride_sink_b, stride_sink_h,"


def sink_params(spec) -> list[str]:
    """The kernel's parameter line of the sinks, for a spec with ``sinks``; else none."""
    return [SINK_PARAMS] if getattr(spec, "sinks", False) else []


def online_softmax(spec: AttentionSpec, indent: str, v_load: list[str], *, to_base2: str | float | None = None,
                   rows_option: bool = False, guard: bool = False, guard_note: str = "",
                   fold_rescale: bool = False, dropout: bool = False) -> list[str]:
    """The online-softmax update for one tile of scores ``qk`` (torch's ``forward_inner``): the running
    row max ``m_new`` (base 2), ``alpha`` that rescales the row sum ``l_i`` and the output ``acc``,
    and ``p @ v`` added to ``acc``.

    ``to_base2`` is the factor that still takes ``qk`` to base 2 (None: it is there already); it joins
    the max and, in one FMA, the subtraction inside ``exp2``. ``rows_option`` compiles in torch's
    ROWS_GUARANTEED_SAFE switch. ``v_load`` are the lines (indented) that load ``v``. ``guard`` adds the
    non-finite value guard of partial blocks (``guard_note`` comments it); ``fold_rescale`` rescales
    ``acc`` inside the dot where no guard comes between. ``dropout`` drops pairs from ``p @ v`` only
    (the kernel's ``dropout_head`` and dropout arguments in scope, :func:`dropout_keep`).
    """
    tile_max = row_max(spec, "qk")
    if to_base2 is None:
        lines = [f"m_new = tl.maximum(m_i, {tile_max})"]
    else:
        lines = [f"m_new = tl.maximum(m_i, {tile_max} * {to_base2})  # running max, base 2"]
    if rows_option:
        lines += ["if ROWS_GUARANTEED_SAFE:  # the caller promised every row allows some key",
                  "    m_safe = m_new",
                  "else:",
                  "    # a row with nothing allowed yet keeps m == -inf; use 0 there so exp2 never sees -inf - -inf",
                  "    m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)"]
    else:
        lines.append("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)  # nothing allowed yet: no -inf - -inf")
    lines.append("alpha = tl.exp2(m_i - m_safe)")
    if to_base2 is None:
        lines.append("p = tl.exp2(qk - m_safe[:, None])")
    elif spec.target == "interpreter":  # its tl.fma rounds worse than a multiply and a subtraction
        lines.append(f"p = tl.exp2(qk * {to_base2} - m_safe[:, None])  # to base 2 and minus the max")
    else:
        lines.append(f"p = tl.exp2(tl.fma(qk, {to_base2}, -m_safe[:, None]))  # to base 2 and minus the max: one FMA")
    lines.append(f"l_i = l_i * alpha + {row_sum(spec, 'p')}")
    if dropout:
        lines += ["# dropout: the row sum above keeps every pair (the logsumexp stays the undropped softmax's, as",
                  "# SDPA's); only p @ v sees the kept pairs, scaled by 1 / (1 - p)",
                  f"p = p * {dropout_keep()}"]
    out = [indent + line for line in lines] + v_load
    p = operand(spec, "p")
    if fold_rescale and not guard:
        return out + [f"{indent}acc = {dot(p, 'v', spec, 'acc * alpha[:, None]')}"]
    out.append(f"{indent}acc = acc * alpha[:, None]")
    if guard:  # the guard adds to the rescaled acc, so it comes between the rescale and the dot
        out += [f"{indent}if not IS_FULL_BLOCKS:", f"{indent}    if GUARD_NONFINITE_VALUES:{guard_note}",
                *value_guard_lines(spec, indent + "        ")]
    return out + [f"{indent}acc = {dot(p, 'v', spec, 'acc')}"]


# Masked keys must add exactly 0 to the output even where their value rows hold NaN or inf, but
# tl.dot gives 0 * NaN = NaN. The launcher compiles this guard in (GUARD_NONFINITE_VALUES) only for
# calls whose values hold NaN or inf: its never-taken branch alone, with three more dots per partial
# tile, made the sm_90 compile spill ~11 KB and run ~20x the instructions per partial tile.
# Partial blocks then check each value tile; one with a non-finite entry
# (rare: padding) is multiplied without those entries, and this helper adds what the keys each
# row allows make of them. p >= 0, so counts of NaN, +inf and -inf per output element decide it.
NONFINITE_VALUES = '''\
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


def value_guard_lines(spec: AttentionSpec, indent: str) -> list[str]:
    """Partial blocks: keep non-finite values of masked keys out of ``p @ v`` (see NONFINITE_VALUES)."""
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



# Attention dropout (flexc's dropout_p=). The keep mask is a pure function of the call's seed and the
# pair's indices, so the backward regenerates the forward's mask instead of storing it, and these
# helpers draw exactly the bits flexc.backends.dropout draws in torch for the TORCH backend: Philox
# 4x32-10 at counters (kv_idx, q_idx, b * Hq + h, 0), the pair kept when the first output is at least
# round(p * 2**32). Compiled into a kernel only when its spec has ``dropout``.
DROPOUT_HELPERS = '''\
@triton.jit
def philox(seed, c0, c1, c2, c3):
    # Philox 4x32-10 (Salmon et al. 2011, as Random123 and tl.philox): the first 32-bit output for the
    # uint32 counters c0..c3 keyed by the int64 seed. uint32 arithmetic: products wrap to their low
    # word, umulhi gives the high word, the key's increments wrap.
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def dropout_keep(dropout_ptr, dropout_scale, head, q_idx, kv_idx):
    # 1 / (1 - p) (dropout_scale) where the pair is kept, 0 where it is dropped. head is b * Hq + h;
    # dropout_ptr holds the call's int64 seed, then the threshold round(p * 2**32): a pair is kept when
    # its 32-bit draw is at least that (compared in int64: the threshold may exceed int32)
    seed = tl.load(dropout_ptr)
    threshold = tl.load(dropout_ptr + 1)
    head = head.to(tl.uint32)
    random = philox(seed, kv_idx.to(tl.uint32), q_idx.to(tl.uint32), head, head * 0)  # c3: a uint32 zero
    return tl.where(random.to(tl.int64) >= threshold, dropout_scale, 0.0)
'''

# a dropout kernel's parameters: the int64 pair (seed, threshold) and 1 / (1 - p)
DROPOUT_PARAMS = "dropout_ptr, {dropout_scale},"
# what every function on the way to a tile passes on: those and dropout_head (b * Hq + h)
DROPOUT_ARGS = "dropout_ptr, dropout_scale, dropout_head,"


def dropout_params(spec) -> list[str]:
    """The kernel's parameter line of the dropout values, for a spec with ``dropout``; else none."""
    return [DROPOUT_PARAMS.format(dropout_scale=float_param("dropout_scale", spec))] if spec.dropout else []


def float_param(name: str, spec) -> str:
    """A kernel parameter that takes a Python float: typed fp64 in a float64 kernel. (Triton types a
    float argument fp32 by default: on a GPU a float64 call's scale would lose its last 29 bits,
    1e-8 relative error where float64 inputs promise 1e-15; the interpreter keeps the float.)"""
    return f'{name}: "fp64"' if spec.dtype == torch.float64 else name


def dropout_args(spec) -> list[str]:
    """The parameter (or argument) line that passes the dropout values on, for a spec with ``dropout``; else none."""
    return [DROPOUT_ARGS] if spec.dropout else []


def dropout_head(spec, indent: str, heads: str = "tl.num_programs(1)") -> list[str]:
    """For a spec with ``dropout``, the line that sets ``dropout_head = b * Hq + h`` (the third Philox
    counter), ``heads`` being Hq (by default the grid's head axis); else none."""
    if not spec.dropout:
        return []
    return [f"{indent}dropout_head = b * {heads} + h  # the dropout draw's third counter: b * Hq + h"]


def dropout_keep(q_idx: str = "q_idx", kv_idx: str = "kv_idx") -> str:
    """The keep-and-scale tile of the pairs ``(q_idx, kv_idx)`` (broadcast index tiles)."""
    return f"dropout_keep(dropout_ptr, dropout_scale, dropout_head, {q_idx}, {kv_idx})"


def attention_source(header: list[str], score: RenderedMod | None, mask: RenderedMod | None,
                     *functions: list[str], dropout: bool = False) -> str:
    """A whole kernel source: the header and preamble (imports, the mods), the non-finite value helper
    where a mask_mod applies, the dropout helpers where ``dropout``, then the jitted functions two
    blank lines apart."""
    lines = preamble(header, [r for r in (score, mask) if r is not None])
    if mask is not None:
        lines += [NONFINITE_VALUES, ""]
    if dropout:
        lines += [DROPOUT_HELPERS, ""]
    for i, function in enumerate(functions):
        lines += ["", ""] if i else []
        lines += function
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["DROPOUT_ARGS", "DROPOUT_HELPERS", "DROPOUT_PARAMS", "KEY_TILE", "KV_BASES", "NONFINITE_VALUES", "VALUE_TILE",
           "attention_source", "dot", "dropout_args", "dropout_head", "dropout_keep", "dropout_params", "head_check",
           "online_softmax", "operand", "row_max", "row_sum", "SINK_PARAMS", "sink_params", "softmax_state", "tile_load",
           "tile_walk",
           "value_guard_lines", "widen_suffix"]
