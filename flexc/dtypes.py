"""The dtype flexc computes in: float64 for float64 inputs, float32 for everything else.

One rule for the softmax state, the accumulators, the logsumexp (torch's own dtype for it), the
scores a score_mod sees, and the sinks' and backward's work: 16-bit inputs compute in float32 as
torch's FlexAttention does, and float64 inputs keep every bit.
"""
from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype inputs of ``dtype`` compute in: ``torch.float64`` for float64, else ``torch.float32``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def work_dtype_name(dtype: torch.dtype) -> str:
    """:func:`work_dtype` as the generated kernels spell it: ``"float64"`` or ``"float32"``."""
    return str(work_dtype(dtype)).removeprefix("torch.")
