"""The kernel spec base: what a generated kernel is specialised for, and its cache key.

Each generator takes a frozen dataclass of everything that shapes its source, and the backends
cache compiled kernels by its :meth:`KernelSpec.key`. The key is derived from the fields in order
(a mod by its structure key, never its captured values), after the spec's ``KIND`` tag so kernels
of two kinds never share one. Each kind's module registers its generator for its spec type
(:func:`generates`), and :func:`generate` dispatches on the spec's type: a new kernel kind is its
spec, its generator and that one registration.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import torch

from ..dtypes import work_dtype_name
from ..mods.trace import TracedMod
from .printer import BufferParam


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, next_power_of_2(d))


@functools.cache
def _key_plan(cls: type) -> tuple[operator.attrgetter, tuple[int, ...]]:
    # once per class (key() runs on every call's cache lookup): a getter of the fields in order,
    # and the positions of the mods among them
    names = [f.name for f in fields(cls)]
    return operator.attrgetter(*names), tuple(i for i, name in enumerate(names) if name in cls.MOD_FIELDS)


# each spec type's generator, registered by its module (exact types: a subclass is a kind of its own)
GENERATORS: dict[type, Callable[[Any], Any]] = {}


def generates(spec_type: type) -> Callable:
    """Decorator: the decorated function generates the kernels of ``spec_type`` (exactly that type)."""
    def register(generator: Callable) -> Callable:
        GENERATORS[spec_type] = generator
        return generator
    return register


def generate(spec: "KernelSpec") -> Any:
    """The generated kernel (``.source``, ``.kernel_name``, parameters) of ``spec``, by its type's generator."""
    generator = GENERATORS.get(type(spec))
    if generator is None:
        raise TypeError(f"flexc.codegen.spec.generate: no generator is registered for {type(spec).__name__}, got "
                        f"{spec!r}. Fix: decorate the kind's generator with @generates({type(spec).__name__}).")
    return generator(spec)


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """Base of every kernel spec: the cache key derived from the fields."""

    KIND: ClassVar[tuple[str, ...]] = ()  # the key's leading tag ("decode", ...); the forward's is empty
    MOD_FIELDS: ClassVar[tuple[str, ...]] = ()  # fields holding a TracedMod (or None): keyed by structure
    TILES: ClassVar[tuple[str, ...]] = ()  # the tile fields (kernel_options names them upper-cased)
    # the groups of tiles a smaller configuration halves (those above 16 of the first group that has
    # one), tried in order after the pipeline stages (flexc.backends.triton.config.smaller_config)
    SHRINK_ORDER: ClassVar[tuple[tuple[str, ...], ...]] = ()

    def key(self) -> tuple:
        """The kernel cache key: the fields in order, the mods' structure, never their captured values.
        Computed once per spec (a call looks its kernels up more than once; the spec and its mods are
        frozen)."""
        known = self.__dict__.get("_key")
        if known is not None:
            return known
        get_fields, mods = _key_plan(type(self))
        values = list(get_fields(self))
        for i in mods:
            if values[i] is not None:
                values[i] = values[i].key
        known = self.KIND + tuple(values)
        object.__setattr__(self, "_key", known)  # (not a field: equality, hash and replace() ignore it)
        return known


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KernelSpec):
    """An attention kernel's spec: the mods and head dims lead every one's fields.

    The specs also share ``num_warps``, ``num_stages``, ``has_full_blocks``, ``target``
    (``"cuda"`` or ``"interpreter"``), ``fp32_precision`` and ``index_dtype``, each declared in its
    own spec's field order (the key's order). Every spec's fields are keyword-only: a flag passed by
    position lands in whatever field sits there (tests/test_house.py refuses positional construction).
    """

    MOD_FIELDS: ClassVar[tuple[str, ...]] = ("score_mod", "mask_mod")

    score_mod: TracedMod | None
    mask_mod: TracedMod | None
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int

    @property
    def widens(self) -> bool:
        """Whether 16-bit tiles are widened to fp32 before tl.dot (Triton's interpreter: its 16-bit dot
        is unreliable)."""
        return self.target == "interpreter" and self.dtype in (torch.float16, torch.bfloat16)

    @property
    def padded(self) -> tuple[bool, bool]:
        """Whether the head dim and the value head dim are padded (their tiles need bounds checks)."""
        return self.head_dim != padded_head_dim(self.head_dim), self.v_head_dim != padded_head_dim(self.v_head_dim)

    def shared_memory(self) -> int | None:
        """Bytes of shared memory a launch needs at least, for the kernels with one query and one key
        tile (the forward's and decode's ``block_m``/``block_n``; None for the others): the ring of
        ``num_stages - 1`` key and value tiles the pipeliner keeps in flight, and the query tile. A
        lower bound (the compiler may add scratch, e.g. for layout conversions)."""
        block_m, block_n = getattr(self, "block_m", None), getattr(self, "block_n", None)
        if block_m is None or block_n is None:
            return None
        d, dv = padded_head_dim(self.head_dim), padded_head_dim(self.v_head_dim)
        return (max(1, self.num_stages - 1) * block_n * (d + dv) + block_m * d) * self.dtype.itemsize

    @property
    def acc_dtype(self) -> str:
        """The Triton dtype of the softmax state and gradient accumulators."""
        return "tl." + work_dtype_name(self.dtype)

    @property
    def tl_dtype(self) -> str:
        """The Triton dtype of the inputs."""
        return TL_DTYPES[self.dtype]


@dataclass(frozen=True)
class GeneratedKernel:
    """A generated attention kernel: its source, and the captured-tensor parameters of each mod in order."""

    source: str
    kernel_name: str
    score_params: tuple[BufferParam, ...]
    mask_params: tuple[BufferParam, ...]


@dataclass(frozen=True, kw_only=True)
class RowsSpec(KernelSpec):
    """A small kernel over rows of value-head vectors in a work dtype (the decode kernel's merge, the
    backward's prologue): what it is specialised for (its :meth:`key` is the cache key)."""

    work_dtype: str  # "float32" or "float64"
    v_head_dim_pad: int
    block_rows: int
    target: str = "cuda"
    num_warps: int = 4
    num_stages: int = 1


@dataclass(frozen=True)
class GeneratedSource:
    """A generated kernel that takes no captured tensors: its source and its name."""

    source: str
    kernel_name: str


TL_DTYPES = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
             torch.float64: "tl.float64"}

# how fp32 dots may run (tl.dot's input_precision), as torch's FLOAT32_PRECISION kernel option names them
FP32_PRECISIONS = ("ieee", "tf32", "tf32x3")


def precision_option(kernel_options: dict | None) -> str | None:
    """The ``FLOAT32_PRECISION`` kernel option, unquoted and checked, or None when absent."""
    value = (kernel_options or {}).get("FLOAT32_PRECISION")
    if value is None:
        return None
    text = value.strip("'\"").lower() if isinstance(value, str) else None
    if text not in FP32_PRECISIONS:
        raise ValueError(f"flex_attention: kernel_options['FLOAT32_PRECISION'] must be one of "
                         f"{list(FP32_PRECISIONS)} (quoted or not, as torch passes it), got {value!r}. Fix: pass "
                         f"'ieee' for full fp32 dots or 'tf32' for TensorFloat-32.")
    return text


__all__ = ["AttentionSpec", "FP32_PRECISIONS", "GeneratedKernel", "GeneratedSource", "KernelSpec", "RowsSpec",
           "TL_DTYPES", "next_power_of_2", "padded_head_dim", "precision_option"]
