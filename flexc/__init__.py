"""flexc: a compiler for attention variants, drop-in for torch's FlexAttention."""
from ._version import __version__
from .mods.ir import Node
from .mods.trace import TraceError, TracedMod, trace
from .mods.evaluate import evaluate
from .mods.grid import evaluate_grid
from .masks.mask_mods import and_masks, noop_mask, not_mask, or_masks
from .masks.block_mask import BlockMask, create_mask
from .masks import block_mask_pytree  # noqa: F401  (registers BlockMask as a pytree node)
from .call.attention import AuxOutput, AuxRequest, FallbackWarning, flex_attention
# create_block_mask dispatches to one custom-op node inside torch.compile
from .torch_compile.under_compile import create_block_mask
from .backends.triton.cache import cache_clear, cache_info
from .call.kernel_source import kernel_source
# torch's commonly imported private names, so `from torch.nn.attention.flex_attention import ...`
# becomes `from flexc import ...` unchanged
from .call.compat import (FlexKernelOptions, _Backend, _DEFAULT_SPARSE_BLOCK_SIZE, _LARGE_SPARSE_BLOCK_SIZE,
                     _MaskModWrapper, _WARNINGS_SHOWN, _apply_kernel_options, _create_empty_block_mask,
                     flex_attention_hop, _ModificationType, _dense_to_ordered, _get_mod_type, _identity, _mask_mod_signature,
                     _ordered_to_dense, _round_up_to_multiple, _score_mod_signature, _transpose_ordered,
                     _vmap_for_bhqkv, create_nested_block_mask)
from .tools.plot import plot  # matplotlib is imported only when plot() runs

__all__ = ["Node", "TraceError", "TracedMod", "trace", "evaluate", "evaluate_grid",
           "BlockMask", "create_block_mask", "create_mask", "and_masks", "or_masks", "not_mask", "noop_mask",
           "flex_attention", "AuxRequest", "AuxOutput", "FallbackWarning",
           "kernel_source", "cache_info", "cache_clear", "FlexKernelOptions", "create_nested_block_mask",
           "plot", "__version__"]

from . import old_paths as _old_paths

_old_paths.install(__name__)  # `import flexc.call.attention` and the other paths from before the folders
