"""The generated-Triton backward: configuration, the pre-pass, and the launch.

:func:`triton_backward` is what ``BACKEND: "TRITON"`` runs for ``flex_attention``'s backward (on
CUDA compiled, on CPU through Triton's interpreter). It computes ``delta = rowsum(out · dO) − dlse``
and the base-2 logsumexp in torch (one elementwise pass each), finds or generates the kernel of
:mod:`flexc.codegen.backward` in the forward's cache, and launches it once. Key/value gradients
of a batch-broadcast key (``Bkv = 1``) are computed per batch and summed afterwards, so no
program ever adds into another's dk/dv; captured-tensor gradients go through fp32/fp64 atomics.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ...codegen.backward import BackwardSpec, generate_backward
from ...codegen.scalars import lift_for_call
from ...analysis.tiles import cdiv, transpose_ordered
from ...mods.traced_mod import TracedMod, trainable_slots
from .. import registry
from ... import device as gpu
from . import forward as fwd
from ..nonfinite import all_finite

_OPTIONS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
RCP_LN2 = 1.4426950408889634


def default_backward_config(dtype: torch.dtype, head_dim: int, v_head_dim: int, target: str) -> tuple[int, ...]:
    """``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)`` for a dtype and head dims.

    torch's names: dK/dV programs own ``BLOCK_N1`` keys and step over ``BLOCK_M1`` queries; dQ
    programs own ``BLOCK_M2`` queries and step over ``BLOCK_N2`` keys.

    On CUDA, torch's Hopper choices for 16-bit inputs; fp32/fp64 use smaller tiles (their
    operands take twice or four times the shared memory). Under the interpreter each tile step
    costs a fixed overhead, so 64 x 64 tiles (as the forward) take the fewest steps.
    """
    if target == "interpreter":
        return 64, 64, 64, 64, 4, 1
    d = max(fwd.padded_head_dim(head_dim), fwd.padded_head_dim(v_head_dim))
    if dtype in (torch.float32, torch.float64):
        return (32, 32, 32, 32, 4, 1) if d <= 128 else (16, 16, 16, 16, 4, 1)
    if d < 64:
        return 64, 64, 64, 64, 4, 3
    if d <= 128:
        return 64, 128, 128, 64, 8, 3
    return 64, 64, 64, 64, 4, 2


def _backward_options(kernel_options: dict | None) -> dict:
    """The backward's options: ``bwd_X`` overrides ``X``; ``fwd_`` keys are not ours."""
    options: dict = {}
    for name, value in (kernel_options or {}).items():
        if name in _OPTIONS:
            options.setdefault(name, value)
    for name, value in (kernel_options or {}).items():
        if isinstance(name, str) and name.startswith("bwd_") and name[4:] in _OPTIONS:
            options[name[4:]] = value
    return options


def resolve_backward_config(kernel_options: dict | None, dtype: torch.dtype, head_dim: int, v_head_dim: int,
                            q_block_size: int, kv_block_size: int, target: str) -> tuple[int, ...]:
    """Tiles and launch options: the user's ``kernel_options`` over :func:`default_backward_config`.

    Query tiles (``BLOCK_M1``, ``BLOCK_M2``) must divide the BlockMask's query block size and key
    tiles (``BLOCK_N1``, ``BLOCK_N2``) its key block size: a default that does not is halved, a
    user's choice raises ``ValueError``.
    """
    options = _backward_options(kernel_options)
    defaults = dict(zip(_OPTIONS, default_backward_config(dtype, head_dim, v_head_dim, target)))
    chosen = {}
    for name in _OPTIONS:
        if name in options:
            pow2 = name != "num_stages"
            chosen[name] = fwd._check_int_option(name, options[name], pow2, 16 if name.startswith("BLOCK") else 1)
    config = {**defaults, **chosen}
    for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
        block_size, what = (q_block_size, "query (Q)") if "_M" in name else (kv_block_size, "key (KV)")
        tile = config[name]
        if block_size % tile == 0:
            continue
        if name in chosen:
            raise ValueError(
                f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of "
                f"kernel_options[{name!r}]={tile} for the backward. Fix: pass a {name} dividing {block_size} "
                f"(e.g. {fwd._largest_pow2_divisor(block_size, tile)}) or build the BlockMask with a "
                f"BLOCK_SIZE that is a multiple of {tile}.")
        tile = fwd._largest_pow2_divisor(block_size, tile)
        if tile < 16:
            raise ValueError(f"flexc: the BlockMask's {what} block size {block_size} must be a multiple of 16 "
                             f"for the Triton backward. Fix: build the BlockMask with BLOCK_SIZE a multiple of 16.")
        config[name] = tile
    return tuple(config[name] for name in _OPTIONS)


def make_backward_spec(score_mod: TracedMod | None, mask_mod: TracedMod | None, dtype: torch.dtype, head_dim: int,
                       v_head_dim: int, block_size: tuple[int, int] | None, kernel_options: dict | None,
                       target: str, grad_slots: Sequence[int] = (), has_full_blocks: bool = True,
                       index_dtype: str = "int32") -> BackwardSpec:
    """The :class:`BackwardSpec` for these mods and shapes; ``block_size=None`` means no BlockMask.
    ``index_dtype`` is the mods' integer index type (see :mod:`flexc.codegen.index_width`)."""
    if block_size is None:
        # no BlockMask: every block is full; blocks as large as the largest tile
        m1, n1, m2, n2, warps, stages = resolve_backward_config(kernel_options, dtype, head_dim, v_head_dim,
                                                                1 << 20, 1 << 20, target)
        q_block, kv_block, mask_mod, has_full_blocks = max(m1, m2), max(n1, n2), None, True
    else:
        q_block, kv_block = block_size
        m1, n1, m2, n2, warps, stages = resolve_backward_config(kernel_options, dtype, head_dim, v_head_dim,
                                                                q_block, kv_block, target)
    return BackwardSpec(score_mod, mask_mod, dtype, head_dim, v_head_dim, q_block, kv_block, m1, n1, m2, n2,
                        warps, stages, has_full_blocks, tuple(grad_slots), target, fwd._fp32_precision(target),
                        index_dtype)


def spec_for_call(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  block_mask: Any, kernel_options: dict | None, grad_slots: Sequence[int] = ()) -> BackwardSpec:
    """The backward spec that a flex_attention call with these (validated) arguments runs."""
    block_size = (fwd._block_sizes(block_mask, query.shape[-2], value.shape[-2], kernel_options)
                  if block_mask is not None else None)
    has_full = block_mask is not None and getattr(block_mask, "full_kv_num_blocks", None) is not None
    B, Hq, L, E = query.shape
    # as the forward: int64 index arithmetic where int32 could wrap (torch computes in int64)
    index_dtype = fwd._index_dtype((score_mod, mask_mod), B, Hq, L, value.shape[-2])
    return make_backward_spec(score_mod, mask_mod, query.dtype, E, value.shape[-1], block_size,
                              kernel_options, fwd._target(query.device), grad_slots, has_full, index_dtype)


# ---- tables ---------------------------------------------------------------------------------

def _tables(block_mask: Any, spec: BackwardSpec, L: int, S: int, device: torch.device) -> list[torch.Tensor]:
    """Key-direction then query-direction tables (partial, then full when kept apart), int32."""
    if block_mask is None:
        nq, nkv = max(1, cdiv(L, spec.q_block_size)), max(1, cdiv(S, spec.kv_block_size))
        i32 = dict(dtype=torch.int32, device=device)
        return [torch.zeros((1, 1, nq), **i32), torch.zeros((1, 1, nq, nkv), **i32),
                torch.full((1, 1, nq), nkv, **i32), torch.arange(nkv, **i32).expand(1, 1, nq, nkv).contiguous(),
                torch.zeros((1, 1, nkv), **i32), torch.zeros((1, 1, nkv, nq), **i32),
                torch.full((1, 1, nkv), nq, **i32), torch.arange(nq, **i32).expand(1, 1, nkv, nq).contiguous()]
    kv = fwd._tables(block_mask, spec, S, device)
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


# ---- the launch ---------------------------------------------------------------------------

def _backward_args(spec: BackwardSpec, generated, query, key, value, grad_out, lse2, delta, dq, dk, dv, tables,
                   grads, score_mod, mask_mod, scale: float, guard_inputs: bool | None = None) -> tuple[list, dict]:
    """The backward kernel's positional arguments and constexprs for one launch (``guard_inputs``:
    compile the NaN/inf input guard in; by default the launcher's choice for these tensors)."""
    B, Hq, L, E = query.shape
    Bkv, Hkv, S, Ev = value.shape
    device = query.device
    buffers = (fwd._buffer_arguments(score_mod, generated.score_params, device)
               + fwd._buffer_arguments(mask_mod, generated.mask_params, device))
    by_slot = dict(zip(spec.grad_slots, grads))
    for p in generated.grad_params:
        g = by_slot[p.slot]
        buffers.append(g if p.what == "ptr" else g.stride(p.dim) if p.what == "stride" else g.shape[p.dim])
    Bm, Hm, nQ = tables[0].shape
    nKV = tables[1].shape[-1]
    stride_kb = key.stride(0) if Bkv == B else 0
    stride_vb = value.stride(0) if Bkv == B else 0
    shapes = [float(scale), L, S, Hq // Hkv,
              *query.stride(), stride_kb, *key.stride()[1:], stride_vb, *value.stride()[1:], *grad_out.stride(),
              delta.stride(0), delta.stride(1), *dq.stride(), *dk.stride(), *dv.stride(), Bm, Hm, nQ, nKV]
    args = [query, key, value, grad_out, lse2, delta, dq, dk, dv] + tables + buffers + shapes
    if guard_inputs is None:
        # zeroing masked NaN/inf q and k entries: compiled in only where it can matter
        # (CPU calls with such entries; on CUDA as torch's kernels, see _guards_nonfinite_values)
        guard_inputs = spec.mask_mod is not None and gpu.is_plain_cpu(device) and not all_finite(query, key)
    constants = dict(BLOCK_M1=spec.block_m1, BLOCK_N1=spec.block_n1, BLOCK_M2=spec.block_m2, BLOCK_N2=spec.block_n2,
                     Q_BLOCK_SIZE=spec.q_block_size, KV_BLOCK_SIZE=spec.kv_block_size,
                     # lengths that are multiples of the blocks (so of every tile: blocks are multiples
                     # of the tiles) need no bounds checks (a second variant). Tiles alone do not do:
                     # the loops walk every tile of a listed block, past the end of a last, shorter one
                     DIVISIBLE=L % spec.q_block_size == 0 and S % spec.kv_block_size == 0,
                     GUARD_NONFINITE_INPUTS=guard_inputs, HEAD_DIM=E,
                     HEAD_DIM_PAD=fwd.padded_head_dim(E), V_HEAD_DIM=Ev, V_HEAD_DIM_PAD=fwd.padded_head_dim(Ev))
    return args, constants


def _outputs(spec: BackwardSpec, query, key, value, score_mod) -> tuple:
    """``(dq, dk, dv, summed, grads)``: dk/dv per query batch, summed afterwards when ``Bkv == 1 < B``."""
    B, Hkv, S, E, Ev = query.shape[0], key.shape[1], key.shape[2], key.shape[3], value.shape[3]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    summed = key.shape[0] == 1 and B > 1
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.empty((B, Hkv, S, E), dtype=acc if summed else key.dtype, device=query.device)
    dv = torch.empty((B, Hkv, S, Ev), dtype=acc if summed else value.dtype, device=query.device)
    grads = [torch.zeros(score_mod.buffers[s].shape, dtype=spec.grad_dtype(s), device=query.device)
             for s in spec.grad_slots]
    return dq, dk, dv, summed, grads


def launch_backward(spec: BackwardSpec, query, key, value, out, lse, grad_out, grad_lse,
                    score_mod: TracedMod | None, mask_mod: TracedMod | None, block_mask: Any, scale: float):
    """Run the backward kernel; returns ``(dq, dk, dv, [gradient of each spec.grad_slots tensor])``."""
    B, Hq, L, E = query.shape
    Bkv, Hkv, S, Ev = value.shape
    device = query.device
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    dq, dk, dv, summed, grads = _outputs(spec, query, key, value, score_mod)
    if query.numel() == 0 or S == 0:
        return (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value),
                [g.to(score_mod.buffers[s].dtype) for g, s in zip(grads, spec.grad_slots)])
    # pre-pass: delta = rowsum(out * dO) - dlse, and the logsumexp in base 2 (+inf where nothing is allowed)
    delta = (out.to(acc) * grad_out.to(acc)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc)
    lse2 = torch.where(torch.isneginf(lse), float("inf"), lse.to(acc) * RCP_LN2)
    delta, lse2 = delta.contiguous(), lse2.contiguous()
    tables = _tables(block_mask, spec, L, S, device)
    nQ = tables[0].shape[-1]
    if nQ < cdiv(L, spec.q_block_size):
        raise ValueError(f"flexc: the BlockMask has {nQ} query block rows but L={L} needs "
                         f"{cdiv(L, spec.q_block_size)} of size {spec.q_block_size}. Fix: build it for Q_LEN={L}.")
    kernel = fwd.get_kernel(spec, device)
    args, constants = _backward_args(spec, kernel.generated, query, key, value, grad_out, lse2, delta, dq, dk, dv,
                                     tables, grads, score_mod, mask_mod, scale)
    grid = (cdiv(S, spec.block_n1) + (Hq // Hkv) * cdiv(L, spec.block_m2), Hkv, B)
    gpu.launch(kernel.fn, grid, spec, device, args, constants)
    if summed:
        dk = dk.sum(0, keepdim=True).to(key.dtype)
        dv = dv.sum(0, keepdim=True).to(value.dtype)
    buf_grads = [g.to(score_mod.buffers[s].dtype) for g, s in zip(grads, spec.grad_slots)]
    return dq, dk, dv, buf_grads


def compile_backward_offline(spec: BackwardSpec, inputs: tuple, capability: int = 90, warp_size: int = 32) -> Any:
    """Compile the CUDA backward kernel for ``spec`` without a GPU, specialised like a real launch.

    ``inputs`` is ``(query, key, value, block_mask)`` as for
    :func:`flexc.backends.triton.forward.compile_offline` (e.g. from ``offline_inputs``).
    """
    if spec.target != "cuda":
        raise ValueError(f"compile_backward_offline: spec.target must be 'cuda', got {spec.target!r}. "
                         f"Fix: build the spec with target 'cuda'.")
    query, key, value, block_mask = inputs
    generated = generate_backward(spec)
    module, _ = fwd.import_source(generated.source, "cuda")
    dq, dk, dv, _, grads = _outputs(spec, query, key, value, spec.score_mod)
    rows = torch.empty(query.shape[:3], dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    tables = _tables(block_mask, spec, query.shape[2], key.shape[2], query.device)
    # the stand-in tensors are uninitialised: the guard is off, as in every CUDA launch
    args, constants = _backward_args(spec, generated, query, key, value, torch.empty_like(query), rows, rows, dq, dk,
                                     dv, tables, grads, spec.score_mod, spec.mask_mod, query.shape[-1] ** -0.5,
                                     guard_inputs=False)
    return fwd.compile_like_launcher(getattr(module, generated.kernel_name), args, constants, spec.num_warps,
                                     spec.num_stages, capability, warp_size)


class BackwardPlan(NamedTuple):
    """The backward kernel a training call launches, and the mods it takes."""

    score_mod: TracedMod | None  # the call's mods, captured numbers lifted to kernel arguments
    mask_mod: TracedMod | None
    kernels: tuple  # (BackwardSpec,), or () when nothing is launched (no query rows or no keys)


def launches_nothing(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`launch_backward` returns zero gradients without a kernel (no query rows or no keys)."""
    return query.numel() == 0 or value.shape[-2] == 0


def plan_backward(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                  block_mask: Any, kernel_options: dict | None, grad_slots: Sequence[int] = ()) -> BackwardPlan:
    """The backward kernel for these (validated) arguments: the one rule :func:`triton_backward` and
    :func:`flexc.kernel_source` share."""
    score_mod, mask_mod = lift_for_call(query, score_mod, mask_mod)  # captured numbers become arguments
    if launches_nothing(query, value):
        return BackwardPlan(score_mod, mask_mod, ())
    spec = spec_for_call(query, value, score_mod, mask_mod, block_mask, kernel_options, tuple(grad_slots))
    return BackwardPlan(score_mod, mask_mod, (spec,))


def triton_backward(query, key, value, out, lse, grad_out, grad_lse, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, scale: float, grad_slots: Sequence[int] = (),
                    kernel_options: dict | None = None):
    """The ``"TRITON"`` backward: ``(dq, dk, dv, buffer_grads)`` like :func:`torch_cpu.torch_backward`.

    ``lse`` is the forward's natural-log logsumexp (``-inf`` on rows with nothing allowed);
    ``grad_lse`` may be None; ``buffer_grads`` follows ``grad_slots``. The kernel is
    :func:`plan_backward`'s.
    """
    plan = plan_backward(query, value, score_mod, mask_mod, block_mask, kernel_options, grad_slots)
    score_mod, mask_mod = plan.score_mod, plan.mask_mod
    if plan.kernels:
        (spec,) = plan.kernels
    else:  # launch_backward returns the zero gradients without a kernel
        spec = spec_for_call(query, value, score_mod, mask_mod, block_mask, kernel_options, tuple(grad_slots))
    return launch_backward(spec, query, key, value, out, lse, grad_out, grad_lse, score_mod, mask_mod,
                           block_mask, scale)


def forward_for_training(query, key, value, score_mod: TracedMod | None, mask_mod: TracedMod | None,
                         block_mask: Any, scale: float, kernel_options: dict | None):
    """The Triton forward that autograd saves for :func:`triton_backward`: ``(out, lse)``, the
    logsumexp in float64 for float64 inputs (the backward's probabilities come from it). Its kernel
    is :func:`flexc.backends.triton.forward.plan_forward`'s with ``training=True``: the forward
    kernel that writes the logsumexp, for short queries too."""
    plan = fwd.plan_forward(query, key, value, score_mod, mask_mod, block_mask, kernel_options, True, training=True)
    return fwd.launch_plan(plan, query, key, value, block_mask, scale, kernel_options, True)


def backward_source(query: torch.Tensor, value: torch.Tensor, score_mod: TracedMod | None,
                    mask_mod: TracedMod | None, block_mask: Any, kernel_options: dict | None) -> str:
    """The backward source a training call with these arguments runs (captured tensors that
    require grad receive gradients); compiles nothing. :func:`flexc.kernel_source` with
    ``backward=True`` also says when no generated backward runs."""
    plan = plan_backward(query, value, score_mod, mask_mod, block_mask, kernel_options, trainable_slots(score_mod))
    if not plan.kernels:
        return ("# flexc: this call's backward launches no kernel: it has no query rows or no keys, so the\n"
                "# gradients are zeros.\n")
    return fwd.source_for(plan.kernels[0])


registry.register_training("TRITON", forward_for_training, triton_backward)

__all__ = ["BackwardPlan", "backward_source", "plan_backward", "compile_backward_offline", "forward_for_training", "default_backward_config", "launch_backward", "make_backward_spec",
           "resolve_backward_config", "spec_for_call", "triton_backward"]
