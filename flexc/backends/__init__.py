"""Attention backends: functions that run the forward pass for :func:`flexc.flex_attention`.

Every forward backend has the signature ``forward(query, key, value, score_mod, mask_mod,
block_mask, scale, kernel_options, need_lse) -> (out, lse)``, where ``score_mod``/``mask_mod``
are :class:`flexc.TracedMod` or ``None`` and ``block_mask`` is a BlockMask (flexc's or torch's) or
``None`` for "everything allowed". Backends are registered by name in
``flexc.call.attention.BACKENDS``. The backward pass always runs on :mod:`flexc.backends.cpu.torch_cpu`.
"""
