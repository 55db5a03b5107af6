"""Small emitters of Triton source lines shared by the forward, backward and decode generators.

Each returns text (a line, an expression or a list of lines) laid out the way every generated
kernel lays it out: a ``@triton.jit`` function with one parameter group per line, calls of the
block-loop functions with one argument group per line, compile-time options passed through by
keyword, and tile loads whose bounds mask holds only the checks a case needs.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .printer import RenderedMod
from .triton_helpers import HELPERS

HEAD_DIMS = ("HEAD_DIM", "HEAD_DIM_PAD", "V_HEAD_DIM", "V_HEAD_DIM_PAD")  # every kernel's head-dim constexprs


def preamble(header: list[str], mods: Sequence[RenderedMod]) -> list[str]:
    """The header comment, the imports, then the math helpers and device functions of ``mods``."""
    imports = ["import triton", "import triton.language as tl"]
    if any(r.uses_libdevice for r in mods):
        imports.append("from triton.language.extra import libdevice")
    lines = header + imports + ["", ""]
    for name in sorted(set().union(*(r.helpers for r in mods))):
        lines += [HELPERS[name], ""]
    for r in mods:
        lines += [r.source, ""]
    return lines


def jit_def(name: str, params: Iterable[str], decorator: str = "@triton.jit") -> list[str]:
    """The opening of a jitted function: decorator, ``def name(``, one parameter line each, ``):``."""
    return [decorator, f"def {name}(", *("    " + p for p in params), "):"]


def call(result: str, fn: str, args: Iterable[str], indent: str) -> list[str]:
    """``result = fn(`` with one argument line each, indented one level deeper, and ``)``."""
    return [f"{indent}{result} = {fn}(", *(f"{indent}    {a}" for a in args), f"{indent})"]


def names_line(names: Sequence[str]) -> list[str]:
    """One parameter (or argument) line of ``names``, e.g. captured-tensor pointers; none if empty."""
    return [", ".join(names) + ","] if names else []


def constexprs(*groups: Sequence[str]) -> list[str]:
    """Compile-time parameters, one line per group: ``A: tl.constexpr, B: tl.constexpr,``."""
    return [" ".join(f"{name}: tl.constexpr," for name in group) for group in groups]


def keywords(*groups: Sequence[str]) -> list[str]:
    """Compile-time arguments passed through by keyword, one line per group: ``A=A, B=B,``.
    An item that already holds ``=`` (``CHECK_KV=True``) is written as it is."""
    return [" ".join((item if "=" in item else f"{item}={item}") + "," for item in group) for group in groups]


def pad_check(offs: str, dim: str, padded: bool) -> str | None:
    """The bounds check of a head-dim axis padded to a power of two (None when it is not padded)."""
    return f"{offs} < {dim}" if padded else None


def bounds(*checks: str | None) -> str:
    """The checks that apply (None ones dropped) joined by ``&``, comparisons in parentheses."""
    present = [c for c in checks if c]
    if len(present) == 1:
        return present[0]
    return " & ".join(f"({c})" if " < " in c else c for c in present)


def load(ptrs: str, *checks: str | None, other: str = "0.0", widen: str = "") -> str:
    """``tl.load`` of ``ptrs``, masked by the checks that apply (plain when none does), then ``widen``."""
    if not any(checks):
        return f"tl.load({ptrs}){widen}"
    return f"tl.load({ptrs}, mask={bounds(*checks)}, other={other}){widen}"


def store(ptrs: str, value: str, *checks: str | None) -> str:
    """``tl.store`` of ``value`` at ``ptrs``, masked by the checks that apply."""
    if not any(checks):
        return f"tl.store({ptrs}, {value})"
    return f"tl.store({ptrs}, {value}, mask={bounds(*checks)})"


__all__ = ["HEAD_DIMS", "bounds", "call", "constexprs", "jit_def", "keywords", "load", "names_line", "pad_check",
           "preamble", "store"]
