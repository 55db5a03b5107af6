"""Generate the backward's prologue: what every program of the backward kernel reads per query row.

Both kinds of backward program (:mod:`flexc.codegen.backward`) need, for each query row,

    delta = rowsum(out · dO) − dlse       (in fp32, fp64 for fp64 inputs)
    lse2  = row_max + log2(row_sum)       (the logsumexp in base 2; +inf where nothing is allowed)

from the forward's statistics (:mod:`flexc.codegen.forward`: each row's base-2 max, +inf where
the row allows nothing, and its sum of exp2(score - max)), rounded once: the natural-log logsumexp
the user sees, converted, would be rounded twice (a few ulps of |lse| per row, a bias in every dS).

The dK/dV programs read them for every query tile they visit, so no program can compute them for
the others within the backward's own launch: this kernel computes them just before it, one launch
over the query rows, reading ``out`` and ``dO`` in their dtype and summing in the work dtype (a
rounded delta would hurt the gradients that cancel). ``+inf`` makes ``p = exp2(qk − lse2)`` exactly 0
on a row that allows nothing (its scores are all ``-inf``, and ``-inf − -inf`` would be NaN). The dQ
programs read the statistics themselves (see :mod:`flexc.codegen.backward`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .parts import row_sum
from .spec import GeneratedSource, RowsSpec, generates

KERNEL_NAME = "flex_attention_backward_prologue"


@dataclass(frozen=True, kw_only=True)
class PrologueSpec(RowsSpec):
    """What one prologue kernel is specialised for; ``work_dtype`` is delta's and the base-2
    logsumexp's dtype. HAS_GRAD_LSE is a launch constexpr: one source either way."""

    KIND = ("backward prologue",)


class GeneratedPrologue(GeneratedSource):
    """A generated prologue kernel."""


_SOURCE = '''\
# flexc: the backward's prologue, delta and the base-2 logsumexp per query row (flexc.codegen.prologue)
# work dtype {work}; BLOCK_ROWS={block_rows}, V_HEAD_DIM_PAD={v_pad}; target: {target}
# HAS_GRAD_LSE: the logsumexp received a gradient (dlse); without one delta is the row sum alone
import triton
import triton.language as tl


@triton.jit
def {name}(
    out_ptr, grad_out_ptr, row_max_ptr, row_sum_ptr, grad_lse_ptr, delta_ptr, lse2_ptr,
    Q_LEN, V_HEAD_DIM,
    stride_ob, stride_oh, stride_om, stride_od,  # out [B, Hq, L, Ev]
    stride_dob, stride_doh, stride_dom, stride_dod,  # dO [B, Hq, L, Ev]
    stride_lb, stride_lh, stride_lm,  # the forward's row_max and row_sum [B, Hq, L]
    stride_gb, stride_gh, stride_gm,  # dlse [B, Hq, L] (unused without HAS_GRAD_LSE)
    stride_xb, stride_xh,  # delta and lse2 [B, Hq, L] (L contiguous)
    BLOCK_ROWS: tl.constexpr, V_HEAD_DIM_PAD: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    h = tl.program_id(1)
    b = tl.program_id(2)
    d = tl.arange(0, V_HEAD_DIM_PAD)
    row_in_range = m < Q_LEN
    tile = row_in_range[:, None] & (d[None, :] < V_HEAD_DIM)
    o = tl.load(out_ptr + b * stride_ob + h * stride_oh + m[:, None] * stride_om + d[None, :] * stride_od,
                mask=tile, other=0.0)
    do = tl.load(grad_out_ptr + b * stride_dob + h * stride_doh + m[:, None] * stride_dom + d[None, :] * stride_dod,
                 mask=tile, other=0.0)
    # summed in the work dtype, from out and dO as the forward wrote and autograd passed them
    delta = {row_sum}
    if HAS_GRAD_LSE:
        delta -= tl.load(grad_lse_ptr + b * stride_gb + h * stride_gh + m * stride_gm, mask=row_in_range,
                         other=0.0).to({acc})
    stats = b * stride_lb + h * stride_lh + m * stride_lm
    row_max = tl.load(row_max_ptr + stats, mask=row_in_range, other=0.0).to({acc})
    row_sum = tl.load(row_sum_ptr + stats, mask=row_in_range, other=1.0).to({acc})
    # base 2, rounded once; +inf (the max) on rows that allow nothing: their exp2(qk - lse2) are exactly 0
    lse2 = row_max + tl.log2(row_sum)
    tl.store(delta_ptr + b * stride_xb + h * stride_xh + m, delta, mask=row_in_range)
    tl.store(lse2_ptr + b * stride_xb + h * stride_xh + m, lse2, mask=row_in_range)
'''


@generates(PrologueSpec)
def generate_prologue(spec: PrologueSpec) -> GeneratedPrologue:
    """The Triton source of the prologue kernel described by ``spec``."""
    acc = f"tl.{spec.work_dtype}"
    source = _SOURCE.format(name=KERNEL_NAME, work=spec.work_dtype, block_rows=spec.block_rows,
                            v_pad=spec.v_head_dim_pad, target=spec.target, acc=acc,
                            row_sum=row_sum(spec, f"o.to({acc}) * do.to({acc})"))
    return GeneratedPrologue(source, KERNEL_NAME)


__all__ = ["GeneratedPrologue", "KERNEL_NAME", "PrologueSpec", "generate_prologue"]
