"""The generated-Triton forward: the kernels a call runs, and their launch.

:func:`triton_forward` is registered as the ``"TRITON"`` forward in :mod:`flexc.backends.registry`.
:func:`plan_forward` picks the kernels (the forward kernel, or for short queries the split-KV
decode kernel and its merge, :mod:`.decode`); :func:`launch` finds the forward kernel for the mods'
*structure* in the cache (:mod:`.cache`) and launches it on the BlockMask's tables. CUDA tensors
run the compiled kernel; CPU tensors run the same source through Triton's interpreter.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from ... import device as gpu
from ...analysis.tiles import cdiv
from ...constants import LOG2E
from ...dtypes import work_dtype
from ...codegen.decode import DecodeSpec
from ...codegen.forward import NO_BLOCK_MASK, ForwardSpec
from ...codegen.scalars import lift_for_call
from ...codegen.spec import padded_head_dim
from ...mods.traced_mod import TracedMod
from .. import registry
from ..dropout import Dropout
from ..layout import EmptyMaker, output_maker
from . import cache, config, decode, launcher, retry
from . import tma


def make_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, dtype: torch.dtype, head_dim: int,
              v_head_dim: int, block_size: tuple[int, int] | None, kernel_options: dict | None, target: str,
              need_lse: bool, has_full_blocks: bool = True, index_dtype: str = "int32",
              training: bool = False, dropout: bool = False, sinks: bool = False,
              float_indices: bool = False) -> ForwardSpec:
    """The :class:`ForwardSpec` for these mods and shapes; ``block_size=None`` means no BlockMask.

    ``index_dtype`` is the mods' integer index type (see :mod:`flexc.codegen.index_width`);
    ``training`` adds the generated backward's statistics to the outputs; ``dropout`` compiles
    attention dropout in, ``sinks`` the learned attention sinks; ``float_indices``: every index below
    2**23 (:func:`flexc.codegen.index_width.float_indices`).
    """
    if block_size is None:
        block_m, block_n, warps, stages = config.resolve_config(kernel_options, dtype, head_dim, NO_BLOCK_MASK,
                                                                None, target)
        q_block, kv_block, mask_mod, has_full_blocks = NO_BLOCK_MASK, block_n, None, True
    else:
        q_block, kv_block = block_size
        block_m, block_n, warps, stages = config.resolve_config(kernel_options, dtype, head_dim, q_block, kv_block,
                                                                target)
    flags = config.flags(kernel_options)
    return ForwardSpec(score_mod=score_mod, mask_mod=mask_mod, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim,
                       q_block_size=q_block, kv_block_size=kv_block, block_m=block_m, block_n=block_n, num_warps=warps,
                       num_stages=stages, has_full_blocks=has_full_blocks, output_lse=need_lse or training,
                       output_stats=training, target=target,
                       fp32_precision=config.fp32_precision(target, kernel_options), prescale_qk=flags["PRESCALE_QK"],
                       rows_guaranteed_safe=flags["ROWS_GUARANTEED_SAFE"],
                       blocks_are_contiguous=flags["BLOCKS_ARE_CONTIGUOUS"], index_dtype=index_dtype, dropout=dropout,
                       sinks=sinks, float_indices=float_indices)


def spec_for_call(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  block_mask: Any, kernel_options: dict | None, need_lse: bool, training: bool = False,
                  dropout: bool = False, sinks: bool = False) -> ForwardSpec:
    """The forward kernel's spec that a flex_attention call with these (validated) arguments runs."""
    layout = config.call_layout(query, value, score_mod, mask_mod, block_mask, kernel_options)
    spec = make_spec(score_mod, mask_mod, query.dtype, query.shape[-1], value.shape[-1], layout.block_size,
                     kernel_options, layout.target, need_lse, layout.has_full_blocks, layout.index_dtype, training,
                     dropout, sinks, layout.float_indices)
    if config.pass_options(kernel_options, config.FORWARD_OPTIONS, "fwd_"):
        return spec  # the user's tiles: a GPU that lacks the memory says so, and the launch retries smaller
    return config.within_shared_memory(spec, query.device)


class ForwardPlan(NamedTuple):
    """The kernels a Triton forward launches for one call, in launch order, and the mods they take."""

    score_mod: TracedMod | None  # the call's mods, captured numbers lifted to kernel arguments
    mask_mod: TracedMod | None
    kernels: tuple  # (ForwardSpec,), (DecodeSpec, MergeSpec), or () when nothing is launched


def launches_nothing(query: torch.Tensor, value: torch.Tensor, need_lse: bool) -> bool:
    """Whether the forward kernel's launcher fills the outputs itself and launches no kernel: no
    query rows, no keys, or nothing to write (an empty value head dim without the logsumexp)."""
    B, Hq, L, _ = query.shape
    S, Ev = value.shape[-2], value.shape[-1]
    return B * Hq * L == 0 or S == 0 or (Ev == 0 and not need_lse)


def plan_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                 mask_mod: TracedMod | None, block_mask: Any, kernel_options: dict | None, need_lse: bool,
                 training: bool = False, dropout: bool = False, sinks: bool = False) -> ForwardPlan:
    """The kernels the ``"TRITON"`` forward launches for these (validated) arguments.

    The one rule :func:`triton_forward`, the training forward
    (:func:`flexc.backends.triton.backward.forward_for_training`, ``training=True``) and
    :func:`flexc.kernel_source` share: short queries (:func:`flexc.backends.triton.decode.applies`) run the
    split-KV decode kernel then its merge, except in training, whose generated backward takes the
    forward kernel's logsumexp and statistics; anything else runs the forward kernel (its logsumexp
    variant when ``need_lse`` or ``training``, which also writes the backward's statistics), or nothing
    when :func:`launches_nothing`. ``dropout`` selects either kernel's dropout variant (both draw
    the same mask, so inference with dropout decodes as it would without). ``sinks``: the call has
    learned attention sinks, which every kernel that ends a row's softmax folds in (the forward
    kernel, or the decode kernel's merge).
    """
    score_mod, mask_mod = lift_for_call(query, score_mod, mask_mod)  # captured numbers become arguments
    if not training and decode.applies(query, key, block_mask):  # short queries: split-KV decoding
        spec = decode.make_spec(score_mod, mask_mod, query, key, value, block_mask, dropout=dropout,
                                kernel_options=kernel_options)
        return ForwardPlan(score_mod, mask_mod, (spec, decode.merge_spec(spec, sinks)))
    need_lse = need_lse or training
    if launches_nothing(query, value, need_lse):
        return ForwardPlan(score_mod, mask_mod, ())
    spec = spec_for_call(query, value, score_mod, mask_mod, block_mask, kernel_options, need_lse, training, dropout,
                         sinks)
    spec = tma.choose(spec, key, value, kernel_options)  # USE_TMA: key/value tiles through descriptors
    return ForwardPlan(score_mod, mask_mod, (spec,))


class ForwardLaunch:
    """The forward kernel's launch for one call signature: spec, mods and grid decided once, then
    launched on each call's tensors (of the shapes, strides and dtypes it was made for) and its
    BlockMask's tables, read at each call: a kept plan holds no table, so a mask the caller drops
    is freed.

    :func:`launch` makes one and runs it once; :mod:`flexc.call.plans` keeps it with a call's plan,
    so a warm call allocates its outputs, lists its arguments and launches. ``lse_dtype`` float64
    keeps a float64 call's logsumexp exact for its backward. The first launch runs out of GPU
    resources into smaller tiles, or out of a TMA variant that fails to compile into plain loads
    (:func:`flexc.backends.triton.retry.launch_with_fallbacks`); later launches take what worked.
    """

    def __init__(self, spec: ForwardSpec, query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                 mask_mod: TracedMod | None, block_mask: Any, scale: float, lse_dtype: torch.dtype = torch.float32):
        B, Hq, L, _ = query.shape
        S, self.v_head_dim = value.shape[2], value.shape[3]
        self.spec, self.score_mod, self.mask_mod, self.scale, self.lse_dtype = spec, score_mod, mask_mod, scale, lse_dtype
        self.device, self.lengths = query.device, (L, S)
        self.nothing = launches_nothing(query, value, spec.output_lse)  # no rows, or no keys: rows fully masked
        self.tables = launcher.LastTables(lambda block_mask: launcher.kv_tables(block_mask, spec, S, self.device))
        if not self.nothing:
            if max(B, Hq) > 65535 and spec.target == "cuda":
                raise ValueError(f"flexc: batch {B} and query heads {Hq} must each be at most 65535 (CUDA grid "
                                 f"limit). Fix: split the batch into chunks.")
            launcher.check_query_blocks(self.tables(block_mask), L, spec.q_block_size)
        self.grid = forward_grid(spec, query)
        self.worked = False  # launched once with this spec, nothing replaced it: no retry needed
        self.kernel_key = cache.kernel_key(spec, self.device)
        self.tail: list | None = None  # the kernel's arguments after its tensors (forward_argument_tail)
        # the outputs' allocations (the output laid out like the query, launcher.empty_output)
        self.new_out = output_maker(query, (B, Hq, L, self.v_head_dim))
        self.new_lse = EmptyMaker((B, Hq, L), lse_dtype, self.device) if spec.output_lse else None
        self.new_stats = EmptyMaker((2, B, Hq, L), lse_dtype, self.device) if spec.output_stats else None
        self.constants: dict[bool, dict] = {}  # by whether the non-finite values guard is compiled in

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                 dropout: Dropout | None = None, sinks: torch.Tensor | None = None, mods: tuple | None = None,
                 same_tables: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(out, lse, stats)`` of this call (see :func:`launch`) on its ``block_mask`` (of the planned
        layout); ``mods``: this call's ``(score_mod, mask_mod)`` of the planned structure, whose
        captured tensors it reads (a compiled call's), else the planned ones; ``same_tables``: the
        caller vouches that the mask holds the tables of the earlier calls (:class:`launcher.LastTables`)."""
        spec = self.spec
        tables = [] if self.nothing else self.tables(block_mask, same_tables)
        score_mod, mask_mod = mods if mods is not None else (self.score_mod, self.mask_mod)
        launcher.check_dropout(spec, dropout)
        launcher.check_sinks(spec, sinks)
        out = self.new_out(query)
        lse = self.new_lse() if spec.output_lse else None
        stats = self.new_stats() if spec.output_stats else None
        if self.nothing:
            out.zero_()
            _fill_dead_rows(lse, stats, sinks)
            return out, lse, stats
        guard_values = launcher.guards_nonfinite_values(spec, value)

        def attempt(spec: ForwardSpec) -> None:
            mine = spec is self.spec
            # (looked up at each launch, by the key made once: the cache's LRU order and eviction
            # see every use, and an evicted kernel's module is freed even while a plan lives)
            kernel = cache.get_kernel(spec, self.device, self.kernel_key if mine else None)
            if mine and self.tail is None:
                self.tail = forward_argument_tail(kernel.generated, query, key, value, out, lse, tables,
                                                           self.scale)
            args = forward_arguments(kernel.generated, query, key, value, out, lse, tables, score_mod,
                                              mask_mod, self.scale, stats, dropout, sinks,
                                              self.tail if mine else None)
            constants = self.constants.get(guard_values) if spec is self.spec else None
            if constants is None:
                constants = forward_constexprs(spec, *self.lengths, args, guard_values, self.scale)
                if spec is self.spec:
                    self.constants[guard_values] = constants
            if spec.tma and not gpu.runs_interpreted(self.device):  # the descriptors' scratch memory
                tma.ensure_allocator()
            gpu.launch(kernel.fn, self.grid if spec is self.spec else forward_grid(spec, query), spec,
                       self.device, args, constants, len(self.tail) if mine else 0)

        if self.worked:
            attempt(spec)
        else:
            retry.launch_with_fallbacks(spec, self.device, attempt, "forward")
            # (a replaced spec keeps the retry's path: its grid and constants differ)
            self.worked = cache.resolve_fallback(spec, self.device) is spec
        return out, lse, stats


def launch(spec: ForwardSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float,
           lse_dtype: torch.dtype = torch.float32, dropout: Dropout | None = None,
           sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the forward kernel for ``spec`` on these tensors; the mods supply the captured-tensor values,
    ``dropout`` the seed and probability of a spec with dropout, ``sinks`` (``[B or 1, Hq, 1]``) the
    sink logits of a spec with sinks: ``(out, lse, stats)``, ``stats`` the
    backward's statistics ``[2, B, Hq, L]`` (each row's base-2 max, then its sum of exp2(score - max);
    :mod:`flexc.backends.triton.backward`) where ``spec.output_stats``. One :class:`ForwardLaunch`,
    made and run once.
    """
    return ForwardLaunch(spec, query, value, score_mod, mask_mod, block_mask, scale, lse_dtype)(
        query, key, value, block_mask, dropout, sinks)


def _fill_dead_rows(lse: torch.Tensor | None, stats: torch.Tensor | None, sinks: torch.Tensor | None) -> None:
    """The logsumexp and statistics the kernel writes for rows that allow nothing: the sink's state
    (lse the sink, base-2 max the sink's, sum 1), or lse -inf, max +inf and sum 1 where there is no sink."""
    if lse is not None:
        lse.copy_(sinks.expand(lse.shape)) if sinks is not None else lse.fill_(float("-inf"))
    if stats is not None:
        sink2 = sinks.to(stats.dtype) * LOG2E if sinks is not None else None
        stats[0].copy_(sink2.masked_fill(sink2 == float("-inf"), float("inf")).expand(stats[0].shape)
                       if sink2 is not None else torch.full_like(stats[0], float("inf")))
        stats[1].fill_(1.0)


def launch_plan(plan: ForwardPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                scale: float, kernel_options: dict | None, need_lse: bool,
                dropout: Dropout | None = None, sinks: torch.Tensor | None = None, training: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the kernels of ``plan`` (planned with ``dropout=`` whether ``dropout`` is given, and ``sinks=``
    whether ``sinks`` is, and ``training=`` as ``training``): ``(out, lse,
    stats)``, lse float64 for float64 inputs, None unless ``need_lse`` or the plan's forward writes it
    (the training forward, which also writes the backward's statistics ``stats``: see :func:`launch`)."""
    launches = plan_launches(plan, query, key, value, block_mask, scale, kernel_options, need_lse,
                             dropout is not None, sinks is not None, training)
    return launches(query, key, value, block_mask, dropout, sinks)


def plan_launches(plan: ForwardPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                  scale: float, kernel_options: dict | None, need_lse: bool, dropout: bool = False,
                  sinks: bool = False, training: bool = False) -> Callable:
    """The launches of ``plan`` for calls of this signature, decided: a callable ``(query, key, value,
    block_mask, dropout, sinks, mods=None, same_tables=False) -> (out, lse, stats)`` as :func:`launch_plan`
    returns them (``dropout``, ``sinks``: whether the calls pass them; ``mods``, ``same_tables``: see
    :meth:`ForwardLaunch.__call__`)."""
    other_kind = PLAN_LAUNCHES.get(type(plan.kernels[0])) if plan.kernels else None
    if other_kind is not None:
        return other_kind(plan, query, key, value, block_mask, scale, kernel_options, need_lse)
    if plan.kernels:
        (spec,) = plan.kernels
    else:  # the launcher returns the empty or fully masked outputs without a kernel
        spec = spec_for_call(query, value, plan.score_mod, plan.mask_mod, block_mask, kernel_options, need_lse,
                             training=training, dropout=dropout, sinks=sinks)
    # a float64 call gets a float64 logsumexp, as torch returns (and as the decode kernel writes)
    lse_dtype = work_dtype(query.dtype)
    return ForwardLaunch(spec, query, value, plan.score_mod, plan.mask_mod, block_mask, scale, lse_dtype)


def _decode_launch(plan: ForwardPlan, query, key, value, block_mask, scale, kernel_options,
                   need_lse) -> decode.DecodeLaunch:
    """A decode plan's launch: the split-KV decode kernel, then its merge."""
    decode_spec, merge = plan.kernels
    return decode.DecodeLaunch(decode_spec, query, key, value, plan.score_mod, plan.mask_mod, block_mask, scale,
                               num_splits=config.requested_splits(kernel_options), merge=merge, need_lse=need_lse)


def _decode_launches(plan: ForwardPlan, query, key, value, block_mask, scale, kernel_options, need_lse) -> Callable:
    """A decode plan's launches: the split-KV decode kernel, then its merge (no statistics)."""
    decoding = _decode_launch(plan, query, key, value, block_mask, scale, kernel_options, need_lse)

    def decode_launches(query, key, value, block_mask, dropout=None, sinks=None, mods=None, same_tables=False):
        return (*decoding(query, key, value, block_mask, dropout, sinks, mods, same_tables), None)
    return decode_launches


# the plans whose first kernel is not the forward kernel's, launched by their first kernel's spec type
PLAN_LAUNCHES = {DecodeSpec: _decode_launches}
# those whose launch is itself prepare_forward's callable ((out, lse or None) of a call)
PREPARED_LAUNCHES = {DecodeSpec: _decode_launch}


def triton_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                   mask_mod: TracedMod | None, block_mask: Any, scale: float, kernel_options: dict | None,
                   need_lse: bool, dropout: Dropout | None = None, sinks: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"TRITON"`` forward backend: ``(out [B,Hq,L,Ev] in query's dtype, lse [B,Hq,L] fp32 or None)``.

    Inputs are validated by :func:`flexc.flex_attention`; this checks only what the kernel adds
    (block sizes against tiles, devices of captured tensors). The kernels are :func:`plan_forward`'s;
    ``dropout`` (flexc's ``dropout_p``) runs the kernels' variants that draw its mask; ``sinks``
    (``[B or 1, Hq, 1]``, :func:`flexc.call.sinks.check_sinks`) the kernels that fold them in.
    """
    return prepare_forward(query, key, value, score_mod, mask_mod, block_mask, scale, kernel_options, need_lse,
                           dropout is not None, sinks is not None)(query, key, value, block_mask, dropout, sinks)


def prepare_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, scale: float, kernel_options: dict | None,
                    need_lse: bool, dropout: bool = False, sinks: bool = False) -> Callable:
    """:func:`triton_forward` for calls of this signature, decided once (the backend's preparation in
    :mod:`flexc.backends.registry`): a callable ``(query, key, value, block_mask, dropout, sinks,
    mods=None, same_tables=False) -> (out, lse or None)`` for calls with inputs of these shapes, strides
    and dtypes, these mods and a BlockMask of this one's layout (``dropout``, ``sinks``: whether the
    calls pass them; ``mods``, ``same_tables``: see :meth:`ForwardLaunch.__call__`)."""
    plan = plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, need_lse,
                        dropout=dropout, sinks=sinks)
    direct = PREPARED_LAUNCHES.get(type(plan.kernels[0])) if plan.kernels else None
    if direct is not None:  # (a decoding step: its launch called directly, no wrapper in between)
        return direct(plan, query, key, value, block_mask, scale, kernel_options, need_lse)
    launches = plan_launches(plan, query, key, value, block_mask, scale, kernel_options, need_lse, dropout, sinks)

    def forward(query, key, value, block_mask, dropout=None, sinks=None, mods=None, same_tables=False):
        out, lse, _ = launches(query, key, value, block_mask, dropout, sinks, mods, same_tables)
        return out, lse
    return forward


registry.register(registry.TRITON, triton_forward, prepare=prepare_forward)


# ---- the forward kernel's arguments, constexprs and grid ------------------------------------


def forward_arguments(generated: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor | None, tables: list[torch.Tensor],
                      score_mod: TracedMod | None, mask_mod: TracedMod | None, scale: float,
                      stats: torch.Tensor | None = None, dropout: Dropout | None = None,
                      sinks: torch.Tensor | None = None, tail: list | None = None) -> list:
    """The forward kernel's positional arguments, in the order of its signature (constexprs excluded);
    ``stats`` ``[2, B, Hq, L]``: the training forward's backward statistics (laid out as ``lse``);
    ``dropout`` for a kernel with dropout, ``sinks`` for one with sinks; ``tail``: the
    :func:`kernel_argument_tail` of an earlier call of the same signature, when the caller keeps it
    (the same kernel, shapes, strides and scale)."""
    if generated.needs_positive_scale and not scale > 0:
        # the kernel multiplies raw q.k by scale * log2(e) after taking the row max, so the scale
        # must be positive: q.k * scale == (-q).k * |scale|, and with scale 0 every score is 0
        query = -query if scale < 0 else torch.zeros_like(query)
    outputs = [out]
    if lse is not None:
        outputs.append(lse)
    if stats is not None:  # both contiguous [B, Hq, L] planes, as lse: they share its strides
        outputs += [stats[0], stats[1]]
    buffers = launcher.mod_arguments(generated, score_mod, mask_mod, query.device)
    if dropout is not None:
        buffers += launcher.dropout_arguments(dropout, query.device)
    if sinks is not None:
        buffers += launcher.sink_arguments(sinks, work_dtype(query.dtype))
    if tail is None:
        tail = forward_argument_tail(generated, query, key, value, out, lse, tables, scale)
    return [query, key, value, *outputs, *tables, *buffers, *tail]


def forward_argument_tail(generated: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor | None, tables: list[torch.Tensor], scale: float) -> list:
    """The forward kernel's :func:`kernel_argument_tail`: its scale, lengths, group size and strides
    (a kernel that needs a positive scale gets ``|scale|``, or 1 for 0: :func:`forward_arguments`
    negates or zeroes the query)."""
    if generated.needs_positive_scale and not scale > 0:
        scale = abs(scale) or 1.0
    output_strides = [*out.stride()] + ([lse.stride(0), lse.stride(1)] if lse is not None else [])
    return launcher.kernel_argument_tail(query, key, value, tables,
                                [float(scale), query.shape[2], value.shape[2], query.shape[1] // value.shape[1]],
                                output_strides)


def exact_in_query(spec: ForwardSpec, scale: float | None) -> bool:
    """Whether the forward kernel may fold ``scale`` into q (POW2_SCALE): where a score_mod needs the
    scaled score (without one, the scale joins the exponent anyway), and the scale is a power of
    two from 2**-20 to 1 (the default 1/sqrt(D) for D = 1, 4, 16, 64, 256...) and the inputs have
    float32's exponent range (not float16's): then q * scale and q.k * scale are exact (short of
    inputs below ~1e-32), and q.(scale * k) == (q.k) * scale."""
    if scale is None or spec.score_mod is None or spec.prescale_qk or spec.dtype == torch.float16:
        return False
    mantissa, exponent = math.frexp(float(scale))
    return mantissa == 0.5 and -19 <= exponent <= 1


def forward_constexprs(spec: ForwardSpec, L: int, S: int, tensors: list, guard_values: bool = False,
                       scale: float | None = None) -> dict[str, int]:
    """The forward kernel's compile-time arguments for ``spec`` and one call's lengths, tensors and scale.

    Whole tiles (lengths multiples of BLOCK_M, and of the key block, so of BLOCK_N), int64 offsets, the non-finite values
    guard and a power-of-two scale (:func:`exact_in_query`) select variants that Triton compiles once each; other
    lengths reuse them.
    """
    largest = max((t.numel() for t in tensors if isinstance(t, torch.Tensor)), default=0)
    return dict(BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, Q_BLOCK_SIZE=spec.q_block_size,
                KV_BLOCK_SIZE=spec.kv_block_size, HEAD_DIM=spec.head_dim,
                HEAD_DIM_PAD=padded_head_dim(spec.head_dim), V_HEAD_DIM=spec.v_head_dim,
                V_HEAD_DIM_PAD=padded_head_dim(spec.v_head_dim), ROWS_GUARANTEED_SAFE=spec.rows_guaranteed_safe,
                BLOCKS_ARE_CONTIGUOUS=spec.blocks_are_contiguous, Q_LEN_DIVISIBLE=L % spec.block_m == 0,
                # the key loop walks every tile of a listed block: a last block reaching past KV_LEN
                # has whole tiles past it even when BLOCK_N divides KV_LEN (kv_block_size is a multiple
                # of BLOCK_N, so this implies it)
                KV_LEN_DIVISIBLE=S % spec.kv_block_size == 0, INT64_OFFSETS=largest >= launcher.INT32_OFFSET_LIMIT,
                GUARD_NONFINITE_VALUES=guard_values, POW2_SCALE=exact_in_query(spec, scale))


def forward_grid(spec: ForwardSpec, query: torch.Tensor) -> tuple[int, int, int]:
    """One program per query tile, query head and batch."""
    B, Hq, L, _ = query.shape
    return cdiv(L, spec.block_m), Hq, B


__all__ = ["exact_in_query", "forward_argument_tail", "forward_arguments", "forward_constexprs", "forward_grid", "ForwardLaunch", "ForwardPlan", "launch", "launch_plan", "launches_nothing", "make_spec", "plan_forward", "plan_launches", "prepare_forward", "spec_for_call", "triton_forward"]
