"""The CUDA variant of generated kernels compiles for Hopper (sm_90) without a GPU: Triton's
front end, its LLVM/PTX passes and ptxas all run on the CPU. This catches invalid Triton in the
source that only a GPU run would otherwise reveal, and checks shared memory fits an H100/H200."""
from __future__ import annotations

import pytest
import torch

import flexc
from flexc.backends.triton import cache as kernel_cache, forward as triton_forward, launcher as triton_launcher, offline as triton_offline
from printer_mods import MASK_MODS, SCORE_MODS

pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

HOPPER_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KiB)


def _sum_of(names):
    mods = [SCORE_MODS[n] for n in names]

    def combined(score, b, h, q_idx, kv_idx):
        total = score
        for mod in mods:
            total = total + mod(score, b, h, q_idx, kv_idx)
        return total
    return combined


def every_mask_op(b, h, q_idx, kv_idx):
    allowed = MASK_MODS["compare_and_or"](b, h, q_idx, kv_idx)
    for mod in MASK_MODS.values():
        allowed = allowed | mod(b, h, q_idx, kv_idx)
    return allowed


# every printer test mod except the constant one, in groups small enough to compile in seconds
_SCORE_GROUPS = [sorted(SCORE_MODS)[i::4] for i in range(4)]
for _group in _SCORE_GROUPS:
    if "constant" in _group:
        _group.remove("constant")


def compile_for_hopper(score_mod, mask_mod, dtype, head_dim, v_head_dim, block_size=(128, 128), options=None):
    spec = triton_forward.make_spec(flexc.trace(score_mod) if score_mod else None,
                                    flexc.trace(mask_mod) if mask_mod else None, dtype, head_dim, v_head_dim,
                                    block_size if mask_mod else None, options, "cuda", True,
                                    has_full_blocks=mask_mod is not None)
    compiled = triton_offline.compile_offline(spec, capability=90)
    assert "cubin" in compiled.asm
    assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY
    return compiled


@pytest.mark.parametrize("group", range(len(_SCORE_GROUPS)))
def test_every_printed_op_compiles_for_hopper(group):
    small_tiles = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2}  # the ops are under test, not the tiles
    compile_for_hopper(_sum_of(_SCORE_GROUPS[group]), every_mask_op if group == 0 else None, torch.bfloat16, 64, 64,
                       options=small_tiles)


@pytest.mark.parametrize("dtype,head_dim,v_head_dim", [(torch.bfloat16, 128, 128), (torch.float16, 256, 256),
                                                       (torch.float32, 80, 48), (torch.float64, 32, 32)])
def test_default_configs_compile_and_fit_shared_memory(dtype, head_dim, v_head_dim):
    from catalogue import mask_catalogue, score_catalogue

    masks, scores = mask_catalogue(1, 2, 256, 256), score_catalogue(1, 2, 256, 256)
    compile_for_hopper(scores["soft_capping_tanh"], masks["document_causal"], dtype, head_dim, v_head_dim)


def test_kernel_without_block_mask_compiles():
    compile_for_hopper(lambda score, b, h, q_idx, kv_idx: score * 0.5, None, torch.bfloat16, 64, 64,
                       options={"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2})


def test_offline_compile_specialises_like_the_launcher():
    # 16-byte-aligned pointers and strides divisible by 16 let Triton pipeline K/V tiles through
    # shared memory with asynchronous copies; typing every integer as a plain i32 loses both.
    compiled = compile_for_hopper(None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, torch.bfloat16, 128, 128)
    assert "cp.async" in compiled.asm["ptx"]
    assert compiled.metadata.shared >= 96 * 1024  # 3 stages of 64 x 128 bf16 K and V tiles, plus Q


def test_int64_offset_variant_compiles(monkeypatch):
    # strides equal to 1 are compile-time constants there: widening them must still compile
    def wide_multiplies():
        compiled = compile_for_hopper(SCORE_MODS["captured_1d_negative_index"], None, torch.bfloat16, 64, 64,
                                      options={"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2})
        return compiled.asm["ptx"].count("mul.lo.s64")

    narrow = wide_multiplies()
    monkeypatch.setattr(triton_launcher, "INT32_OFFSET_LIMIT", 1)
    assert wide_multiplies() > narrow


def test_math_functions_use_libdevice_on_cuda():
    from flexc.codegen.printer import keep_precise_math

    def every_math_function(score, b, h, q_idx, kv_idx):
        s = score * 0.1
        return (torch.tanh(s) + torch.tan(s) + torch.atan(s) + torch.asin(s * 0.1) + torch.acos(s * 0.1)
                + torch.sinh(s) + torch.cosh(s) + torch.asinh(s) + torch.acosh(s * s + 1.0) + torch.atanh(s * 0.1)
                + torch.expm1(s) + torch.log1p(s * s) + torch.erfc(s) + torch.log10(s * s + 1.0) + torch.trunc(s)
                + torch.round(s) + torch.atan2(s, s + 2.0) + torch.fmod(s, 0.3) + torch.sigmoid(s))

    small_tiles = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2}
    traced = flexc.trace(every_math_function)
    spec = triton_forward.make_spec(traced, None, torch.bfloat16, 64, 64, None, small_tiles, "cuda", True)
    source = kernel_cache.source_for(spec)
    assert "libdevice.rint(" in source and "def tanh(" not in source and "def sigmoid(" not in source
    # fp32 tanh and sigmoid: one exp2 and one rcp.approx each (FAST_MATH, the default) ...
    body = source[source.index("def score_mod("):]
    assert "libdevice.tanh(" not in body and "tl.sigmoid(" not in body
    assert body.count("fast_tanh(") == 1 and body.count("fast_sigmoid(") == 1
    compiled = triton_offline.compile_offline(spec, capability=90)
    assert "rcp.approx.ftz.f32" in compiled.asm["ptx"]
    # ... and libdevice's tanh with FAST_MATH=False: another kernel (the mark is in the cache key)
    precise = triton_forward.make_spec(keep_precise_math(traced), None, torch.bfloat16, 64, 64, None, small_tiles,
                                       "cuda", True)
    source = kernel_cache.source_for(precise)
    assert "libdevice.tanh(" in source and "tl.sigmoid(" in source and "fast_tanh" not in source
    assert precise.key() != spec.key()
    assert "cubin" in triton_offline.compile_offline(precise, capability=90).asm


def test_float64_kernels_keep_accurate_tanh_and_sigmoid():
    # the fast helpers take libdevice's tanh and tl.sigmoid for float64 scores, decided when Triton compiles
    soft_cap = lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0) + torch.sigmoid(score)
    spec = triton_forward.make_spec(flexc.trace(soft_cap), None, torch.float64, 64, 64, None,
                                    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2}, "cuda", True)
    assert "fast_tanh(" in kernel_cache.source_for(spec)
    ptx = triton_offline.compile_offline(spec, capability=90).asm["ptx"]
    assert "rcp.approx.ftz.f32" not in ptx and "rcp.approx.ftz.f64" in ptx  # libdevice's tanh (fp64)


def test_decode_kernel_compiles_without_its_value_guard_by_default():
    # the NaN/inf value guard (GUARD_NONFINITE_VALUES) is compiled in only for CPU calls; on sm_90
    # it must be compiled out entirely (compiled in, it doubles shared memory and spills heavily)
    from flexc.backends.triton import decode as triton_decode

    q = torch.empty(2, 32, 1, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 8, 4096, 64, dtype=torch.bfloat16)
    mask_mod = lambda b, h, q_idx, kv_idx: q_idx + 4000 >= kv_idx
    soft_cap = lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0)
    bm = flexc.create_block_mask(mask_mod, 2, 1, 1, 4096, device="cpu")
    spec = triton_decode.make_spec(flexc.trace(soft_cap), flexc.trace(mask_mod), q, k, k, bm, target="cuda")
    assert "fast_tanh(score * 0.03333333333333333, score * " in kernel_cache.source_for(spec)  # as the forward
    off = triton_offline.compile_offline(spec, inputs=(q, k, k, bm))
    on = triton_offline.compile_offline(spec, inputs=(q, k, k, bm), guard_values=True)
    assert "cubin" in off.asm and off.metadata.shared <= HOPPER_SHARED_MEMORY
    assert off.metadata.shared < on.metadata.shared and "nonfinite_values" not in off.asm["ptx"]
    assert 2 * len(off.asm["ptx"]) < len(on.asm["ptx"])  # the guard's three extra dots and selects are gone


@pytest.mark.parametrize("kernel", ["forward", "backward", "decode"])
def test_dropout_kernels_compile_for_hopper(kernel):
    # the Philox helper's uint32 arithmetic (umulhi, wrapping products) as the CUDA compiler types it;
    # the decode kernel draws it on [BLOCK_M, 1] head and row vectors (its packed rows)
    from flexc.backends.triton import backward as triton_backward, decode as triton_decode

    mask = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    inputs = None
    if kernel == "backward":
        spec = triton_backward.make_backward_spec(None, mask, torch.bfloat16, 64, 64, (128, 128), None, "cuda",
                                                  dropout=True)
    elif kernel == "decode":
        q, k = torch.empty(2, 32, 2, 64, dtype=torch.bfloat16), torch.empty(2, 8, 4096, 64, dtype=torch.bfloat16)
        bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 4000 >= kv_idx, 2, 1, 2, 4096, device="cpu")
        spec = triton_decode.make_spec(None, flexc.trace(bm.mask_mod), q, k, k, bm, target="cuda", dropout=True)
        inputs = (q, k, k, bm)
    else:
        spec = triton_forward.make_spec(None, mask, torch.bfloat16, 64, 64, (128, 128), None, "cuda", True,
                                        dropout=True)
    compiled = triton_offline.compile_offline(spec, capability=90, inputs=inputs)
    assert "cubin" in compiled.asm and compiled.metadata.shared <= HOPPER_SHARED_MEMORY
    assert "mul.hi.u32" in compiled.asm["ptx"]  # umulhi: the high words of Philox's products


def test_float64_kernels_take_scale_and_dropout_scale_as_fp64_arguments():
    """Triton types a Python float argument fp32: a float64 kernel declares its float parameters
    fp64, so the scale (and dropout's 1 / (1 - p)) keep float64's digits on a GPU."""
    from flexc.backends.triton import backward as triton_backward, decode as triton_decode

    mask = flexc.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    q, k = torch.empty(1, 4, 2, 64, dtype=torch.float64), torch.empty(1, 4, 256, 64, dtype=torch.float64)
    bm = flexc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 200 >= kv_idx, 1, 1, 2, 256, device="cpu")
    specs = {
        "forward": triton_forward.make_spec(None, mask, torch.float64, 64, 64, (128, 128), None, "cuda", True,
                                            dropout=True),
        "backward": triton_backward.make_backward_spec(None, mask, torch.float64, 64, 64, (128, 128), None, "cuda",
                                                       dropout=True),
        "decode": triton_decode.make_spec(None, flexc.trace(bm.mask_mod), q, k, k, bm, target="cuda", dropout=True),
    }
    for kind, spec in specs.items():
        source = kernel_cache.source_for(spec)
        assert 'scale: "fp64", ' in source and 'dropout_scale: "fp64",' in source, kind
    fp32 = triton_forward.make_spec(None, mask, torch.float32, 64, 64, (128, 128), None, "cuda", True)
    assert '"fp64"' not in kernel_cache.source_for(fp32)
    ptx = triton_offline.compile_offline(specs["forward"], capability=90).asm["ptx"]
    assert ptx.count(".param .f64") == 2  # the launch passes both as doubles
