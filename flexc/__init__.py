"""flexc: a compiler for attention variants, drop-in for torch's FlexAttention."""
import os as _os
import sys as _sys

from ._version import __version__

__all__ = ["Node", "TraceError", "TracedMod", "trace", "evaluate", "evaluate_grid",
           "BlockMask", "create_block_mask", "create_mask", "and_masks", "or_masks", "not_mask", "noop_mask",
           "flex_attention", "AuxRequest", "AuxOutput", "FallbackWarning",
           "kernel_source", "cache_info", "cache_clear", "FlexKernelOptions", "create_nested_block_mask",
           "plot", "__version__"]


def _load_api() -> None:
    """Import the public API (and torch) into the package's namespace."""
    global _api_loaded
    _api_loaded = True
    from .mods.ir import Node
    from .mods.trace import TraceError, TracedMod, trace
    from .mods.evaluate import evaluate
    from .mods.grid import evaluate_grid
    from .masks.mask_mods import and_masks, noop_mask, not_mask, or_masks
    from .masks.block_mask import BlockMask
    from .masks.create import create_mask
    from .masks import block_mask_pytree  # noqa: F401  (registers BlockMask as a pytree node)
    from .call.attention import AuxOutput, AuxRequest, FallbackWarning, flex_attention
    # create_block_mask dispatches to one custom-op node inside torch.compile
    from .torch_compile.compiled_block_mask import create_block_mask
    from .backends.triton.cache import cache_info
    from .call.plans import cache_clear
    from .call.kernel_source import kernel_source
    # torch's commonly imported private names, so `from torch.nn.attention.flex_attention import ...`
    # becomes `from flexc import ...` unchanged
    from .call.compat import (FlexKernelOptions, _Backend, _DEFAULT_SPARSE_BLOCK_SIZE, _LARGE_SPARSE_BLOCK_SIZE,
                         _MaskModWrapper, _WARNINGS_SHOWN, _apply_kernel_options, _create_empty_block_mask,
                         flex_attention_hop, _ModificationType, _dense_to_ordered, _get_mod_type, _identity, _mask_mod_signature,
                         _ordered_to_dense, _round_up_to_multiple, _score_mod_signature, _transpose_ordered,
                         _vmap_for_bhqkv, create_nested_block_mask)
    from .tools.plot import plot  # matplotlib is imported only when plot() runs
    globals().update((name, value) for name, value in locals().items() if not name.startswith("__"))


def _imported_by_the_flexc_command() -> bool:
    """True while `python -m flexc` or the `flexc` console script imports this package (before its code runs)."""
    if _os.path.basename(_sys.argv[0]) in ("flexc", "flexc.exe"):
        return True
    argv = getattr(_sys, "orig_argv", [])  # `python [options] -m flexc ...`; sys.argv[0] is '-m' meanwhile
    return _sys.argv[:1] == ["-m"] and ("-mflexc" in argv or any(
        a == "-m" and argv[i + 1:i + 2] == ["flexc"] for i, a in enumerate(argv)))


# The flexc command parses its arguments before it needs torch (~1 s to import), so `flexc --help` and
# `--version` answer at once; there the API loads on first use. Every other import loads it now.
_api_loaded = False
if _imported_by_the_flexc_command():
    def __getattr__(name: str):
        # a submodule (`from .. import device` inside flexc) is left to the import system to load
        submodule = _os.path.join(__path__[0], name)
        if _api_loaded or name.startswith("__") or _os.path.isdir(submodule) or _os.path.isfile(submodule + ".py"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        _load_api()
        return getattr(_sys.modules[__name__], name)
else:
    _load_api()
