"""Triton source generation: the IR -> Triton expression printer and the forward kernel generator."""
from .forward import ForwardSpec, GeneratedForward, generate_forward
from .printer import RenderedMod, render_mod

__all__ = ["ForwardSpec", "GeneratedForward", "RenderedMod", "generate_forward", "render_mod"]
