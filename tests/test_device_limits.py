"""The simulated GPU (flexc.device.simulate) refuses what CUDA refuses and Triton's interpreter
does not: over-long device-side assert messages, grids past CUDA's limits, host tensors handed to
a launch, and configurations needing more shared memory than the simulated GPU has per block."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import flexc
from flexc import device as gpu
from flexc.analysis import bounds
from flexc.codegen.forward import ForwardSpec

MOD_SOURCE = '''
def make(table, ids):
    def relative_bias_score_mod_with_a_long_descriptive_name(score, b, h, q_idx, kv_idx):
        return score + table[ids[q_idx] * 16 + (kv_idx % 16)]
    return relative_bias_score_mod_with_a_long_descriptive_name
'''


def _mod_in_a_deep_folder(tmp_path, table, ids):
    folder = tmp_path / ("user_project_" + "x" * 60) / ("experiments_" + "y" * 60)
    folder.mkdir(parents=True)
    path = folder / "attention_variants_with_relative_position_biases.py"
    path.write_text(MOD_SOURCE)
    spec = importlib.util.spec_from_file_location("deep_mod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(table, ids)


def test_an_assert_message_over_cudas_limit_raises_on_the_simulated_gpu():
    ok = torch.tensor(True)
    with gpu.simulate("sm_90"):
        gpu.assert_async(ok, "x" * gpu.ASSERT_MESSAGE_LIMIT)
        with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
            gpu.assert_async(ok, "x" * (gpu.ASSERT_MESSAGE_LIMIT + 1))
    gpu.assert_async(ok, "x" * 300)  # the CPU's own torch._assert_async takes any length


def test_the_device_side_bounds_check_names_the_mod_and_the_fix_in_a_message_cuda_accepts(tmp_path):
    table, ids = torch.randn(64), torch.arange(256) // 64  # 0..3: indices up to 63
    mod = _mod_in_a_deep_folder(tmp_path, table, ids)
    traced = flexc.trace(mod)
    with gpu.simulate("sm_90"):
        bounds.check_mod(traced, 1, 1, 256, 256, "flex_attention")  # proven on the host, remembered
        ids[200] = 4  # 4 * 16 + 15 = 79: past the end of the table
        with pytest.raises(RuntimeError) as raised:  # the second check runs on the device
            bounds.check_mod(traced, 1, 1, 256, 256, "flex_attention")
    message = str(raised.value)
    assert "Message length" not in message, message
    assert "relative_bias_score_mod_with_a_long_descriptive_name" in message
    assert "attention_variants_with_relative_position_biases.py:4" in message
    assert "out of range" in message and "Fix: clamp it, e.g. .clamp(0, 63)" in message
    assert "x" * 60 not in message  # the folders are left out


def _spec(**changes):
    fields = dict(score_mod=None, mask_mod=None, dtype=torch.float16, head_dim=64, v_head_dim=64, q_block_size=128,
                  kv_block_size=128, block_m=128, block_n=128)
    return ForwardSpec(**(fields | changes))


def test_a_simulated_launch_refuses_grids_host_tensors_and_shared_memory_past_the_gpus():
    from triton.runtime.errors import OutOfResources

    device = torch.device("cpu")
    spec = _spec()
    with gpu.simulate("sm_90"):
        gpu.check_launch((2 ** 31 - 1, 65535, 65535), spec, device, [torch.zeros(1)])
        with pytest.raises(ValueError, match="at most 65535 programs along axis y"):
            gpu.check_launch((1, 65536, 1), spec, device, [])
        with pytest.raises(ValueError, match="kernel argument 1 .* is a tensor on meta"):
            gpu.check_launch((1, 1, 1), spec, device, [torch.zeros(1), torch.zeros(2, device="meta")])
    # fp32, head dim 256, 64-key tiles, 3 stages: 2 * 64 * 512 * 4 + 128 * 256 * 4 = 393216 bytes
    big = _spec(dtype=torch.float32, head_dim=256, v_head_dim=256, block_n=64, num_stages=3)
    assert gpu.shared_memory_estimate(big) == 393216
    # within sm_90's 232448 bytes, past sm_80's 166912
    between = _spec(dtype=torch.float32, head_dim=128, v_head_dim=128, block_m=128, block_n=64, num_stages=3)
    assert 166912 < gpu.shared_memory_estimate(between) <= 232448
    with gpu.simulate("sm_90"):
        gpu.check_launch((1, 1, 1), between, device, [])
    with gpu.simulate("sm_80"), pytest.raises(OutOfResources):
        gpu.check_launch((1, 1, 1), between, device, [])
