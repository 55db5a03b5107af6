"""Compile a Triton kernel for a CUDA target without a GPU, specialised as a real launch would be.

:func:`compile_offline` takes a forward, backward or decode spec and CPU stand-ins of the launch's
tensors (:func:`offline_inputs`), builds the kernel's arguments as the launch does
(:mod:`.launcher`) and hands them to :func:`compile_like_launcher`: Triton's front end, LLVM and
ptxas run on the CPU.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ...analysis.tiles import cdiv
from ...codegen.backward import BackwardSpec
from ...codegen.decode import DecodeSpec
from ...codegen.forward import NO_BLOCK_MASK, ForwardSpec
from ...dtypes import work_dtype
from ..dropout import Dropout
from . import backward, cache, decode, forward, launcher

# a dropout kernel's stand-in seed and probability (their values do not shape the compiled kernel)
_STAND_IN_DROPOUT = Dropout(0.1, 0)


def compile_like_launcher(fn: Any, args: list, constants: dict, num_warps: int, num_stages: int,
                          capability: int = 90, warp_size: int = 32) -> Any:
    """Compile the ``@triton.jit`` kernel ``fn`` for a CUDA target as its launcher would for ``args``.

    No GPU is needed: Triton's front end, LLVM and ptxas run on the CPU. The arguments are
    specialised exactly as :meth:`JITFunction.run` does for a real launch (tensor pointers 16-byte
    aligned, integers divisible by 16 marked, integers equal to 1 made constants,
    ``do_not_specialize`` honoured), so the machine code is what a GPU would run: typing every
    integer as i32 with no attributes instead changes shared memory, loads and spills.
    ``args`` may hold CPU tensors; only their dtype and address alignment matter.
    """
    triton = cache.require_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, warp_size)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(constants, num_warps=num_warps, num_stages=num_stages)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def offline_inputs(spec: ForwardSpec | BackwardSpec, batch: int = 1, heads: int = 16, q_len: int = 4096,
                   kv_len: int | None = None, block_mask: Any = None) -> tuple:
    """CPU stand-ins ``(query, key, value, block_mask)`` for compiling ``spec`` offline.

    Only their shapes, strides, dtypes and alignment reach the compiler; tensors are left
    uninitialised. Without ``block_mask`` the BlockMask tables are all-zero tensors of the shape
    ``create_block_mask`` gives for one batch and head (or none when ``spec`` has no BlockMask).
    """
    kv_len = q_len if kv_len is None else kv_len
    query = torch.empty((batch, heads, q_len, spec.head_dim), dtype=spec.dtype)
    key = torch.empty((batch, heads, kv_len, spec.head_dim), dtype=spec.dtype)
    value = torch.empty((batch, heads, kv_len, spec.v_head_dim), dtype=spec.dtype)
    if block_mask is None and spec.q_block_size != NO_BLOCK_MASK:
        nq, nkv = cdiv(q_len, spec.q_block_size), cdiv(kv_len, spec.kv_block_size)
        counts, indices = torch.zeros((1, 1, nq), dtype=torch.int32), torch.zeros((1, 1, nq, nkv), dtype=torch.int32)
        block_mask = SimpleNamespace(kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=counts,
                                     full_kv_indices=indices, BLOCK_SIZE=(spec.q_block_size, spec.kv_block_size))
    return query, key, value, block_mask


# Each kind's launch arguments ``(spec, generated, query, key, value, block_mask, scale, dropout, num_splits,
# guard_values) -> (args, constexprs)``, as its launch builds them (the mods' captured tensors are their
# traced values); dispatched by the spec's type (exactly: the backward's row pass is not a backward here).

def _forward_arguments(spec: ForwardSpec, generated, query, key, value, block_mask, scale, drop, num_splits,
                       guard_values) -> tuple[list, dict]:
    L, S = query.shape[2], key.shape[2]
    out = launcher.empty_output(query, value.shape[-1])
    lse = torch.empty(query.shape[:3], dtype=torch.float32) if spec.output_lse else None
    stats = torch.empty((2, *query.shape[:3]), dtype=torch.float32) if spec.output_stats else None
    tables = launcher.kv_tables(block_mask, spec, S, query.device)
    args = forward.forward_arguments(generated, query, key, value, out, lse, tables, spec.score_mod, spec.mask_mod,
                                      scale, stats, drop)
    return args, forward.forward_constexprs(spec, L, S, args, guard_values, scale)


def _backward_arguments(spec: BackwardSpec, generated, query, key, value, block_mask, scale, drop, num_splits,
                        guard_values) -> tuple[list, dict]:
    dq, dk, dv, _, grads = backward.backward_outputs(spec, query, key, value, spec.score_mod)
    rows = torch.empty(query.shape[:3], dtype=work_dtype(query.dtype))
    tables = backward.backward_tables(block_mask, spec, query.shape[2], key.shape[2], query.device)
    stats = rows.new_empty((2, *rows.shape))
    return backward.backward_arguments(spec, generated, query, key, value, torch.empty_like(query), rows, rows,
                                       stats, dq, dk, dv, tables, grads, spec.score_mod, spec.mask_mod, scale,
                                       guard_inputs=guard_values, dropout=drop)


def _decode_arguments(spec: DecodeSpec, generated, query, key, value, block_mask, scale, drop, num_splits,
                      guard_values) -> tuple[list, dict]:
    args, constants, _ = decode.decode_arguments(spec, generated, query, key, value, spec.score_mod, spec.mask_mod,
                                                   block_mask, scale, num_splits, guard_values, dropout=drop)
    return args, constants


LAUNCH_ARGUMENTS = {ForwardSpec: _forward_arguments, BackwardSpec: _backward_arguments, DecodeSpec: _decode_arguments}
# the kinds :func:`offline_inputs` makes stand-ins for (a decode spec needs its short queries)
DEFAULT_INPUTS = (ForwardSpec, BackwardSpec)


def compile_offline(spec: ForwardSpec | BackwardSpec | DecodeSpec, capability: int = 90, warp_size: int = 32,
                    inputs: tuple | None = None, *, num_splits: int = 8, guard_values: bool = False) -> Any:
    """Compile the CUDA kernel for ``spec`` (forward, backward or decode) to a cubin without a GPU,
    specialised like a real launch.

    ``inputs`` is ``(query, key, value, block_mask)`` (CPU tensors of the launch's shapes; default
    :func:`offline_inputs`, which a decode spec cannot take: pass its short queries); the mods'
    captured tensors are their traced values. ``num_splits`` is a decode launch's splits.
    ``guard_values`` compiles the NaN/inf guard in (CUDA launches never do, so by default neither
    does this, whatever the uninitialised stand-ins hold). Returns Triton's compiled kernel:
    ``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata.shared`` (bytes).
    """
    arguments = LAUNCH_ARGUMENTS.get(type(spec))
    if arguments is None:
        raise TypeError(f"compile_offline: spec must be a {', '.join(t.__name__ for t in LAUNCH_ARGUMENTS)}, got a "
                        f"{type(spec).__name__}. Fix: compile the forward, backward or decode kernel it belongs to.")
    if spec.target != "cuda":
        raise ValueError(f"compile_offline: spec.target must be 'cuda', got {spec.target!r}. "
                         f"Fix: build the spec with target 'cuda'.")
    if inputs is None:
        if type(spec) not in DEFAULT_INPUTS:
            raise ValueError(f"compile_offline: a {type(spec).__name__} needs inputs=(query, key, value, block_mask) "
                             f"with its short queries. Fix: pass the stand-ins the spec was made for.")
        inputs = offline_inputs(spec)
    generated = cache.generate(spec)
    module, _ = cache.import_source(generated.source, "cuda")
    query, key, value, block_mask = inputs
    drop = _STAND_IN_DROPOUT if spec.dropout else None
    args, constants = arguments(spec, generated, query, key, value, block_mask, query.shape[-1] ** -0.5, drop,
                                num_splits, guard_values)
    return compile_like_launcher(getattr(module, generated.kernel_name), args, constants, spec.num_warps,
                                 spec.num_stages, capability, warp_size)


__all__ = ["compile_like_launcher", "compile_offline", "offline_inputs"]
