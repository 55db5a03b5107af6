"""Where a mod's code is: the ``file:line`` and source text a trace error points at."""
from __future__ import annotations

import dis
import linecache
import os
import sys
from typing import Callable

import torch

from ..traced_mod import code_of

# frames in flexc/mods (the tracer) and in torch are not the mod's lines
_MODS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _site_of(filename: str, lineno: int) -> tuple[str, str]:
    return f" ({filename}:{lineno})", linecache.getline(filename, lineno).strip()


def user_site() -> tuple[str, str]:
    """`` (file:line)`` and source text of the innermost frame outside flexc and torch: the mod's line."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_MODS_DIR + os.sep) and not path.startswith(_TORCH_DIR + os.sep) \
                and os.path.basename(path) != "functools.py":
            return _site_of(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return "", ""


def return_site(fn: Callable) -> tuple[str, str]:
    """The mod's return statement when it has exactly one, else its ``def`` line."""
    code = code_of(fn)
    if code is None:
        return "", ""
    lines = {
        ins.positions.lineno for ins in dis.get_instructions(code)
        if ins.opname in ("RETURN_VALUE", "RETURN_CONST") and getattr(ins, "positions", None)
        and ins.positions.lineno
    }
    return _site_of(code.co_filename, lines.pop() if len(lines) == 1 else code.co_firstlineno)
