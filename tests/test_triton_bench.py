"""bench/gpu.py gets one run on a GPU machine, so its parts are checked here on the CPU: it exits
cleanly without a GPU, its FLOP counts equal the masks' allowed pairs, its SDPA encodings and its
dense reference agree with flexc, and its correctness check passes through the interpreter."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench", "gpu.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu"] = bench  # torch's tracing of the bench's mods looks their module up
_spec.loader.exec_module(bench)


def test_exits_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for minutes")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


@pytest.mark.parametrize("L", [300, 1024])
def test_flop_counts_are_the_masks_allowed_pairs(L):
    mods = bench.make_mods(L, 4, "cpu")
    b, h, q, kv = bench.index_tensors(L, 4, "cpu")
    assert sum(mods["_lengths"]) == L
    for name in bench.MASK_NAMES:
        score_mod, mask_mod, _ = mods[name]
        counted = L * L if mask_mod is None else int(torch.broadcast_to(mask_mod(b, h, q, kv), (1, 1, L, L)).sum())
        assert bench.allowed_pairs(name, L, mods["_lengths"]) == counted, name


def test_sdpa_encodings_and_dense_reference_agree_with_flexc():
    L, H = 96, 4
    mods = bench.make_mods(L, H, "cpu")
    q, k, v = (torch.randn(1, H, L, 32) for _ in range(3))
    for name in ("full", "causal", "sliding", "document", "alibi"):
        score_mod, mask_mod, kind = mods[name]
        ref, ref_lse = bench.dense_reference(q, k, v, score_mod, mask_mod)
        mask, is_causal = bench.sdpa_inputs(kind, score_mod, mask_mod, L, H, q.dtype, "cpu")
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=0)
        block_mask = flexc.create_block_mask(mask_mod, None, None, L, L, device="cpu") if mask_mod else None
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                        kernel_options={"BACKEND": "TRITON"})
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)


def test_correctness_section_passes_through_the_interpreter(capsys):
    ok = bench.check_correctness(flexc, torch_flex, torch_flex.flex_attention, "cpu", L_main=128, ragged=(100, 24))
    out = capsys.readouterr().out
    assert ok, out
    assert out.count("PASS") == 7


def test_table_rows_and_printing_on_cpu(monkeypatch, capsys):
    import time

    monkeypatch.setattr(bench, "bench_ms", lambda fn: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "TOKENS", 64)
    monkeypatch.setattr(bench, "HEADS", 2)
    rows = bench.run_table(flexc, torch_flex, torch_flex.flex_attention, "cpu", (16,), (64,), time.time() + 600)
    assert [key for key, _ in rows] == [(16, 64, name) for name in bench.MASK_NAMES]
    for (_, L, name), row in rows:
        assert all(isinstance(row[col], float) for col in ("flexc", "torch", "sdpa")), row
        mods = bench.make_mods(L, 2, "cpu")
        expected = 4 * 1 * 2 * 16 * bench.allowed_pairs(name, L, mods["_lengths"]) / 2e-3 / 1e12
        assert row["flexc"] == pytest.approx(expected)
    bench.print_table(rows)
    out = capsys.readouterr().out
    assert "forward TFLOP/s" in out and out.count("  1.00") >= 4  # flexc/flex ratio with equal stub timings
