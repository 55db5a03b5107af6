"""The source text of a plan's kernels, as :func:`flexc.kernel_source` shows it; compiles nothing."""
from __future__ import annotations

import torch

from . import cache

# between the sources of a call's kernels in kernel_source's text
KERNEL_SEPARATOR = "# ======== kernel {index}/{count}: {name} ========"


def sources_text(kernels: tuple, device: torch.device | None = None) -> str:
    """The sources of ``kernels`` (specs in launch order) as they run for tensors on ``device`` (what
    replaced one on its GPU, :func:`.cache.generated_for`): one kernel's source as it is; several
    after a comment naming them, each after a :data:`KERNEL_SEPARATOR` line (the text still parses
    as Python); none, a comment saying so."""
    if not kernels:
        return ("# flexc: this call launches no kernel: it has no query rows or no keys (or nothing to write), so "
                "the launcher\n# fills the output with zeros and the logsumexp with -inf itself.\n")
    generated = [cache.generated_for(spec, device) for spec in kernels]
    if len(generated) == 1:
        return generated[0].source
    names = ", then ".join(g.kernel_name for g in generated)
    parts = [f"# flexc: this call launches {len(generated)} kernels, in this order: {names}.\n"
             f"# Their sources follow, each after a '# ======== kernel i/{len(generated)}: NAME ========' line.\n"]
    for index, g in enumerate(generated, 1):
        parts.append("\n" + KERNEL_SEPARATOR.format(index=index, count=len(generated), name=g.kernel_name)
                     + "\n" + g.source)
    return "".join(parts)


__all__ = ["KERNEL_SEPARATOR", "sources_text"]
