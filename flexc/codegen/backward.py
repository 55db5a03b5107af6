"""Generate the backward attention kernel for one pair of traced mods.

Modelled on torch's FlexAttention backward template: one launch, two kinds of program.

* A **dK/dV program** owns one tile of ``BLOCK_N1`` keys of one key head and batch. For every
  query head of its GQA group it walks the BlockMask's *query-direction* tables (partial query
  blocks, then full ones), recomputes the scores transposed (keys down, queries across), applies
  the score_mod (everywhere) and the mask_mod (partial blocks only), and accumulates
  ``dv += pᵀ·dO``, ``dsᵀ = pᵀ·(dpᵀ − delta) · dscore_mod/dscore`` and ``dk += dsᵀ·q``. It also adds
  the gradients of captured tensors (``d score_mod / d gathered element`` from
  :mod:`flexc.mods.derivative`) at the gathered indices with atomic adds, summed inside the tile first
  along every axis the index does not depend on.
* A **dQ program** owns one tile of ``BLOCK_M2`` queries of one query head: it walks the key
  tables like the forward and accumulates ``dq += ds·k``.

With attention dropout (``spec.dropout``) both programs draw the forward's keep mask again from the
call's seed (:data:`flexc.codegen.parts.DROPOUT_HELPERS`): the forward's output is ``(p ∘ keep) @ v``
with ``keep`` 0 or ``1 / (1 − p)``, so ``dv += (p ∘ keep)ᵀ·dO`` and ``dp = (dO·vᵀ) ∘ keep`` before ``ds``;
``delta = rowsum(out·dO)`` with the forward's (dropped) output is ``rowsum(p ∘ dp)`` as it should be.

dq, dk and dv are each written by exactly one program (no atomics). ``delta = rowsum(out·dO) −
dlse`` and the base-2 logsumexp (``+inf`` on rows that attend to nothing, so their ``p`` is 0) are
computed just before, by the prologue kernel (:mod:`flexc.codegen.prologue`). The dQ programs
instead take the forward's statistics (each row's base-2 max and sum of ``exp2(score − max)``):
their probabilities are ``exp2(score − max)`` and the row's dq is divided by the sum once, so each
row's probabilities sum to 1 as the forward's did (fp32: dq within 1.2x of SDPA's error where the
logsumexp's rounding, a factor per row, left it at 1.4–1.5x). With ``precise`` (PRECISE_GRADIENTS)
a row pass runs instead of the prologue (:mod:`flexc.codegen.backward_rows`): both kinds of program
then take ``p = exp(score − m)`` over the row pass's sum, ``m`` the row max in natural log, and a
delta from those probabilities, 16-bit ``dS`` enters the dq/dk dots as two operands, and
captured-tensor gradients are summed in float64. :class:`BackwardSpec` is everything that shapes
the source.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..mods import ir
from ..mods.derivative import ScoreModDerivative, differentiate
from ..constants import LOG2E
from .emit import HEAD_DIMS, bounds, call, constexprs, jit_def, keywords, names_line, preamble, store
from .header import describe_dims, describe_mods, index_note, widen_note
from .kernel_mods import hoisted_lines, param_stems, render_mods
from .parts import (DROPOUT_HELPERS, KV_BASES, dot, dropout_args, dropout_head, dropout_keep, dropout_params,
                    float_param, head_check, operand, row_sum, tile_load, tile_walk, widen_suffix)
from .printer import BufferParam, RenderedMod, python_literal, render_mod
from .spec import AttentionSpec, GeneratedKernel, generates

KERNEL_NAME = "flex_attention_backward"
HEADS = "tl.num_programs(1) * GQA_GROUP"  # Hq: the grid's head axis is the key head


@dataclass(frozen=True, kw_only=True)
class BackwardSpec(AttentionSpec):
    """What one generated backward kernel is specialised for.

    ``block_m1``/``block_n1`` are the dK/dV programs' query step and key tile, ``block_m2``/``block_n2``
    the dQ programs' query tile and key step (torch's names and meanings). ``grad_slots`` are the score_mod's captured tensors
    that receive gradients. The other fields mean what they mean in :class:`ForwardSpec`.
    """

    KIND = ("backward",)
    TILES = ("block_m1", "block_n1", "block_m2", "block_n2")
    SHRINK_ORDER = (TILES,)  # every tile above 16 at once

    q_block_size: int
    kv_block_size: int
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int = 4
    num_stages: int = 1
    has_full_blocks: bool = True
    grad_slots: tuple[int, ...] = ()
    target: str = "cuda"
    fp32_precision: str = "ieee"
    # integer type of the mods' index arithmetic, as the forward's (flexc.codegen.index_width)
    index_dtype: str = "int32"
    # attention dropout: the forward's keep mask regenerated in both programs (see the module docstring)
    dropout: bool = False
    # PRECISE_GRADIENTS: delta and the probabilities' sum come from this backward's own probabilities
    # (a row pass before it, flexc.codegen.backward_rows), and 16-bit dS enters the dq/dk dots as
    # two operands (its rounding and the remainder) instead of one
    precise: bool = False
    # every index below 2**23: index differences the mods read as floats print in float32, exactly
    # (flexc.codegen.printer, flexc.codegen.index_width.float_indices)
    float_indices: bool = False

    @property
    def splits_ds(self) -> bool:
        """Whether dS enters the dq/dk dots as two 16-bit operands (PRECISE_GRADIENTS, 16-bit inputs)."""
        return self.precise and self.dtype in (torch.float16, torch.bfloat16)

    def grad_dtype(self, slot: int) -> torch.dtype:
        """The dtype captured tensor ``slot``'s gradient is accumulated in (atomics need fp32/fp64):
        float64 for a float64 tensor and with ``precise`` (an element's gradient may sum a term
        from every pair of a diagonal, a head or more: fp32 atomics lose bits the reference's
        sums keep), else fp32."""
        wide = self.precise or self.score_mod.buffers[slot].dtype == torch.float64
        return torch.float64 if wide else torch.float32


@dataclass(frozen=True)
class GeneratedBackward(GeneratedKernel):
    """A generated backward kernel: its source and the parameters that carry captured tensors.

    ``score_params``/``mask_params`` read the mods' captured tensors; ``grad_params`` point into
    the gradient accumulators (their ``slot`` is the score_mod slot whose gradient they hold).
    """

    grad_params: tuple[BufferParam, ...]
    derivative: ScoreModDerivative | None


@dataclass(frozen=True)
class _GatherCode:
    grad: RenderedMod      # d score_mod / d element
    address: RenderedMod   # where that element's gradient accumulates
    what: str              # the gathered element, for the comment


def _unique(params) -> list[BufferParam]:
    seen, out = set(), []
    for p in params:
        if p.name not in seen:
            seen.add(p.name)
            out.append(p)
    return out


def _accumulates(p: BufferParam, n_buf: int) -> bool:
    """Whether an address parameter points into a gradient accumulator (slots ``n_buf + slot``)."""
    return p.what != "scalar" and p.slot >= n_buf


def mod_call(r: RenderedMod, args: str) -> str:
    """A rendered mod applied to ``args`` in the kernel: its function call, or its value if constant."""
    if r.is_constant:
        return python_literal(float(r.literal))
    return f"{r.fn_name}({', '.join([args, *r.call_args])})"


@dataclass(frozen=True)
class RenderedBackward:
    """The mods of a backward spec as kernel text, and the kernel's captured-value parameters:
    what the backward kernel and its row pass (:mod:`flexc.codegen.backward_rows`) share, so both
    take the same arguments."""

    score: RenderedMod | None
    mask: RenderedMod | None
    d_score: RenderedMod | None  # d score_mod / d score
    gathers: list  # [_GatherCode]: the captured tensors that receive gradients
    derivative: ScoreModDerivative | None
    score_params: tuple[BufferParam, ...]
    mask_params: tuple[BufferParam, ...]
    grad_params: list[BufferParam]  # addresses into the gradient accumulators (slots n_buf + slot)
    buffers: list[str]  # every captured-value parameter name, in the kernels' order
    n_buf: int
    # what the block loops pass on to the mod functions (RenderedMod.call_args): the dK/dV
    # programs' (the gradient addresses last) and the dQ programs' and row pass's (without them)
    args: list[str]
    dq_args: list[str]

    @property
    def mods(self) -> list[RenderedMod]:
        """The functions whose lookups the kernel may hoist (:func:`hoisted_lines`)."""
        return [m for m in (self.score, self.mask, self.d_score) if m is not None] + [g.grad for g in self.gathers]

    def generated(self, source: str, kernel_name: str) -> GeneratedBackward:
        grad_params = tuple(BufferParam(p.name, p.slot - self.n_buf, p.what, p.dim) for p in self.grad_params)
        return GeneratedBackward(source, kernel_name, self.score_params, self.mask_params, grad_params,
                                 self.derivative)


def render_backward(spec: BackwardSpec) -> RenderedBackward:
    """The mods, their derivatives and the gradient addresses of ``spec`` as kernel text."""
    # the forward's mod functions, parameter names and all; lookups indexed by b and h only are
    # values the kernel loads once per program (per head in the dK/dV programs' loop over heads)
    score, mask = render_mods(spec, spec.target, spec.index_dtype, hoist=True)
    # the derivative functions and gradient addresses print like the mods (libdevice, index width)
    style = dict(target=spec.target, index_dtype=spec.index_dtype, float_indices=spec.float_indices, hoist=True)
    widen = "float64" if spec.dtype == torch.float64 else None
    derivative = differentiate(spec.score_mod, spec.grad_slots, widen) if spec.score_mod is not None else None
    taken: set[str] = set()
    score_stems = param_stems(spec.score_mod, taken, "score")
    param_stems(spec.mask_mod, taken, "mask")
    d_score = gathers = None
    if derivative is not None:
        # derivatives read the score_mod's captured numbers: the same kernel arguments (score_mod_<name>)
        d_score = render_mod(derivative.as_mod(derivative.d_score, "score_grad"), "score_grad", score_stems,
                             scalar_prefix="score_mod", **style)
        n = len(spec.score_mod.buffers)
        gathers = []
        for j, g in enumerate(derivative.gathers):
            slot, ndim = g.slot, len(g.indices)
            grad_buf = ir.buffer(n + slot, "float64" if spec.grad_dtype(slot) == torch.float64 else "float32",
                                 ndim, ir.FLOAT)
            stem = f"{score_stems[slot]}_grad"
            while stem in taken:
                stem += "_"
            # the indices may read other captured tensors (bias[doc[kv_idx]]): the score_mod's parameters
            stems = {**score_stems, n + slot: stem}
            names = spec.score_mod.buffer_names + tuple(f"{name}_grad" for name in spec.score_mod.buffer_names)
            target = dataclasses.replace(spec.score_mod, root=ir.load(grad_buf, g.indices), buffer_names=names,
                                         name=f"gather{j}_address")
            address = render_mod(target, f"gather{j}_address", stems, address=True, scalar_prefix="score_mod",
                                 index_dtype=spec.index_dtype)
            grad = render_mod(derivative.as_mod(g.grad, f"gather{j}_grad"), f"gather{j}_grad", score_stems,
                              scalar_prefix="score_mod", **style)
            what = ir.format_expr(g.load, spec.score_mod.buffer_names)
            gathers.append(_GatherCode(grad, address, what))
    else:
        d_score = None
        gathers = []

    n_buf = len(spec.score_mod.buffers) if spec.score_mod is not None else 0
    # what an address reads besides its gradient accumulator (captured numbers, index tensors such
    # as doc in bias[doc[kv_idx]]) is the score_mod's, under the score_mod's parameter names
    score_params = _unique([p for r in (score, d_score) if r is not None for p in r.params]
                           + [p for g in gathers for p in g.grad.params]
                           + [p for g in gathers for p in g.address.params if not _accumulates(p, n_buf)])
    mask_params = tuple(mask.params) if mask is not None else ()
    grad_params = _unique([p for g in gathers for p in g.address.params if _accumulates(p, n_buf)])
    buffers = [p.name for p in score_params] + [p.name for p in mask_params] + [p.name for p in grad_params]
    accumulators = {p.name for p in grad_params}
    dq_args = []
    for r in [m for m in (score, d_score) if m is not None] + [g.grad for g in gathers] + [g.address for g in gathers] \
            + ([mask] if mask is not None else []):
        dq_args += [name for name in r.call_args if name not in dq_args and name not in accumulators]
    args = dq_args + [p.name for p in grad_params]
    return RenderedBackward(score, mask, d_score, gathers, derivative, tuple(score_params), mask_params, grad_params,
                            buffers, n_buf, args, dq_args)


@generates(BackwardSpec)
def generate_backward(spec: BackwardSpec) -> GeneratedBackward:
    """The Triton source of the backward kernel described by ``spec``."""
    r = render_backward(spec)
    score, mask, d_score, gathers = r.score, r.mask, r.d_score, r.gathers
    mods = [m for m in (score, mask, d_score) if m is not None] + [m for g in gathers for m in (g.grad, g.address)]
    # a constant mod is printed as its value where it is used: no function
    lines = preamble(_header(spec, r.derivative, gathers), [m for m in mods if not m.is_constant])
    if spec.dropout:
        lines += [DROPOUT_HELPERS, ""]
    lines += _dkdv_blocks(spec, score, mask, d_score, gathers, r.args)
    lines += ["", ""]
    lines += _dq_blocks(spec, score, mask, d_score, r.dq_args)  # dQ programs add no captured-tensor gradients
    lines += ["", ""]
    lines += _kernel(spec, d_score, r)
    return r.generated("\n".join(lines).rstrip() + "\n", KERNEL_NAME)


def _header(spec: BackwardSpec, derivative: ScoreModDerivative | None, gathers: list[_GatherCode]) -> list[str]:
    names = spec.score_mod.buffer_names if spec.score_mod is not None else ()
    lines = [
        "# flexc backward attention kernel (generated; flexc.kernel_source(..., backward=True) returns this text).",
        *describe_mods(spec),
    ]
    if derivative is not None:
        lines.append(f"#   d score_mod / d score = {ir.format_expr(derivative.d_score, names)}")
    if gathers:
        lines.append("#   captured tensors that receive gradients (atomic adds at the gathered index):")
        for g in gathers:
            lines.append(f"#     d / d {g.what} = {g.grad.expression}")
    lines += [
        describe_dims(spec),
        f"#   BlockMask blocks: {spec.q_block_size} x {spec.kv_block_size} (query x key)",
        f"#   tiles: dQ programs BLOCK_M2={spec.block_m2} x BLOCK_N2={spec.block_n2}, dK/dV programs "
        f"BLOCK_M1={spec.block_m1} x BLOCK_N1={spec.block_n1}; num_warps={spec.num_warps}, "
        f"num_stages={spec.num_stages}; target: {spec.target}",
        *index_note(spec),
        *(["#   dropout: the forward's keep mask (Philox, keyed by the call's seed) is drawn again here; kept",
           "#   pairs scaled by 1 / (1 - p), so dv = (p * keep)^T dO and dp = (dO v^T) * keep"] if spec.dropout else []),
        "# One launch. Programs [0, NUM_KV_TILES) each own a key tile of one key head: they walk the",
        "# BlockMask's query tables for every query head of the GQA group and write dK, dV (and add",
        "# captured-tensor gradients). The remaining programs each own a query tile of one query head:",
        "# they walk the key tables and write dQ. Partial blocks run the mask_mod, full blocks do not;",
        "# scores are recomputed and turned into probabilities with the base-2 logsumexp (dK/dV) or the",
        "# forward's row max and sum (dQ: dq is divided by the sum once).",
        *widen_note(spec, "operands are rounded to the input dtype first, as on the GPU."),
    ]
    return lines


def score_mod_lines(spec, score: RenderedMod | None, mask: RenderedMod | None, shape: str, indent: str,
                    mask_scores: bool = True) -> list[str]:
    """``qk`` (the modified score) from ``score`` (the scaled q·k), ``valid`` narrowed by the mask_mod,
    and (``mask_scores``) ``qk`` set to -inf outside ``valid``; without it the caller masks the
    exponent (:func:`_exponent`)."""
    out = []
    if score is None:
        out.append(f"{indent}qk = score")
    else:
        out.append(f"{indent}# score_mod: {score.expression}")
        if score.is_constant:
            out.append(f"{indent}qk = tl.full({shape}, {python_literal(float(score.literal))}, score.dtype)")
        else:
            call = mod_call(score, "score, b, h, q_idx, kv_idx")
            if "score" in score.reads or {"q_idx", "kv_idx"} <= score.reads:
                out.append(f"{indent}qk = {call}.to(score.dtype)")
            else:  # varies along at most one axis: broadcast it to the tile
                out.append(f"{indent}qk = tl.full({shape}, 0.0, score.dtype) + {call}")
    if mask is not None:
        out.append(f"{indent}if not IS_FULL_BLOCKS:  # full blocks are known to be all allowed")
        out.append(f"{indent}    # mask_mod: {mask.expression}")
        if mask.is_constant:  # always False (always True was dropped)
            out.append(f"{indent}    valid = valid & (q_idx < 0)  # allows nothing")
        else:
            out.append(f"{indent}    valid = valid & {mod_call(mask, 'b, h, q_idx, kv_idx')}")
            if spec.target == "interpreter":
                # the interpreter stores a per-program comparison (h == 0, b < 2) as int32 and
                # broadcasts it to the tile as int32: valid would be an int32 tile typed int1,
                # which tl.where takes but an atomic add's mask (the gathers') rejects
                out.append(f"{indent}    valid = valid != 0  # a bool tile again")
    if mask_scores:
        out.append(f"{indent}qk = tl.where(valid, qk, float(\"-inf\"))")
    return out


def _folds_scale(spec: BackwardSpec, score: RenderedMod | None) -> bool:
    """Whether ``scale · log2(e)`` joins the exponent's subtraction (one FMA per pair instead of a scale,
    a change of base and a subtraction): with no score_mod, nothing needs the natural score. The
    forward computes its max and probabilities from the raw q·k the same way, so p is the forward's.
    PRECISE_GRADIENTS keeps its subtraction first (see :func:`_dkdv_probabilities`)."""
    return score is None and not spec.precise


def _score_lines(spec: BackwardSpec, score, mask, product: str, valid: str, shape: str) -> list[str]:
    """The recomputed scores of one tile: ``qk`` (raw q·k where :func:`_folds_scale`, else the scaled
    and modified score) and ``valid`` (in range and, in partial blocks, allowed by the mask_mod)."""
    indent = "        "
    if _folds_scale(spec, score):
        lines = [f"{indent}qk = {product}  # {shape}, raw: scale * log2(e) is applied in the exponent",
                 f"{indent}valid = {valid}"]
        return lines + score_mod_lines(spec, None, mask, shape, indent, mask_scores=False)[1:]
    return [f"{indent}score = {product} * scale  # {shape}",
            f"{indent}valid = {valid}",
            *score_mod_lines(spec, score, mask, shape, indent, mask_scores=spec.precise)]


def _exponent(spec: BackwardSpec, score, row_stat: str) -> str:
    """``qk`` in base 2 minus the row's base-2 statistic ``row_stat``, -inf outside ``valid``: masked
    after the subtraction, so the change of base and the subtraction fuse into one FMA."""
    to_base2 = "qk_scale" if _folds_scale(spec, score) else LOG2E
    return f"tl.where(valid, qk * {to_base2} - {row_stat}, float(\"-inf\"))"


def _qk_scale(spec: BackwardSpec, score) -> list[str]:
    """The folded factor's definition (before a tile loop), where :func:`_folds_scale`."""
    if not _folds_scale(spec, score):
        return []
    return [f"    qk_scale = scale * {LOG2E}  # the scores' scale and the change to base 2, applied at once"]


def _score_grad_lines(d_score: RenderedMod | None, ds: str, indent: str) -> list[str]:
    """``ds`` (d loss / d modified score) times d score_mod / d score, zero outside ``valid``."""
    if d_score is None:
        return []
    if d_score.is_constant:
        value = float(d_score.literal)
        if value == 1.0:
            return []
        return [f"{indent}{ds} = {ds} * {python_literal(value)}  # d score_mod / d score: {d_score.expression}"]
    return [f"{indent}# d score_mod / d score: {d_score.expression}",
            f"{indent}{ds} = tl.where(valid, {ds} * {mod_call(d_score, 'score, b, h, q_idx, kv_idx')}, 0.0)"]


def _folds_score_grad(d_score: RenderedMod | None, gathers) -> bool:
    """Whether d score_mod / d score multiplies the probabilities as soon as they are formed: a
    derivative that reads the tile (soft-capping's 1 - tanh^2) would otherwise keep the natural
    score alive through the dv and dp dots, a tile of registers that made the D=128 programs spill.
    Gradients of captured tensors take ds before the derivative, so they keep the late product."""
    return d_score is not None and not d_score.is_constant and not gathers


def _p_grad_lines(d_score: RenderedMod | None, p: str, indent: str) -> list[str]:
    """``{p}_grad = p * d score_mod / d score`` (see :func:`_folds_score_grad`)."""
    return [f"{indent}# d score_mod / d score: {d_score.expression}; taken now, so the natural score dies here",
            f"{indent}{p}_grad = {p} * {mod_call(d_score, 'score, b, h, q_idx, kv_idx')}"]


def _masked_ds(spec: BackwardSpec, p: str, dp_minus_delta: str) -> str:
    """``ds = p * (dp - delta)``, exactly 0 outside ``valid`` even where ``dp`` is NaN or inf (a masked
    key's value row). Where ``p`` is the probability tile itself (not ``p_grad``) and the exponent was
    masked to -inf (so ``p`` is exactly 0 outside ``valid``), the select takes the fp32 difference
    before the product: selected after it, the compiler moves it past the rounding to the dot's
    16-bit operand, where each select unpacks and repacks a pair of halves (on sm_90 the dQ partial
    loop's 625 SASS instructions per tile were 581 this way). Otherwise (``p_grad``, whose derivative
    may be non-finite on a masked pair, and PRECISE_GRADIENTS) it selects the product."""
    if p in ("p", "pT") and not spec.precise:
        return f"{p} * tl.where(valid, {dp_minus_delta}, 0.0)"
    return f"tl.where(valid, {p} * ({dp_minus_delta}), 0.0)"


def _ignores_score(d_score: RenderedMod | None) -> bool:
    return d_score is not None and d_score.is_constant and float(d_score.literal) == 0.0


def _gather_lines(spec: BackwardSpec, gathers: list[_GatherCode], indent: str) -> list[str]:
    """Atomic adds of ``dsT * d score_mod / d element`` at each gathered element (transposed tile)."""
    out = []
    for g in gathers:
        reads = g.address.reads
        out.append(f"{indent}# d / d {g.what} = {g.grad.expression}")
        if g.grad.is_constant:
            value = float(g.grad.literal)
            term = "dsT" if value == 1.0 else f"dsT * {python_literal(value)}"
        else:
            term = f"tl.where(valid, dsT * {mod_call(g.grad, 'score, b, h, q_idx, kv_idx')}, 0.0)"
        if spec.precise and spec.dtype != torch.float64:  # summed (tile, then atomics) in float64
            term = f"({term}).to(tl.float64)"
        address = mod_call(g.address, "score, b, h, q_idx, kv_idx")
        if "score" in reads or {"q_idx", "kv_idx"} <= reads:
            out.append(f"{indent}grad = {term}")
            if not {"q_idx", "kv_idx"} <= reads:  # an index read from the score alone: spread it over the tile
                address = f"{address} + tl.full((BLOCK_N1, BLOCK_M1), 0, tl.int32)"
            out.append(f"{indent}tl.atomic_add({address}, grad, mask=valid)")
        elif "q_idx" in reads:  # constant along the keys: one add per query
            out.append(f"{indent}grad = {row_sum(spec, term, 0)}[None, :]  # summed over the keys")
            out.append(f"{indent}tl.atomic_add({address}, grad, mask=q_in_range[None, :])")
        elif "kv_idx" in reads:  # constant along the queries: one add per key
            out.append(f"{indent}grad = {row_sum(spec, term, 1)}[:, None]  # summed over the queries")
            out.append(f"{indent}tl.atomic_add({address}, grad, mask=kv_in_range[:, None])")
        else:  # one element for the whole tile
            out.append(f"{indent}grad = {row_sum(spec, row_sum(spec, term, 1), 0)}  # summed over the tile")
            out.append(f"{indent}tl.atomic_add({address}, grad)")
    return out


def _finite_lines(x: str, indent: str) -> list[str]:
    """In partial blocks, zero the non-finite entries of ``x`` before it meets ``ds`` in a dot.

    A masked pair has ds = 0 but 0 * NaN is NaN: padding keys (or queries) holding NaN or inf
    would poison the gradients of the rows that do not see them. An allowed pair with such an
    entry already has a NaN ds (its score is NaN), so zeroing changes nothing there. The launcher
    compiles this in (GUARD_NONFINITE_INPUTS) only for calls whose inputs hold NaN or inf: always
    compiled in, it cost the sm_90 partial loops up to 1.2x torch's instruction count.
    """
    return [f"{indent}if not IS_FULL_BLOCKS:",
            f"{indent}    if GUARD_NONFINITE_INPUTS:  # masked pairs add exactly 0 even against NaN/inf entries",
            f"{indent}        {x} = tl.where(({x} == {x}) & (tl.abs({x}) != float(\"inf\")), {x}, 0.0)"]


def tile_bounds(indent: str, in_range: str, idx: str, offs: str, length: str, block: str, axis: str) -> list[str]:
    """``in_range`` and the clamped index ``idx`` of a tile; no checks when the lengths divide the tiles."""
    return [
        f"{indent}if DIVISIBLE:  # both lengths are multiples of every tile: nothing to bounds-check",
        f"{indent}    {in_range} = tl.full(({block},), 1, tl.int1)",
        f"{indent}    {idx} = {offs}{axis}",
        f"{indent}else:",
        f"{indent}    {in_range} = {offs} < {length}",
        f"{indent}    {idx} = tl.minimum({offs}, {length} - 1){axis}  # clamped: captured-tensor lookups stay in bounds",
    ]


def _ds_dot(spec: BackwardSpec, ds: str, other: str, acc: str, indent: str) -> list[str]:
    """``acc += ds · other`` with ``ds`` (fp32) as the dot's operand: rounded to the input dtype, as
    torch's template does, or with :attr:`BackwardSpec.splits_ds` as two operands, its rounding and
    what the rounding dropped, so the dot sees ~16 of its bits instead of 8 (one more dot)."""
    if not spec.splits_ds:
        return [f"{indent}{acc} = {dot(operand(spec, ds), other, spec, acc)}"]
    return [f"{indent}# PRECISE_GRADIENTS: {ds} enters as its {spec.tl_dtype} rounding plus the remainder",
            f"{indent}{ds}_hi = {operand(spec, ds)}",
            f"{indent}{acc} = {dot(f'{ds}_hi', other, spec, acc)}",
            f"{indent}{acc} = {dot(operand(spec, f'({ds} - {ds}_hi.to({spec.acc_dtype}))'), other, spec, acc)}"]


def _in_tile(block: str, what: str) -> list[str]:
    """``in_tile``, a row's offset within its tile, for the tile loads of a walk: each load's address
    is the tile's first row (``start * stride``, one scalar per tile) plus the thread's offsets within
    the tile, which do not change from tile to tile. Written as one product ``offs * stride`` the
    addresses cost a multiply and a 64-bit add each per tile (on sm_90 the D=128 dQ loop of ALiBi
    issued 8 more instructions per tile)."""
    return [f"    in_tile = tl.arange(0, {block})  # a {what}'s offset within its tile: loads address a tile "
            f"as its first row plus these"]


def _dkdv_blocks(spec, score, mask, d_score, gathers, buffers) -> list[str]:
    tiles = spec.q_block_size // spec.block_m1
    params = [
        "dk, dv, k, v, b, h, kv_idx, kv_in_range,",
        "query_ptr, grad_out_ptr, q_head, do_head, lse_ptr, delta_ptr, stride_qm, stride_qd, stride_dom, stride_dod,",
        *(["row_sum_ptr,"] if spec.precise else []),
        "block_count_ptr, block_index_ptr, scale, Q_LEN,",
        *names_line(buffers),
        *dropout_args(spec),
        *constexprs(("IS_FULL_BLOCKS", "BLOCK_M1", "BLOCK_N1", "Q_BLOCK_SIZE"), ("DIVISIBLE", "GUARD_NONFINITE_INPUTS"),
                    HEAD_DIMS),
    ]
    # the head's offset plus the tile's, from the kernel's own pointers (see the kernel's q_head)
    q_ptrs = "query_ptr + (q_head + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd)"
    do_ptrs = "grad_out_ptr + (do_head + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod)"
    head, tail = tile_walk("block_index_ptr", tiles, "Q_BLOCK_SIZE", "BLOCK_M1", "start_m", count_ptr="block_count_ptr")
    body = [
        *jit_def("dkdv_blocks", params),
        "    # One key tile against the query tiles of the listed query blocks, transposed: rows are",
        "    # keys, columns are queries, so dv and dk accumulate without transposing p and ds.",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        *_qk_scale(spec, score),
        *head,
        "        offs_m = start_m + tl.arange(0, BLOCK_M1)",
        *tile_bounds("        ", "q_in_range", "q_idx", "offs_m", "Q_LEN", "BLOCK_M1", "[None, :]"),
        f"        qT = {tile_load(spec, q_ptrs, 'q_in_range[None, :]', '[:, None]')}",
        f"        do = {tile_load(spec, do_ptrs, 'q_in_range[:, None]', '[None, :]', value=True)}",
        *_dkdv_row_stats(spec),
        "        delta = tl.load(delta_ptr + offs_m, mask=q_in_range, other=0.0)",
        *_score_lines(spec, score, mask, dot('k', 'qT', spec), "kv_in_range[:, None] & q_in_range[None, :]",
                      "(BLOCK_N1, BLOCK_M1)"),
        *_dkdv_probabilities(spec, score),
    ]
    fold = _folds_score_grad(d_score, gathers)
    p_ds, of_ds = ("pT_grad", "score") if fold else ("pT", "modified score")
    if fold:
        body += _p_grad_lines(d_score, "pT", "        ")
    if spec.dropout:  # the forward's out = (p * keep) @ v: dv and dp go through the kept pairs
        body += [f"        keepT = {dropout_keep()}  # the forward's mask, drawn again",
                 f"        dv = {dot(operand(spec, '(pT * keepT)'), 'do', spec, 'dv')}"]
    else:
        body.append(f"        dv = {dot(operand(spec, 'pT'), 'do', spec, 'dv')}")
    needs_ds = gathers or not _ignores_score(d_score)
    if needs_ds:
        body += [
            f"        dpT = {dot('v', 'tl.trans(do)', spec)}",
            *(["        dpT = dpT * keepT  # d out / d p: dropped pairs reach nothing"] if spec.dropout else []),
            f"        dsT = {_masked_ds(spec, p_ds, 'dpT - delta[None, :]')}  # d loss / d {of_ds}",
            *_gather_lines(spec, gathers, "        "),
        ]
    if not _ignores_score(d_score):
        body += [
            *([] if fold else _score_grad_lines(d_score, "dsT", "        ")),
            *_finite_lines("qT", "        "),
            *_ds_dot(spec, "dsT", "tl.trans(qT)", "dk", "        "),
        ]
    body += [*tail, "    return dk, dv"]
    return body


def _dkdv_row_stats(spec: BackwardSpec) -> list[str]:
    """The dK/dV programs' per-query statistics: the base-2 logsumexp, or with PRECISE_GRADIENTS the
    row pass's natural-log row max and the reciprocal of its probability sum."""
    if not spec.precise:
        return ["        lse = tl.load(lse_ptr + offs_m, mask=q_in_range, other=float(\"inf\"))  # base 2; +inf: p = 0"]
    return ["        m = tl.load(lse_ptr + offs_m, mask=q_in_range, other=float(\"inf\"))  # natural log; +inf: p = 0",
            "        inv_sum = 1.0 / tl.load(row_sum_ptr + offs_m, mask=q_in_range, other=1.0)"]


def _dkdv_probabilities(spec: BackwardSpec, score) -> list[str]:
    """``pT`` from the recomputed scores ``qk``: ``exp2(qk·log2 e − lse2)``, or with PRECISE_GRADIENTS
    ``exp(qk − m) / sum`` with the subtraction first (its rounding then scales with ``|qk − m|``, not
    ``|qk|``), normalised by the row pass's sum, so each row's p sums to 1 as the row pass's did."""
    if not spec.precise:
        return [f"        pT = tl.exp2({_exponent(spec, score, 'lse[None, :]')})"]
    return [f"        pT = tl.exp2((qk - m[None, :]) * {LOG2E}) * inv_sum[None, :]"]


def key_walk(spec: BackwardSpec, score, mask, buffers: list[str], name: str, state: str, reads: str, doc: str,
             p_note: str, update: list[str]) -> list[str]:
    """A ``@triton.jit`` function that walks one query tile over the key tiles of its listed blocks,
    recomputing each tile's modified scores ``qk``, its probabilities ``p`` (from ``row_max``; the
    comment ``p_note`` says how they are normalised) and ``dp = dO·vᵀ`` (through the forward's keep
    mask with dropout), then runs ``update`` (lines at two levels of indent) on the carried ``state``
    (its first parameters, returned at the end; ``reads``: more per-row inputs, e.g. ``"delta, "``):
    the dQ programs' ``dq`` and the row pass's sums."""
    tiles = spec.kv_block_size // spec.block_n2
    params = [
        f"{state}, q, do, row_max, {reads}b, h, q_idx, q_in_range,",
        "key_ptr, value_ptr, stride_kn, stride_kd, stride_vn, stride_vd,",
        "block_count_ptr, block_index_ptr, scale, KV_LEN,",
        *names_line(buffers),
        *dropout_args(spec),
        *constexprs(("IS_FULL_BLOCKS", "BLOCK_M2", "BLOCK_N2", "KV_BLOCK_SIZE"), ("DIVISIBLE", "GUARD_NONFINITE_INPUTS"),
                    HEAD_DIMS),
    ]
    k_ptrs = "key_ptr + start_n * stride_kn + (in_tile[None, :] * stride_kn + offs_d[:, None] * stride_kd)"
    v_ptrs = "value_ptr + start_n * stride_vn + (in_tile[None, :] * stride_vn + offs_dv[:, None] * stride_vd)"
    head, tail = tile_walk("block_index_ptr", tiles, "KV_BLOCK_SIZE", "BLOCK_N2", "start_n", count_ptr="block_count_ptr")
    probabilities = (f"tl.exp2((qk - row_max[:, None]) * {LOG2E})" if spec.precise  # natural-log max, subtracted first
                     else f"tl.exp2({_exponent(spec, score, 'row_max[:, None]')})")
    return [
        *jit_def(name, params),
        f"    # {doc}",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        *_in_tile("BLOCK_N2", "key"),
        *_qk_scale(spec, score),
        *head,
        "        offs_n = start_n + in_tile",
        *tile_bounds("        ", "kv_in_range", "kv_idx", "offs_n", "KV_LEN", "BLOCK_N2", "[None, :]"),
        f"        kT = {tile_load(spec, k_ptrs, 'kv_in_range[None, :]', '[:, None]')}",
        f"        vT = {tile_load(spec, v_ptrs, 'kv_in_range[None, :]', '[:, None]', value=True)}",
        *_score_lines(spec, score, mask, dot('q', 'kT', spec), "q_in_range[:, None] & kv_in_range[None, :]",
                      "(BLOCK_M2, BLOCK_N2)"),
        f"        p = {probabilities}  # {p_note}",
        f"        dp = {dot('do', 'vT', spec)}",
        *([f"        dp = dp * {dropout_keep()}  # the forward's mask, drawn again"]
          if spec.dropout else []),
        *update,
        *tail,
        f"    return {state}",
    ]


def _dq_blocks(spec, score, mask, d_score, buffers) -> list[str]:
    note = ("the row pass's natural-log max; dq is divided by the sum once" if spec.precise
            else "not yet divided by the row's sum: dq is, once")
    fold = _folds_score_grad(d_score, ())
    return key_walk(spec, score, mask, buffers, "dq_blocks", "dq", "delta, ", "One query tile against the key tiles "
                    "of the listed key blocks.", note, [
                        *(_p_grad_lines(d_score, "p", "        ") if fold else []),
                        f"        ds = {_masked_ds(spec, 'p_grad' if fold else 'p', 'dp - delta[:, None]')}",
                        *([] if fold else _score_grad_lines(d_score, "ds", "        ")),
                        *_finite_lines("kT", "        "),
                        *_ds_dot(spec, "ds", "tl.trans(kT)", "dq", "        "),
                    ])


def kernel_params(spec: BackwardSpec, buffers: list[str]) -> tuple[list[str], list[str]]:
    """The backward kernel's parameter lines (its row pass takes the same ones, so one argument list
    launches both) and the parameters left unspecialised (lengths and captured values)."""
    full = spec.has_full_blocks
    params = [
        "query_ptr, key_ptr, value_ptr, grad_out_ptr, lse_ptr, delta_ptr, row_max_ptr, row_sum_ptr,",
        "dq_ptr, dk_ptr, dv_ptr,",
        "partial_kv_counts_ptr, partial_kv_indices_ptr," + (" full_kv_counts_ptr, full_kv_indices_ptr," if full else ""),
        "partial_q_counts_ptr, partial_q_indices_ptr," + (" full_q_counts_ptr, full_q_indices_ptr," if full else ""),
        *names_line(buffers),
        *dropout_params(spec),
        f"{float_param('scale', spec)}, Q_LEN, KV_LEN, GQA_GROUP,",
        "stride_qb, stride_qh, stride_qm, stride_qd,",
        "stride_kb, stride_kh, stride_kn, stride_kd,",
        "stride_vb, stride_vh, stride_vn, stride_vd,",
        "stride_dob, stride_doh, stride_dom, stride_dod,",
        "stride_lb, stride_lh,",
        "stride_dqb, stride_dqh, stride_dqm, stride_dqd,",
        "stride_dkb, stride_dkh, stride_dkn, stride_dkd,",
        "stride_dvb, stride_dvh, stride_dvn, stride_dvd,",
        "MASK_BATCH, MASK_HEADS, MASK_Q_BLOCKS, MASK_KV_BLOCKS,",
        *constexprs(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), ("Q_BLOCK_SIZE", "KV_BLOCK_SIZE", "DIVISIBLE"),
                    ("GUARD_NONFINITE_INPUTS", "INT64_OFFSETS"), HEAD_DIMS),
    ]
    return params, ["Q_LEN", "KV_LEN"] + [b for b in buffers if not b.endswith("_ptr")]


def _kernel(spec: BackwardSpec, d_score: RenderedMod | None, r: RenderedBackward) -> list[str]:
    acc = spec.acc_dtype
    widen = widen_suffix(spec)
    full = spec.has_full_blocks
    params, unspecialised = kernel_params(spec, r.buffers)
    dims = ("GUARD_NONFINITE_INPUTS", *HEAD_DIMS)

    def dkdv_call(kind: str, is_full: bool) -> list[str]:
        return call("dk, dv", "dkdv_blocks", [
            "dk, dv, k, v, b, h, kv_idx, kv_in_range,",
            "query_ptr, grad_out_ptr, q_head, do_head, lse_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,",
            *(["row_sum_base,"] if spec.precise else []),
            f"{kind}_q_counts_ptr + mask_col, {kind}_q_indices_ptr + mask_col * MASK_Q_BLOCKS, scale, Q_LEN,",
            *names_line(r.args),
            *dropout_args(spec),
            *keywords((f"IS_FULL_BLOCKS={is_full}", "BLOCK_M1", "BLOCK_N1", "Q_BLOCK_SIZE", "DIVISIBLE"), dims),
        ], "            ")

    def dq_call(kind: str, is_full: bool) -> list[str]:
        return call("dq", "dq_blocks", [
            "dq, q, do, row_max, delta, b, h, q_idx, q_in_range,",
            "key_base, value_base, stride_kn, stride_kd, stride_vn, stride_vd,",
            f"{kind}_kv_counts_ptr + mask_row, {kind}_kv_indices_ptr + mask_row * MASK_KV_BLOCKS, scale, KV_LEN,",
            *names_line(r.dq_args),
            *dropout_args(spec),
            *keywords((f"IS_FULL_BLOCKS={is_full}", "BLOCK_M2", "BLOCK_N2", "KV_BLOCK_SIZE", "DIVISIBLE"), dims),
        ], "        ")

    d_check, dv_check = head_check(spec, "[None, :]"), head_check(spec, "[None, :]", value=True)
    body = [
        *jit_def(KERNEL_NAME, params, f"@triton.jit(do_not_specialize={unspecialised!r})"),
        "    pid = tl.program_id(0)",
        "    h_kv = tl.program_id(1)  # the key/value head",
        "    b = tl.program_id(2)  # the batch index the mods see",
        "    offs_d = tl.arange(0, HEAD_DIM_PAD)",
        "    offs_dv = tl.arange(0, V_HEAD_DIM_PAD)",
        "    NUM_KV_TILES = (KV_LEN + BLOCK_N1 - 1) // BLOCK_N1",
        "    NUM_Q_TILES = (Q_LEN + BLOCK_M2 - 1) // BLOCK_M2",
        *KV_BASES,
        "    if pid < NUM_KV_TILES:",
        "        # ---- a dK/dV program: one key tile, every query head of the group ----",
        "        offs_n = pid * BLOCK_N1 + tl.arange(0, BLOCK_N1)",
        *tile_bounds("        ", "kv_in_range", "kv_idx", "offs_n", "KV_LEN", "BLOCK_N1", "[:, None]"),
        f"        k = {tile_load(spec, 'key_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd', 'kv_in_range[:, None]', '[None, :]')}",
        f"        v = {tile_load(spec, 'value_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd', 'kv_in_range[:, None]', '[None, :]', value=True)}",
        f"        dk = tl.full((BLOCK_N1, HEAD_DIM_PAD), 0.0, {acc})",
        f"        dv = tl.full((BLOCK_N1, V_HEAD_DIM_PAD), 0.0, {acc})",
        "        for g in range(GQA_GROUP):",
        "            h = h_kv * GQA_GROUP + g  # the query head the mods see",
        *dropout_head(spec, "            ", HEADS),
        *hoisted_lines(r.mods, "            "),
        "            # this tile's column of the BlockMask's query tables; batch and heads broadcast by modulo",
        "            mask_col = ((b % MASK_BATCH) * MASK_HEADS + h % MASK_HEADS) * MASK_KV_BLOCKS + (pid * BLOCK_N1) // KV_BLOCK_SIZE",
        "            # this head's query and grad_out rows as element offsets, which the loops add to the tile's",
        "            # and then to the kernel's pointers: a per-head base pointer kept across the loops would",
        "            # take a 64-bit register pair each (ALiBi D=128 spilled on sm_90)",
        "            if INT64_OFFSETS:  # a tensor holds 2**31 elements or more",
        "                q_head = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh",
        "                do_head = b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh",
        "            else:",
        "                q_head = b * stride_qb + h * stride_qh",
        "                do_head = b * stride_dob + h * stride_doh",
        "            lse_base = lse_ptr + b * stride_lb + h * stride_lh",
        "            delta_base = delta_ptr + b * stride_lb + h * stride_lh",
        *(["            row_sum_base = row_sum_ptr + b * stride_lb + h * stride_lh"] if spec.precise else []),
        "            # 1. partial query blocks: score_mod and mask_mod",
        *dkdv_call("partial", False),
    ]
    if full:
        body += ["            # 2. full query blocks: score_mod only", *dkdv_call("full", True)]
    body += [
        "        dk_out = dk_ptr + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd",
        f"        {store('dk_out', '(dk * scale).to(dk_ptr.dtype.element_ty)', 'kv_in_range[:, None]', d_check)}",
        "        dv_out = dv_ptr + b * stride_dvb + h_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd",
        f"        {store('dv_out', 'dv.to(dv_ptr.dtype.element_ty)', 'kv_in_range[:, None]', dv_check)}",
        "    else:",
        "        # ---- a dQ program: one query tile of one query head ----",
        "        tile = pid - NUM_KV_TILES",
        "        h = h_kv * GQA_GROUP + tile // NUM_Q_TILES  # the query head the mods see",
        *dropout_head(spec, "        ", HEADS),
        *hoisted_lines(r.mods, "        "),
        "        q_tile = tile % NUM_Q_TILES",
        "        offs_m = q_tile * BLOCK_M2 + tl.arange(0, BLOCK_M2)",
        *tile_bounds("        ", "q_in_range", "q_idx", "offs_m", "Q_LEN", "BLOCK_M2", "[:, None]"),
        f"        dq = tl.full((BLOCK_M2, HEAD_DIM_PAD), 0.0, {acc})",
    ]
    if not _ignores_score(d_score):
        body += [
            "        q = tl.load(query_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,",
            f"                    mask={bounds('q_in_range[:, None]', d_check)}, other=0.0){widen}",
            "        do = tl.load(grad_out_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,",
            f"                     mask={bounds('q_in_range[:, None]', dv_check)}, other=0.0){widen}",
            "        # the forward's row max (base 2; +inf where nothing is allowed: p = 0) and row sum: this",
            "        # program's p = exp2(score - max) sum to the forward's sum, and dq is divided by it at the end",
            ("        row_max = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m, mask=q_in_range, "
             "other=float(\"inf\"))  # natural log: the row pass's" if spec.precise else
             "        row_max = tl.load(row_max_ptr + b * stride_lb + h * stride_lh + offs_m, mask=q_in_range, other=float(\"inf\"))"),
            "        row_sum = tl.load(row_sum_ptr + b * stride_lb + h * stride_lh + offs_m, mask=q_in_range, other=1.0)",
            "        delta = tl.load(delta_ptr + b * stride_lb + h * stride_lh + offs_m, mask=q_in_range, other=0.0)",
            "        mask_row = ((b % MASK_BATCH) * MASK_HEADS + h % MASK_HEADS) * MASK_Q_BLOCKS + (q_tile * BLOCK_M2) // Q_BLOCK_SIZE",
            "        # 1. partial key blocks: score_mod and mask_mod",
            *dq_call("partial", False),
        ]
        if full:
            body += ["        # 2. full key blocks: score_mod only", *dq_call("full", True)]
        body.append("        dq = dq / row_sum[:, None]  # the probabilities' normalisation, once per row")
    else:
        body.append("        # the score_mod ignores the score: no gradient reaches q (or k)")
    body += [
        "        dq_out = dq_ptr + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd",
        f"        {store('dq_out', '(dq * scale).to(dq_ptr.dtype.element_ty)', 'q_in_range[:, None]', d_check)}",
    ]
    return body


__all__ = ["BackwardSpec", "GeneratedBackward", "KERNEL_NAME", "RenderedBackward", "generate_backward", "kernel_params",
           "key_walk", "mod_call", "render_backward", "score_mod_lines", "tile_bounds"]
