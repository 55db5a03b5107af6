"""Count the reads of tensor contents on the host that flexc's own code makes.

On a GPU each such read (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``,
``nonzero``) is a device-to-host sync that stalls the launch queue, and CUDA graph capture refuses
it. Under ``FLEXC_SIMULATE_DEVICE`` the tensors live on the CPU, so the reads cost nothing there,
but they are counted here all the same: a read is flexc's when the innermost Python frame outside
torch (and outside this module) that asked for it is in the flexc package. Reads by Triton's
interpreter, which runs the kernel itself on the CPU, are not flexc's.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexc

FLEXC_DIR = os.path.dirname(os.path.abspath(flexc.__file__)) + os.sep
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.abspath(__file__))
_READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_METHODS = ("tolist", "numpy")


def _flexc_site() -> str | None:
    """``file:line`` of the flexc frame that asked, or None when the asker is not flexc."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIPPED):
            return f"{os.path.relpath(path, os.path.dirname(FLEXC_DIR))}:{frame.f_lineno}" \
                if path.startswith(FLEXC_DIR) else None
        frame = frame.f_back
    return None


class _ReadCounter(TorchDispatchMode):
    def __init__(self, sites: list):
        super().__init__()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READ_OPS:
            site = _flexc_site()
            if site is not None:
                self.sites.append(f"{func.__name__} at {site}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list]:
    """Within the block, the returned list collects ``"op at flexc/file.py:line"`` per host read."""
    sites: list = []
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrapped(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            site = _flexc_site()
            if site is not None:
                sites.append(f"{name} at {site}")
            return original(self, *args, **kwargs)
        return method

    for name in _METHODS:
        setattr(torch.Tensor, name, wrapped(name))
    try:
        with _ReadCounter(sites):
            yield sites
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
