"""``bench/gpu.py --all`` is the one prepared run a GPU machine gets, so its logic is proven here
under simulation (CPU tensors take sm_90's host decisions, kernels run in Triton's interpreter):
with the tiniest settings it reaches its one summary line with zero failures; a wrong result
ends the run at once with one FAIL line, status 1 and the summary; without CUDA and without
--simulate it says so; the timing part's ratio summary and cell order."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_gpu_all", os.path.join(ROOT, "bench", "gpu.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu_all"] = bench  # torch's tracing of the bench's mods looks their module up
_spec.loader.exec_module(bench)

TINY = ["--all", "--simulate", "sm_90", "--check-length", "32", "--no-compile"]


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.strip().splitlines()


def test_all_simulated_reaches_the_summary_with_zero_failures(capsys):
    # two cases: ALiBi with learnable slopes (bf16; decoding fp32) and soft-capping (fp32; decoding
    # bf16), each forward + lse, backward and decoding with 1 and 16 rows; then the capture logic
    assert bench.main(TINY + ["--cases", "2"]) == 0
    lines = _lines(capsys)
    summary = [line for line in lines if line.startswith("gpu.py summary:")]
    assert summary == [lines[-1]], lines
    assert summary[0].startswith("gpu.py summary: ok; correctness 8 pass, 0 fail, 0 not run;"), summary
    assert "CUDA graph (simulated) ok" in summary[0] and "timing needs a GPU (not run)" in summary[0]
    assert not any(line.startswith("FAIL") for line in lines)
    assert sum(line.startswith("PASS") for line in lines) == 2
    assert any(line.startswith("graph: 4 replays with input_pos advanced in place equal dense") for line in lines)


def test_a_wrong_result_fails_fast_with_one_line(monkeypatch, capsys):
    strict = {dtype: dict.fromkeys(tol, 0.0) for dtype, tol in bench.TOLERANCE.items()}
    monkeypatch.setattr(bench, "TOLERANCE", strict)  # every rounding error is now a wrong result
    assert bench.main(TINY + ["--cases", "3"]) == 1
    lines = _lines(capsys)
    failures = [line for line in lines if line.startswith("FAIL")]
    assert len(failures) == 1 and failures[0].startswith("FAIL forward alibi (no mask) bf16: out max|error|"), lines
    assert lines[-1].startswith("gpu.py summary: FAILED at forward alibi (no mask) bf16: out max|error|")
    assert "correctness 0 pass, 1 fail, 11 not run" in lines[-1] and "capture not run" in lines[-1]
    assert not any(line.startswith("PASS") or line.startswith("graph:") for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --all would run for minutes")
def test_all_without_cuda_or_simulation_says_so(capsys):
    assert bench.main(["--all"]) == 0
    lines = _lines(capsys)
    assert "no CUDA device" in lines[0] and "--simulate sm_90" in lines[0]
    assert lines[-1] == "gpu.py summary: nothing run (no CUDA device)"


def test_ratio_summary_and_cell_order():
    rows = [((64, 1024, "causal"), {"flexc": 2.0, "torch": 1.0}), ((64, 2048, "causal"), {"flexc": 1.0, "torch": 2.0}),
            ((64, 4096, "causal"), {"flexc": "skipped (time)"}), ((128, 1024, "causal"), {"flexc": 3.0, "torch": "x"})]
    assert bench.ratio_stats(rows) == "worst 0.50 geomean 1.00 (2 cells)"
    assert bench.ratio_stats(rows[2:]) == "no cells"
    assert bench.spread((1024, 2048, 4096, 8192, 16384)) == (1024, 4096, 16384, 2048, 8192)


def test_timing_tables_share_the_budget_and_keep_measured_cells(monkeypatch, capsys):
    # the GPU's cells stubbed (they need CUDA): the tables' flow, shares, printing and ratio summary
    import argparse
    import time

    import flexc
    from torch.nn.attention import flex_attention as torch_flex

    cells = []

    def fake_cell(flexc, torch_flex, compiled_flex, name, L, D, device, deadline, backward=False):
        cells.append(("fwd+bwd" if backward else "fwd", D, L, name))
        return {"B": 1, "flexc": 2.0, "torch": 1.0 if L == 1024 else 4.0}

    def fake_decode_cell(flexc, torch_flex, name, S, D, device, deadline):
        cells.append(("decode", D, S, name))
        if len([c for c in cells if c[0] == "decode"]) == 3:
            raise bench.OutOfTime()  # the hard stop in the middle of the decoding table
        return {"B": 4, "flexc": 1.0, "torch": 1.0, "flexc_us": 10.0, "torch_us": 10.0, "flexc_w4_us": 12.5}

    monkeypatch.setattr(bench, "run_cell", fake_cell)
    monkeypatch.setattr(bench, "run_decode_cell", fake_decode_cell)
    args = argparse.Namespace(dims=(64, 128), lengths=(1024, 2048, 4096))
    tables, printed = {}, set()
    with pytest.raises(bench.OutOfTime):
        bench.run_timing(flexc, torch_flex, "cpu", args, time.time() + 600, tables, printed)
    # lengths spread (1K, 4K, then 2K), both head dims at each, both masks at each
    assert [c[1:3] for c in cells if c[0] == "fwd"][::2] == [(64, 1024), (128, 1024), (64, 4096), (128, 4096),
                                                             (64, 2048), (128, 2048)]
    assert printed == {"forward", "forward+backward"} and len(tables["decode"]) == 2  # kept before the stop
    assert bench.ratio_stats(tables["forward"]) == "worst 0.50 geomean 0.79 (12 cells)"
    assert [key for key, _ in tables["forward"]][:3] == [(64, 1024, "causal"), (64, 1024, "document"),
                                                         (64, 2048, "causal")]  # printed in order
    bench.print_decode_table(tables["decode"])
    out = capsys.readouterr().out
    assert "forward + backward TFLOP/s" in out and "time ratio geomean 0.80 (2 cells)" in out
