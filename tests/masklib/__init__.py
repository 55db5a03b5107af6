"""A small multi-file mask library written against torch's FlexAttention module, as third-party
code is. tests/test_dropin_names.py copies it with only its import lines changed to flexc and runs
both copies side by side; nothing here may mention flexc."""
from .masks import causal_mask, generate_doc_mask_mod, generate_prefix_lm_mask, generate_sliding_window
from .mods import compose_score_mods, generate_alibi_bias, generate_tanh_softcap
from .blocks import build_block_mask, default_kernel_options
from .attend import attend
from .utils import mod_grid

__all__ = ["attend", "build_block_mask", "causal_mask", "compose_score_mods", "default_kernel_options",
           "generate_alibi_bias", "generate_doc_mask_mod", "generate_prefix_lm_mask", "generate_sliding_window",
           "generate_tanh_softcap", "mod_grid"]
