"""flexc/backends/nonfinite.py: the finiteness check that picks the CPU paths' fast, -inf-masked
kernels. A verdict is remembered for a tensor only while it is unmodified."""
import torch

from flexc.backends import nonfinite


def test_a_verdict_is_remembered_until_the_tensor_changes_in_place(monkeypatch):
    sums = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **kw: sums.append(1) or real_sum(self, *a, **kw))
    t = torch.randn(64)
    assert nonfinite.all_finite(t) and nonfinite.all_finite(t)
    assert len(sums) == 1  # the second answer came from memory
    t[7] = float("nan")  # a write bumps the version counter: checked again
    assert not nonfinite.all_finite(t)
    view = t[4:12]
    t[7] = 1.0  # written through the base: the view shares its version counter
    assert nonfinite.all_finite(view)
    t[5] = float("inf")
    assert not nonfinite.all_finite(view)
    assert len(sums) == 4


def test_inference_tensors_are_checked_every_time():
    with torch.inference_mode():
        t = torch.ones(8)
        assert nonfinite.all_finite(t)
        t[0] = float("-inf")
        assert not nonfinite.all_finite(t)


def test_a_sum_that_overflows_reports_not_finite():
    assert not nonfinite.all_finite(torch.full((4,), 3e38))  # (only costs the NaN-safe path)
    assert nonfinite.all_finite(torch.zeros(3, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16))
