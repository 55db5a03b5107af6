"""Generate the backward's row pass: delta and the probabilities' sum from the backward's own probabilities.

The backward (:mod:`flexc.codegen.backward`) forms ``dS = P ∘ (dP − delta)``. The dK/dV programs
take ``P = exp2(score − lse2)`` and, by default, ``delta = rowsum(out · dO)`` from the forward's
rounded output (torch's template does the same): both differ from the backward's own
``P`` by a few roundings, so a row's ``dS`` no longer sums to 0, and every gradient that sums
``dS`` (dq, a learnable bias, ALiBi slopes) collects the difference: up to 1.6x SDPA's error
against float64 in fp32.

With ``PRECISE_GRADIENTS`` (the default for fp32 and fp64 inputs) this kernel runs first. One
program per query tile and head walks the key tables as the dQ programs do, recomputes the
scores, ``p = exp(score − m)`` with ``m`` the forward's row max in natural log (subtracted before
the scaling to base 2, so the rounding of ``p`` scales with ``|score − m|`` as in a natural-log
softmax, not with ``|score|``) and ``dp = dO · vᵀ`` (dropped pairs through the forward's keep
mask), and sums per row

    psum = Σ p,   delta = Σ p · dp / psum

The caller (:class:`flexc.backends.triton.backward.BackwardLaunch`) stores ``m`` in the logsumexp's
place, ``−dlse`` in delta's and the sink's share ``exp(sink − m)`` (or 0) in the row sum's; this
kernel adds to the last two. Both kinds of backward program then take ``p = exp(score − m) / psum``,
which sums to 1 over each row with the sink, and a delta that matches it. A row that allows nothing
(``m = +inf``) keeps ``p = 0``, its delta as given and a sum of 1. It costs two dots per (query,
key) pair beside the backward's seven.

The kernel takes the backward kernel's parameters (:func:`flexc.codegen.backward.kernel_params`),
so one argument list launches both; its grid is the dQ programs' part of the backward's.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .backward import (BackwardSpec, GeneratedBackward, RenderedBackward, kernel_params, key_walk, render_backward,
                       tile_bounds)
from .kernel_mods import hoisted_lines
from .emit import HEAD_DIMS, bounds, call, jit_def, keywords, names_line, preamble
from .header import describe_dims, describe_mods, index_note, widen_note
from .parts import (DROPOUT_HELPERS, KV_BASES, dropout_args, dropout_head, head_check, row_sum,
                    widen_suffix)
from .spec import generates

KERNEL_NAME = "flex_attention_backward_rows"
HEADS = "tl.num_programs(1) * GQA_GROUP"  # Hq: the grid's head axis is the key head


@dataclass(frozen=True, kw_only=True)
class BackwardRowsSpec(BackwardSpec):
    """The row pass of the backward :class:`BackwardSpec` with the same fields (its own cache key)."""

    KIND = ("backward rows",)


def rows_spec(spec: BackwardSpec) -> BackwardRowsSpec:
    """The row pass that runs before the backward ``spec`` (one with ``precise``)."""
    return BackwardRowsSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})


@generates(BackwardRowsSpec)
def generate_backward_rows(spec: BackwardRowsSpec) -> GeneratedBackward:
    """The Triton source of the row pass described by ``spec``."""
    r = render_backward(spec)
    lines = preamble(_header(spec), [m for m in (r.score, r.mask) if m is not None and not m.is_constant])
    if spec.dropout:
        lines += [DROPOUT_HELPERS, ""]
    lines += _row_blocks(spec, r.score, r.mask, r.dq_args)  # the row pass adds no gradients
    lines += ["", ""]
    lines += _kernel(spec, r)
    return r.generated("\n".join(lines).rstrip() + "\n", KERNEL_NAME)


def _header(spec: BackwardRowsSpec) -> list[str]:
    return [
        "# flexc backward row pass (generated; runs before the backward kernel with PRECISE_GRADIENTS).",
        *describe_mods(spec),
        describe_dims(spec),
        f"#   BlockMask blocks: {spec.q_block_size} x {spec.kv_block_size} (query x key)",
        f"#   tiles: BLOCK_M2={spec.block_m2} x BLOCK_N2={spec.block_n2}; num_warps={spec.num_warps}, "
        f"num_stages={spec.num_stages}; target: {spec.target}",
        *index_note(spec),
        "# Per query row: psum = sum of p = exp(score - m) and delta = sum of p * dp / psum, from the",
        "# probabilities the backward itself recomputes (m: the forward's row max in natural log, stored",
        "# in lse's place), so its dS sums to 0 over each row as far as fp32 rounding allows. Adds to",
        "# delta (-dlse there) and to the row sum (the sink's share there), which both backward programs",
        "# then divide p by.",
        *widen_note(spec, "operands are rounded to the input dtype first, as on the GPU."),
    ]


def _row_blocks(spec: BackwardRowsSpec, score, mask, buffers: list[str]) -> list[str]:
    return key_walk(spec, score, mask, buffers, "row_blocks", "psum, pdp", "", "One query tile against the key "
                    "tiles of the listed key blocks: the row sums of p and p * dp.",
                    "subtracted first: its rounding scales with |qk - m|, as in a natural-log softmax", [
                        f"        psum += {row_sum(spec, 'p')}",
                        "        # where(valid): a masked pair adds 0 even against a NaN/inf value row",
                        f"        pdp += {row_sum(spec, 'tl.where(valid, p * dp, 0.0)')}",
                    ])


def _kernel(spec: BackwardRowsSpec, r: RenderedBackward) -> list[str]:
    acc = spec.acc_dtype
    widen = widen_suffix(spec)
    params, unspecialised = kernel_params(spec, r.buffers)
    dims = ("GUARD_NONFINITE_INPUTS", *HEAD_DIMS)

    def blocks_call(kind: str, is_full: bool) -> list[str]:
        return call("psum, pdp", "row_blocks", [
            "psum, pdp, q, do, row_max, b, h, q_idx, q_in_range,",
            "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,",
            f"{kind}_kv_counts_ptr + mask_row, {kind}_kv_indices_ptr + mask_row * MASK_KV_BLOCKS, scale, KV_LEN,",
            *names_line(r.dq_args),
            *dropout_args(spec),
            *keywords((f"IS_FULL_BLOCKS={is_full}", "BLOCK_M2", "BLOCK_N2", "KV_BLOCK_SIZE", "DIVISIBLE"), dims),
        ], "    ")

    d_check, dv_check = head_check(spec, "[None, :]"), head_check(spec, "[None, :]", value=True)
    rows = "b * stride_lb + h * stride_lh + offs_m"
    body = [
        *jit_def(KERNEL_NAME, params, f"@triton.jit(do_not_specialize={unspecialised!r})"),
        "    # one query tile of one query head (the dQ programs' part of the backward's grid)",
        "    pid = tl.program_id(0)",
        "    h_kv = tl.program_id(1)  # the key/value head",
        "    b = tl.program_id(2)  # the batch index the mods see",
        "    NUM_Q_TILES = (Q_LEN + BLOCK_M2 - 1) // BLOCK_M2",
        *KV_BASES,
        "    h = h_kv * GQA_GROUP + pid // NUM_Q_TILES  # the query head the mods see",
        *dropout_head(spec, "    ", HEADS),
        *hoisted_lines(r.mods, "    "),
        "    q_tile = pid % NUM_Q_TILES",
        "    offs_m = q_tile * BLOCK_M2 + tl.arange(0, BLOCK_M2)",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        *tile_bounds("    ", "q_in_range", "q_idx", "offs_m", "Q_LEN", "BLOCK_M2", "[:, None]"),
        "    q = tl.load(query_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,",
        f"                mask={bounds('q_in_range[:, None]', d_check)}, other=0.0){widen}",
        "    do = tl.load(grad_out_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,",
        f"                 mask={bounds('q_in_range[:, None]', dv_check)}, other=0.0){widen}",
        "    # each row's max in natural log (the forward's, converted by the caller; +inf where nothing is",
        "    # allowed: p = 0), and its sum of p so far (the sink's share, or 0)",
        f"    row_max = tl.load(lse_ptr + {rows}, mask=q_in_range, other=float(\"inf\"))",
        f"    psum = tl.load(row_sum_ptr + {rows}, mask=q_in_range, other=0.0)",
        f"    pdp = tl.full((BLOCK_M2,), 0.0, {acc})",
        "    mask_row = ((b % MASK_BATCH) * MASK_HEADS + h % MASK_HEADS) * MASK_Q_BLOCKS + (q_tile * BLOCK_M2) // Q_BLOCK_SIZE",
        "    # 1. partial key blocks: score_mod and mask_mod",
        *blocks_call("partial", False),
    ]
    if spec.has_full_blocks:
        body += ["    # 2. full key blocks: score_mod only", *blocks_call("full", True)]
    body += [
        "    live = psum > 0.0  # the row allows some key",
        "    psum_safe = tl.where(live, psum, 1.0)",
        f"    delta = tl.load(delta_ptr + {rows}, mask=q_in_range, other=0.0) + tl.where(live, pdp / psum_safe, 0.0)",
        f"    tl.store(delta_ptr + {rows}, delta, mask=q_in_range)",
        f"    tl.store(row_sum_ptr + {rows}, psum_safe, mask=q_in_range)",
    ]
    return body


__all__ = ["BackwardRowsSpec", "KERNEL_NAME", "generate_backward_rows", "rows_spec"]
