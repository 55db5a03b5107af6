"""bench/host.py (host time per call with launches stubbed) runs, with tiny counts, so it cannot rot:
every flexc row reaches the stubbed launcher (it measured the generated kernels' path, not a fallback)
and the floor makes the training step's launches."""
from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_host", os.path.join(ROOT, "bench", "host.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_every_row_reaches_the_stubbed_launcher_and_the_summary_names_each():
    import flexc.device

    launch = flexc.device.launch
    results = bench.measure(repeats=1, calls=1)
    assert flexc.device.launch is launch  # the stub is undone
    assert all(us > 0 and (launches >= 1 or name == bench.IDIOM) for name, (us, launches) in results.items()), results
    assert results[bench.IDIOM][1] == 0
    assert results["floor (trivial autograd.Function)"][1] == results["training step"][1]
    line = bench.summary(results)
    for word in ("forward", "forward+lse", "training step", "floor", "decode step", "compiled forward"):
        assert word in line
    binding = bench.measure_binding(bench.measure.seen, repeats=1, calls=1)  # (each kernel kind launched)
    assert {"forward", "prologue", "backward", "decode", "merge"} <= set(binding)
    assert all(us["triton"] > 0 and us["flexc"] > 0 for us in binding.values())
    cpu = bench.measure_cpu_training(repeats=1, calls=1)
    assert cpu["flexc"] > 0 and cpu["sdpa"] > 0
    assert "x SDPA's" in bench.summary(results, cpu)
    forward = bench.measure_cpu_forward(repeats=1, calls=1)
    assert set(forward) == {"flexc causal", "sdpa causal", "flexc window", "sdpa window"}
    assert all(us > 0 for us in forward.values())
    decode = bench.measure_cpu_decode(repeats=1, calls=1)
    assert decode["flexc"] > 0 and decode["sdpa"] > 0
