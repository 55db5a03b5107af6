"""One causal call of torch's fused CPU kernel, split along the diagonal so that the score tiles
above it are not computed.

``aten._scaled_dot_product_flash_attention_for_cpu(..., is_causal=True)`` skips keys past a query
tile's diagonal only a whole key tile (512 keys) at a time, so below ~1K keys its causal call
computes, then masks, the whole ``L x L`` square: at L=256 a causal call costs what an unmasked one
does, forward and backward. Split into chunks of ``T`` rows, the triangle is covered by
``n (n + 1) / 2`` tiles of ``T x T`` instead of ``n^2`` (n = L / T):

* forward, by query chunks: chunk ``[q0, q1)`` attends to keys ``[0, q1)`` with an additive float
  mask (0 allowed, -inf above the diagonal: a column slice of one cached ``T x S`` tile); the first
  chunk is the kernel's own causal call. Each chunk's rows see all their keys, so its output and
  logsumexp are final;
* backward, by key chunks: keys ``[k0, k1)`` are seen by queries ``[k0, L)`` only, and the kernel's
  causal mode (``kv <= q`` counted from the call's first row and key) masks exactly the diagonal
  tile. The kernel's gradient reads the forward's logsumexp, so a subset of the keys gives those
  keys' ``dk``/``dv`` in full and a part of ``dq``; the parts are summed.

Measured at one thread (B=2, H=4, L=256, D=32, fp32): forward 0.80x and backward 0.85x of the one
causal call.

:class:`RecordedChunks` is the split as one autograd node, for the training calls that would
otherwise record the kernel's single call (:func:`flexc.backends.cpu.causal_call.recorder`).
"""
from __future__ import annotations

import functools

import torch

from . import fused_cpu

# the rows (and keys) of a chunk, forward and backward
FORWARD_CHUNK = 128
BACKWARD_CHUNK = 128
# the lengths split. Each kernel call has fixed costs (its buffers, their cache misses): below
# ~384 they eat the saving (L=256: as fast as one call, at best). From 768 the kernel takes its
# queries 256 rows at a time, which a call of 128-row chunks loses (L=768: a wash; L=1024: the
# forward 4% slower, the backward 6% faster)
MIN_SPLIT_LENGTH = 384
MAX_SPLIT_LENGTH = 767


def split(L: int, S: int) -> bool:
    """Whether a causal call of ``L`` queries and ``S`` keys is split: square, of a length between
    :data:`MIN_SPLIT_LENGTH` and :data:`MAX_SPLIT_LENGTH`."""
    return L == S and MIN_SPLIT_LENGTH <= L <= MAX_SPLIT_LENGTH


def kernel_layout(t: torch.Tensor, last: int | None = None) -> torch.Tensor:
    """An empty tensor shaped as ``t`` (last dim ``last``), laid out ``[B, L, H, E]`` as the kernel
    lays out what it returns (row-major when batch and heads are folded into one dimension)."""
    B, H, L, E = t.shape
    return t.new_empty(B, L, H, E if last is None else last).transpose(1, 2)


@functools.lru_cache(maxsize=16)
def _diagonal_mask(T: int, S: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]``: 0 where ``j <= S - T + r``, -inf above. Its last ``n`` rows and columns
    ``[S - q1, S)`` are the mask of query rows ``[q1 - n, q1)`` against keys ``[0, q1)``."""
    blocked = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    return torch.zeros(T, S, dtype=dtype).masked_fill_(blocked, float("-inf"))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of causal attention (``kv <= q``, counted from the first row and key) of
    kernel inputs ``[B, H, L, E]``: the kernel's causal call, split by query chunks when
    :func:`split` says so (out laid out as the kernel lays it out)."""
    L, S = q.shape[2], k.shape[2]
    T = FORWARD_CHUNK
    if not split(L, S):
        return fused_cpu.FLASH(q, k, v, is_causal=True, scale=scale)
    out, lse = kernel_layout(q, v.shape[-1]), q.new_empty(q.shape[:-1])
    mask = _diagonal_mask(T, S, q.dtype)
    for q0 in range(0, L, T):
        n = min(T, L - q0)
        q1 = q0 + n
        if q0 == 0:
            o, m = fused_cpu.FLASH(q.narrow(2, 0, n), k.narrow(2, 0, n), v.narrow(2, 0, n), is_causal=True,
                                   scale=scale)
        else:
            o, m = fused_cpu.FLASH(q.narrow(2, q0, n), k.narrow(2, 0, q1), v.narrow(2, 0, q1),
                                   attn_mask=mask.narrow(0, T - n, n).narrow(1, S - q1, q1), scale=scale)
        out.narrow(2, q0, n).copy_(o)
        lse.narrow(2, q0, n).copy_(m)
    return out, lse


def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`forward`, from its ``out`` and ``lse``: the kernel's causal
    backward, split by key chunks when :func:`split` says so."""
    L, S = q.shape[2], k.shape[2]
    T = BACKWARD_CHUNK
    if not split(L, S):
        return fused_cpu.FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    dq = None
    dk, dv = kernel_layout(k), kernel_layout(v)
    for k0 in range(0, L, T):
        n, rows = min(T, L - k0), L - k0
        part_q, part_k, part_v = fused_cpu.FLASH_BACKWARD(
            grad_out.narrow(2, k0, rows), q.narrow(2, k0, rows), k.narrow(2, k0, n), v.narrow(2, k0, n),
            out.narrow(2, k0, rows), lse.narrow(2, k0, rows), 0.0, True, scale=scale)
        if dq is None:
            dq = part_q  # (the first chunk's queries are all of them)
        else:
            dq.narrow(2, k0, rows).add_(part_q)
        dk.narrow(2, k0, n).copy_(part_k)
        dv.narrow(2, k0, n).copy_(part_v)
    return dq, dk, dv


class RecordedChunks(torch.autograd.Function):
    """:func:`forward` as one autograd node whose backward is :func:`backward`: the output only
    (the logsumexp is kept for the backward, not differentiable)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out, lse = forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(fused_cpu.unit_last_stride(grad_out), q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None
