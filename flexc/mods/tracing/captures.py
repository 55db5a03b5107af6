"""What a mod can reach by name: its captured tensors and Python numbers, and the names its captured
tensors get in the graph."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch


def _captures(fn: Callable) -> list[tuple[str, Any]]:
    """``(name, value)`` of every tensor and Python number the mod can reach by name: its closures,
    defaults, ``functools.partial`` arguments and globals, and those of the functions it calls."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int = 0) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            for i, a in enumerate(obj.args):
                note(f"arg{i}", a, depth)
            for k, a in (obj.keywords or {}).items():
                note(k, a, depth)
            visit(obj.func, depth + 1)
            return
        code = getattr(obj, "__code__", None)
        if code is None:
            return
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                note(name, cell.cell_contents, depth)
            except ValueError:  # empty cell
                pass
        params = list(inspect.signature(obj).parameters.values()) if callable(obj) else []
        for p in params:
            if p.default is not p.empty:
                note(p.name, p.default, depth)
        globs = getattr(obj, "__globals__", {})
        for name in code.co_names:
            if name in globs:
                note(name, globs[name], depth)

    def note(name: str, value: Any, depth: int) -> None:
        if isinstance(value, (torch.Tensor, int, float)):
            found.append((name, value))
        elif callable(value) and not isinstance(value, type) and not inspect.ismodule(value):
            visit(value, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if callable(v):
                    visit(v, depth + 1)

    visit(fn)
    return found


def captured_numbers(fn: Callable) -> dict[str, int | float]:
    """The Python ints and floats (not bools) a mod captures, by name (the first place wins)."""
    numbers: dict[str, int | float] = {}
    for name, value in _captures(fn):
        if type(value) in (int, float) and name.isidentifier():
            numbers.setdefault(name, value)
    return numbers


def buffer_names(fn: Callable, buffers: list) -> tuple:
    """Names for captured tensors, found in the mod's closures, defaults, partial args and globals."""
    found: dict[int, str] = {}
    for name, value in _captures(fn):
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), name)
    names, used = [], set()
    for slot, t in enumerate(buffers):
        name = found.get(id(t), f"buf{slot}")
        if name in used:
            name = f"{name}_{slot}"
        used.add(name)
        names.append(name)
    return tuple(names)
