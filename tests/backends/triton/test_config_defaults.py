"""flexc's CUDA defaults are torch's sm_90 picks, read from the installed torch, except the listed
departures (flexc.backends.triton.config.DEPARTURES), each of which names the hardware row that
shows it faster. A torch upgrade that changes its picks fails here."""
from __future__ import annotations

import pathlib
import re
from unittest import mock

import pytest
import torch

import flexc
from flexc.backends.triton import config
from flexc.codegen.printer import PRECISE, precise_math_for

ROOT = pathlib.Path(__file__).resolve().parents[3]
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 192, 256, 512)
# picks torch 2.13 added to its sm_90 table: an older torch falls back to its generic pick there
ADDED_IN_TORCH_2_13 = {("forward", torch.float32, 192)}


def torch_picks(kind: str, dtype: torch.dtype, head_dim: int) -> tuple:
    """What the installed torch's FlexAttention picks on capability (9, 0) without max-autotune, in
    flexc's option order (torch/_inductor/template_heuristics/triton.py, CUDAConfigHeuristic)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            inductor_config.patch(max_autotune=False):
        heuristic = CUDAConfigHeuristic()
        if kind == "forward":
            (c,) = heuristic.get_flex_attn_fwd_configs(head_dim, dtype)
            return c.block_m, c.block_n, c.num_warps, c.num_stages
        if kind == "backward":
            (c,) = heuristic.get_flex_attn_bwd_configs(head_dim, dtype)
            return c.block_m1, c.block_n1, c.block_m2, c.block_n2, c.num_warps, c.num_stages
        (c,) = heuristic.get_flex_decode_configs(head_dim, dtype)
        return c.block_n, c.num_warps, c.num_stages


def flexc_picks(kind: str, dtype: torch.dtype, head_dim: int) -> tuple:
    if kind == "forward":
        return config.default_config(dtype, head_dim, "cuda")
    if kind == "backward":
        return config.default_backward_config(dtype, head_dim, "cuda")
    block_m, block_n, warps, stages = config.resolve_decode_config(128, 4, "cuda")
    return block_n, warps, stages


OPTIONS = {"forward": config.FORWARD_OPTIONS, "backward": config.BACKWARD_OPTIONS,
           "decode": ("BLOCK_N", "num_warps", "num_stages")}


@pytest.mark.parametrize("kind", ["forward", "backward", "decode"])
def test_cuda_defaults_are_torchs_sm90_picks_but_the_listed_departures(kind):
    older_torch = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            if older_torch and (kind, dtype, head_dim) in ADDED_IN_TORCH_2_13:
                continue
            theirs, ours = torch_picks(kind, dtype, head_dim), flexc_picks(kind, dtype, head_dim)
            for name, mine, torchs in zip(OPTIONS[kind], ours, theirs):
                listed = config.departure(kind, name, dtype, head_dim)
                if listed is None:
                    assert mine == torchs, (kind, dtype, head_dim, name, mine, torchs)
                else:
                    assert (mine, listed.torch) == (listed.value, torchs), (kind, dtype, head_dim, name)


def test_fast_math_default_is_the_listed_departure():
    soft_cap = flexc.trace(lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0))
    (default,) = precise_math_for({}, soft_cap)
    on = not any(n.attr == PRECISE for n in default.root.walk() if n.op == "tanh")
    listed = config.departure("all", "FAST_MATH", torch.bfloat16, 128)
    assert on == (listed is not None and listed.value)  # without a departure: torch's lowering (off)


def _section(text: str, heading: str) -> str | None:
    """The text under a markdown heading line ending in ``heading`` (or a line equal to it), up to the
    next heading."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip("#").strip() == heading:
            rest = []
            for later in lines[i + 1:]:
                if later.startswith("#"):
                    break
                rest.append(later)
            return "\n".join(rest)
    return None


@pytest.mark.parametrize("listed", config.DEPARTURES, ids=lambda d: f"{d.kernel}-{d.option}")
def test_every_departure_cites_a_hardware_table_with_its_figures(listed):
    where, _, figures = listed.row.partition(": ")
    page, _, heading = where.partition(", ")
    assert page == "docs/hardware.md" and heading and figures, listed.row
    # docs/kernels.md's "Defaults" table names the departure and its row
    kernels = (ROOT / "docs" / "kernels.md").read_text()
    assert f"`{listed.option}`" in _section(kernels, "Defaults: torch's picks and the departures") and heading in kernels
    hardware = ROOT / page
    if not hardware.exists():
        pytest.skip(f"{page} is not in this checkout yet")
    section = _section(hardware.read_text(), heading)
    assert section is not None, f"{page} has no table headed {heading!r}"
    for number in re.findall(r"\d+\.\d+", figures):
        assert number in section, (number, heading)


def _masks():
    doc = torch.arange(256) // 100

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 64)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return causal, sliding_window, document


def _alibi(score, b, h, q_idx, kv_idx):
    return score + 0.5 * (kv_idx - q_idx)


def _soft_cap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)])
def test_calls_on_hopper_run_the_defaults_whatever_the_mask_and_score_mod(dtype, head_dim):
    # what a call plans on a (simulated) H100/H200, for each kind of mask and score_mod: the forward,
    # backward and decode kernels take the defaults above, and TMA only where a departure lists it (none)
    from flexc.backends.triton import backward as triton_backward, decode as triton_decode, forward as triton_forward
    from flexc.backends.triton import tma

    L = 256
    q, k, v = (torch.randn(1, 2, L, head_dim, dtype=dtype) for _ in range(3))
    with flexc.device.simulate("sm_90"):
        for mask_mod in _masks():
            block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
            for score_mod in (None, _alibi, _soft_cap):
                score = flexc.trace(score_mod) if score_mod else None
                (fwd,) = triton_forward.plan_forward(q, k, v, score, flexc.trace(mask_mod), block_mask, None,
                                                     True, training=True).kernels
                assert (fwd.block_m, fwd.block_n, fwd.num_warps, fwd.num_stages) == \
                    flexc_picks("forward", dtype, head_dim)
                assert fwd.tma == tma.by_default(fwd) == (config.departure("forward", "USE_TMA", dtype, head_dim)
                                                          is not None)
                bwd = triton_backward.plan_backward(q, v, score, flexc.trace(mask_mod), block_mask, None).kernels[-1]
                assert (bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2, bwd.num_warps, bwd.num_stages) == \
                    flexc_picks("backward", dtype, head_dim)
                row = q[:, :, :1]
                decode = triton_decode.make_spec(score, flexc.trace(mask_mod), row, k, v, block_mask)
                assert (decode.block_n, decode.num_warps, decode.num_stages) == flexc_picks("decode", dtype, head_dim)
