"""Attention dropout (flexc's own ``dropout_p=`` keyword): which (batch, head, q_idx, kv_idx) pairs
a call keeps, from a counter-based random number generator.

Each pair's keep decision is a pure function of the call's seed and the pair's indices: Philox
4x32 with 10 rounds (Triton's ``tl.philox``, the generator torch's own CUDA dropout uses) on the
counters ``(kv_idx, q_idx, b * Hq + h, 0)``, keyed by the 64-bit seed; the pair is kept when the
first 32-bit output is at least ``p * 2**32``. So the backward regenerates the forward's mask
without storing it, and the TORCH backend (this module, in torch integer arithmetic) and the
generated Triton kernels (the ``philox``/``dropout_keep`` device helpers of
:data:`flexc.codegen.parts.DROPOUT_HELPERS`) draw the same mask for the same seed. The kept
probabilities are scaled by ``1 / (1 - p)``, as SDPA's dropout does; the logsumexp is the
undropped softmax's.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..device import is_gpu

_M32 = 0xFFFFFFFF
# Philox 4x32 constants (Salmon et al. 2011), as in Triton's triton.language.random
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
ROUNDS = 10


class Dropout(NamedTuple):
    """One call's dropout: its probability and seed (the same for the forward and the backward).

    ``q_positions``/``kv_positions`` (int64, optional) map the call's query rows and keys to the
    positions whose pairs are drawn: context parallelism's shards draw the pairs of the full
    sequence (:mod:`flexc.call.distributed`). None: the call's own indices."""

    p: float
    seed: int | torch.Tensor  # a 0-d int64 tensor when drawn on a GPU (flexc.backends.dropout.draw)
    q_positions: torch.Tensor | None = None
    kv_positions: torch.Tensor | None = None

    @property
    def threshold(self) -> int:
        """A pair is kept when its 32-bit random value is at least this."""
        return min(int(round(self.p * 2 ** 32)), _M32)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)


def check(dropout_p: Any, generator: Any, where: str = "flex_attention") -> float:
    """``dropout_p`` as a float in [0, 1), after checking it and ``generator``."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{where}: dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} "
                        f"{dropout_p!r}. Fix: pass e.g. dropout_p=0.1 (0 turns dropout off).")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p!r}. Fix: pass e.g. "
                         f"dropout_p=0.1 (0 turns dropout off; 1 would drop every probability).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{where}: generator must be a torch.Generator or None, got {type(generator).__name__}. "
                        f"Fix: pass torch.Generator().manual_seed(0).")
    return float(dropout_p)


def seed_tensor(generator: torch.Generator | None) -> torch.Tensor:
    """A call's seed as a 0-d int64 tensor, drawn from ``generator`` (torch's default CPU generator
    when None: a draw on a CPU generator needs no device sync). One draw per call, eager or compiled,
    so both advance the generator alike."""
    return torch.randint(0, 2 ** 62, (), generator=generator,
                         device=generator.device if generator is not None else "cpu")


def draw(dropout_p: float, generator: torch.Generator | None) -> Dropout:
    """This call's dropout, its seed drawn by :func:`seed_tensor`: a Python int from a host generator,
    the 0-d tensor itself from a GPU's (reading it on the host would sync the device every call;
    :func:`philox` and the Triton launcher take either)."""
    seed = seed_tensor(generator)
    return from_seed(dropout_p, seed) if generator is not None else Dropout(dropout_p, int(seed))


def from_seed(dropout_p: float, seed: torch.Tensor) -> Dropout:
    """The dropout of a call whose 0-d int64 ``seed`` is drawn: kept a tensor on a GPU (real or
    simulated), read into an int on the host."""
    return Dropout(dropout_p, seed if is_gpu(seed.device) else int(seed))


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for a 32-bit constant ``a`` and 32-bit values ``b`` (int64
    tensors), with 16-bit halves so that no product leaves int64."""
    low_part, high_part = a * (b & 0xFFFF), a * (b >> 16)
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _M32
    hi = (high_part + (low_part >> 16)) >> 16
    return hi, lo


def philox(seed: int | torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor) -> torch.Tensor:
    """The first 32-bit output (as int64 in [0, 2**32)) of Philox 4x32-10 for counters ``c0..c3``
    (broadcastable int64 tensors of 32-bit values) and a 64-bit ``seed`` (an int or a 0-d int64 tensor): Triton's
    ``tl.philox(seed, c0, c1, c2, c3)[0]``, bit for bit."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _M32 for c in (c0, c1, c2, c3)))
    for _ in range(ROUNDS):
        hi_b, lo_b = _mul_hi_lo(ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & _M32, (k1 + KEY_B) & _M32
    return c0


def keep_scale(dropout: Dropout, Hq: int, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
               kv_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``1 / (1 - p)`` where the pair ``(b, h, q_idx, kv_idx)`` (broadcastable index tensors) is
    kept, 0 where it is dropped, in ``dtype``."""
    if dropout.q_positions is not None:
        q_idx = dropout.q_positions.to(q_idx.device)[q_idx]
    if dropout.kv_positions is not None:
        kv_idx = dropout.kv_positions.to(kv_idx.device)[kv_idx]
    random = philox(dropout.seed, kv_idx, q_idx, b * Hq + h, torch.zeros((), dtype=torch.int64))
    return torch.where(random >= dropout.threshold, dropout.scale, 0.0).to(dtype)
