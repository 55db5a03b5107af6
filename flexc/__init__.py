"""flexc: a compiler for attention variants, drop-in for torch's FlexAttention."""
from .ir import Node
from .trace import TraceError, TracedMod, trace
from .evaluate import evaluate, evaluate_grid

__all__ = ["Node", "TraceError", "TracedMod", "trace", "evaluate", "evaluate_grid"]
