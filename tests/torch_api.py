"""The installed torch's FlexAttention API, for tests that compare flexc's against it.

flexc follows the API of the torch README's table tests (`make test`); an older torch that
pyproject allows (2.11, `make test-oldest`) lacks some of its parameters and fields, so these tests
read what the installed torch has instead of assuming the newer one."""
import inspect
import re

import torch
from torch.nn.attention import flex_attention as tfa

from repo import ROOT


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# the torch whose API flexc follows: the one README's table says `make test` runs
FOLLOWED = _minor(re.search(r"^\| torch \| ([0-9.]+) \|", (ROOT / "README.md").read_text(), re.M).group(1))
OLDER_TORCH = _minor(torch.__version__) < FOLLOWED


def takes(fn, name: str) -> bool:
    """Whether the installed torch's ``fn`` has a parameter ``name``."""
    return name in inspect.signature(fn).parameters


def torch_tile_classes(ref) -> torch.Tensor:
    """0 empty / 1 partial / 2 full per tile of torch's BlockMask ``ref``, read from its own tables."""
    width = lambda idx: (idx.shape[-1],) if takes(tfa._ordered_to_dense, "num_cols") else ()  # (2.11: the width)
    dense = lambda num, idx: tfa._ordered_to_dense(num, idx, *width(idx))
    return dense(ref.kv_num_blocks, ref.kv_indices) + 2 * dense(ref.full_kv_num_blocks, ref.full_kv_indices)
