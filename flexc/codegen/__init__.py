"""Triton source generation: the IR -> Triton expression printer, and the forward, decode, merge and
backward kernel generators built on shared parts (spec: the spec base and cache key; parts: tiles and
the online softmax; kernel_mods: the mods in a kernel; header: header comments; emit: line layout)."""
from .forward import ForwardSpec, GeneratedForward, generate_forward
from .printer import RenderedMod, render_mod

__all__ = ["ForwardSpec", "GeneratedForward", "RenderedMod", "generate_forward", "render_mod"]
