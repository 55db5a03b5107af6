"""``bench/gpu.py --all`` is the one prepared run a GPU machine gets, so its logic is proven here
under simulation (CPU tensors take sm_90's host decisions, kernels run in Triton's interpreter,
every problem tiny): with one case forced to fail, every other case of every part still runs, the
failure is counted and listed, the summary line and the markdown file say so, the status is 1;
wrong results are failures that do not stop the run either; a part that spends its share of the
budget, or hangs past it, stops and the next part starts; without CUDA and without --simulate it
says so."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

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


def test_a_case_forced_to_fail_is_counted_and_listed_and_every_other_case_runs(tmp_path, capsys):
    out = tmp_path / "results.md"
    forced = "forward: D=64 L=128 document"
    assert bench.main(TINY + ["--cases", "2", "--out", str(out), "--fail-case", forced]) == 1
    lines = _lines(capsys)
    # every part ran every one of its cases; only the forced one failed
    assert sum(line.startswith("PASS ") for line in lines) == 2
    assert any(line.startswith("CUDA graph: 4 replays with input_pos advanced in place equal dense") for line in lines)
    for part, cases in (("forward", 5), ("forward+backward", 5), ("decode", 2), ("host time", 3),
                        ("block-mask build", 1)):
        assert sum(line.startswith(f"{part} ") and ": flexc " in line for line in lines) == cases - (part == "forward")
    failures = [line for line in lines if line.startswith("FAIL")]
    assert failures == [f"FAIL {forced}: ForcedFailure: forced by --fail-case {forced!r}"] * 2, failures
    summary = lines[-1]
    assert summary.startswith(f"gpu.py summary: FAILED; 18 passed, 1 failed ({forced}), 0 not run (passed/cases: "
                              "correctness 2/2, capture 1/1, forward 4/5, forward+backward 5/5, decode 2/2, "
                              "host time 3/3, block-mask build 1/1); flexc/torch speed: forward worst "), summary
    assert f"tables in {out};" in summary
    table = [line for line in lines if line.split()[:4] == ["64", "128", "-", "document"]]
    assert len(table) == 1 and table[0].endswith("FAILED")
    # the markdown file: the failure, the summary, and a table per part with its ratio column
    text = out.read_text()
    assert f"## Failures (1)\n\n- `{forced}`: ForcedFailure:" in text and summary in text
    for title in ("## Correctness", "## Capture", "## Forward:", "## Forward+backward:", "## Decode per token",
                  "## Per-call host time", "## Block-mask build"):
        assert title in text, title
    assert "| D | L | B | mask | flexc ms | torch ms | SDPA ms | flexc TFLOP/s | torch TFLOP/s | flexc/torch |" in text
    assert "| 64 | 128 | 1 | causal |" in text and "| D | S | mask | flexc us | torch us | flexc/torch |" in text


def test_wrong_results_are_failures_that_do_not_stop_the_run(monkeypatch, capsys, tmp_path):
    strict = {dtype: dict.fromkeys(tol, 0.0) for dtype, tol in bench.TOLERANCE.items()}
    monkeypatch.setattr(bench, "TOLERANCE", strict)  # every rounding error is now a wrong result
    assert bench.main(TINY + ["--cases", "2", "--parts", "correctness,capture", "--out", str(tmp_path / "r.md")]) == 1
    lines = _lines(capsys)
    failures = [line for line in lines if line.startswith("FAIL")]
    assert [line.split(": WrongResult: ")[0] for line in failures[:3]] == [
        "FAIL correctness: alibi (no mask)", "FAIL correctness: softcap (no mask)", "FAIL capture: CUDA graph"]
    assert failures[0].endswith("forward alibi (no mask) bf16: out max|error| "
                                + failures[0].split("out max|error| ")[1])
    assert lines[-1].startswith("gpu.py summary: FAILED; 0 passed, 3 failed (correctness: alibi (no mask); "
                                "correctness: softcap (no mask); capture: CUDA graph), 0 not run")


def test_a_part_that_spends_its_share_stops_and_the_next_part_starts(monkeypatch, capsys, tmp_path):
    clock = [0.0]
    monkeypatch.setattr(bench, "now", lambda: clock[0])

    def ten_seconds(*args, **kwargs):
        clock[0] += 10.0
        return "stub"
    monkeypatch.setattr(bench, "check_case", ten_seconds)
    monkeypatch.setattr(bench, "capture_graph", ten_seconds)
    # budget 115 s: correctness 90 (its weight, 90 of the two parts' 115), capture what is left
    args = ["--budget", "115", "--cases", "12", "--parts", "correctness,capture", "--out", str(tmp_path / "r.md")]
    assert bench.main(TINY + args) == 0
    lines = _lines(capsys)
    assert sum(line.startswith("PASS ") for line in lines) == 10  # started at 0, 10, ..., 90 s
    assert "(correctness: its share of the budget is spent; 2 cases not run (" in "\n".join(lines)
    assert "CUDA graph: stub" in lines
    assert lines[-1].startswith("gpu.py summary: ok; 11 passed, 0 failed, 2 not run (passed/cases: "
                                "correctness 10/12, capture 1/1)")


def test_a_part_stuck_past_its_share_is_stopped_by_the_watchdog(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "WATCHDOG_GRACE", 0.3)
    monkeypatch.setattr(bench, "check_case", lambda *args, **kwargs: time.sleep(30))
    monkeypatch.setattr(bench, "capture_graph", lambda *args, **kwargs: "stub")
    start = time.monotonic()
    args = ["--budget", "2", "--cases", "3", "--parts", "correctness,capture", "--out", str(tmp_path / "r.md")]
    assert bench.main(TINY + args) == 0
    assert time.monotonic() - start < 20
    lines = _lines(capsys)
    assert ("(correctness: stopped by the watchdog 0.3 s past its share, in correctness: alibi (no mask); 3 cases not "
            "run (") in "\n".join(lines)
    assert "CUDA graph: stub" in lines and lines[-1].startswith("gpu.py summary: ok; 1 passed, 0 failed, 3 not run")


def test_a_fail_case_that_names_no_case_fails_the_run(capsys, tmp_path):
    args = ["--parts", "block-mask build", "--fail-case", "forward: no such case", "--out", str(tmp_path / "r.md")]
    assert bench.main(TINY + args) == 1
    lines = _lines(capsys)
    assert "FAIL --fail-case 'forward: no such case': ValueError: matched no case" in lines[-2]
    assert lines[-1].startswith("gpu.py summary: FAILED; 1 passed, 1 failed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --all would run for minutes")
def test_all_without_cuda_or_simulation_says_so(capsys):
    assert bench.main(["--all"]) == 0
    lines = _lines(capsys)
    assert "no CUDA device" in lines[0] and "--simulate sm_90" in lines[0]
    assert lines[-1] == "gpu.py summary: nothing run (no CUDA device)"


def test_ratios_and_tables():
    rows = [("a", {"flexc_ms": 2.0, "torch_ms": 1.0}), ("b", {"flexc_ms": 1.0, "torch_ms": 2.0}),
            ("c", {"flexc": "not run"}), ("d", {"flexc_ms": 3.0, "torch": "RuntimeError: x"})]
    assert bench.ratio_stats(rows) == "worst 0.50 (a) geomean 1.00 (2 cells)"
    assert bench.ratio_stats(rows[2:]) == "no cells"
    assert bench.render(("x", "name"), [["1", "a|b"]], markdown=True) == ["| x | name |", "|---|---|",
                                                                            "| 1 | a\\|b |"]
    assert bench.render(("x", "name"), [["10", "a"]], markdown=False) == [" x  name", "10     a"]


def test_the_correctness_plan_rotates_checks_dtypes_and_score_mods():
    cases = bench.check_cases(2, 4, 64, "cpu")
    plans = [bench.check_plan(i) for i in range(len(cases))]
    assert all(plan[2] == bench.EXTRA_CHECKS for plan in plans[:3])  # the score_mods alone: every check
    backward = [case[3] for case, plan in zip(cases, plans) if plan[2] == ("backward",)]
    assert {"alibi", "softcap", "rel_bias", None} <= set(backward)  # backward meets every score_mod
    assert {plan[0] for plan in plans} == {torch.bfloat16, torch.float32}
    assert all(plan[0] != plan[1] for plan in plans)
    assert len(cases) == len({case[1] for case in cases[3:]}) + 3  # every catalogue mask once
