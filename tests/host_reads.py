"""Count the host reads and host/device copies that flexc's own code makes.

On a GPU each read of a device tensor's contents on the host (``.item()``, ``int(t)``, ``bool(t)``,
``.tolist()``, ``.numpy()``, ``nonzero``) is a device-to-host sync that stalls the launch queue, and
so is a device-to-host copy (``.cpu()``, ``.to("cpu")``); a host-to-device copy of pageable memory
(``torch.tensor(data, device=d)``, ``torch.as_tensor(data, device=d)``, ``.to(d)`` or ``.cuda()``
of a host tensor, ``copy_`` from one) waits for the host too; CUDA graph capture refuses all of
them, and a host tensor handed to a kernel launch cannot be read there. Under
``FLEXC_SIMULATE_DEVICE`` the tensors live on the CPU, so these cost nothing there, but they are
counted here all the same: an operation is flexc's when the innermost Python frame outside torch
(and outside this module) that asked for it is in the flexc package. Reads by Triton's
interpreter, which runs the kernel itself on the CPU, are not flexc's.

Which tensors are the host's: under simulation every tensor is on the CPU, so the counter follows
the ones flexc makes on the host: made by a factory (``torch.tensor``, ``torch.zeros``,
``torch.randint``...) without a device, or with one spelled ``"cpu"`` (a string, or a
``torch.device("cpu")`` on a line that says "cpu"), moved there by ``.cpu()``/``.to("cpu")``, and
whatever torch computes from host tensors alone. Reading those is not a sync, and is not counted;
moving them to the device is.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import weakref
from typing import Iterator

import torch
import torch._dynamo  # noqa: F401  (imported before any patch: dynamo's tables record torch's own factories)
from torch.utils._python_dispatch import TorchDispatchMode

import flexc
from flexc import device as gpu

FLEXC_DIR = os.path.dirname(os.path.abspath(flexc.__file__)) + os.sep
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.abspath(__file__))
_READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_METHODS = ("tolist", "numpy")
# factories whose result lives on the host unless given a device; tensor/as_tensor copy their data there
_FACTORIES = ("tensor", "as_tensor", "from_numpy", "randint", "zeros", "ones", "full", "empty", "arange")
_COPYING = ("tensor", "as_tensor")


def _flexc_frame():
    """The flexc frame that asked, or None when the asker is not flexc."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIPPED):
            return frame if path.startswith(FLEXC_DIR) else None
        frame = frame.f_back
    return None


def _site(frame) -> str:
    path = os.path.abspath(frame.f_code.co_filename)
    return f"{os.path.relpath(path, os.path.dirname(FLEXC_DIR))}:{frame.f_lineno}"


def _flexc_site() -> str | None:
    """``file:line`` of the flexc frame that asked, or None when the asker is not flexc."""
    frame = _flexc_frame()
    return _site(frame) if frame is not None else None


def _names_host(device, frame) -> bool:
    """Whether ``device`` (an argument given at ``frame``'s line) is the host: ``"cpu"`` spelled as a
    string, or a CPU device on a line that says so (``torch.device("cpu")``, a ``_CPU`` constant).
    Under simulation the device path's own device is the CPU too, taken from a tensor (``q.device``)."""
    if isinstance(device, str):
        return device.startswith("cpu")
    if isinstance(device, torch.device) and device.type == "cpu":
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        return "cpu" in line.lower()
    return False


def _target_device(args, kwargs):
    """The device a ``Tensor.to(...)`` call names, or None (a dtype-only conversion)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class _Tracker(TorchDispatchMode):
    """Counts host reads of device tensors, and marks what torch computes from host tensors alone."""

    def __init__(self, sites: list, host: _Tensors):
        super().__init__()
        self.sites, self.host = sites, host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        from_host = bool(tensors) and all(t in self.host for t in tensors)
        if func in _READ_OPS and not from_host:
            site = _flexc_site()
            if site is not None:
                self.sites.append(f"{func.__name__} at {site}")
        out = func(*args, **(kwargs or {}))
        if from_host:
            for t in _leaves(out):
                if isinstance(t, torch.Tensor):
                    self.host.add(t)
        return out


class _Tensors:
    """A set of tensors by identity, holding none alive (a WeakSet compares tensors with ``==``)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: object) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


def _leaves(tree):
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _leaves(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _leaves(x)
    else:
        yield tree


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list]:
    """Within the block, the returned list collects ``"what at flexc/file.py:line"`` per host read,
    device-to-host copy, host-to-device copy, and host tensor handed to a kernel launch."""
    sites: list = []
    host = _Tensors()
    patched: list = []

    def patch(owner, name, make):
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, make(original))

    def reading(name):
        def make(original):
            def method(self, *args, **kwargs):
                site = _flexc_site()
                if site is not None and self not in host:
                    sites.append(f"{name} at {site}")
                return original(self, *args, **kwargs)
            return method
        return make

    def factory(name):
        def make(original):
            def made(*args, **kwargs):
                out = original(*args, **kwargs)
                frame = _flexc_frame()
                if frame is None or not isinstance(out, torch.Tensor):
                    return out
                device = kwargs.get("device")
                data = args[0] if args else kwargs.get("data")
                data_on_device = isinstance(data, torch.Tensor) and data not in host
                if device is None or _names_host(device, frame):
                    if not (name == "as_tensor" and data_on_device):
                        host.add(out)
                elif name in _COPYING and not data_on_device and gpu.is_gpu(torch.device(device)):
                    sites.append(f"host-to-device copy (torch.{name}) at {_site(frame)}")
                return out
            return made
        return make

    def to_host(name):  # .cpu(), .to(...)
        def make(original):
            def method(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                frame = _flexc_frame()
                if frame is None:
                    return out
                target = {"cpu": "cpu", "cuda": "cuda"}.get(name) or _target_device(args, kwargs)
                if target is None:
                    return out
                if name == "cpu" or _names_host(target, frame):
                    if self not in host:
                        sites.append(f"device-to-host copy (.{name}) at {_site(frame)}")
                    if out is not self:
                        host.add(out)
                elif self in host and gpu.is_gpu(torch.device(target)):
                    sites.append(f"host-to-device copy (.{name}) at {_site(frame)}")
                return out
            return method
        return make

    def copy_into(original):
        def method(self, src, *args, **kwargs):
            frame = _flexc_frame()
            if frame is not None and isinstance(src, torch.Tensor) and (src in host) != (self in host):
                sites.append(f"{'host-to-device' if src in host else 'device-to-host'} copy (copy_) at {_site(frame)}")
            return original(self, src, *args, **kwargs)
        return method

    def launching(original):
        def launch(fn, grid, spec, device, args, *rest, **options):
            frame = _flexc_frame()
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a in host:
                    sites.append(f"host tensor handed to a launch (argument {i}) at "
                                 f"{_site(frame) if frame is not None else '?'}")
            return original(fn, grid, spec, device, args, *rest, **options)
        return launch

    for name in _METHODS:
        patch(torch.Tensor, name, reading(name))
    for name in _FACTORIES:
        patch(torch, name, factory(name))
    patch(torch.Tensor, "cpu", to_host("cpu"))
    patch(torch.Tensor, "to", to_host("to"))
    patch(torch.Tensor, "cuda", to_host("cuda"))
    patch(torch.Tensor, "copy_", copy_into)
    patch(gpu, "launch", launching)
    try:
        with _Tracker(sites, host):
            yield sites
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
