"""flexc: a compiler for attention variants, drop-in for torch's FlexAttention."""
from ._version import __version__
from .ir import Node
from .trace import TraceError, TracedMod, trace
from .evaluate import evaluate, evaluate_grid
from .mask_mods import and_masks, noop_mask, not_mask, or_masks
from .block_mask import BlockMask, create_block_mask, create_mask
from .attention import AuxOutput, AuxRequest, flex_attention
from .backends.triton_backend import cache_clear, cache_info, kernel_source
from .plot import plot  # matplotlib is imported only when plot() runs

__all__ = ["Node", "TraceError", "TracedMod", "trace", "evaluate", "evaluate_grid",
           "BlockMask", "create_block_mask", "create_mask", "and_masks", "or_masks", "not_mask", "noop_mask",
           "flex_attention", "AuxRequest", "AuxOutput",
           "kernel_source", "cache_info", "cache_clear", "plot", "__version__"]
