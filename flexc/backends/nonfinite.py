"""NaN/inf-safe pieces of the CPU paths: a masked-out (query, key) pair must contribute exactly 0
to the output and the gradients whatever the key and value rows hold (padding, an uninitialised
KV cache), while NaN and inf that the mask allows propagate as in torch.

Masking by selection (``masked_fill`` with -inf) keeps non-finite *keys* out of the scores; the
probability of a masked pair is then exactly 0, but a matmul still forms ``0 * NaN = NaN`` with
its *value* row. :func:`matmul_skipping_zeros` is the product without that. The fast paths
(additive -inf masks, torch's fused kernel, plain matmuls) stay in use whenever
:func:`all_finite` says the inputs allow them.
"""
from __future__ import annotations

import math

import torch

from ..device import is_gpu
from ..dtypes import work_dtype
from .versioned_memo import VersionedMemo


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element is finite: one sum per tensor (NaN and inf survive a sum), read as a
    Python float (a tensor isfinite costs as much again as the sum of a small tensor). A sum that
    overflows reports False, which only costs the slower NaN-safe path. The answer is remembered
    while the tensors hold the same elements, unmodified (:mod:`flexc.backends.versioned_memo`, one
    lookup for the group): a training step's backward asks again about the inputs its forward saved."""
    return _VERDICTS.get(tensors, None, lambda: all(_finite(t) for t in tensors))


# the verdicts of recently checked groups of tensors, while their contents stay (one lookup per call)
_VERDICTS = VersionedMemo(64)


def _finite(t: torch.Tensor) -> bool:
    return math.isfinite(t.sum(dtype=work_dtype(t.dtype)).item())


def matmul_skipping_zeros(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in which an exact zero of ``a`` contributes 0 even where ``b`` holds NaN or inf.

    A plain matmul gives ``0 * NaN = NaN``, so a masked key (probability 0) whose value row holds
    NaN would poison its query row. Here non-finite entries of ``b`` are zeroed for the product and
    what the nonzero entries of ``a`` make of them (NaN, +inf or -inf per output element) is added
    back, from 0/1 products over the few key rows (dim -2 of ``b``) that hold such entries (on a GPU,
    over every row: finding the few would read them on the host).
    """
    bad = ~torch.isfinite(b)
    if is_gpu(b.device):  # every key row: finding the few would read them on the host (a sync)
        a_sel, b_sel = a, b
    else:
        rows = bad.any(-1).reshape(-1, b.shape[-2]).any(0).nonzero().flatten()
        if rows.numel() == 0:
            return torch.matmul(a, b)
        a_sel, b_sel = a[..., rows], b[..., rows, :]
    out = torch.matmul(a, b.masked_fill(bad, 0.0))
    pos, neg = (a_sel > 0).to(out.dtype), (a_sel < 0).to(out.dtype)
    is_nan = b_sel.isnan().to(out.dtype)
    is_pinf, is_ninf = (b_sel == float("inf")).to(out.dtype), (b_sel == float("-inf")).to(out.dtype)
    n_nan = torch.matmul(pos + neg, is_nan)  # (a NaN in ``a`` already made the product NaN)
    n_pinf = torch.matmul(pos, is_pinf) + torch.matmul(neg, is_ninf)
    n_ninf = torch.matmul(pos, is_ninf) + torch.matmul(neg, is_pinf)
    nan = (n_nan > 0) | ((n_pinf > 0) & (n_ninf > 0))
    inf = torch.where(n_pinf > 0, float("inf"), torch.where(n_ninf > 0, float("-inf"), 0.0)).to(out.dtype)
    return out.add_(inf.masked_fill_(nan, float("nan")))
