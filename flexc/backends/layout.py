"""Output and gradient layouts: the strides torch's FlexAttention gives what it returns.

torch lays an output (and a gradient) out densely in its reference's dimension order (the query's
for the output, each input's for its gradient), with the last dimension innermost whatever the
reference says (``torch._higher_order_ops.flex_attention._permute_strides``). Eager calls, the
Triton forward's output buffer and the custom operators that compiled calls run (their real and
fake implementations) all take their strides from :func:`output_strides`, so a compiled call
returns what an eager one does.
"""
from __future__ import annotations

import torch


def strides_like(shape: tuple, reference_strides: tuple) -> list[int]:
    """Dense strides for ``shape`` that lay dimensions out in the order of ``reference_strides``
    (torch's rule for outputs and gradients): smallest stride innermost, ties put the later
    dimension inside, and the last dimension innermost whatever the reference says."""
    def dense(order):
        strides, step = [0] * len(shape), 1
        for d in order:
            strides[d], step = step, step * shape[d]
        return strides

    # insertion sort by (stride, -dim), written out: dynamo cannot sort by symbolic sizes (sorted's key)
    order: list[int] = []
    for d in range(len(shape)):
        i = len(order)
        while i > 0 and (reference_strides[d] < reference_strides[order[i - 1]]
                         or reference_strides[d] == reference_strides[order[i - 1]]):
            i -= 1
        order.insert(i, d)
    strides = dense(order)
    if strides[-1] != 1:
        last = len(shape) - 1
        strides = dense([last] + [d for d in order if d != last])
    return strides


def row_major(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (sizes taken as they are, 0 included)."""
    if len(shape) == 4:  # attention's tensors, written out: read on every call (decoding steps included)
        _, h, l, d = shape
        ld = l * d
        return h * ld, ld, d, 1
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def output_strides(shape: tuple, reference: torch.Tensor) -> tuple[int, ...]:
    """The strides of a ``shape`` result laid out like ``reference`` (:func:`strides_like`), read
    without the sort for a row-major reference (the common case)."""
    ref = reference.stride()
    if ref == row_major(reference.shape):
        return ref if shape == reference.shape else row_major(shape)
    return tuple(strides_like(tuple(shape), ref))


def laid_out_like(t: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``t`` with :func:`output_strides` (a query permuted from [B, L, H, D] gives an output whose
    transpose back is free), as torch returns outputs and gradients; copies only when ``t`` is laid
    out otherwise. The strides never depend on ``t``'s own, so every path that produces ``t``
    (backends, the custom operators' real and fake implementations) returns the same ones."""
    if t.shape == reference.shape and t.stride() == reference.stride() == row_major(reference.shape):
        return t  # (the common case, read on every call: a row-major reference's own strides)
    strides = output_strides(t.shape, reference)
    if t.stride() == strides:
        return t
    return t.new_empty_strided(t.shape, strides).copy_(t)


def empty_like_reference(shape: tuple, reference: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised ``shape`` tensor on ``reference``'s device with :func:`output_strides`, to
    write a result into where :func:`laid_out_like` will not copy it."""
    return torch.empty_strided(tuple(shape), output_strides(shape, reference),
                               dtype=reference.dtype if dtype is None else dtype, device=reference.device)


__all__ = ["empty_like_reference", "laid_out_like", "output_strides", "row_major", "strides_like"]
