"""Generate the kernel that merges the split-KV decode kernel's partial results.

The decode kernel (:mod:`flexc.codegen.decode`) writes, per split of the key range, a normalised
output and its logsumexp for each packed row. This kernel combines them in one launch (a decoding
step is then two launches with fixed grids and allocations, so it can be captured in a CUDA graph):

    m = max_s lse_s                       (taken as 0 where every split is -inf)
    w_s = exp(lse_s - m),  total = max(sum_s w_s, 1)
    out = sum_s w_s * out_s / total,  lse = m + log(total)

With learned attention sinks (flexc's ``sinks=``, :attr:`MergeSpec.sinks`) the merge starts from the
row's sink logit ``s`` as from one more split with output 0: ``m`` starts at ``s`` and ``total`` at
``exp(s - m)``, so the output's normalisation and the logsumexp include the sink (a row dead in every
split gets output 0 and logsumexp ``s``). Without sinks the kernel has no sink text at all.

A row that is dead in every split (all ``-inf``) gets output 0 and logsumexp ``-inf``; for a live
row the best split weighs 1, so the clamp of ``total`` changes nothing. A split whose logsumexp is
NaN (its row's scores hold a NaN) makes the row's output and logsumexp NaN, as the forward does:
both maxima propagate NaN (Triton's default drops it). Two passes over the splits
with elementwise operations only (no reductions across the split axis), so the same source runs
compiled and in Triton's interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import GeneratedSource, RowsSpec, generates

KERNEL_NAME = "flex_decode_merge"


@dataclass(frozen=True, kw_only=True)
class MergeSpec(RowsSpec):
    """What one merge kernel is specialised for; ``work_dtype`` is the partial results' dtype."""

    KIND = ("merge",)

    sinks: bool = False  # the kernel takes the call's sinks and folds them in (see the module doc)


class GeneratedMerge(GeneratedSource):
    """A generated merge kernel."""


_SOURCE = '''\
# flexc: merge of the split-KV decode kernel's partial results (flexc.codegen.merge)
# partials in {work}; BLOCK_ROWS={block_rows}, V_HEAD_DIM_PAD={v_pad}; target: {target}
import triton
import triton.language as tl


@triton.jit
def {name}(
    out_split, lse_split, out, lse,
    num_splits, rows, L, Hq_per_kv, V_HEAD_DIM,
    stride_sb, stride_sh, stride_ss, stride_sm,  # out_split [B, Hkv, splits, M, Ev] (Ev contiguous)
    stride_lb, stride_lh, stride_ls,  # lse_split [B, Hkv, splits, M] (M contiguous)
    stride_ob, stride_oh, stride_ol, stride_od,  # out [B, Hq, L, Ev]
    stride_xb, stride_xh,  # lse [B, Hq, L] (L contiguous)
{sink_params}    BLOCK_ROWS: tl.constexpr, V_HEAD_DIM_PAD: tl.constexpr,
    LSE_SPLIT_AT: tl.constexpr, LSE_AT: tl.constexpr,  # where lse_split and lse start past their pointers
):
    row0 = tl.program_id(0) * BLOCK_ROWS
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    r = row0 + tl.arange(0, BLOCK_ROWS)  # packed rows: query head hkv * G + r // L, query row r % L
    d = tl.arange(0, V_HEAD_DIM_PAD)
    live_row = r < rows
    lse_base = lse_split + LSE_SPLIT_AT + b * stride_lb + hkv * stride_lh + r
    out_base = out_split + b * stride_sb + hkv * stride_sh + r[:, None] * stride_sm + d[None, :]
    tile = live_row[:, None] & (d[None, :] < V_HEAD_DIM)
{sink_load}    # pass 1: the largest split logsumexp per row
{m_init}
    for s in range(0, num_splits):
        # (a NaN split, a row whose scores hold a NaN, keeps the row NaN, as in the forward)
        m = tl.maximum(m, tl.load(lse_base + s * stride_ls, mask=live_row, other=float("-inf")),
                       propagate_nan=tl.PropagateNan.ALL)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # pass 2: weights, their total and the weighted outputs
{total_init}
    acc = tl.full((BLOCK_ROWS, V_HEAD_DIM_PAD), 0.0, {acc})
    for s in range(0, num_splits):
        w = tl.exp(tl.load(lse_base + s * stride_ls, mask=live_row, other=float("-inf")) - m_safe)
        total += w
        acc += w[:, None] * tl.load(out_base + s * stride_ss, mask=tile, other=0.0)
    total = tl.maximum(total, 1.0, propagate_nan=tl.PropagateNan.ALL)
    head = hkv * Hq_per_kv + r // L
    q = r % L
    o = out + b * stride_ob + head[:, None] * stride_oh + q[:, None] * stride_ol + d[None, :] * stride_od
    tl.store(o, (acc / total[:, None]).to(out.dtype.element_ty), mask=tile)
    tl.store(lse + LSE_AT + b * stride_xb + head * stride_xh + q, m + tl.log(total), mask=live_row)
'''


# the sink lines of a merge with sinks (MergeSpec.sinks), and the lines they replace without them
_SINK_PARAMS = "    sinks, stride_nb, stride_nh,  # sinks [B or 1, Hq] (stride_nb 0 when they broadcast over B)\n"
_SINK_LOAD = """\
    # the row's learned attention sink: a split of its own with output 0 and logsumexp the sink's
    # logit, where the merge starts (a -inf sink, like a dead split, weighs nothing)
    sink = tl.load(sinks + b * stride_nb + (hkv * Hq_per_kv + r // L) * stride_nh, mask=live_row,
                   other=float("-inf")).to({acc})
"""
_PLAIN_STARTS = ('    m = tl.full((BLOCK_ROWS,), float("-inf"), {acc})', "    total = tl.full((BLOCK_ROWS,), 0.0, {acc})")
_SINK_STARTS = ("    m = sink", "    total = tl.exp(sink - m_safe)  # the sink's weight")


@generates(MergeSpec)
def generate_merge(spec: MergeSpec) -> GeneratedMerge:
    """The Triton source of the merge kernel described by ``spec``."""
    acc = f"tl.{spec.work_dtype}"
    m_init, total_init = _SINK_STARTS if spec.sinks else _PLAIN_STARTS
    source = _SOURCE.format(name=KERNEL_NAME, work=spec.work_dtype, block_rows=spec.block_rows,
                            v_pad=spec.v_head_dim_pad, target=spec.target, acc=acc,
                            sink_params=_SINK_PARAMS if spec.sinks else "",
                            sink_load=_SINK_LOAD.format(acc=acc) if spec.sinks else "",
                            m_init=m_init.format(acc=acc), total_init=total_init.format(acc=acc))
    return GeneratedMerge(source, KERNEL_NAME)
