"""bench/kernel_metrics.py reads compiled kernels without a GPU: its SASS and TTGIR readers on small
hand-written texts (loop kinds from line info, ring slots from the rings a loop indexes), then one
forward and one backward case compiled for sm_90, where flexc's and torch's loops must be matched by
kind whatever their order (flexc's backward runs dK/dV first, torch's dQ first)."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_kernel_metrics", os.path.join(ROOT, "bench", "kernel_metrics.py"))
metrics = importlib.util.module_from_spec(_spec)
sys.modules["bench_kernel_metrics"] = metrics
_spec.loader.exec_module(metrics)

SOURCE = '''\
import triton


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def dq_blocks(dq):
    for i in range(4):
        dq = dq + mask_mod(0, 0, i, 0)
    return dq


def dkdv_blocks(dk):
    for i in range(4):
        dk = dk + i
    return dk
'''


@pytest.fixture
def kernel_file(tmp_path):
    path = tmp_path / "kernel.py"
    path.write_text(SOURCE)
    metrics.source_map.cache_clear()
    return str(path)


def test_sass_loops_take_their_kind_from_line_info(kernel_file):
    f = kernel_file
    text = f'''
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "{f}", line 5 inlined at "{f}", line 10
	//## File "{f}", line 10
        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
	//## File "{f}", line 10
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R151], desc[UR32][R4.64], P1 ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
.L_x_2:
	//## File "{f}", line 16
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24 ;
        /*0060*/              @P1 BRA `(.L_x_2) ;
.L_x_3:
        /*0070*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0080*/              @P2 BRA `(.L_x_3) ;
.L_x_4:
        /*0090*/                   BRA `(.L_x_4) ;
'''
    instructions, labels = metrics.parse_sass(text)
    assert instructions[1] == ("ISETP.GE.AND P0, PT, R2, R3, PT", ((f, 5), (f, 10), (f, 10)))
    loops = metrics.loops_in(instructions, labels, backward=True)
    # the loop without tensor-core instructions and the kernel's closing BRA to itself are not key-tile loops
    assert [(loop.kind, loop.size, loop.mma, loop.async_copies) for loop in loops] == [
        ("dQ partial", 4, 1, 1), ("dK/dV full", 2, 1, 0)]
    assert [loop.kind for loop in metrics.loops_in(instructions, labels, backward=False)] == ["partial", "full"]
    # the code every program runs once: the MOV before the loops; the bookkeeping loop and the closing
    # BRA after them
    assert metrics.outside_loops(instructions, labels) == {"before": 1, "after": 3, "outside": 4}


def test_ttgir_rings_are_the_smallest_tile_ring_each_loop_indexes(kernel_file):
    f = kernel_file
    ttgir = f'''#loc = loc("{f}":1:1)
#loc5 = loc("{f}":5:12)
#loc9 = loc("{f}":9:5)
#loc10 = loc("{f}":10:14)
#loc15 = loc("{f}":15:5)
#loc20 = loc(callsite(#loc5 at #loc10))
#loc21 = loc("dq"(#loc20))
module {{
  tt.func public @kernel() {{
    %k = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable> loc(#loc)
    %v = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable> loc(#loc)
    %idx = ttg.local_alloc : () -> !ttg.memdesc<1x1xi32, #shared2, #smem, mutable> loc(#loc)
    %lse = ttg.local_alloc : () -> !ttg.memdesc<1x64xf32, #shared2, #smem, mutable> loc(#loc)
    %doc = ttg.local_alloc : () -> !ttg.memdesc<1x1x64xi64, #shared2, #smem, mutable> loc(#loc)
    %a:2 = scf.for %i = %c0 to %n step %c1 iter_args(%x = %z) -> (tensor<64x64xf32>) {{
      %0 = ttg.memdesc_index %k[%i] : !ttg.memdesc<3x64x128xbf16> -> !ttg.memdesc<64x128xbf16> loc(#loc10)
      %1 = ttg.memdesc_index %v[%i] : !ttg.memdesc<2x128x64xbf16> -> !ttg.memdesc<128x64xbf16> loc(#loc10)
      %2 = ttg.memdesc_index %idx[%i] : !ttg.memdesc<1x1xi32> -> !ttg.memdesc<1xi32> loc(#loc10)
      %6 = ttg.memdesc_index %lse[%i] : !ttg.memdesc<1x64xf32> -> !ttg.memdesc<64xf32> loc(#loc10)
      %7 = ttg.memdesc_index %doc[%i] : !ttg.memdesc<1x1x64xi64> -> !ttg.memdesc<1x64xi64> loc(#loc10)
      %3 = arith.cmpi sge, %q, %kv : tensor<64x64xi32> loc(#loc21)
      %4 = ttng.warp_group_dot %0, %1, %x : tensor<64x64xf32> loc(#loc10)
      scf.yield %4 : tensor<64x64xf32> loc(#loc9)
    }} loc(#loc9)
    %b = scf.for %i = %c0 to %n step %c1 iter_args(%y = %a#0) -> (tensor<64x64xf32>) {{
      %5 = ttng.warp_group_dot %p, %q, %y : tensor<64x64xf32> loc("{f}":16:14)
      scf.yield %5 : tensor<64x64xf32> loc(#loc15)
    }} loc(#loc15)
    tt.return loc(#loc)
  }} loc(#loc)
}} loc(#loc)
'''
    # the rings of block indices (1x1) and of vectors (1x64, 1x1x64) are not tile rings; a loop with no
    # ring copies nothing ahead: 0
    assert metrics.ttgir_rings(ttgir, backward=True) == {"dQ partial": [2], "dK/dV full": [0]}


def test_summary_line_format():
    totals = metrics.Totals()
    assert totals.line() == ("kernel metrics: forward worst n/a, soft-cap worst n/a, backward worst n/a, "
                             "decode worst n/a, min ring slots n/a, C7511 kernels 0, spilling kernels 0")
    report = {"loop_info": [metrics.Loop("partial", 600, 8, 4, 3), metrics.Loop("full", 500, 8, 4, 2)],
              "c7511": ["ptxas info : (C7511) ..."], "spill_stores": 0, "spill_loads": 4}
    totals.add("forward", "soft-cap + causal", {"partial": 0.9, "full": 1.1}, report)
    assert totals.line() == ("kernel metrics: forward worst 1.100, soft-cap worst 1.100, backward worst n/a, "
                             "decode worst n/a, min ring slots 2, C7511 kernels 1, spilling kernels 1")
    # three decimals: a ratio just over a bound reads as over it (0.9232 is not "0.92")
    totals.add("backward", "alibi + causal", {"dQ full": 0.9232}, report)
    assert "forward worst 1.100, soft-cap worst 1.100, backward worst 0.923, decode worst n/a" in totals.line()


def _args(**kw):
    return SimpleNamespace(**{"cases": ["causal"], "head_dims": [64], "length": 1024, "show_torch_source": False,
                              "show_flexc_source": False, **kw})


def test_backward_loops_are_matched_by_kind_not_order(capsys):
    totals = metrics.Totals()
    metrics.run_backward(_args(), totals)
    out = capsys.readouterr().out
    flexc_line = next(line for line in out.splitlines() if line.strip().startswith("flexc"))
    torch_line = next(line for line in out.splitlines() if line.strip().startswith("torch "))
    kinds = lambda line: re.findall(r"(dK/dV|dQ) (partial|full) \d+ r(\d)", line)
    assert [k[:2] for k in kinds(flexc_line)] == [("dK/dV", "partial"), ("dK/dV", "full"), ("dQ", "partial"),
                                                  ("dQ", "full")]
    assert [k[:2] for k in kinds(torch_line)] == [("dQ", "partial"), ("dQ", "full"), ("dK/dV", "partial"),
                                                  ("dK/dV", "full")]
    assert all(int(k[2]) >= 2 for k in kinds(flexc_line) + kinds(torch_line))  # both pipeline every loop
    ratios = dict(re.findall(r"(dK/dV \w+|dQ \w+) (\d\.\d\d)", torch_line.split("ratio")[1]))
    assert set(ratios) == {"dK/dV partial", "dK/dV full", "dQ partial", "dQ full"} and "unmatched" not in torch_line
    assert 0.5 < float(ratios["dQ full"]) < 1.5
    assert round(totals.worst["backward"], 2) == max(map(float, ratios.values()))


def _side_lines(out: str) -> dict:
    """The report's kernel lines by side ("flexc", "torch", "torch@flexc"), not its ptxas notes."""
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "ptxas" not in line}


def test_forward_reports_torch_at_both_tiles_the_c7511_note_and_the_code_outside_loops(capsys, monkeypatch):
    from flexc.backends.triton import config as triton_config

    totals = metrics.Totals()
    metrics.run_forward(_args(), totals)
    out = capsys.readouterr().out
    lines = _side_lines(out)
    # flexc's default at D=64 is torch's 128 x 128 with 4 warps: one torch kernel, and both serialise
    # their wgmma (C7511, which ptxas prints as info)
    assert re.search(r"partial \d+ r\d \| full \d+ r\d \| outside \d+ \(before \d+, after \d+\)", lines["flexc"])
    assert "w4" in lines["flexc"] and "w4" in lines["torch"] and "torch@flexc" not in lines
    assert "C7511" in lines["torch"] and "C7511" in lines["flexc"] and totals.c7511 == 1
    # a tile of flexc's own (as a departure would give) is compared with torch at that tile too
    monkeypatch.setattr(triton_config, "default_config", lambda dtype, head_dim, target: (128, 128, 8, 3))
    metrics.run_forward(_args(), metrics.Totals())
    lines = _side_lines(capsys.readouterr().out)
    assert "w4" in lines["torch"] and "w8" in lines["torch@flexc"] and "ratio partial" in lines["torch@flexc"]
