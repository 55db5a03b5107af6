"""What flexc's kernels would run on a Hopper GPU, measured without one, beside torch's templates.

    python bench/kernel_metrics.py                    # forward, backward and decode, D=64 and D=128, bf16, sm_90
    python bench/kernel_metrics.py --quick            # causal and soft-cap + causal at D=64 (all three parts)
    python bench/kernel_metrics.py --forward --cases causal --head-dims 128 --show-torch-source
    python bench/kernel_metrics.py --backward         # the backward kernels beside torch's backward template
    python bench/kernel_metrics.py --decode           # the decode kernel beside torch's flex_decode template
    python bench/kernel_metrics.py --decode --warps 2 4   # the decode kernel at each num_warps (guard off)
    python bench/kernel_metrics.py --decode --value-guard # also the decode kernel with its CPU-only NaN/inf guard
    python bench/kernel_metrics.py --forward --tma    # flexc's forward with plain and with TMA key/value loads

Each kernel is compiled for ``GPUTarget("cuda", 90, 32)`` on the CPU (Triton's front end, LLVM and
the ptxas bundled with Triton) with its arguments specialised as Triton's launcher specialises a
real launch (:func:`flexc.backends.triton.offline.compile_like_launcher`), and flexc's mods with
their captured numbers lifted into kernel arguments as a real call lifts them
(:func:`flexc.codegen.scalars.lift_for_call`): that is what makes the numbers mean something.

Per kernel: registers per thread, spill stores/loads (bytes), shared memory, and ptxas's C7511 note
(``wgmma.mma_async`` serialised: the tensor cores wait for each other), which ptxas prints as "info"
rather than a warning. Per key-tile loop, the innermost SASS loops with tensor-core instructions
(HGMMA/HMMA; loops without them are bookkeeping):

* its **kind**, read from the line info of its instructions (``nvdisasm -gi``): the backward's
  direction from the function its lines lie in (``dkdv``: the dK/dV programs, ``dq``: the dQ
  programs; flexc emits dK/dV first, torch dQ first), and *partial* when some instruction comes
  from the mask_mod (flexc's ``mask_mod`` function, torch's mask lines, which the rendering tags),
  *full* otherwise;
* its SASS instructions per iteration;
* its **ring slots**: the software pipeline's depth, the number of shared-memory buffers of each
  ring its async copies (cp.async, TMA) fill, from the final TTGIR (the leading dimension of each
  ``ttg.local_alloc`` the loop indexes; the smallest ring of the dots' operand tiles), and 0 for a
  loop that copies nothing asynchronously (num_stages=1). ``rN`` in the tables. With one slot the
  copy for the next tile waits for this tile's last read: little of its latency is hidden. Rings of
  vectors (the dK/dV loops' logsumexp and delta, a mask's gather such as ``document_id[kv_idx]``: 2
  slots at num_stages=3 in flexc's kernels and torch's alike) and of block indices are not counted:
  what the depth hides is the tiles' copies.

Per kernel also the code outside the key-tile loops (``outside N (before B, after A)``: SASS
instructions, NOPs aside, that each program runs once whatever its number of key tiles: setup before
the first loop, the epilogue after the last). Short loops pay it per program: on an H200 the TMA
variant, 1-5 % fewer instructions per key tile but ~31 % more code outside the loops, ran a
sliding-window forward 2.5x slower. These counts are a regression guard; defaults come from hardware
rows (docs/kernels.md "Defaults").

flexc's loops are matched with torch's by kind, whatever their order, and a kind on one side only
is reported. Ratios are flexc / torch (lower is better) per (query, key) pair: a loop's
instructions times num_warps over the tile it covers per iteration (BLOCK_M x BLOCK_N; BLOCK_M1 x
BLOCK_N1 for dK/dV, BLOCK_M2 x BLOCK_N2 for dQ), so kernels with different tiles compare the work
they issue for the same attention matrix (equal tiles: the plain ratio of the counts). torch is
measured at its own default configuration (torch 2.13's Hopper defaults) and, where flexc's
differs (a user's kernel_options, or a listed departure), also at flexc's; a loop's ratio is the
worse of the two.

torch's templates are read from the installed torch (``torch/_inductor/kernel/flex/templates``)
and rendered for the same case the way Inductor renders them for static shapes (sizes and strides
as literals, ``IS_DIVISIBLE`` when both lengths are multiples of 128), with the mods written as
Inductor lowers them (``x / 20`` as ``x * 0.05``, ``libdevice.tanh``; a captured Python number
as the constant dynamo specialises it to).

The last line is the summary: ``kernel metrics: forward worst R, soft-cap worst R, backward worst
R, decode worst R, min ring slots N, C7511 kernels N, spilling kernels N`` (soft-cap: every
soft-cap loop of the three parts; ring slots, C7511 and spills: flexc's kernels), each worst ratio R
with three decimals (``forward worst 0.919``) so that one just over a bound does not round onto it.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
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
from flexc.backends.triton import cache as kernel_cache, forward as triton_forward, offline as triton_offline  # noqa: E402
from flexc.backends.triton import tma as triton_tma  # noqa: E402
from flexc.codegen.index_width import float_indices  # noqa: E402
from flexc.codegen.scalars import lift_for_call  # noqa: E402

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (and Inductor's), stated
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

CAPABILITY = 90
H100_SMS = 132
WINDOW = 256
SOFT_CAP = 20.0
BATCH, HEADS, LENGTH = 2, 16, 4096
# torch 2.13's Hopper defaults for the forward template: (BLOCK_M, BLOCK_N, num_stages, num_warps)
TORCH_H100_CONFIG = {(torch.bfloat16, 64): (128, 128, 3, 4), (torch.bfloat16, 128): (128, 64, 3, 8),
                     (torch.float16, 64): (128, 128, 3, 4), (torch.float16, 128): (128, 64, 3, 8)}
MASK_TAG = "  # mask_mod"  # marks the mask lines in torch's rendered templates (a loop running them is partial)


# ---- the cases: each mod for flexc, and the same mod as Inductor lowers it into the template -----

def make_cases(L: int, H: int) -> dict:
    """name -> (score_mod, mask_mod, captured tensors, Inductor's score lines, Inductor's mask lines)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(L // 16, L // 3, (64,), generator=g)
    document_id = torch.repeat_interleave(torch.arange(64), lengths)[:L].contiguous()
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)
    cap = SOFT_CAP  # captured, as attention-gym's generate_tanh_softcap captures it: a kernel argument

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

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
            "tmp0 = (qk)", f"tmp1 = {1 / SOFT_CAP}", "tmp2 = tmp0 * tmp1", "tmp3 = libdevice.tanh(tmp2)",
            f"tmp4 = {SOFT_CAP}", "tmp5 = tmp3 * tmp4", "post_mod_scores = tmp5"],
            ["tmp6 = (m)", "tmp7 = (n)", "tmp8 = tmp6 >= tmp7", "mask_mod_output = tmp8"]),
    }


QUICK_CASES, QUICK_HEAD_DIMS = ("causal", "soft-cap + causal"), (64,)

# The backward's joint graph as Inductor lowers it (subgraph 1 of torch's backward template):
# grad_scores from grad_score_mod ({ds}) and the pre-mod score ({score}).
JOINT_LINES = {
    "soft-cap + causal": ["tmp20 = ({score})", f"tmp21 = {1 / SOFT_CAP}", "tmp22 = tmp20 * tmp21",
                          "tmp23 = libdevice.tanh(tmp22)", "tmp24 = tmp23 * tmp23", "tmp25 = 1.0", "tmp26 = tmp25 - tmp24",
                          f"tmp27 = {SOFT_CAP}", "tmp28 = ({ds}) * tmp27", "tmp29 = tmp28 * tmp26", "tmp30 = tmp29 * tmp21",
                          "grad_scores = tmp30"],
}
BACKWARD_CASES = ("causal", "alibi + causal", "soft-cap + causal")
# torch 2.13's Hopper defaults for the backward template: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, stages, warps)
TORCH_H100_BWD_CONFIG = {64: (64, 128, 128, 64, 3, 8), 128: (64, 128, 128, 64, 3, 8)}

DECODE_HEADS, DECODE_KV_HEADS = 32, 8  # GQA 4: four packed query heads per tile
# torch 2.13's flex_decode default on sm_90: (BLOCK_N, num_stages, num_warps). Its heuristic picks
# (64, 3, 2) for sm_90 and then overwrites it with (64, 1, 2) in the else of the sm_110 test.
TORCH_H100_DECODE_CONFIG = (64, 1, 2)


# ---- reading a compiled kernel ----------------------------------------------------------------

@dataclasses.dataclass
class Loop:
    """One key-tile loop of a kernel: an innermost SASS loop with tensor-core instructions."""

    kind: str  # "partial"/"full" (forward, decode), "dK/dV partial", "dQ full", ... (backward)
    size: int  # SASS instructions per iteration
    mma: int  # tensor-core instructions per iteration
    async_copies: int  # cp.async (LDGSTS) and TMA copies per iteration
    ring: int = 0  # ring slots (0: no ring, nothing copied asynchronously)

    def cell(self) -> str:
        return f"{self.kind} {self.size} r{self.ring}"


def ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes, warnings and the C7511 note from ptxas -v, run as Triton runs it for sm_90a."""
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
    lines = [line.strip() for line in log.splitlines()]
    return {"regs": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0,
            "warnings": [line for line in lines if "warning" in line.lower()],
            "c7511": [line for line in lines if "C7511" in line]}


_LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(\.L_x_\d+)")
_MMA = re.compile(r"\b(?:HGMMA|HMMA|IMMA|UTC\w*MMA)\b")
_ASYNC_COPY = re.compile(r"\b(?:LDGSTS|UTMALDG|UBLKCP)\b")
_EXIT = re.compile(r"\bEXIT\b")


def sass(cubin: bytes) -> tuple[list[tuple[str, tuple]], dict[str, int]]:
    """The kernel's SASS with line info (``nvdisasm -c -gi``), read by :func:`parse_sass`."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-gi", f.name], capture_output=True, text=True,
                              check=True).stdout
    return parse_sass(text)


def parse_sass(text: str) -> tuple[list[tuple[str, tuple]], dict[str, int]]:
    """``nvdisasm -gi`` output as ``(instruction, source locations)`` in program order, and its labels
    (name -> index of the next instruction). Locations are ``(file, line)``, innermost first, then
    the call sites the function was inlined at (one comment line per inlining level)."""
    instructions, labels, where, fresh = [], {}, (), True
    for line in text.splitlines():
        location = _LOCATION.search(line)
        if location:  # one comment line per inlining level, innermost first
            file, at, inlined_file, inlined_at = location.groups()
            level = ((file, int(at)),) + (((inlined_file, int(inlined_at)),) if inlined_file else ())
            where, fresh = (level if fresh else where + level), False
            continue
        fresh = True
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = _INSTRUCTION.search(line)
        if instruction:
            instructions.append((instruction.group(1), where))
    return instructions, labels


def innermost_mma_loops(spans: list[tuple[int, int]], has_mma) -> list[tuple[int, int]]:
    """The spans (first, last) with tensor-core work and no such span strictly inside them."""
    with_mma = [s for s in spans if has_mma(s)]
    return sorted(s for s in with_mma
                  if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in with_mma))


@functools.lru_cache(maxsize=None)
def source_map(path: str) -> tuple[tuple[tuple[str, int, int], ...], frozenset]:
    """A generated source's functions ``(name, first line, last line)`` and its mask lines: those of
    a function named ``mask_mod`` and those calling it (flexc), those tagged with :data:`MASK_TAG` and
    those reading ``mask_mod_output`` (torch's rendering). Only partial blocks run any of them."""
    try:
        text = open(path).read()
    except OSError:
        return (), frozenset()
    functions = tuple((node.name, node.lineno, node.end_lineno) for node in ast.walk(ast.parse(text))
                      if isinstance(node, ast.FunctionDef))
    masked = {i for i, line in enumerate(text.splitlines(), 1)
              if line.endswith(MASK_TAG) or "mask_mod_output" in line
              or ("mask_mod(" in line and not line.lstrip().startswith("def "))}
    for name, first, last in functions:
        if name == "mask_mod":
            masked.update(range(first, last + 1))
    return functions, frozenset(masked)


def kind_of(locations, backward: bool) -> str:
    """A loop's kind from the source locations of its instructions (see the module docstring)."""
    functions, masked = set(), False
    for path, line in locations:
        defined, mask_lines = source_map(path)
        inside = [(last - first, name) for name, first, last in defined if first <= line <= last]
        if inside:
            functions.add(min(inside)[1])
        masked |= line in mask_lines
    part = "partial" if masked else "full"
    if not backward:
        return part
    if any("dkdv" in f for f in functions):
        return f"dK/dV {part}"
    if any(re.search(r"(^|_)dq(_|$)", f) for f in functions):
        return f"dQ {part}"
    return f"? {part}"


def sass_loops(cubin: bytes, backward: bool) -> tuple[list[Loop], dict[str, int]]:
    """The kernel's key-tile loops in program order (ring slots filled in by :func:`ttgir_rings`), and
    its code outside them (:func:`outside_loops`)."""
    instructions, labels = sass(cubin)
    return loops_in(instructions, labels, backward), outside_loops(instructions, labels)


def loop_spans(instructions: list, labels: dict) -> list[tuple[int, int]]:
    """The (first, last) instruction indices of the key-tile loops: innermost backward branches
    with tensor-core instructions."""
    spans = []
    exits = [i for i, (text, _) in enumerate(instructions) if _EXIT.search(text)]
    for index, (text, _) in enumerate(instructions):
        branch = _BRANCH.search(text)
        if branch and branch.group(1) in labels and labels[branch.group(1)] < index:
            first = labels[branch.group(1)]
            # not a loop: a TMA wait's out-of-line retry (placed after the kernel's EXIT) branching
            # back into the loop it waits in
            if not any(first <= i <= index for i in exits):
                spans.append((first, index))

    def has_mma(span):
        return any(_MMA.search(instructions[i][0]) for i in range(span[0], span[1] + 1))

    return innermost_mma_loops(spans, has_mma)


def outside_loops(instructions: list, labels: dict) -> dict[str, int]:
    """SASS instructions (NOPs aside) outside the key-tile loops, which every program runs once
    whatever its number of key tiles: ``before`` the first loop (setup: offsets, descriptors, the
    query tile), ``after`` the last (the epilogue, and out-of-line code placed after it), and in all
    (``outside``, those between loops included). A kernel without key-tile loops is all outside."""
    spans = loop_spans(instructions, labels)
    counted = [not re.match(r"NOP\b", text) for text, _ in instructions]
    inside = set()
    for first, last in spans:
        inside.update(range(first, last + 1))
    before = sum(counted[:spans[0][0]]) if spans else sum(counted)
    after = sum(counted[spans[-1][1] + 1:]) if spans else 0
    outside = sum(c for i, c in enumerate(counted) if i not in inside)
    return {"before": before, "after": after, "outside": outside}


def loops_in(instructions: list, labels: dict, backward: bool) -> list[Loop]:
    """The key-tile loops (:func:`loop_spans`) of parsed SASS, in program order."""
    loops = []
    for first, last in loop_spans(instructions, labels):
        body = instructions[first:last + 1]
        locations = {where for _, chain in body for where in chain}
        loops.append(Loop(kind_of(locations, backward), len(body), sum(bool(_MMA.search(t)) for t, _ in body),
                          sum(bool(_ASYNC_COPY.search(t)) for t, _ in body)))
    return loops


_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_LOC_REF = re.compile(r"#loc\d*\b")
_FILE_LOC = re.compile(r'"([^"]+\.py)":(\d+):\d+')
_RING = re.compile(r"^\s*(%[\w.#]+) = ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<((?:\d+x)+)")


def ttgir_rings(ttgir: str, backward: bool) -> dict[str, list[int]]:
    """kind -> ring slots of each of the kind's loops (program order), from the final TTGIR: the
    innermost ``scf.for`` loops with a dot, their kind from their ops' locations, their slots the
    smallest leading dimension of the tile-sized ``ttg.local_alloc`` rings they index (0 if none)."""
    lines = ttgir.splitlines()
    table = {m.group(1): m.group(2) for m in map(_LOC_DEF.match, lines) if m}

    @functools.lru_cache(maxsize=None)
    def resolve(name: str) -> frozenset:
        raw = table.get(name, "")
        found = {(path, int(line)) for path, line in _FILE_LOC.findall(raw)}
        for ref in _LOC_REF.findall(raw):
            if ref != name:
                found |= resolve(ref)
        return frozenset(found)

    rings = {}
    for line in lines:
        ring = _RING.match(line)
        if ring:
            dims = [int(d) for d in ring.group(2).rstrip("x").split("x")]
            if len(dims) >= 3 and min(dims[1:]) > 1:  # tiles: not vectors (lse, gathers), nor block indices
                rings[ring.group(1)] = dims[0]
    spans, stack = [], []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("}") and stack:
            opened, is_for = stack.pop()
            if is_for:
                spans.append((opened, i))
        if line.rstrip().endswith("{"):
            stack.append((i, "scf.for" in line and not line.lstrip().startswith("}")))

    def has_dot(span):
        return any("warp_group_dot" in lines[i] or "tt.dot " in lines[i] for i in range(*span))

    found: dict[str, list[int]] = {}
    for first, last in innermost_mma_loops(spans, has_dot):
        body = lines[first:last + 1]
        locations = set()
        for line in body:
            for ref in _LOC_REF.findall(line):
                locations |= resolve(ref)
            locations |= {(path, int(at)) for path, at in _FILE_LOC.findall(line)}
        slots = [rings[name] for line in body for name in re.findall(r"ttg\.memdesc_index (%[\w.#]+)\[", line)
                 if name in rings]
        found.setdefault(kind_of(locations, backward), []).append(min(slots, default=0))
    return found


def measure(compiled, backward: bool = False) -> dict:
    """ptxas's report, shared memory, the key-tile loops (``loops``: their sizes; ``loop_info``:
    :class:`Loop` records, ring slots included) and the code outside them (``code_outside``:
    :func:`outside_loops`) of a compiled kernel."""
    report = ptxas_report(compiled.asm["ptx"])
    report["shared"] = compiled.metadata.shared
    loops, report["code_outside"] = sass_loops(compiled.asm["cubin"], backward)
    rings = ttgir_rings(compiled.asm["ttgir"], backward)
    seen: dict[str, int] = {}
    for loop in loops:
        slots = rings.get(loop.kind, [])
        i = seen.get(loop.kind, 0)
        seen[loop.kind] = i + 1
        loop.ring = slots[i] if i < len(slots) else min(slots, default=0)
    report["loop_info"] = loops
    report["loops"] = [loop.size for loop in loops]
    return report


# ---- flexc's kernels --------------------------------------------------------------------------

def _lifted(dtype, score_mod, mask_mod):
    """The traced mods as a real call passes them to the kernels: captured numbers lifted into
    kernel arguments (:func:`flexc.codegen.scalars.lift_for_call`)."""
    score = flexc.trace(score_mod) if score_mod is not None else None
    mask = flexc.trace(mask_mod) if mask_mod is not None else None
    return lift_for_call(torch.empty(0, dtype=dtype), score, mask)


def compile_flexc(score_mod, mask_mod, dtype, head_dim, L: int, H: int, options=None, tma: bool = False):
    """flexc's forward as a call would launch it; ``tma``: with its key/value tiles through tensor
    descriptors (USE_TMA)."""
    score, mask = _lifted(dtype, score_mod, mask_mod)
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, L, device="cpu") if mask_mod is not None else None
    spec = triton_forward.make_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                    options, "cuda", False, mask is not None,
                                    float_indices=float_indices(BATCH, H, L, L))  # as call_layout decides
    spec = dataclasses.replace(spec, tma=tma)
    inputs = triton_offline.offline_inputs(spec, BATCH, H, L, L, block_mask)
    return spec, triton_offline.compile_offline(spec, CAPABILITY, inputs=inputs)


def compile_flexc_backward(score_mod, mask_mod, dtype, head_dim, L: int, H: int, options=None):
    from flexc.backends.triton import backward as triton_backward

    score, mask = _lifted(dtype, score_mod, mask_mod)
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, L, L, device="cpu") if mask_mod is not None else None
    spec = triton_backward.make_backward_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                              options, "cuda", (), mask is not None,
                                              float_indices=float_indices(BATCH, H, L, L))
    fwd_spec = triton_forward.make_spec(score, mask, dtype, head_dim, head_dim, (128, 128) if mask else None,
                                        None, "cuda", False, mask is not None)
    inputs = triton_offline.offline_inputs(fwd_spec, BATCH, H, L, L, block_mask)
    return spec, triton_offline.compile_offline(spec, CAPABILITY, inputs=inputs)


def compile_flexc_decode(score_mod, mask_mod, dtype, head_dim, L: int, guard_values: bool, num_warps=None):
    """The split-KV decode kernel for one query row per head against an L-key cache, as a CUDA
    launch compiles it (``guard_values``: the CPU-only NaN/inf value guard compiled in;
    ``num_warps``: the launcher's choice unless given)."""
    from flexc.backends.triton import decode as triton_decode

    q = torch.empty((BATCH, DECODE_HEADS, 1, head_dim), dtype=dtype)
    k = torch.empty((BATCH, DECODE_KV_HEADS, L, head_dim), dtype=dtype)
    block_mask = flexc.create_block_mask(mask_mod, 1, 1, 1, L, device="cpu") if mask_mod is not None else None
    score, mask = _lifted(dtype, score_mod, mask_mod)
    spec = triton_decode.make_spec(score, mask, q, k, k, block_mask, target="cuda")
    if num_warps is not None:
        spec = dataclasses.replace(spec, num_warps=num_warps)
    return spec, triton_offline.compile_offline(spec, CAPABILITY, inputs=(q, k, k, block_mask),
                                                guard_values=guard_values)


# ---- torch's templates ------------------------------------------------------------------------

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
    # (flex_decode's text is indented one level, its def_kernel line too: that line starts the kernel)
    text = "\n".join(open(os.path.join(folder, f"{name}.py.jinja")).read().lstrip(" ") for name in templates)
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


def _tagged(mask_lines) -> list[str]:
    return [line + MASK_TAG for line in mask_lines]


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
        lines = score_lines if subgraph_number == 0 else _tagged(mask_lines)
        return "\n".join(lines)

    def store_output(indices, value, mask, val_shape=None):
        zq, hq, m, d = indices
        s = _strides(shapes["Q"])
        return (f"xindex = {d} + {s[2]}*{m} + {s[1]}*{hq} + {s[0]}*{zq}\n"
                f"    tl.store(out_ptr0 + (tl.broadcast_to(xindex, {list(val_shape)})), {value}, {mask})".replace("'", ""))

    return _render_template(("flex_attention", "utilities", "common"), defines, inputs, 9, n_buffers, shapes,
                            "triton_tem_fused_0", modification, store_output, "torch's flex_attention template")


def compile_torch(case, dtype, head_dim, L: int, H: int, config=None):
    """torch's forward template for ``case``, at ``config`` (BLOCK_M, BLOCK_N, stages, warps; default
    torch's own)."""
    _, _, buffers, score_lines, mask_lines = case
    config = config or TORCH_H100_CONFIG[(dtype, head_dim)]
    source = render_torch_template(score_lines, mask_lines, len(buffers), dtype, head_dim, L, H, config)
    module, _ = kernel_cache.import_source(source, "cuda")
    n_blocks = L // 128
    q = torch.empty((BATCH, H, L, head_dim), dtype=dtype)
    counts = torch.zeros((1, 1, n_blocks), dtype=torch.int32)
    indices = torch.zeros((1, 1, n_blocks, n_blocks), dtype=torch.int32)
    lse = torch.empty((BATCH, H, L), dtype=torch.float32)
    args = [q, torch.empty_like(q), torch.empty_like(q), lse, lse, counts, indices, counts, indices,
            *buffers, torch.empty_like(q)]
    block_m, block_n, stages, warps = config
    compiled = triton_offline.compile_like_launcher(module.triton_tem_fused_0, args, {}, warps, stages, CAPABILITY)
    return source, compiled, config


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
            lines = _tagged(renumber(line) for line in mask_lines)
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


def compile_torch_backward(case_name, case, dtype, head_dim, L: int, H: int, config=None):
    """torch's backward template for ``case`` at ``config`` (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2,
    stages, warps; default torch's own)."""
    _, _, buffers, score_lines, mask_lines = case
    config = config or TORCH_H100_BWD_CONFIG[head_dim]
    source = render_torch_backward_template(case_name, score_lines, mask_lines, len(buffers), head_dim, L, H, config)
    module, _ = kernel_cache.import_source(source, "cuda")
    n_blocks = L // 128
    q = torch.empty((BATCH, H, L, head_dim), dtype=dtype)
    rows = torch.empty((BATCH, H, L), dtype=torch.float32)
    counts = torch.zeros((1, 1, n_blocks), dtype=torch.int32)
    indices = torch.zeros((1, 1, n_blocks, n_blocks), dtype=torch.int32)
    args = [q, torch.empty_like(q), torch.empty_like(q), rows, rows, torch.empty_like(q), torch.empty_like(q),
            torch.empty_like(q), counts, indices, counts, indices, counts, indices, counts, indices,
            *buffers, torch.empty_like(q)]
    stages, warps = config[4], config[5]
    compiled = triton_offline.compile_like_launcher(module.triton_tem_fused_bwd_0, args, {}, warps, stages, CAPABILITY)
    return source, compiled, config


def torch_decode_splits() -> int:
    """torch's ``get_split_k`` on an H100 for the decode cases: two splits per SM and (batch, key head)."""
    return max(H100_SMS // (BATCH * DECODE_KV_HEADS) * 2, 1)


def render_torch_decode_template(score_lines, mask_lines, n_buffers, head_dim, L: int, config) -> str:
    """torch's flex_decode template (GQA packing, split KV) rendered for one query row per head
    against an L-key cache, as Inductor renders it (static shapes)."""
    block_n, _, _ = config
    G = DECODE_HEADS // DECODE_KV_HEADS
    block_m = max(16, 1 << (G - 1).bit_length())  # next_power_of_2(Q_LEN * G), at least 16
    splits = torch_decode_splits()
    defines = dict(PRESCALE_QK=False, ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False, WRITE_DQ=True,
                   OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=False, FLOAT32_PRECISION="'ieee'", IS_DIVISIBLE=False,
                   SM_SCALE=head_dim ** -0.5, GQA_SHARED_HEADS=G, HAS_FULL_BLOCKS=True, QK_HEAD_DIM=head_dim,
                   QK_HEAD_DIM_ROUNDED=head_dim, V_HEAD_DIM=head_dim, V_HEAD_DIM_ROUNDED=head_dim,
                   SAFE_HEAD_DIM=True, USE_TMA=False, SPLIT_KV=splits, BLOCK_M=block_m, BLOCK_N=block_n,
                   SAFE_M_BOUNDARY=G % block_m == 0, SAFE_N_BOUNDARY=True, SPARSE_Q_BLOCK_SIZE=128,
                   SPARSE_KV_BLOCK_SIZE=128, INDEX_DTYPE="tl.int32")
    inputs = ["Q", "K", "V", "M", "L", "KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX"]
    n_blocks = L // 128
    kv = (BATCH, DECODE_KV_HEADS, L, head_dim)
    shapes = {"Q": (BATCH, DECODE_KV_HEADS, G, 1, head_dim), "K": kv, "V": kv,
              "M": (BATCH, splits, DECODE_HEADS, 1), "L": (BATCH, splits, DECODE_HEADS, 1),
              "KV_NUM_BLKS": (1, 1, 1), "KV_IDX": (1, 1, 1, n_blocks), "FULL_KV_NUM_BLKS": (1, 1, 1),
              "FULL_KV_IDX": (1, 1, 1, n_blocks), "ACC": (BATCH, splits, DECODE_HEADS, 1, head_dim)}

    def modification(subgraph_number, output_name, **kwargs):
        lines = score_lines if subgraph_number == 0 else _tagged(mask_lines)
        return "\n".join(lines)

    def store_output(indices, value, mask, val_shape=None):
        z, t, hq, m, d = indices
        s = _strides(shapes["ACC"])
        return (f"xindex = {d} + {s[3]}*{m} + {s[2]}*{hq} + {s[1]}*{t} + {s[0]}*{z}\n"
                f"    tl.store(out_ptr0 + (tl.broadcast_to(xindex, {list(val_shape)})), {value}, {mask})".replace("'", ""))

    return _render_template(("flex_decode", "utilities", "common"), defines, inputs, 9, n_buffers, shapes,
                            "triton_tem_fused_decode_0", modification, store_output, "torch's flex_decode template")


def compile_torch_decode(case, dtype, head_dim, L: int, config=None):
    """torch's flex_decode template for ``case`` at ``config`` (BLOCK_N, stages, warps; default torch's
    own); its BLOCK_M is the packed rows, 16 here."""
    _, _, buffers, score_lines, mask_lines = case
    config = config or TORCH_H100_DECODE_CONFIG
    source = render_torch_decode_template(score_lines, mask_lines, len(buffers), head_dim, L, config)
    module, _ = kernel_cache.import_source(source, "cuda")
    G, splits = DECODE_HEADS // DECODE_KV_HEADS, torch_decode_splits()
    q = torch.empty((BATCH, DECODE_HEADS, 1, head_dim), dtype=dtype)
    q5 = q.as_strided((BATCH, DECODE_KV_HEADS, G, 1, head_dim), _strides((BATCH, DECODE_KV_HEADS, G, 1, head_dim)))
    k = torch.empty((BATCH, DECODE_KV_HEADS, L, head_dim), dtype=dtype)
    rows = torch.empty((BATCH, splits, DECODE_HEADS, 1), dtype=torch.float32)
    counts = torch.zeros((1, 1, 1), dtype=torch.int32)
    indices = torch.zeros((1, 1, 1, L // 128), dtype=torch.int32)
    acc = torch.empty((BATCH, splits, DECODE_HEADS, 1, head_dim), dtype=torch.float32)
    args = [q5, k, torch.empty_like(k), rows, torch.empty_like(rows), counts, indices, counts, indices, *buffers, acc]
    _, stages, warps = config
    compiled = triton_offline.compile_like_launcher(module.triton_tem_fused_decode_0, args, {}, warps, stages,
                                                    CAPABILITY)
    return source, compiled, config


# ---- comparing ------------------------------------------------------------------------------

@dataclasses.dataclass
class Side:
    """One measured kernel: who, its tile label, its report, and the (query, key) pairs each
    iteration of a loop of each kind covers over num_warps."""

    who: str
    tiles: str
    report: dict
    warps: int
    pairs: dict  # kind prefix ("", "dK/dV", "dQ") -> BLOCK_M x BLOCK_N of one iteration

    def per_pair(self, loop: Loop) -> float:
        prefix = loop.kind.split(" ")[0] if " " in loop.kind else ""
        return loop.size * self.warps / self.pairs[prefix]


def _kernel_cell(report) -> str:
    c7511 = " C7511" if report["c7511"] else ""
    return (f"regs {report['regs']:>3} spill {report['spill_stores']}/{report['spill_loads']} "
            f"smem {report['shared'] // 1024}K{c7511}")


def _outside_cell(report) -> str:
    code = report["code_outside"]
    return f"outside {code['outside']} (before {code['before']}, after {code['after']})"


def _loops_cell(report) -> str:
    loops = " | ".join(loop.cell() for loop in report["loop_info"]) or "no key-tile loop"
    return f"{loops} | {_outside_cell(report)}"


def compare(flexc_side: Side, torch_sides: list[Side]) -> tuple[list[str], dict[str, float]]:
    """Lines for one case and, per flexc loop kind, its worst ratio against the torch kernels (loops
    matched by kind, in order within a kind); a kind on one side only is noted."""
    lines = [f"  {flexc_side.who:<12} {flexc_side.tiles:<24} {_kernel_cell(flexc_side.report):<40} "
             f"{_loops_cell(flexc_side.report)}"]
    worst: dict[str, float] = {}
    ours = flexc_side.report["loop_info"]
    for side in torch_sides:
        theirs = side.report["loop_info"]
        ratios = []
        for kind in dict.fromkeys(loop.kind for loop in ours + theirs):
            mine = [loop for loop in ours if loop.kind == kind]
            other = [loop for loop in theirs if loop.kind == kind]
            for a, b in zip(mine, other):
                r = flexc_side.per_pair(a) / side.per_pair(b)
                ratios.append(f"{kind} {r:.2f}")
                worst[kind] = max(worst.get(kind, 0.0), r)
            if len(mine) != len(other):
                ratios.append(f"{kind}: flexc {len(mine)} loop(s), torch {len(other)} (unmatched)")
        lines.append(f"  {side.who:<12} {side.tiles:<24} {_kernel_cell(side.report):<40} {_loops_cell(side.report)}"
                     f"   ratio {', '.join(ratios)}")
    return lines, worst


def torch_sides(configs: list, compile_one, describe, show_source: bool, backward: bool = False) -> list[Side]:
    """One :class:`Side` per torch configuration: the first is torch's default ("torch"), a second
    torch at flexc's tile ("torch@flexc"). ``compile_one(config)`` gives ``(source, compiled, _)``;
    ``describe(config)`` gives ``(tiles label, num_warps, pairs per loop kind)``."""
    sides = []
    for i, config in enumerate(configs):
        source, compiled, _ = compile_one(config)
        if show_source:
            print(source)
        tiles, warps, pairs = describe(config)
        sides.append(Side("torch" if i == 0 else "torch@flexc", tiles, measure(compiled, backward=backward), warps,
                          pairs))
    return sides


@dataclasses.dataclass
class Totals:
    """What the summary line collects."""

    worst: dict = dataclasses.field(default_factory=dict)  # part -> worst ratio
    soft_cap: float = 0.0
    min_ring: int | None = None
    c7511: int = 0
    spilling: int = 0

    def add(self, part: str, case: str, worst: dict, flexc_report: dict) -> None:
        if worst:
            self.worst[part] = max(self.worst.get(part, 0.0), *worst.values())
            if "soft-cap" in case:
                self.soft_cap = max(self.soft_cap, *worst.values())
        rings = [loop.ring for loop in flexc_report["loop_info"]]
        if rings:
            self.min_ring = min(rings + ([self.min_ring] if self.min_ring is not None else []))
        self.c7511 += bool(flexc_report["c7511"])
        self.spilling += bool(flexc_report["spill_stores"] or flexc_report["spill_loads"])

    def line(self) -> str:
        # three decimals: a worst ratio read against a bound (0.92) must not round onto it
        def r(part):
            return f"{self.worst[part]:.3f}" if part in self.worst else "n/a"

        soft = f"{self.soft_cap:.3f}" if self.soft_cap else "n/a"
        ring = self.min_ring if self.min_ring is not None else "n/a"
        return (f"kernel metrics: forward worst {r('forward')}, soft-cap worst {soft}, backward worst "
                f"{r('backward')}, decode worst {r('decode')}, min ring slots {ring}, C7511 kernels {self.c7511}, "
                f"spilling kernels {self.spilling}")


def _print_block(title: str, lines: list[str], flexc_report: dict) -> None:
    print(title)
    for line in lines:
        print(line)
    for note in flexc_report["warnings"] + flexc_report["c7511"]:
        print(f"    flexc ptxas: {note}")
    sys.stdout.flush()


def run_forward(args, totals: Totals) -> None:
    dtype, L, H = torch.bfloat16, args.length, HEADS
    cases = make_cases(L, H)
    print(f"\nforward, sm_{CAPABILITY}, bf16, B={BATCH}, H={H}, L=S={L}; per kernel: registers, spill stores/loads "
          f"(B), shared memory, C7511; per key-tile loop: kind, SASS instructions per iteration, ring slots")
    for head_dim in args.head_dims:
        for name in args.cases or list(cases):
            case = cases[name]
            spec, compiled = compile_flexc(case[0], case[1], dtype, head_dim, L, H)
            ours = Side("flexc", f"{spec.block_m}x{spec.block_n} w{spec.num_warps} s{spec.num_stages}",
                        measure(compiled), spec.num_warps, {"": spec.block_m * spec.block_n})
            configs = [TORCH_H100_CONFIG[(dtype, head_dim)]]
            if (spec.block_m, spec.block_n, spec.num_stages, spec.num_warps) != configs[0]:
                configs.append((spec.block_m, spec.block_n, spec.num_stages, spec.num_warps))
            def describe(config):
                bm, bn, stages, warps = config
                return f"{bm}x{bn} w{warps} s{stages}", warps, {"": bm * bn}
            sides = torch_sides(configs, lambda c: compile_torch(case, dtype, head_dim, L, H, c), describe,
                                args.show_torch_source)
            if args.show_flexc_source:
                print(kernel_cache.source_for(spec))
            lines, worst = compare(ours, sides)
            _print_block(f"{name} D={head_dim}", lines, ours.report)
            totals.add("forward", name, worst, ours.report)


def tma_verdict(plain: dict, tma: dict) -> list[str]:
    """Why the TMA kernel is worse than the plain one (empty: no worse): more instructions per pair in
    a loop (same tiles, so the plain counts), fewer ring slots, spills, or C7511."""
    reasons = []
    mine, theirs = plain["loop_info"], tma["loop_info"]
    if [loop.kind for loop in mine] != [loop.kind for loop in theirs]:
        reasons.append("loops differ")
    for a, b in zip(mine, theirs):
        if b.size > a.size:
            reasons.append(f"{b.kind} +{b.size - a.size}")
        if b.ring < a.ring:
            reasons.append(f"{b.kind} ring {a.ring}->{b.ring}")
    if tma["spill_stores"] or tma["spill_loads"]:
        reasons.append("spills")
    if tma["c7511"]:
        reasons.append("C7511")
    return reasons


def run_forward_tma(args, totals: Totals) -> None:
    """flexc's forward kernel with plain key/value loads and with TMA (USE_TMA) side by side: whether
    TMA's loops are no worse (:func:`tma_verdict`) and what it adds outside them. A regression guard,
    not a decider: TMA is off by default (torch's default; flexc.backends.triton.tma), since on an
    H200 loops 1-5 % shorter ran a sliding-window forward 2.5x slower, the code outside them being
    paid per program."""
    dtype, L, H = torch.bfloat16, args.length, HEADS
    cases = make_cases(L, H)
    print(f"\nforward, plain vs TMA key/value loads, sm_{CAPABILITY}, bf16, B={BATCH}, H={H}, L=S={L}; per kernel: "
          f"registers, spill stores/loads (B), shared memory, C7511; per key-tile loop: kind, SASS instructions "
          f"per iteration, ring slots")
    for head_dim in args.head_dims:
        for name in args.cases or list(cases):
            case = cases[name]
            spec, compiled = compile_flexc(case[0], case[1], dtype, head_dim, L, H)
            plain = measure(compiled)
            tma = measure(compile_flexc(case[0], case[1], dtype, head_dim, L, H, tma=True)[1])
            tiles = f"{spec.block_m}x{spec.block_n} w{spec.num_warps} s{spec.num_stages}"
            ratios = ", ".join(f"{b.kind} {b.size / a.size:.3f}" for a, b in zip(plain["loop_info"], tma["loop_info"]))
            reasons = tma_verdict(plain, tma)
            outside = tma["code_outside"]["outside"] / max(1, plain["code_outside"]["outside"])
            pick = f"outside the loops tma/plain {outside:.2f}; default: {'TMA' if triton_tma.by_default(spec) else 'plain'}"
            print(f"{name} D={head_dim}")
            print(f"  {'plain':<12} {tiles:<24} {_kernel_cell(plain):<40} {_loops_cell(plain)}")
            print(f"  {'tma':<12} {tiles:<24} {_kernel_cell(tma):<40} {_loops_cell(tma)}   tma/plain {ratios}   "
                  f"loops {'no worse' if not reasons else 'worse: ' + ', '.join(reasons)}; {pick}", flush=True)
            totals.add("forward", name, {}, tma)


def run_backward(args, totals: Totals) -> None:
    dtype, L, H = torch.bfloat16, args.length, HEADS
    cases = make_cases(L, H)
    names = [n for n in args.cases or list(BACKWARD_CASES) if n in cases]
    print(f"\nbackward, sm_{CAPABILITY}, bf16, B={BATCH}, H={H}, L=S={L}; tiles BLOCK_M1,N1 (dK/dV) and BLOCK_M2,N2 (dQ)")
    for head_dim in args.head_dims:
        for name in names:
            case = cases[name]
            spec, compiled = compile_flexc_backward(case[0], case[1], dtype, head_dim, L, H)
            ours = Side("flexc", f"{spec.block_m1},{spec.block_n1},{spec.block_m2},{spec.block_n2} "
                        f"w{spec.num_warps} s{spec.num_stages}", measure(compiled, backward=True), spec.num_warps,
                        {"dK/dV": spec.block_m1 * spec.block_n1, "dQ": spec.block_m2 * spec.block_n2})
            mine = (spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2, spec.num_stages, spec.num_warps)
            configs = [TORCH_H100_BWD_CONFIG[head_dim]] + ([mine] if mine != TORCH_H100_BWD_CONFIG[head_dim] else [])
            def describe(config):
                m1, n1, m2, n2, stages, warps = config
                return f"{m1},{n1},{m2},{n2} w{warps} s{stages}", warps, {"dK/dV": m1 * n1, "dQ": m2 * n2}
            sides = torch_sides(configs, lambda c: compile_torch_backward(name, case, dtype, head_dim, L, H, c),
                                describe, args.show_torch_source, backward=True)
            if args.show_flexc_source:
                print(kernel_cache.source_for(spec))
            lines, worst = compare(ours, sides)
            _print_block(f"{name} D={head_dim}", lines, ours.report)
            totals.add("backward", name, worst, ours.report)


def run_decode(args, totals: Totals) -> None:
    dtype, L = torch.bfloat16, args.length
    cases = make_cases(L, DECODE_HEADS)
    print(f"\ndecode, sm_{CAPABILITY}, bf16, B={BATCH}, Hq={DECODE_HEADS}, Hkv={DECODE_KV_HEADS}, 1 query row, S={L}; "
          f"flexc's decode kernel as CUDA launches it (no value guard) beside torch's flex_decode template "
          f"(SPLIT_KV={torch_decode_splits()}); tiles: packed rows x keys")
    for head_dim in args.head_dims:
        for name in args.cases or list(cases):
            case = cases[name]
            spec, compiled = compile_flexc_decode(case[0], case[1], dtype, head_dim, L, False)
            ours = Side("flexc", f"{spec.block_m}x{spec.block_n} w{spec.num_warps} s{spec.num_stages}",
                        measure(compiled), spec.num_warps, {"": spec.block_m * spec.block_n})
            G = DECODE_HEADS // DECODE_KV_HEADS
            torch_m = max(16, 1 << (G - 1).bit_length())
            configs = [TORCH_H100_DECODE_CONFIG]
            if (spec.block_n, spec.num_stages, spec.num_warps) != configs[0]:
                configs.append((spec.block_n, spec.num_stages, spec.num_warps))
            def describe(config):
                bn, stages, warps = config
                return f"{torch_m}x{bn} w{warps} s{stages}", warps, {"": torch_m * bn}
            sides = torch_sides(configs, lambda c: compile_torch_decode(case, dtype, head_dim, L, c), describe,
                                args.show_torch_source)
            if args.show_flexc_source:
                print(kernel_cache.source_for(spec))
            lines, worst = compare(ours, sides)
            if getattr(args, "value_guard", False):  # the CPU-only NaN/inf value guard compiled in, for reference
                guarded = measure(compile_flexc_decode(case[0], case[1], dtype, head_dim, L, True)[1])
                lines.insert(1, f"  {'flexc+guard':<12} {ours.tiles:<24} {_kernel_cell(guarded):<40} "
                                f"{_loops_cell(guarded)}")
            _print_block(f"{name} D={head_dim}", lines, ours.report)
            totals.add("decode", name, worst, ours.report)


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


# ---- the report ----------------------------------------------------------------------------

def _loops(report) -> str:
    return "(" + ", ".join(map(str, report["loops"])) + ")"


def _row(report) -> str:
    return (f"{report['regs']:>4} {report['spill_stores']:>4}/{report['spill_loads']:<4} "
            f"{report['shared'] // 1024:>4}K {_loops(report):<13}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all; the backward: "
                        + ", ".join(BACKWARD_CASES) + ")")
    parser.add_argument("--head-dims", nargs="*", type=int, default=None, help="default 64 128")
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--quick", action="store_true", help="cases " + ", ".join(QUICK_CASES) + " at D="
                        + ", ".join(map(str, QUICK_HEAD_DIMS)) + " (unless --cases/--head-dims say otherwise)")
    parser.add_argument("--forward", action="store_true", help="the forward kernels (with none of --forward, "
                        "--backward, --decode: all three)")
    parser.add_argument("--backward", action="store_true", help="the backward kernels")
    parser.add_argument("--decode", action="store_true", help="the split-KV decode kernel")
    parser.add_argument("--value-guard", action="store_true", help="with --decode: also flexc's decode kernel "
                        "with the NaN/inf value guard CPU calls compile in (CUDA launches never do)")
    parser.add_argument("--warps", nargs="*", type=int, default=None,
                        help="with --decode: compile the decode kernel at each of these num_warps instead")
    parser.add_argument("--tma", action="store_true", help="with --forward: flexc's forward with plain and with "
                        "TMA (tensor-descriptor) key/value loads instead of against torch")
    parser.add_argument("--show-torch-source", action="store_true")
    parser.add_argument("--show-flexc-source", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.cases = args.cases or list(QUICK_CASES)
        args.head_dims = args.head_dims or list(QUICK_HEAD_DIMS)
    args.head_dims = args.head_dims or [64, 128]
    if args.decode and args.warps:
        cases = make_cases(args.length, DECODE_HEADS)
        return main_decode_warps(args, cases, args.cases or list(cases))
    parts = [p for p in ("forward", "backward", "decode") if getattr(args, p)] or ["forward", "backward", "decode"]
    totals = Totals()
    for part in parts:
        run_forward_part = run_forward_tma if args.tma else run_forward
        {"forward": run_forward_part, "backward": run_backward, "decode": run_decode}[part](args, totals)
    print()
    print(totals.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
