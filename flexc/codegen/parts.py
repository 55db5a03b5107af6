"""Tile fragments of the generated attention kernels: dots, row reductions, masked tile loads, the
online softmax (state and per-tile update, as torch's templates share one ``forward_inner``) and the
guard that keeps non-finite values of masked keys out of ``p @ v``.

The forward and decode generators share the online softmax; the backward uses the rest.
"""
from __future__ import annotations

import torch

from .emit import load, pad_check
from .spec import AttentionSpec

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


def softmax_state(spec: AttentionSpec) -> list[str]:
    """The online softmax's starting state: row max -inf, row sum 0, output accumulator 0."""
    acc_dtype = spec.acc_dtype
    return [f"    m_i = tl.full((BLOCK_M,), float(\"-inf\"), {acc_dtype})",
            f"    l_i = tl.full((BLOCK_M,), 0.0, {acc_dtype})",
            f"    acc = tl.full((BLOCK_M, V_HEAD_DIM_PAD), 0.0, {acc_dtype})"]


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


__all__ = ["KV_BASES", "NONFINITE_VALUES", "dot", "head_check", "operand", "row_max", "row_sum", "softmax_state",
           "tile_load", "value_guard_lines", "widen_suffix"]
