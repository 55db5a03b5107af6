"""How torch calls made while a mod runs reach the tracer: :class:`TraceMode` routes torch functions and
tensor methods on proxies to the tables of :mod:`flexc.mods.tracing.torch_ops` (and forbids mutation and
randomness); :func:`hook_function_apply` routes ``torch.autograd.Function.apply``."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..derived import leaves
from ..traced_mod import TraceError
from .proxies import PartialLoad, Proxy
from .torch_ops import TORCH_FUNCS

_INPLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                              "and", "or", "xor", "lshift", "rshift", "matmul")}


def _mutates(name: str) -> bool:
    """``add_``, ``index_put_``, ``__setitem__``, ``__iadd__``...: torch's in-place naming."""
    return (name in ("__setitem__", "index_put") or name in _INPLACE_DUNDERS
            or (name.endswith("_") and not name.endswith("__")))


# torch functions that draw random numbers: traced once, their values would be frozen into the
# graph, so they are rejected as torch's vmap rejects randomness.
_RANDOM_FUNCS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "binomial", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "rrelu", "native_dropout",
})


def _reject_random(tracer, name: str) -> None:
    if name in _RANDOM_FUNCS:
        tracer.fail(f"`torch.{name}` draws random numbers inside the mod; flexc traces a mod once, so the values would "
                    f"be frozen into one constant for every position (torch's vmap rejects this too)",
                    "draw the tensor once outside the mod and capture it, e.g. `noise = torch.randn(L, S)` "
                    "and return `score + noise[q_idx, kv_idx]`")


def dispatch_call(tracer, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` with a proxy among its arguments, traced by ``tracer`` through the tables."""
    name = getattr(func, "__name__", repr(func))
    _reject_random(tracer, name)
    if name == "__getitem__" and isinstance(args[0], torch.Tensor):
        return tracer.index(args[0], args[1])
    if _mutates(name):
        tracer.fail(f"`{name}` mutates a tensor inside the mod", "mods must be pure: compute new values instead of writing into captured tensors")
    handler = TORCH_FUNCS.get(name)
    if handler is None:
        tracer.fail(f"torch function `{name}` is not supported by flexc's tracer",
                    "rewrite the mod with supported operations: arithmetic, comparisons, &, |, ~, torch.where, "
                    "abs/exp/exp2/log/log2/sqrt/rsqrt/tanh/sigmoid/sin/cos/floor/ceil/sign/clamp/minimum/maximum")
    return call_handler(tracer, name, handler, args, kwargs)


def call_handler(tracer, name: str, handler: Callable, args: tuple, kwargs: dict) -> Any:
    """``handler`` for the torch call ``name``; a signature mismatch is reported as the mod's error."""
    try:
        return handler(tracer, *args, **kwargs)
    except TraceError:
        raise
    except TypeError as e:  # a signature mismatch: report it as the user's call, not flexc's internals
        tracer.fail(f"`{name}` was called with arguments flexc does not support ({e})",
                    f"call it as in the torch documentation with one value per operand, e.g. `torch.{name}(x, y)`")


# tensor methods that turn a captured tensor's values into Python values the trace may bake in
_VALUE_READS = frozenset({"__int__", "__float__", "__bool__", "__complex__", "__index__", "item", "tolist",
                          "numpy", "__array__", "__format__", "__len__", "__iter__"})


class TraceMode(TorchFunctionMode):
    """Routes torch calls that touch a proxy into the graph; forbids mutating captured tensors."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, (Proxy, PartialLoad)) for a in leaves((args, kwargs))):
            return dispatch_call(self.tracer, func, args, kwargs)
        name = getattr(func, "__name__", "")
        _reject_random(self.tracer, name)
        if name in _VALUE_READS:
            self.tracer.reads_values = True
        if _mutates(name) and args and isinstance(args[0], torch.Tensor):
            self.tracer.fail(f"`{name}` mutates a tensor inside the mod",
                             "mods must be pure: compute new values instead of writing into captured tensors")
        result = func(*args, **kwargs)
        # an operation on captured tensors is replayed when they change (flexc.mods.derived)
        tensors = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.tracer.recorder.note(func, args, kwargs, tensors, result)
        return result


# torch.autograd.Function.apply is routed to the tracer while a mod is traced (a Function's
# apply does not reach __torch_function__). The hook is installed only while some thread traces,
# and calls without a traced value go to torch's own apply unchanged.
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_apply_lock = threading.Lock()
_apply_users = 0
_active = threading.local()


def _traced_apply(cls, *args, **kwargs):
    tracer = getattr(_active, "tracer", None)
    if tracer is None or not any(isinstance(a, (Proxy, PartialLoad)) for a in leaves((args, kwargs))):
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    return tracer.function_apply(cls, args, kwargs)


@contextlib.contextmanager
def hook_function_apply(tracer):
    global _apply_users
    with _apply_lock:
        if _apply_users == 0:
            torch.autograd.Function.apply = classmethod(_traced_apply)
        _apply_users += 1
    previous, _active.tracer = getattr(_active, "tracer", None), tracer
    try:
        yield
    finally:
        _active.tracer = previous
        with _apply_lock:
            _apply_users -= 1
            if _apply_users == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY
