"""The ``flexc`` command: ``trace`` prints traced expressions, ``show`` prints generated kernels."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import flexc
from flexc.cli import main

MODS = textwrap.dedent('''
    import torch
    slopes = torch.exp2(-torch.arange(1, 5).float())

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def generate_sliding_window(window):
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return sliding_window
''')


@pytest.fixture()
def mods_file(tmp_path):
    path = tmp_path / "mods.py"
    path.write_text(MODS)
    return str(path)


def test_trace_prints_every_mod_and_its_captured_tensors(mods_file, capsys):
    assert main(["trace", mods_file]) == 0
    out = capsys.readouterr().out
    assert "alibi (score_mod): score + slopes[h] * (kv_idx - q_idx)" in out
    assert "slopes: [4] float32" in out
    assert "causal (mask_mod): q_idx >= kv_idx" in out


def test_trace_evaluates_an_expression_in_the_file(mods_file, capsys):
    assert main(["trace", f"{mods_file}:generate_sliding_window(128)"]) == 0
    assert "(q_idx >= kv_idx) & (q_idx - kv_idx <= 128)" in capsys.readouterr().out


def test_show_prints_the_source_kernel_source_returns(mods_file, capsys):
    assert main(["show", f"{mods_file}:alibi,causal", "--device", "cpu", "--dtype", "float32",
                 "--head-dim", "16", "--block-size", "32", "-o", "BLOCK_M=32", "-o", "BLOCK_N=32"]) == 0
    shown = capsys.readouterr().out
    namespace = {}
    exec(MODS, namespace)
    q = k = v = torch.randn(1, 4, 64, 16)
    block_mask = flexc.create_block_mask(namespace["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    expected = flexc.kernel_source(q, k, v, score_mod=namespace["alibi"], block_mask=block_mask,
                                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert shown == expected


def test_show_defaults_to_the_cuda_kernel_of_the_files_mods(mods_file, capsys):
    assert main(["show", mods_file, "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "target: cuda" in out and "BLOCK_M=128, BLOCK_N=64; num_warps=8" in out
    assert "def score_mod(score, b, h, q_idx, kv_idx, slopes_ptr, slopes_stride_0):" in out


@pytest.mark.parametrize("target,message", [
    ("{path}:missing", "defines no 'missing'. Mods defined there: alibi, causal"),
    ("{path}:slopes", "is not a score_mod"),
    ("{path}:generate_sliding_window(", "evaluating"),
    ("/no/such/file.py", "no such file"),
])
def test_errors_name_the_problem_and_exit_2(mods_file, capsys, target, message):
    assert main(["show", target.format(path=mods_file)]) == 2
    assert message in capsys.readouterr().err


def test_bad_kernel_option_is_reported(mods_file, capsys):
    assert main(["show", f"{mods_file}:causal", "--block-size", "96", "-o", "BLOCK_M=64"]) == 2
    assert "must be a multiple of kernel_options['BLOCK_M']=64" in capsys.readouterr().err


def test_console_script_module_runs(mods_file):
    done = subprocess.run([sys.executable, "-m", "flexc.cli", "trace", f"{mods_file}:causal"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "causal (mask_mod): q_idx >= kv_idx"
