"""tests/host_reads.py counts what a GPU would wait for on flexc's device path, under simulation:
host reads of device tensors, device-to-host and host-to-device copies, host tensors handed to a
launch; and not the reads, moves and fills of tensors flexc keeps on the host."""
from __future__ import annotations

import linecache
import os

import pytest
import torch

from flexc import device as gpu
from flexc.codegen.forward import ForwardSpec
from host_reads import FLEXC_DIR, counting_host_reads

PROBES = '''
def h2d_tensor(dev):
    return torch.tensor([1, 2], device=dev)

def h2d_as_tensor(dev):
    return torch.as_tensor([1, 2], device=dev)

def h2d_to(dev):
    return torch.tensor([1, 2]).to(dev)

def h2d_copy(t):
    return t.copy_(torch.tensor([1.0, 2.0]))

def d2h_cpu(t):
    return t.cpu()

def d2h_to(t):
    return t.to("cpu")

def d2h_to_device_object(t):
    return t.to(torch.device("cpu"))

def read(t):
    return t.tolist()

def host_launch(dev, spec):
    flexc_device.launch(_NoKernel(), (1,), spec, dev, [torch.zeros(2)], {})

def on_the_host():  # made, read and moved on the host: nothing a GPU waits for
    t = torch.tensor([3, 4]) + 1
    return t.tolist(), int(t[0]), t.cpu(), t.to("cpu")

def on_the_device(t):  # device tensors kept on their device, and fills
    return t.to(t.device), t.to(torch.float64), torch.full((2,), 7, device=t.device), t * 2

class _NoKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None
'''


@pytest.fixture(scope="module")
def probe():
    """Functions whose frames are flexc's (compiled as a file in the flexc package)."""
    path = os.path.join(FLEXC_DIR, "host_read_probes.py")
    linecache.cache[path] = (len(PROBES), None, PROBES.splitlines(True), path)  # the counter reads the lines
    namespace = {"torch": torch, "flexc_device": gpu}
    exec(compile(PROBES, path, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name, counted", [
    ("h2d_tensor", "host-to-device copy (torch.tensor)"), ("h2d_as_tensor", "host-to-device copy (torch.as_tensor)"),
    ("h2d_to", "host-to-device copy (.to)"), ("h2d_copy", "host-to-device copy (copy_)"),
    ("d2h_cpu", "device-to-host copy (.cpu)"), ("d2h_to", "device-to-host copy (.to)"),
    ("d2h_to_device_object", "device-to-host copy (.to)"), ("read", "tolist"),
    ("host_launch", "host tensor handed to a launch (argument 0)")])
def test_a_host_copy_or_read_on_the_simulated_device_path_is_counted(probe, name, counted):
    device_tensor = torch.zeros(2)
    spec = ForwardSpec(score_mod=None, mask_mod=None, dtype=torch.float32, head_dim=16, v_head_dim=16, q_block_size=16,
                       kv_block_size=16, block_m=16, block_n=16, num_stages=1)
    args = {"h2d_tensor": (device_tensor.device,), "h2d_as_tensor": (device_tensor.device,),
            "h2d_to": (device_tensor.device,), "host_launch": (device_tensor.device, spec)}.get(name, (device_tensor,))
    with gpu.simulate("sm_90"), counting_host_reads() as counted_sites:
        probe[name](*args)
    assert [s.split(" at ")[0] for s in counted_sites] == [counted], counted_sites
    assert " at host_read_probes.py:" in counted_sites[0], counted_sites


def test_host_tensors_read_on_the_host_and_device_tensors_kept_on_the_device_are_not_counted(probe):
    with gpu.simulate("sm_90"), counting_host_reads() as counted_sites:
        probe["on_the_host"]()
        probe["on_the_device"](torch.zeros(2))
    assert counted_sites == []
