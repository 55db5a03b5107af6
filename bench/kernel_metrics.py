"""What the forward kernels would run on a Hopper GPU, measured without one, beside torch's template.

    python bench/kernel_metrics.py                    # the five mods at D=64 and D=128, bf16, sm_90
    python bench/kernel_metrics.py --cases causal --head-dims 128 --show-torch-source
    python bench/kernel_metrics.py --backward         # the backward kernels beside torch's backward template
    python bench/kernel_metrics.py --decode           # the decode kernel, its NaN/inf value guard off and on
    python bench/kernel_metrics.py --decode --warps 2 4   # the decode kernel at each num_warps (guard off)

Each kernel is compiled for ``GPUTarget("cuda", 90, 32)`` on the CPU (Triton's front end, LLVM and
the ptxas bundled with Triton) with its arguments specialised as Triton's launcher specialises a
real launch (:func:`flexc.backends.triton_backend.compile_like_launcher`): that is what makes the
numbers mean something. For each kernel it prints registers per thread, spill stores/loads (bytes),
shared memory, ptxas warnings, and the SASS instructions in one iteration of each key-tile loop
(the partial-block loop, then the full-block loop): the work per visited tile, which dominates.

The comparison is torch's own FlexAttention template, read from the installed torch
(``torch/_inductor/kernel/flex/templates``) and rendered here for the same case the way Inductor
renders it for static shapes (sizes and strides as literals, ``IS_DIVISIBLE`` when both lengths
are multiples of 128, torch's Hopper tile defaults), with the mods written as Inductor lowers them
(``x / 20`` as ``x * 0.05``, ``libdevice.tanh``). Ratios are flexc / torch (lower is better), per
(query, key) pair: a loop's instructions times num_warps over BLOCK_M x BLOCK_N, so that kernels
with different tiles compare the work they issue for the same attention matrix (equal tiles: the
plain ratio of the counts). The last line is the summary:
``kernel metrics: worst partial-loop ratio X, worst full-loop ratio Y, spilling kernels N``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import flexc  # noqa: E402
from flexc.backends import triton_backend  # noqa: E402

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (and Inductor's), stated
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

CAPABILITY = 90
WINDOW = 256
BATCH, HEADS, LENGTH = 2, 16, 4096
# torch 2.13's Hopper defaults for the forward template: (BLOCK_M, BLOCK_N, num_stages, num_warps)
TORCH_H100_CONFIG = {(torch.bfloat16, 64): (128, 128, 3, 4), (torch.bfloat16, 128): (128, 64, 3, 8),
                     (torch.float16, 64): (128, 128, 3, 4), (torch.float16, 128): (128, 64, 3, 8)}


# ---- the cases: each mod for flexc, and the same mod as Inductor lowers it into the template -----

def make_cases(L: int, H: int) -> dict:
    """name -> (score_mod, mask_mod, captured tensors, Inductor's score lines, Inductor's mask lines)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(L // 16, L // 3, (64,), generator=g)
    document_id = torch.repeat_interleave(torch.arange(64), lengths)[:L].contiguous()
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    identity = ["tmp0 = (qk)", "post_mod_scores = tmp0"]
    causal_lines = ["tmp1 = (m)", "tmp2 = (n)", "tmp3 = tmp1 >= tmp2", "mask_mod_output = tmp3"]
    return {
        "causal": (None, causal, [], identity, causal_lines),
        "sliding-window 256": (None, sliding_window, [], identity, [
            "tmp1 = (m)", "tmp2 = (n)", "tmp3 = tmp1 >= tmp2", "tmp4 = tmp1 - tmp2",
            f"tmp5 = tl.full([1], {WINDOW}, tl.int32)", "tmp6 = tmp4 <= tmp5", "tmp7 = tmp3 & tmp6",
            "mask_mod_output = tmp7"]),
        "document": (None, document_causal, [document_id], identity, [
            "tmp1 = (m)", "tmp2 = tl.load(in_ptr9 + tmp1)", "tmp3 = (n)", "tmp4 = tl.load(in_ptr9 + tmp3)",
            "tmp5 = tmp2 == tmp4", "tmp6 = tmp1 >= tmp3", "tmp7 = tmp5 & tmp6", "mask_mod_output = tmp7"]),
        "alibi + causal": (alibi, causal, [slopes], [
            "tmp0 = (qk)", "tmp1 = tl.load(in_ptr9 + off_h)", "tmp2 = (n)", "tmp3 = (m)", "tmp4 = tmp2 - tmp3",
            "tmp5 = tmp4.to(tl.float32)", "tmp6 = tmp1 * tmp5", "tmp7 = tmp0 + tmp6", "post_mod_scores = tmp7"],
            ["tmp8 = (m)", "tmp9 = (n)", "tmp10 = tmp8 >= tmp9", "mask_mod_output = tmp10"]),
        "soft-cap + causal": (soft_cap, causal, [], [
            "tmp0 = (qk)", "tmp1 = 0.05", "tmp2 = tmp0 * tmp1", "tmp3 = libdevice.tanh(tmp2)", "tmp4 = 20.0",
            "tmp5 = tmp3 * tmp4", "post_mod_scores = tmp5"],
            ["tmp6 = (m)", "tmp7 = (n)", "tmp8 = tmp6 >= tmp7", "mask_mod_output = tmp8"]),
    }


# The backward's joint graph as Inductor lowers it (subgraph 1 of torch's backward template):
# grad_scores from grad_score_mod ({ds}) and the pre-mod score ({score}).
JOINT_LINES = {
    "soft-cap + causal": ["tmp20 = ({score})", "tmp21 = 0.05", "tmp22 = tmp20 * tmp21",
                          "tmp23 = libdevice.tanh(tmp22)", "tmp24 = tmp23 * tmp23", "tmp25 = 1.0", "tmp26 = tmp25 - tmp24",
                          "tmp27 = 20.0", "tmp28 = ({ds}) * tmp27", "tmp29 = tmp28 * tmp26", "tmp30 = tmp29 * tmp21",
                          "grad_scores = tmp30"],
}
BACKWARD_CASES = ("causal", "alibi + causal", "soft-cap + causal")
# torch 2.13's Hopper defaults for the backward template: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, stages, warps)
TORCH_H100_BWD_CONFIG = {64: (64, 128, 128, 64, 3, 8), 128: (64, 128, 128, 64, 3, 8)}


# ---- measuring a compiled kernel ----------------------------------------------------------

def ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and warnings from ptxas -v, run as Triton runs it for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(CAPABILITY).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(CAPABILITY)}", src, "-o", src + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"regs": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0,
            "warnings": [line.strip() for line in log.splitlines() if "warning" in line.lower()]}


def loop_sizes(cubin: bytes) -> list[int]:
    """SASS instructions in one iteration of each outermost loop, in program order.

    A loop is a branch back to an earlier label; nested loops (inside another) and the one-instruction
    ``BRA`` to itself that ends every kernel are not listed.
    """
    from triton.tools.disasm import get_sass

    lines = [line.strip() for line in get_sass(cubin).splitlines() if line.strip()]
    labels, loops, index = {}, [], 0
    for line in lines:
        if re.match(r"^[.\w]+:$", line):
            labels[line[:-1]] = index
            continue
        branch = re.search(r"\bBRA\s+([.\w]+)", line)
        if branch and branch.group(1) in labels:
            loops.append((labels[branch.group(1)], index))
        index += 1
    outer = [(a, b) for a, b in loops if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in loops)]
    return [b - a + 1 for a, b in sorted(outer) if b > a]


def measure(compiled) -> dict:
    report = ptxas_report(compiled.asm["ptx"])
    report["shared"] = compiled.metadata.shared
    report["loops"] = loop_sizes(compiled.asm["cubin"])
    return report


# ---- flexc's kernel -----------------------------------------------------------------------

def compile_flexc(score_mod, mask_mod, dtype, head_dim, L: int, H: int, options=None):
    score = flexc.trace(score_mod) if score_mod is not None else None
    mask = flexc.trace(mask_mod) if mask_mod is not None else None
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, L, device="cpu") if mask_mod is not None else None
    spec = triton_backend.make_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                    options, "cuda", False, mask is not None)
    inputs = triton_backend.offline_inputs(spec, BATCH, H, L, L, block_mask)
    return spec, triton_backend.compile_offline(spec, CAPABILITY, inputs=inputs)


# ---- torch's template ---------------------------------------------------------------------

def _strides(shape) -> list[int]:
    """Contiguous strides of ``shape``."""
    return [int(torch.tensor(shape[d + 1:]).prod()) if d + 1 < len(shape) else 1 for d in range(len(shape))]


def _render_template(templates, defines: dict, inputs: list, first_buffer: int, n_buffers: int, shapes: dict,
                     kernel_name: str, modification, store_output, title: str) -> str:
    """One of torch's FlexAttention Jinja templates (``templates``: file stems, in order) rendered as
    Inductor renders it for static shapes: ``defines`` as constexprs, sizes and strides as literals,
    captured tensors as ``in_ptr<first_buffer + i>``, the mods through ``modification``."""
    import jinja2
    import torch._inductor.kernel.flex as flex

    folder = os.path.join(os.path.dirname(flex.__file__), "templates")
    text = "\n".join(open(os.path.join(folder, f"{name}.py.jinja")).read() for name in templates)
    argdefs = ", ".join([f"arg_{n}" for n in inputs] + [f"in_ptr{first_buffer + i}" for i in range(n_buffers)]
                        + ["out_ptr0"])

    def gen_defines():
        return "\n".join(f"{k} : tl.constexpr = {v}" for k, v in defines.items())

    def def_kernel(*names):
        body = [f"    {k} : tl.constexpr = {v}" for k, v in defines.items()]
        body += [f"    {n} = arg_{n}" for n in names]
        return f"@triton.jit\ndef {kernel_name}(" + argdefs + "):\n" + "\n".join(body)

    def indent_except_first(text, n):
        return text.replace("\n", "\n" + "    " * n)

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["indent_except_first"] = indent_except_first
    source = env.from_string(text).render(
        def_kernel=def_kernel, gen_argdefs=lambda: argdefs, gen_defines=gen_defines, modification=modification,
        store_output=store_output, stride=lambda name, dim=None: ", ".join(map(str, _strides(shapes[name])))
        if dim is None else str(_strides(shapes[name])[dim]), size=lambda name, dim: str(shapes[name][dim]), **defines)
    header = (f"# {title} (installed torch), rendered by bench/kernel_metrics.py\n"
              "import triton\nimport triton.language as tl\nfrom triton.language.extra import libdevice\n\n")
    return header + source


def render_torch_template(score_lines, mask_lines, n_buffers, dtype, head_dim, L: int, H: int, config) -> str:
    """torch's flex_attention template rendered for one static-shape case, as Inductor would."""
    block_m, block_n, _, _ = config
    defines = dict(PRESCALE_QK=False, ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False, WRITE_DQ=True,
                   OUTPUT_LOGSUMEXP=False, OUTPUT_MAX=False, FLOAT32_PRECISION="'ieee'",
                   IS_DIVISIBLE=L % 128 == 0, SM_SCALE=head_dim ** -0.5, GQA_SHARED_HEADS=1, HAS_FULL_BLOCKS=True,
                   QK_HEAD_DIM=head_dim, QK_HEAD_DIM_ROUNDED=head_dim, V_HEAD_DIM=head_dim,
                   V_HEAD_DIM_ROUNDED=head_dim, SAFE_HEAD_DIM=True, USE_TMA=False, BLOCK_M=block_m,
                   BLOCK_N=block_n, SPARSE_Q_BLOCK_SIZE=128, SPARSE_KV_BLOCK_SIZE=128, INDEX_DTYPE="tl.int32")
    inputs = ["Q", "K", "V", "LSE", "MAX", "KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX"]
    n_blocks = L // 128
    shapes = {"Q": (BATCH, H, L, head_dim), "K": (BATCH, H, L, head_dim), "V": (BATCH, H, L, head_dim),
              "KV_NUM_BLKS": (1, 1, n_blocks), "KV_IDX": (1, 1, n_blocks, n_blocks),
              "FULL_KV_NUM_BLKS": (1, 1, n_blocks), "FULL_KV_IDX": (1, 1, n_blocks, n_blocks)}

    def modification(subgraph_number, output_name, **kwargs):
        lines = score_lines if subgraph_number == 0 else mask_lines
        return "\n".join(lines)

    def store_output(indices, value, mask, val_shape=None):
        zq, hq, m, d = indices
        s = _strides(shapes["Q"])
        return (f"xindex = {d} + {s[2]}*{m} + {s[1]}*{hq} + {s[0]}*{zq}\n"
                f"    tl.store(out_ptr0 + (tl.broadcast_to(xindex, {list(val_shape)})), {value}, {mask})".replace("'", ""))

    return _render_template(("flex_attention", "utilities", "common"), defines, inputs, 9, n_buffers, shapes,
                            "triton_tem_fused_0", modification, store_output, "torch's flex_attention template")


def compile_torch(case, dtype, head_dim, L: int, H: int):
    _, _, buffers, score_lines, mask_lines = case
    config = TORCH_H100_CONFIG[(dtype, head_dim)]
    source = render_torch_template(score_lines, mask_lines, len(buffers), dtype, head_dim, L, H, config)
    module, _ = triton_backend.import_source(source, "cuda")
    n_blocks = L // 128
    q = torch.empty((BATCH, H, L, head_dim), dtype=dtype)
    counts = torch.zeros((1, 1, n_blocks), dtype=torch.int32)
    indices = torch.zeros((1, 1, n_blocks, n_blocks), dtype=torch.int32)
    lse = torch.empty((BATCH, H, L), dtype=torch.float32)
    args = [q, torch.empty_like(q), torch.empty_like(q), lse, lse, counts, indices, counts, indices,
            *buffers, torch.empty_like(q)]
    block_m, block_n, stages, warps = config
    compiled = triton_backend.compile_like_launcher(module.triton_tem_fused_0, args, {}, warps, stages, CAPABILITY)
    return source, compiled, config


# ---- the backward ----------------------------------------------------------------------------

def compile_flexc_backward(score_mod, mask_mod, dtype, head_dim, L: int, H: int, options=None):
    from flexc.backends import triton_backward

    score = flexc.trace(score_mod) if score_mod is not None else None
    mask = flexc.trace(mask_mod) if mask_mod is not None else None
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, L, device="cpu") if mask_mod is not None else None
    spec = triton_backward.make_backward_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                              options, "cuda", (), mask is not None)
    fwd_spec = triton_backend.make_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                        None, "cuda", False, mask is not None)
    inputs = triton_backend.offline_inputs(fwd_spec, BATCH, H, L, L, block_mask)
    return spec, triton_backward.compile_backward_offline(spec, inputs, CAPABILITY)


def render_torch_backward_template(case_name, score_lines, mask_lines, n_buffers, head_dim, L: int, H: int,
                                   config) -> str:
    """torch's flex_attention backward template rendered for one static-shape case, as Inductor would."""
    m1, n1, m2, n2, _, _ = config
    defines = dict(PRESCALE_QK=False, ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False, WRITE_DQ=True,
                   OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=False, FLOAT32_PRECISION="'ieee'",
                   IS_DIVISIBLE=L % 128 == 0, SM_SCALE=head_dim ** -0.5, GQA_SHARED_HEADS=1, HAS_FULL_BLOCKS=True,
                   QK_HEAD_DIM=head_dim, QK_HEAD_DIM_ROUNDED=head_dim, V_HEAD_DIM=head_dim,
                   V_HEAD_DIM_ROUNDED=head_dim, SAFE_HEAD_DIM=True, USE_TMA=False, BLOCK_M1=m1, BLOCK_N1=n1,
                   BLOCK_M2=m2, BLOCK_N2=n2, SPARSE_Q_BLOCK_SIZE=128, SPARSE_KV_BLOCK_SIZE=128,
                   INDEX_DTYPE="tl.int32")
    inputs = ["Q", "K", "V", "LSE", "DELTA", "DO", "DQ", "DV", "KV_NUM_BLKS", "KV_IDX", "Q_NUM_BLKS", "Q_IDX",
              "FULL_KV_NUM_BLKS", "FULL_KV_IDX", "FULL_Q_NUM_BLKS", "FULL_Q_IDX"]
    n_blocks = L // 128
    qkv = (BATCH, H, L, head_dim)
    shapes = {"Q": qkv, "K": qkv, "V": qkv, "DO": qkv, "DQ": qkv, "DV": qkv, "LSE": (BATCH, H, L),
              "DELTA": (BATCH, H, L)}
    for name in ("KV", "Q", "FULL_KV", "FULL_Q"):
        shapes[f"{name}_NUM_BLKS"] = (1, 1, n_blocks)
        shapes[f"{name}_IDX"] = (1, 1, n_blocks, n_blocks)

    def renumber(line: str) -> str:  # captured tensors follow the backward's 16 inputs (the forward's 9)
        return re.sub(r"in_ptr(\d+)", lambda m: f"in_ptr{int(m.group(1)) + 7}", line)

    def modification(subgraph_number, output_name, **kwargs):
        if subgraph_number == 0:
            lines = [renumber(line).replace("(qk)", f"({kwargs['score']})").replace("off_h)", f"{kwargs['h']})")
                     for line in score_lines]
        elif subgraph_number == 1:
            lines = JOINT_LINES.get(case_name, ["grad_scores = ({ds})"])
            lines = [line.format(score=kwargs["score"], ds=kwargs["grad_score_mod"]) for line in lines]
        elif subgraph_number == 2:
            lines = [renumber(line) for line in mask_lines]
        else:  # captured-tensor gradient writes: none (torch's default for buffers without grad)
            return "pass"
        return "\n".join(lines)

    def store_output(indices, value, mask, indent_width=4, val_shape=None):
        zq, hkv, n, k = indices
        s = _strides(shapes["K"])
        pad = " " * indent_width
        return (f"xindex = {k} + {s[2]}*{n} + {s[1]}*{hkv} + {s[0]}*{zq}\n"
                f"{pad}tl.store(out_ptr0 + (tl.broadcast_to(xindex, {list(val_shape)})), {value}, {mask})"
                .replace("'", ""))

    return _render_template(("flex_backwards", "utilities"), defines, inputs, 16, n_buffers, shapes,
                            "triton_tem_fused_bwd_0", modification, store_output,
                            "torch's flex_attention backward template")


def compile_torch_backward(case_name, case, dtype, head_dim, L: int, H: int):
    _, _, buffers, score_lines, mask_lines = case
    config = TORCH_H100_BWD_CONFIG[head_dim]
    source = render_torch_backward_template(case_name, score_lines, mask_lines, len(buffers), head_dim, L, H, config)
    module, _ = triton_backend.import_source(source, "cuda")
    n_blocks = L // 128
    q = torch.empty((BATCH, H, L, head_dim), dtype=dtype)
    rows = torch.empty((BATCH, H, L), dtype=torch.float32)
    counts = torch.zeros((1, 1, n_blocks), dtype=torch.int32)
    indices = torch.zeros((1, 1, n_blocks, n_blocks), dtype=torch.int32)
    args = [q, torch.empty_like(q), torch.empty_like(q), rows, rows, torch.empty_like(q), torch.empty_like(q),
            torch.empty_like(q), counts, indices, counts, indices, counts, indices, counts, indices,
            *buffers, torch.empty_like(q)]
    stages, warps = config[4], config[5]
    compiled = triton_backend.compile_like_launcher(module.triton_tem_fused_bwd_0, args, {}, warps, stages, CAPABILITY)
    return source, compiled, config


def main_backward(args) -> int:
    """The backward table: flexc's generated backward beside torch's backward template, per case and D."""
    dtype, L, H = torch.bfloat16, args.length, HEADS
    cases = make_cases(L, H)
    names = args.cases or list(BACKWARD_CASES)
    print(f"backward, sm_{CAPABILITY}, bf16, B={BATCH}, H={H}, L=S={L}; per kernel: registers, spill stores/loads (B), "
          f"shared memory, SASS instructions per loop iteration (outermost loops in program order)")
    print(f"{'case':<20} {'D':>3} {'flexc tiles (M1,N1,M2,N2)':<26} {'flexc':<40} {'torch tiles':<26} {'torch':<40}")
    spilling = 0
    for head_dim in args.head_dims:
        for name in names:
            case = cases[name]
            spec, compiled = compile_flexc_backward(case[0], case[1], dtype, head_dim, L, H)
            ours = measure(compiled)
            source, torch_compiled, config = compile_torch_backward(name, case, dtype, head_dim, L, H)
            theirs = measure(torch_compiled)
            if args.show_torch_source:
                print(source)
            if args.show_flexc_source:
                print(triton_backend.source_for(spec))
            spilling += bool(ours["spill_stores"] or ours["spill_loads"])
            flexc_tiles = (f"{spec.block_m1},{spec.block_n1},{spec.block_m2},{spec.block_n2} "
                           f"w{spec.num_warps} s{spec.num_stages}")
            torch_tiles = f"{config[0]},{config[1]},{config[2]},{config[3]} w{config[5]} s{config[4]}"
            print(f"{name:<20} {head_dim:>3} {flexc_tiles:<26} {_row(ours):<40} {torch_tiles:<26} {_row(theirs):<40}",
                  flush=True)
            for w in ours["warnings"]:
                print(f"  flexc ptxas: {w}")
    print(f"backward kernel metrics: spilling flexc kernels {spilling}")
    return 0


# ---- the decode kernel ------------------------------------------------------------------------

DECODE_HEADS, DECODE_KV_HEADS = 32, 8  # GQA 4: four packed query heads per tile


def compile_flexc_decode(score_mod, mask_mod, dtype, head_dim, L: int, guard_values: bool, num_warps=None):
    """The split-KV decode kernel for one query row per head against an L-key cache, as a CUDA
    launch compiles it (``guard_values``: the CPU-only NaN/inf value guard compiled in;
    ``num_warps``: the launcher's choice unless given)."""
    import dataclasses

    from flexc.backends import triton_decode
    from flexc.codegen.scalars import lift_scalars

    q = torch.empty((BATCH, DECODE_HEADS, 1, head_dim), dtype=dtype)
    k = torch.empty((BATCH, DECODE_KV_HEADS, L, head_dim), dtype=dtype)
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, 1, L, device="cpu") if mask_mod is not None else None
    spec = triton_decode.make_spec(lift_scalars(flexc.trace(score_mod)) if score_mod else None,
                                   lift_scalars(flexc.trace(mask_mod)) if mask_mod else None,
                                   q, k, k, block_mask, target="cuda")
    if num_warps is not None:
        spec = dataclasses.replace(spec, num_warps=num_warps)
    return spec, triton_decode.compile_decode_offline(spec, q, k, k, block_mask, CAPABILITY,
                                                      guard_values=guard_values)


def main_decode(args) -> int:
    """The decode table: each case's decode kernel as CUDA runs it (guard off) and with the guard in."""
    dtype, L = torch.bfloat16, args.length
    cases = make_cases(L, DECODE_HEADS)
    names = args.cases or list(cases)
    if args.warps:
        return main_decode_warps(args, cases, names)
    print(f"decode, sm_{CAPABILITY}, bf16, B={BATCH}, Hq={DECODE_HEADS}, Hkv={DECODE_KV_HEADS}, 1 query row, "
          f"S={L}; per kernel: registers, spill stores/loads (B), shared memory, SASS instructions per loop "
          f"iteration (partial loop, full loop)")
    print(f"{'case':<20} {'D':>3} {'guard off (CUDA launches)':<40} {'guard on (CPU calls with NaN/inf values)':<40}")
    spilling = 0
    for head_dim in args.head_dims:
        for name in names:
            case = cases[name]
            reports = [measure(compile_flexc_decode(case[0], case[1], dtype, head_dim, L, on)[1]) for on in (False, True)]
            spilling += bool(reports[0]["spill_stores"] or reports[0]["spill_loads"])
            print(f"{name:<20} {head_dim:>3} {_row(reports[0]):<40} {_row(reports[1]):<40}", flush=True)
    print(f"decode kernel metrics: spilling kernels with the guard off {spilling}")
    return 0


def main_decode_warps(args, cases: dict, names: list) -> int:
    """The decode kernel (guard off, as CUDA launches it) at each of ``args.warps``: registers,
    spills, shared memory, SASS instructions per key tile per warp and, times the warps, issued per
    tile (the tile is the same BLOCK_M x BLOCK_N at every warp count, so these compare directly)."""
    L = args.length
    print(f"decode, sm_{CAPABILITY}, bf16, B={BATCH}, Hq={DECODE_HEADS}, Hkv={DECODE_KV_HEADS}, 1 query row, S={L}; "
          f"per num_warps: registers, spill stores/loads (B), shared memory, SASS instructions per key tile per "
          f"warp (partial loop, full loop) and issued per tile (x warps)")
    print(f"{'case':<20} {'D':>3} {'tile':<6} " + " ".join(f"{f'{w} warps':<48}" for w in args.warps)
          + " issued vs first")
    for head_dim in args.head_dims:
        for name in names:
            case = cases[name]
            cells, issued = [], []
            for warps in args.warps:
                spec, compiled = compile_flexc_decode(case[0], case[1], torch.bfloat16, head_dim, L, False, warps)
                report = measure(compiled)
                issued.append([n * warps for n in report["loops"]])
                cells.append(f"{_row(report)} x{warps} {'(' + ', '.join(map(str, issued[-1])) + ')':<12}")
            ratios = " ".join("/".join(f"{a / b:.2f}" for a, b in zip(other, issued[0])) for other in issued[1:])
            print(f"{name:<20} {head_dim:>3} {f'{spec.block_m}x{spec.block_n}':<6} "
                  + " ".join(f"{c:<48}" for c in cells) + f" {ratios}", flush=True)
    return 0


# ---- the table ----------------------------------------------------------------------------

def _loops(report) -> str:
    return "(" + ", ".join(map(str, report["loops"])) + ")"


def _row(report) -> str:
    return (f"{report['regs']:>4} {report['spill_stores']:>4}/{report['spill_loads']:<4} "
            f"{report['shared'] // 1024:>4}K {_loops(report):<13}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--head-dims", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--show-torch-source", action="store_true")
    parser.add_argument("--show-flexc-source", action="store_true")
    parser.add_argument("--backward", action="store_true", help="the backward kernels (default cases: "
                        + ", ".join(BACKWARD_CASES) + ")")
    parser.add_argument("--decode", action="store_true", help="the split-KV decode kernel, value guard off and on")
    parser.add_argument("--warps", nargs="*", type=int, default=None,
                        help="with --decode: compile the decode kernel at each of these num_warps instead")
    args = parser.parse_args(argv)
    if args.backward:
        return main_backward(args)
    if args.decode:
        return main_decode(args)
    dtype, L, H = torch.bfloat16, args.length, HEADS
    cases = make_cases(L, H)
    names = args.cases or list(cases)
    print(f"sm_{CAPABILITY}, bf16, B={BATCH}, H={H}, L=S={L}; per kernel: registers, spill stores/loads (B), "
          f"shared memory, SASS instructions per key tile (partial loop, full loop)")
    print(f"{'case':<20} {'D':>3} {'flexc tiles':<17} {'flexc':<29} {'torch tiles':<17} {'torch':<29} "
          f"{'partial':>7} {'full':>6}")
    worst_partial = worst_full = 0.0
    spilling = 0
    for head_dim in args.head_dims:
        for name in names:
            case = cases[name]
            spec, compiled = compile_flexc(case[0], case[1], dtype, head_dim, L, H)
            ours = measure(compiled)
            source, torch_compiled, config = compile_torch(case, dtype, head_dim, L, H)
            theirs = measure(torch_compiled)
            if args.show_torch_source:
                print(source)
            if args.show_flexc_source:
                print(triton_backend.source_for(spec))
            # per-iteration counts are per warp; a tile of BLOCK_M x BLOCK_N keys split over num_warps
            # warps: compare the instructions issued per (query, key) pair, so tile shapes may differ
            work = spec.num_warps / (spec.block_m * spec.block_n), config[3] / (config[0] * config[1])
            ratios = [a * work[0] / (b * work[1]) for a, b in zip(ours["loops"], theirs["loops"])]
            if len(ours["loops"]) != len(theirs["loops"]):
                print(f"  note: {name} D={head_dim}: flexc has {len(ours['loops'])} loops, torch "
                      f"{len(theirs['loops'])}; ratios pair them in order")
            if ratios:
                worst_partial = max(worst_partial, ratios[0])
                worst_full = max(worst_full, ratios[-1])
            spilling += bool(ours["spill_stores"] or ours["spill_loads"])
            flexc_tiles = f"{spec.block_m}x{spec.block_n} w{spec.num_warps} s{spec.num_stages}"
            torch_tiles = f"{config[0]}x{config[1]} w{config[3]} s{config[2]}"
            print(f"{name:<20} {head_dim:>3} {flexc_tiles:<17} {_row(ours)} {torch_tiles:<17} {_row(theirs)} "
                  + " ".join(f"{r:>6.2f}" for r in ratios), flush=True)
            for w in ours["warnings"]:
                print(f"  flexc ptxas: {w}")
    print(f"kernel metrics: worst partial-loop ratio {worst_partial:.2f}, worst full-loop ratio {worst_full:.2f}, "
          f"spilling kernels {spilling}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
