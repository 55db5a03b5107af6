"""The Triton backend: generated forward, backward and decode kernels, their cache and launch.

Importing it registers ``"TRITON"`` (forward, and the generated backward for training) in
:mod:`flexc.backends.registry`.
"""
from . import backward, forward  # noqa: F401  (each registers itself)
