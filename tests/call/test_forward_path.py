"""The one rule for which forward computes a call's output (flexc.call.forward_path): eager calls, their
training and the compiled ops ask it (tests/torch_compile/test_compiled_equals_eager.py checks they do)."""
from __future__ import annotations

import torch

from flexc.call.forward_path import FORWARD, GENERATED, ROWS, forward_path


def test_the_row_loop_runs_for_torchs_maxima_dropout_and_float64_logsumexp_only():
    f32, f64 = torch.float32, torch.float64
    # (backend, generated pair, want_max, want_lse, dtype, dropout) -> path
    cases = {
        ("TORCH", False, False, False, f32, False): FORWARD,
        ("TORCH", False, True, False, f32, False): ROWS,  # row maxima
        ("TORCH", False, False, False, f32, True): ROWS,  # dropout
        ("TORCH", False, False, True, f64, False): ROWS,  # a float64 logsumexp
        ("TORCH", False, False, False, f64, False): FORWARD,  # float64 without it: the forward's output is the same
        ("TRITON", False, False, True, f64, True): FORWARD,  # the backend's kernels draw the dropout
        ("TRITON", True, False, True, f32, True): GENERATED,  # training through the generated backward
    }
    assert {case: forward_path(*case) for case in cases} == cases
