"""The Triton backend: generated forward, backward and decode kernels, their cache and launch.

Modules by job: :mod:`.cache` (the kernel cache, disk import), :mod:`.config` (tile
configuration), :mod:`.launcher` (kernel arguments and grids), :mod:`.offline` (compiling for
CUDA without a GPU), :mod:`.sources` (the source text of a plan's kernels), and the entry points
:mod:`.forward`, :mod:`.backward` and :mod:`.decode` (the kernels a call runs, and their launch).

Importing it registers ``"TRITON"`` (forward, and the generated backward for training) in
:mod:`flexc.backends.registry`. The names below are the package's public ones.
"""
from . import backward, forward  # noqa: F401  (each registers itself)
from .cache import (CacheInfo, cache_clear, cache_dir, cache_info, cache_limit, generated_for, get_kernel,
                    import_source, require_triton, resolve_fallback, source_for)
from .config import default_config, resolve_config
from .forward import ForwardPlan, launch_plan, launches_nothing, make_spec, plan_forward, triton_forward
from .offline import compile_like_launcher, compile_offline, offline_inputs
from .sources import KERNEL_SEPARATOR, sources_text

__all__ = ["CacheInfo", "ForwardPlan", "KERNEL_SEPARATOR", "cache_clear", "cache_dir", "cache_info", "cache_limit",
           "compile_like_launcher", "compile_offline", "default_config", "generated_for", "get_kernel",
           "import_source", "launch_plan", "launches_nothing", "make_spec", "offline_inputs", "plan_forward",
           "require_triton", "resolve_config", "resolve_fallback", "source_for", "sources_text", "triton_forward"]
