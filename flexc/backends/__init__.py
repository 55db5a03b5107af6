"""Attention backends: what runs a :func:`flexc.flex_attention` call once it is planned.

:mod:`flexc.backends.registry` names them (``"TORCH"``: :mod:`flexc.backends.cpu`; ``"TRITON"``:
:mod:`flexc.backends.triton`, whose generated backward trains too); the other backends train
through the CPU path's backward. The modules here serve every backend: output layouts, dropout's
keep decisions, NaN/inf-safe pieces.
"""
