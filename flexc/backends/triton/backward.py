"""The generated-Triton backward: its spec, its prologue or row pass, and the launch.

:func:`triton_backward` is what ``BACKEND: "TRITON"`` runs for ``flex_attention``'s backward (on
CUDA compiled, on CPU through Triton's interpreter): two launches, no eager pass. The training
forward (:func:`forward_for_training`) saves, beside the logsumexp the user sees, each row's base-2
max and sum of ``exp2(score − max)`` (``stats``). The prologue (:mod:`flexc.codegen.prologue`)
computes ``delta = rowsum(out · dO) − dlse`` and the base-2 logsumexp from them per query row, or
with ``PRECISE_GRADIENTS`` (the default for fp32/fp64 inputs) the row pass
(:mod:`flexc.codegen.backward_rows`) computes delta and the probabilities' sum from the backward's
own probabilities; the kernel of :mod:`flexc.codegen.backward` then writes the gradients. Key/value gradients
of a batch-broadcast key (``Bkv = 1``) are computed per batch and summed afterwards, so no
program ever adds into another's dk/dv; captured-tensor gradients go through fp32/fp64 atomics.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv, transpose_ordered
from ...codegen.backward import BackwardSpec
from ...codegen.backward_rows import rows_spec
from ...codegen.prologue import PrologueSpec
from ...codegen.scalars import lift_for_call
from ...constants import LN2
from ...dtypes import work_dtype, work_dtype_name
from ...codegen.spec import padded_head_dim
from ...mods.traced_mod import TracedMod, trainable_slots
from .. import registry
from ..dropout import Dropout
from ..layout import EmptyMaker, output_maker
from ..nonfinite import all_finite
from . import cache, config, forward, launcher, retry
from .sources import sources_text


def make_backward_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, dtype: torch.dtype, head_dim: int,
                       v_head_dim: int, block_size: tuple[int, int] | None, kernel_options: dict | None,
                       target: str, grad_slots: Sequence[int] = (), has_full_blocks: bool = True,
                       index_dtype: str = "int32", dropout: bool = False, float_indices: bool = False) -> BackwardSpec:
    """The :class:`BackwardSpec` for these mods and shapes; ``block_size=None`` means no BlockMask.
    ``index_dtype`` is the mods' integer index type (see :mod:`flexc.codegen.index_width`); ``dropout``
    compiles the forward's attention dropout in; ``float_indices``: every index below 2**23
    (:func:`flexc.codegen.index_width.float_indices`)."""
    if block_size is None:
        # no BlockMask: every block is full; blocks as large as the largest tile
        m1, n1, m2, n2, warps, stages = config.resolve_backward_config(kernel_options, dtype, head_dim, 1 << 20,
                                                                       1 << 20, target)
        q_block, kv_block, mask_mod, has_full_blocks = max(m1, m2), max(n1, n2), None, True
    else:
        q_block, kv_block = block_size
        m1, n1, m2, n2, warps, stages = config.resolve_backward_config(kernel_options, dtype, head_dim, q_block,
                                                                       kv_block, target)
    return BackwardSpec(score_mod=score_mod, mask_mod=mask_mod, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim,
                        q_block_size=q_block, kv_block_size=kv_block, block_m1=m1, block_n1=n1, block_m2=m2,
                        block_n2=n2, num_warps=warps, num_stages=stages, has_full_blocks=has_full_blocks,
                        grad_slots=tuple(grad_slots), target=target,
                        fp32_precision=config.fp32_precision(target, kernel_options), index_dtype=index_dtype,
                        dropout=dropout, precise=precise_gradients(kernel_options, dtype), float_indices=float_indices)


def precise_gradients(kernel_options: dict | None, dtype: torch.dtype) -> bool:
    """``PRECISE_GRADIENTS`` (flexc's kernel option): the backward's row pass and, for 16-bit inputs,
    dS as two operands (:mod:`flexc.codegen.backward_rows`). By default on for fp32 and fp64 inputs,
    whose users chose them for accuracy; off for fp16/bf16, whose backward then does torch's
    template's arithmetic at its cost (the option adds two dots per pair to the row pass and two
    to the backward's seven)."""
    default = dtype in (torch.float32, torch.float64)
    return bool((kernel_options or {}).get("PRECISE_GRADIENTS", default))


def spec_for_call(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  block_mask: Any, kernel_options: dict | None, grad_slots: Sequence[int] = (),
                  dropout: bool = False) -> BackwardSpec:
    """The backward spec that a flex_attention call with these (validated) arguments runs."""
    layout = config.call_layout(query, value, score_mod, mask_mod, block_mask, kernel_options)
    return make_backward_spec(score_mod, mask_mod, query.dtype, query.shape[-1], value.shape[-1], layout.block_size,
                              kernel_options, layout.target, grad_slots, layout.has_full_blocks, layout.index_dtype,
                              dropout, layout.float_indices)


def prologue_spec(spec: BackwardSpec) -> PrologueSpec:
    """The prologue kernel that computes delta and the base-2 logsumexp for the backward ``spec``:
    rows of the value head dim in the work dtype, about 8K elements a program."""
    v_pad = padded_head_dim(spec.v_head_dim)
    work = work_dtype_name(spec.dtype)
    return PrologueSpec(work_dtype=work, v_head_dim_pad=v_pad, block_rows=min(128, max(16, 8192 // v_pad)),
                        target=spec.target)


def launch_prologue(spec: PrologueSpec, out, stats, grad_out, grad_lse, work_dtype: torch.dtype,
                    kernel: cache.Kernel | None = None, kept: dict | None = None, rows: EmptyMaker | None = None):
    """Run the prologue kernel: ``(delta, lse2)``, each ``[B, Hq, L]`` contiguous in ``work_dtype``
    (``stats``: the forward's ``[2, B, Hq, L]``, or its two planes; ``kernel``: the prologue's, when the
    caller keeps it; ``kept``: where a caller of one signature keeps the launch's grid, the arguments
    after its tensors and its constexprs, by the tensors' strides (no tensor of a call is kept);
    ``rows``: makes the two, when the caller keeps it)."""
    if rows is None:
        rows = EmptyMaker(stats[0].shape, work_dtype, out.device)
    delta, lse2 = rows(), rows()
    if kernel is None:
        kernel = cache.get_kernel(spec, out.device)
    strides = (out.stride(), stats[0].stride(), grad_out.stride(), None if grad_lse is None else grad_lse.stride())
    known = kept.get(strides) if kept is not None else None
    grid = known[0] if known is not None else prologue_grid(spec, out)
    args, constants = prologue_arguments(spec, out, grad_out, stats, grad_lse, delta, lse2,
                                                  known[1] if known is not None else None)
    if kept is not None and known is None:
        kept[strides] = (grid, (args[PROLOGUE_TENSORS:], constants))
    # (the arguments past the tensors are the same at every launch with these strides)
    gpu.launch(kernel.fn, grid, spec, out.device, args, constants,
               fixed=len(args) - PROLOGUE_TENSORS if kept is not None else 0)
    return delta, lse2


def _row_pass_inputs(stats: torch.Tensor, grad_lse: torch.Tensor | None, sinks: torch.Tensor | None,
                     acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the row pass (PRECISE_GRADIENTS, :mod:`flexc.codegen.backward_rows`) starts from, ``[B, Hq, L]``
    each in ``acc``: ``delta = -dlse``; ``m``, each row's max in natural units (the forward's base-2 max
    times ln 2, ``+inf`` where nothing is allowed), from which both the row pass and the backward take
    ``p = exp(score - m)``; and the row's sum of ``p`` so far: the sink's share ``exp(sink - m)``
    (0 without sinks). The row pass adds the keys' ``p`` and ``p * dp`` to the last two."""
    m = stats[0].to(acc) * LN2
    delta = (-grad_lse.to(acc)).contiguous() if grad_lse is not None else torch.zeros_like(m)
    start = torch.exp(sinks.to(acc) - m) if sinks is not None else torch.zeros_like(m)
    return delta, m, torch.stack([stats[0].to(acc), start.expand_as(m)])


class BackwardLaunch:
    """The backward kernels' launches for one call signature: spec, first kernel and cache keys decided
    once, then launched on each call's tensors and tables (:func:`triton_backward` makes one and runs it once; a training
    call's plan keeps one, :func:`prepare_training`). The first launch runs out of GPU resources into
    smaller tiles (:func:`flexc.backends.triton.retry.launch_with_fallbacks`); later ones take what worked."""

    def __init__(self, spec: BackwardSpec, query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                 mask_mod: TracedMod | None, block_mask: Any, scale: float):
        self.spec, self.score_mod, self.mask_mod, self.scale = spec, score_mod, mask_mod, scale
        self.device, self.lengths = query.device, (query.shape[2], value.shape[2])
        self.acc = work_dtype(query.dtype)
        self.nothing = query.numel() == 0 or value.shape[2] == 0
        self.tables = launcher.LastTables(self.tables_of)
        if not self.nothing:
            self.tables(block_mask)  # (its checks, once)
        self.worked = False  # launched once with this spec, nothing replaced it: no retry needed
        # the kernel launched before the backward kernel (row pass or prologue), and the cache keys of
        # both: made once for this spec (a replaced spec makes its own). The kernels are looked up at
        # each launch: the cache's LRU order sees every use, and an evicted kernel is freed
        self.first = rows_spec(spec) if spec.precise else prologue_spec(spec)
        self.keys = (cache.kernel_key(self.first, self.device), cache.kernel_key(spec, self.device))
        # what the launches pass besides the call's tensors: the backward kernel's per grad_out strides
        # (backward_argument_tail) and per input guard (backward_constexprs), the
        # prologue's per gradients' strides (launch_prologue)
        self.tails: dict[tuple, list] = {}
        self.constants: dict[bool, dict] = {}
        self.prologue: dict[tuple, tuple] = {}
        self.grids = (None if self.nothing else
                      (backward_rows_grid(spec, query, value), backward_grid(spec, query, value)))
        # what allocates the gradients (made at the first call: backward_output_makers) and
        # the prologue's outputs
        self.makers: tuple | None = None
        self.rows = EmptyMaker(query.shape[:3], self.acc, self.device)

    def tables_of(self, block_mask: Any) -> list:
        L, S = self.lengths
        tables = backward_tables(block_mask, self.spec, L, S, self.device)
        launcher.check_query_blocks(tables, L, self.spec.q_block_size)
        return tables

    def __call__(self, query, key, value, out, stats, grad_out, grad_lse, block_mask: Any,
                 dropout: Dropout | None = None, sinks: torch.Tensor | None = None, mods: tuple | None = None,
                 same_tables: bool = False):
        """``(dq, dk, dv, [gradient of each spec.grad_slots tensor])`` of this call (see
        :func:`triton_backward`) on its ``block_mask``; ``mods`` and ``same_tables`` as
        :meth:`flexc.backends.triton.forward.ForwardLaunch.__call__` takes them."""
        launcher.check_dropout(self.spec, dropout)
        score_mod, mask_mod = mods if mods is not None else (self.score_mod, self.mask_mod)
        device, acc = self.device, self.acc
        if self.nothing:
            dq, dk, dv, summed, grads = backward_outputs(self.spec, query, key, value, score_mod)
            return (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value),
                    [g.to(score_mod.buffers[s].dtype) for g, s in zip(grads, self.spec.grad_slots)])
        tables = self.tables(block_mask, same_tables)

        def attempt(spec: BackwardSpec):
            # everything from the outputs on: a retry starts over (the row pass adds into its inputs)
            mine = spec is self.spec
            if mine and self.makers is None:
                self.makers = backward_output_makers(query, key, value)
            dq, dk, dv, summed, grads = backward_outputs(spec, query, key, value, score_mod,
                                                                  self.makers if mine else None)
            first = self.first if mine else rows_spec(spec) if spec.precise else prologue_spec(spec)
            first_key, key_of_spec = self.keys if mine else (None, None)
            first_kernel = cache.get_kernel(first, device, first_key)  # (kernels in launch order)
            kernel = cache.get_kernel(spec, device, key_of_spec)
            if spec.precise:
                delta, lse2, row_stats = _row_pass_inputs(stats, grad_lse, sinks, acc)
            else:
                # the prologue: delta = rowsum(out * dO) - dlse, and the logsumexp in base 2 (+inf where nothing is allowed)
                # (the statistics' two planes taken once, for both launches' arguments)
                row_stats = stats.unbind(0)
                delta, lse2 = launch_prologue(first, out, row_stats, grad_out, grad_lse, acc, first_kernel,
                                              self.prologue if mine else None, self.rows)
            guard = guards_nonfinite_inputs(spec, query, key)
            tail = constants = None
            if mine:
                tail, constants = self.tails.get(grad_out.stride()), self.constants.get(guard)
                if tail is None:
                    tail = self.tails[grad_out.stride()] = backward_argument_tail(
                        query, key, value, grad_out, delta, dq, dk, dv, tables, self.scale)
            args, constants = backward_arguments(spec, kernel.generated, query, key, value, grad_out, lse2,
                                                          delta, row_stats, dq, dk, dv, tables, grads, score_mod,
                                                          mask_mod, self.scale, guard, dropout, tail, constants)
            if mine:
                self.constants[guard] = constants
            rows_grid, grid = (self.grids if mine else (backward_rows_grid(spec, query, key),
                                                        backward_grid(spec, query, key)))
            fixed = len(tail) if mine else 0  # (the kept tail: the same at every launch with these strides)
            if spec.precise:
                gpu.launch(first_kernel.fn, rows_grid, spec, device, args, constants, fixed)
            gpu.launch(kernel.fn, grid, spec, device, args, constants, fixed)
            if summed:
                dk = dk.sum(0, keepdim=True).to(key.dtype)
                dv = dv.sum(0, keepdim=True).to(value.dtype)
            return dq, dk, dv, [g.to(score_mod.buffers[s].dtype) for g, s in zip(grads, spec.grad_slots)]

        if self.worked:
            return attempt(self.spec)
        result = retry.launch_with_fallbacks(self.spec, device, attempt, "backward")
        self.worked = cache.resolve_fallback(self.spec, device) is self.spec
        return result


class BackwardPlan(NamedTuple):
    """The backward kernel a training call launches, and the mods it takes."""

    score_mod: TracedMod | None  # the call's mods, captured numbers lifted to kernel arguments
    mask_mod: TracedMod | None
    # (PrologueSpec, BackwardSpec), with PRECISE_GRADIENTS (BackwardRowsSpec, BackwardSpec), or () when
    # nothing is launched (no query rows or no keys)
    kernels: tuple


def launches_nothing(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :class:`BackwardLaunch` returns zero gradients without a kernel (no query rows or no keys)."""
    return query.numel() == 0 or value.shape[-2] == 0


def plan_backward(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  block_mask: Any, kernel_options: dict | None, grad_slots: Sequence[int] = (),
                 dropout: bool = False) -> BackwardPlan:
    """The backward kernel for these (validated) arguments (``dropout``: the call drops attention): the
    one rule :func:`triton_backward` and :func:`flexc.kernel_source` share."""
    score_mod, mask_mod = lift_for_call(query, score_mod, mask_mod)  # captured numbers become arguments
    if launches_nothing(query, value):
        return BackwardPlan(score_mod, mask_mod, ())
    spec = spec_for_call(query, value, score_mod, mask_mod, block_mask, kernel_options, tuple(grad_slots), dropout)
    return BackwardPlan(score_mod, mask_mod, (rows_spec(spec) if spec.precise else prologue_spec(spec), spec))


def triton_backward(query, key, value, out, stats, grad_out, grad_lse, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, scale: float, grad_slots: Sequence[int] = (),
                    kernel_options: dict | None = None, dropout: Dropout | None = None,
                    sinks: torch.Tensor | None = None):
    """The ``"TRITON"`` backward: ``(dq, dk, dv, buffer_grads)`` like :func:`torch_cpu_backward.torch_backward`.

    ``stats`` are :func:`forward_for_training`'s (in place of the logsumexp ``torch_backward`` takes);
    ``grad_lse`` may be None; ``buffer_grads`` follows ``grad_slots``; ``dropout`` is the forward's
    (``out`` its dropped output). The kernel is :func:`plan_backward`'s.
    """
    return backward_launch(query, value, score_mod, mask_mod, block_mask, scale, kernel_options, grad_slots,
                           dropout is not None)(query, key, value, out, stats, grad_out, grad_lse, block_mask, dropout,
                                                sinks)


def backward_launch(query, value, score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any,
                    scale: float, kernel_options: dict | None, grad_slots: Sequence[int] = (),
                    dropout: bool = False) -> BackwardLaunch:
    """The :class:`BackwardLaunch` of :func:`plan_backward`'s kernels for calls of this signature."""
    plan = plan_backward(query, value, score_mod, mask_mod, block_mask, kernel_options, grad_slots, dropout)
    if plan.kernels:
        spec = plan.kernels[1]  # (the launch runs the prologue or row pass kernels[0] of it first)
    else:  # the launch returns the zero gradients without a kernel
        spec = spec_for_call(query, value, plan.score_mod, plan.mask_mod, block_mask, kernel_options,
                             tuple(grad_slots), dropout)
    return BackwardLaunch(spec, query, value, plan.score_mod, plan.mask_mod, block_mask, scale)


def forward_for_training(query, key, value, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                         block_mask: Any, scale: float, kernel_options: dict | None, dropout: Dropout | None = None,
                         sinks: torch.Tensor | None = None):
    """The Triton forward that autograd saves for :func:`triton_backward`: ``(out, lse, stats)``, the
    logsumexp (the user's) and ``stats`` ``[2, B, Hq, L]``, each row's base-2 max (+inf where the row
    allows nothing) and its sum of ``exp2(score − max)``: the backward's probabilities come from them,
    so they sum to 1 as the forward's did. Float64 for float64 inputs. Its kernel is
    :func:`flexc.backends.triton.forward.plan_forward`'s with ``training=True``: the forward kernel
    that writes them, for short queries too (with ``dropout``'s mask drawn). With ``sinks`` the kernel
    folds them into the online softmax, so the statistics (and the logsumexp) include them and the
    backward needs no sink of its own."""
    plan = forward.plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, True,
                                training=True, dropout=dropout is not None, sinks=sinks is not None)
    return forward.launch_plan(plan, query, key, value, block_mask, scale, kernel_options, True, dropout, sinks,
                               training=True)


def backward_source(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, kernel_options: dict | None,
                    dropout: bool = False) -> str:
    """The backward source a training call with these arguments runs (captured tensors that
    require grad receive gradients; ``dropout``: the call drops attention); compiles nothing.
    :func:`flexc.kernel_source` with ``backward=True`` also says when no generated backward runs."""
    plan = plan_backward(query, value, score_mod, mask_mod, block_mask, kernel_options, trainable_slots(score_mod),
                         dropout)
    if not plan.kernels:
        return ("# flexc: this call's backward launches no kernel: it has no query rows or no keys, so the\n"
                "# gradients are zeros.\n")
    # the backward that replaced this one on the device's GPU brings its own row pass
    spec = cache.resolve_fallback(plan.kernels[1], query.device)
    return sources_text((rows_spec(spec) if spec.precise else plan.kernels[0], spec), query.device)


def prepare_training(query, key, value, score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any,
                     scale: float, kernel_options: dict | None, grad_slots: Sequence[int] = (), dropout: bool = False,
                     sinks: bool = False, compiled: bool = False, same_tables: bool = False
                     ) -> tuple[Callable, Callable]:
    """:func:`forward_for_training` and :func:`triton_backward` for calls of this signature, decided once
    (the backend's training preparation in :mod:`flexc.backends.registry`): callables with their
    signatures, reading each call's tensors and BlockMask tables (the tables of the last call while
    they live, when ``same_tables``: every call's mask holds the same tables,
    :class:`flexc.backends.triton.launcher.LastTables`). An eager plan's (``compiled`` False) ignore
    the mods, scale and options they are passed (the plan's are these); a compiled call's read the
    captured tensors of the mods they are passed."""
    plan = forward.plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, True,
                                training=True, dropout=dropout, sinks=sinks)
    forward_launches = forward.plan_launches(plan, query, key, value, block_mask, scale, kernel_options, True,
                                             dropout, sinks, training=True)
    decided: list = []  # the BackwardLaunch, made at the first backward (its errors are the backward's)
    planned = (score_mod, mask_mod, scale, kernel_options, tuple(grad_slots))

    def prepared_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, dropout=None,
                         sinks=None):
        return forward_launches(query, key, value, block_mask, dropout, sinks,
                                (score_mod, mask_mod) if compiled else None, same_tables)

    def prepared_backward(query, key, value, out, stats, grad_out, grad_lse, call_score_mod, call_mask_mod,
                          block_mask, _scale, _grad_slots=(), _kernel_options=None, dropout=None, sinks=None):
        score_mod, mask_mod, scale, kernel_options, grad_slots = planned
        if not decided:
            decided.append(backward_launch(query, value, score_mod, mask_mod, block_mask, scale, kernel_options,
                                           grad_slots, dropout is not None))
        return decided[0](query, key, value, out, stats, grad_out, grad_lse, block_mask, dropout, sinks,
                          (call_score_mod, call_mask_mod) if compiled else None, same_tables)

    return prepared_forward, prepared_backward


registry.register_training(registry.TRITON, forward_for_training, triton_backward, prepare=prepare_training)


# ---- the backward's kernels' arguments, constexprs and grids (prologue, row pass, backward) --


def backward_tables(block_mask: Any, spec: BackwardSpec, L: int, S: int, device: torch.device) -> list[torch.Tensor]:
    """Key-direction then query-direction tables (partial, then full when kept apart), int32."""
    if block_mask is None:
        nq, nkv = max(1, cdiv(L, spec.q_block_size)), max(1, cdiv(S, spec.kv_block_size))
        i32 = dict(dtype=torch.int32, device=device)
        return [torch.zeros((1, 1, nq), **i32), torch.zeros((1, 1, nq, nkv), **i32),
                torch.full((1, 1, nq), nkv, **i32), torch.arange(nkv, **i32).expand(1, 1, nq, nkv).contiguous(),
                torch.zeros((1, 1, nkv), **i32), torch.zeros((1, 1, nkv, nq), **i32),
                torch.full((1, 1, nkv), nq, **i32), torch.arange(nq, **i32).expand(1, 1, nkv, nq).contiguous()]
    kv = launcher.kv_tables(block_mask, spec, S, device)
    if getattr(block_mask, "q_num_blocks", None) is not None and getattr(block_mask, "q_indices", None) is not None \
            and (not spec.has_full_blocks or getattr(block_mask, "full_q_num_blocks", None) is not None):
        names = ["q_num_blocks", "q_indices"] + (["full_q_num_blocks", "full_q_indices"] if spec.has_full_blocks else [])
        q = [getattr(block_mask, n).to(device=device, dtype=torch.int32).contiguous() for n in names]
    else:  # derive the query-direction tables from the key-direction ones, as torch does
        q = list(transpose_ordered(kv[0], kv[1]))
        if spec.has_full_blocks:
            q += list(transpose_ordered(kv[2], kv[3]))
        q = [t.to(device=device, dtype=torch.int32).contiguous() for t in q]
    if spec.has_full_blocks:
        return [kv[0], kv[1], kv[2], kv[3], q[0], q[1], q[2], q[3]]
    return [kv[0], kv[1], q[0], q[1]]


def backward_outputs(spec: BackwardSpec, query, key, value, score_mod, makers: tuple | None = None) -> tuple:
    """``(dq, dk, dv, summed, grads)``: dk/dv per query batch, summed afterwards when ``Bkv == 1 < B``;
    ``makers``: :func:`backward_output_makers` of a call of the same signature, when the caller keeps them."""
    make_dq, make_dk, make_dv, summed = makers if makers is not None else backward_output_makers(query, key, value)
    grads = [torch.zeros(score_mod.buffers[s].shape, dtype=spec.grad_dtype(s), device=query.device)
             for s in spec.grad_slots] if spec.grad_slots else []
    return make_dq(query), make_dk(key), make_dv(value), summed, grads


def backward_output_makers(query, key, value) -> tuple:
    """``(make_dq, make_dk, make_dv, summed)`` for the calls of one signature
    (:func:`flexc.backends.layout.output_maker`): each gradient laid out like its input, as the caller
    returns it; dk and dv row-major in the work dtype when they are summed over the batch afterwards."""
    B, Hkv, S, E, Ev = query.shape[0], key.shape[1], key.shape[2], key.shape[3], value.shape[3]
    summed = key.shape[0] == 1 and B > 1
    if summed:
        acc = work_dtype(query.dtype)
        dk, dv = EmptyMaker((B, Hkv, S, E), acc, query.device), EmptyMaker((B, Hkv, S, Ev), acc, query.device)
        return output_maker(query), lambda _key: dk(), lambda _value: dv(), summed
    return output_maker(query), output_maker(key), output_maker(value), summed


def backward_arguments(spec: BackwardSpec, generated, query, key, value, grad_out, lse2, delta, stats, dq, dk, dv, tables,
                       grads, score_mod, mask_mod, scale: float, guard_inputs: bool | None = None,
                       dropout: Dropout | None = None, tail: list | None = None, constants: dict | None = None
                       ) -> tuple[list, dict]:
    """The backward kernel's positional arguments and constexprs for one launch (``guard_inputs``:
    compile the NaN/inf input guard in; by default the launcher's choice for these tensors; ``dropout``:
    the forward's, for a spec with dropout; ``tail`` and ``constants``: the :func:`backward_argument_tail`
    and :func:`backward_constexprs` of an earlier call of the same signature, ``grad_out`` strides
    and guard, when the caller keeps them)."""
    device = query.device
    buffers = launcher.mod_arguments(generated, score_mod, mask_mod, device)
    if generated.grad_params:
        by_slot = dict(zip(spec.grad_slots, grads))
        for p in generated.grad_params:
            g = by_slot[p.slot]
            buffers.append(g if p.what == "ptr" else g.stride(p.dim) if p.what == "stride" else g.shape[p.dim])
    launcher.check_dropout(spec, dropout)
    if dropout is not None:
        buffers += launcher.dropout_arguments(dropout, device)
    if tail is None:
        tail = backward_argument_tail(query, key, value, grad_out, delta, dq, dk, dv, tables, scale)
    # stats [2, B, Hq, L] (the forward's), or its two planes: both contiguous, strided as lse2 and delta
    args = [query, key, value, grad_out, lse2, delta, stats[0], stats[1], dq, dk, dv, *tables, *buffers, *tail]
    if constants is not None:
        return args, constants
    if guard_inputs is None:
        guard_inputs = guards_nonfinite_inputs(spec, query, key)
    return args, backward_constexprs(spec, query, value, grad_out, guard_inputs)


def guards_nonfinite_inputs(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the backward compiles in the guard zeroing masked NaN/inf query and key entries: only
    where it can matter (CPU calls with such entries; on CUDA as torch's kernels, see
    :func:`guards_nonfinite_values`)."""
    return spec.mask_mod is not None and gpu.is_plain_cpu(query.device) and not all_finite(query, key)


def backward_argument_tail(query, key, value, grad_out, delta, dq, dk, dv, tables, scale: float) -> list:
    """The backward kernel's :func:`kernel_argument_tail`: the same for every call of one signature
    whose ``grad_out`` has the same strides (the other tensors' strides follow from the shapes)."""
    L, S = query.shape[2], value.shape[2]
    return launcher.kernel_argument_tail(query, key, value, tables, [float(scale), L, S, query.shape[1] // value.shape[1]],
                                [*grad_out.stride(), delta.stride(0), delta.stride(1), *dq.stride(), *dk.stride(),
                                 *dv.stride()])


def backward_constexprs(spec: BackwardSpec, query, value, grad_out, guard_inputs: bool) -> dict:
    """The backward kernel's compile-time arguments for one call's shapes and its input guard."""
    L, E = query.shape[2], query.shape[3]
    S, Ev = value.shape[2], value.shape[3]
    return dict(BLOCK_M1=spec.block_m1, BLOCK_N1=spec.block_n1, BLOCK_M2=spec.block_m2, BLOCK_N2=spec.block_n2,
                Q_BLOCK_SIZE=spec.q_block_size, KV_BLOCK_SIZE=spec.kv_block_size,
                # lengths that are multiples of the blocks (so of every tile: blocks are multiples
                # of the tiles) need no bounds checks (a second variant). Tiles alone do not do:
                # the loops walk every tile of a listed block, past the end of a last, shorter one
                DIVISIBLE=L % spec.q_block_size == 0 and S % spec.kv_block_size == 0,
                GUARD_NONFINITE_INPUTS=guard_inputs, HEAD_DIM=E,
                HEAD_DIM_PAD=padded_head_dim(E), V_HEAD_DIM=Ev, V_HEAD_DIM_PAD=padded_head_dim(Ev),
                # the dK/dV programs' head offsets into query and grad_out in int64
                INT64_OFFSETS=max(query.numel(), grad_out.numel()) >= launcher.INT32_OFFSET_LIMIT)


def backward_grid(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int]:
    """Per key head and batch: the dK/dV programs (one per ``BLOCK_N1`` keys), then the dQ programs
    (one per ``BLOCK_M2`` queries of each query head in the group)."""
    B, Hq, L, _ = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    return cdiv(S, spec.block_n1) + (Hq // Hkv) * cdiv(L, spec.block_m2), Hkv, B


def backward_rows_grid(spec: BackwardSpec, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int]:
    """The backward's row pass (:mod:`flexc.codegen.backward_rows`): the dQ programs' part of
    :func:`backward_grid`, one program per ``BLOCK_M2`` queries of each query head in the group."""
    B, Hq, L, _ = query.shape
    return (Hq // key.shape[1]) * cdiv(L, spec.block_m2), key.shape[1], B


PROLOGUE_TENSORS = 7  # the prologue's tensor arguments, first in its signature (prologue_arguments)


def prologue_arguments(spec: PrologueSpec, out: torch.Tensor, grad_out: torch.Tensor, stats: torch.Tensor,
                       grad_lse: torch.Tensor | None, delta: torch.Tensor, lse2: torch.Tensor,
                       tail: tuple[list, dict] | None = None) -> tuple[list, dict]:
    """The backward prologue's positional and constexpr arguments: ``out``, ``grad_out`` ``[B, Hq, L, Ev]``,
    the forward's statistics ``stats`` ``[2, B, Hq, L]`` (or its two planes) and ``grad_lse`` (None: no gradient) ``[B, Hq, L]``
    into ``delta`` and ``lse2`` (contiguous). ``tail``: an earlier call's arguments after the first
    :data:`PROLOGUE_TENSORS` and its constexprs, for a call of the same signature and the same
    ``grad_out`` and ``grad_lse`` strides, when the caller keeps them."""
    has_grad_lse = grad_lse is not None
    grad_lse = grad_lse if has_grad_lse else delta  # an unread stand-in
    tensors = [out, grad_out, stats[0], stats[1], grad_lse, delta, lse2]
    if tail is not None:
        return tensors + tail[0], tail[1]
    return ([*tensors, out.shape[2], out.shape[3], *out.stride(), *grad_out.stride(), *stats[0].stride(),
             *grad_lse.stride(), delta.stride(0), delta.stride(1)],
            dict(BLOCK_ROWS=spec.block_rows, V_HEAD_DIM_PAD=spec.v_head_dim_pad, HAS_GRAD_LSE=has_grad_lse))


def prologue_grid(spec: PrologueSpec, out: torch.Tensor) -> tuple[int, int, int]:
    """One program per ``block_rows`` query rows, query head and batch."""
    B, Hq, L, _ = out.shape
    return cdiv(L, spec.block_rows), Hq, B


__all__ = ["backward_argument_tail", "backward_arguments", "backward_constexprs", "backward_grid", "backward_launch", "backward_output_makers", "backward_outputs", "backward_rows_grid", "backward_source", "backward_tables", "BackwardLaunch", "BackwardPlan", "forward_for_training", "guards_nonfinite_inputs", "launch_prologue", "launches_nothing", "make_backward_spec", "plan_backward", "precise_gradients", "prepare_training", "prologue_arguments", "prologue_grid", "prologue_spec", "PROLOGUE_TENSORS", "spec_for_call", "triton_backward"]
