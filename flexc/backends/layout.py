"""Output and gradient layouts: the strides torch's FlexAttention gives what it returns.

torch lays an output (and a gradient) out densely in its reference's dimension order (the query's
for the output, each input's for its gradient), with the last dimension innermost whatever the
reference says (``torch._higher_order_ops.flex_attention._permute_strides``). Eager calls, the
Triton forward's output buffer and the custom operators that compiled calls run (their real and
fake implementations) all take their strides from :func:`output_strides`, so a compiled call
returns what an eager one does.
"""
from __future__ import annotations

import functools
from typing import Callable

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


def laid_out_like(t: torch.Tensor, reference: torch.Tensor, strides: tuple | None = None) -> torch.Tensor:
    """``t`` with :func:`output_strides` (a query permuted from [B, L, H, D] gives an output whose
    transpose back is free), as torch returns outputs and gradients; copies only when ``t`` is laid
    out otherwise. The strides never depend on ``t``'s own, so every path that produces ``t``
    (backends, the custom operators' real and fake implementations) returns the same ones.
    ``strides``: :func:`output_strides` of ``t``'s shape and ``reference``, when the caller keeps them
    (a plan's calls all have them)."""
    if strides is None:
        strides = output_strides(t.shape, reference)
    if t.stride() == strides:
        return t
    return t.new_empty_strided(t.shape, strides).copy_(t)


def empty_like_reference(shape: tuple, reference: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised ``shape`` tensor on ``reference``'s device with :func:`output_strides`, to
    write a result into where :func:`laid_out_like` will not copy it."""
    return torch.empty_strided(tuple(shape), output_strides(shape, reference),
                               dtype=reference.dtype if dtype is None else dtype, device=reference.device)


class EmptyMaker:
    """Makes uninitialised contiguous tensors of one shape, dtype and device, for a launch that
    allocates them on every call: ``torch.empty_like`` of a one-element template expanded to the
    shape costs about half of ``torch.empty(shape, dtype=, device=)``, which parses its keywords."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        template = torch.empty((), dtype=dtype, device=device).expand(self.shape)
        # (empty_like of a tensor that is not dense gives row-major strides: checked, not assumed)
        self.template = template if torch.empty_like(template).stride() == row_major(self.shape) else None

    def __call__(self) -> torch.Tensor:
        if self.template is None:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return torch.empty_like(self.template)


def empty_maker_like(sample: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Makes uninitialised tensors with ``sample``'s shape, strides, dtype and device (an
    :class:`EmptyMaker` for a row-major sample); holds no sample tensor."""
    if sample.stride() == row_major(sample.shape):
        maker = EmptyMaker(sample.shape, sample.dtype, sample.device)
        # (torch.empty_like of the template called straight, without the maker's Python call in between)
        return maker if maker.template is None else functools.partial(torch.empty_like, maker.template)
    return functools.partial(torch.empty_strided, tuple(sample.shape), sample.stride(), dtype=sample.dtype,
                             device=sample.device)


def output_maker(reference: torch.Tensor, shape: tuple | None = None, dtype: torch.dtype | None = None
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``make(reference)``: uninitialised ``shape`` tensors (the reference's by default) in ``dtype``
    (its own by default) laid out like the reference (:func:`output_strides`), for the calls of one
    signature (references with this one's shape and strides). ``torch.empty_like`` where that gives
    those strides (a dense reference of that shape), else an :class:`EmptyMaker` (row-major) or
    :func:`empty_like_reference`. Holds no reference tensor."""
    shape = tuple(reference.shape if shape is None else shape)
    dtype = reference.dtype if dtype is None else dtype
    strides = output_strides(shape, reference)
    if shape == tuple(reference.shape) and strides == reference.stride():
        return torch.empty_like if dtype == reference.dtype else functools.partial(torch.empty_like, dtype=dtype)
    if strides == row_major(shape):
        maker = EmptyMaker(shape, dtype, reference.device)
        return lambda _reference: maker()
    return functools.partial(empty_like_reference, shape, dtype=dtype)


__all__ = ["EmptyMaker", "empty_maker_like", "output_maker", "empty_like_reference", "laid_out_like", "output_strides", "row_major",
           "strides_like"]
