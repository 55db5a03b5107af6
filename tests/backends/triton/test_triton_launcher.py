"""The launcher passes what validation accepts: a 0-d CPU tensor a mod captures goes with inputs on
a GPU (as in torch), copied to the device once per value rather than on every call (a per-call
host-to-device copy breaks CUDA graph capture). CUDA tensors without a GPU are fake tensors."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flexc
from flexc.backends.triton import launcher
from flexc.codegen.printer import BufferParam
from flexc.mods.traced_mod import check_captured


def test_a_zero_dim_cpu_capture_is_copied_to_the_device_once_per_value():
    offset, doc = torch.tensor(3), torch.zeros(8, dtype=torch.int64)
    shifted = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx)
    documents = flexc.trace(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    pointer = [BufferParam("captured", 0, "ptr")]
    with FakeTensorMode(allow_non_fake_inputs=True):
        device = torch.empty(0, device="cuda").device
        check_captured(shifted, "cuda")  # validation accepts it (as torch does) ...
        first = launcher.buffer_arguments(shifted, pointer, device)[0]  # ... and so does the launcher
        assert (first.device, first.dtype) == (device, offset.dtype)
        assert launcher.buffer_arguments(shifted, pointer, device)[0] is first  # no copy on the next call
        offset.fill_(4)  # a new value: a new copy
        assert launcher.buffer_arguments(shifted, pointer, device)[0] is not first
        # a CPU tensor with dimensions is refused by both
        with pytest.raises(ValueError, match="'doc' on cpu but it runs on cuda:0"):
            check_captured(documents, "cuda")
        with pytest.raises(ValueError, match="'doc' is on cpu but the inputs are on cuda:0"):
            launcher.buffer_arguments(documents, pointer, device)
