"""The import paths flexc's modules had before they moved into stage folders keep working.

``import flexc.attention`` or ``from flexc.backends.triton_backend import compile_offline`` give
the module that now lives at ``flexc.call.attention`` or the package ``flexc.backends.triton``: the same
module object, so assigning or monkeypatching through either path affects both.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old path -> new path, both relative to the package
MOVED = {
    "affine": "analysis.affine",
    "attention": "call.attention",
    "backends.block_plan": "backends.cpu.block_plan",
    "backends.decode_cpu": "backends.cpu.decode_cpu",
    "backends.fused_cpu": "backends.cpu.fused_cpu",
    "backends.torch_cpu": "backends.cpu.torch_cpu",
    "backends.triton_backend": "backends.triton",  # the package re-exports its public names
    "backends.triton_backward": "backends.triton.backward",
    "backends.triton_decode": "backends.triton.decode",
    "backends.cpu.workers": "workers",
    "backends.workers": "workers",
    "block_mask": "masks.block_mask",
    "block_mask_pytree": "masks.block_mask_pytree",
    "block_tables": "analysis.block_tables",
    "bounds": "analysis.bounds",
    "cli": "tools.cli",
    "compat": "call.compat",
    "custom_ops": "torch_compile.custom_ops",
    "derivative": "mods.derivative",
    "derived": "mods.derived",
    "distributed": "call.distributed",
    "dropout": "backends.dropout",
    "elementwise": "mods.elementwise",
    "empty_entries": "masks.empty_entries",
    "evaluate": "mods.evaluate",
    "evaluate_numpy": "mods.evaluate_numpy",
    "ir": "mods.ir",
    "layout": "backends.layout",
    "lowering": "mods.lowering",
    "mask_mods": "masks.mask_mods",
    "mod_key": "mods.mod_key",
    "plot": "tools.plot",
    "promotion": "mods.promotion",
    "range_tables": "analysis.range_tables",
    "ranges": "analysis.ranges",
    "reductions": "mods.reductions",
    "row_intervals": "analysis.row_intervals",
    "sinks": "call.sinks",
    "spans": "analysis.spans",
    "table_lists": "masks.table_lists",
    "tiles": "analysis.tiles",
    "trace": "mods.trace",
    "trace_cache": "mods.trace_cache",
    "under_compile": "torch_compile.under_compile",
    "validate": "call.validate",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (imported on first use)."""

    def __init__(self, target: str):
        self.target = target
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__  # the import machinery stamps the alias's spec on the module
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the module keeps its own name and spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(self.package) + 1:] if fullname.startswith(self.package + ".") else None
        if old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(f"{self.package}.{MOVED[old]}"))


def install(package: str) -> None:
    """Serve the old paths of ``package``: those already imported at once (without replacing a
    public attribute of the same name, such as the function ``flexc.trace``), the rest on demand."""
    for old, new in MOVED.items():
        module = sys.modules.get(f"{package}.{new}")
        if module is None:
            continue
        sys.modules.setdefault(f"{package}.{old}", module)
        parent, _, name = f"{package}.{old}".rpartition(".")
        if not hasattr(sys.modules[parent], name):
            setattr(sys.modules[parent], name, module)
    if not any(isinstance(f, _AliasFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder(package))
