"""The ``flexc`` command.

``flexc trace FILE.py[:NAME]`` prints the traced expression of the mods in a file.
``flexc show FILE.py[:NAME[,NAME]]`` prints the Triton kernel flexc generates for them.

``NAME`` is a score_mod or mask_mod defined in the file, or a Python expression evaluated in the
file's namespace (``"masks.py:generate_sliding_window(128)"``). Without ``NAME`` every top-level
function with a mod's signature is used (``show`` takes at most one of each kind).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any, Callable, Sequence

import torch

from .trace import MASK_MOD, SCORE_MOD, TracedMod, TraceError, mod_kind, trace

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def _split_target(target: str) -> tuple[str, str | None]:
    path, sep, names = target.partition(".py:")
    if sep:
        return path + ".py", names
    return target, None


def _load_namespace(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CliError(f"no such file: {path!r}. Expected FILE.py[:NAME], e.g. `flexc show masks.py:causal`.")
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)  # the file may import its neighbours
    try:
        return runpy.run_path(path, run_name="__flexc_cli__")
    finally:
        sys.path.remove(directory)


def _is_mod(value: Any) -> bool:
    if not callable(value) or isinstance(value, type):
        return False
    try:
        mod_kind(value)
    except (TraceError, TypeError):
        return False
    return True


def _find_mods(path: str, names: str | None) -> list[tuple[str, Callable]]:
    """``(label, function)`` for each requested mod, or every mod defined at the file's top level."""
    namespace = _load_namespace(path)
    if names:
        found = []
        for name in (n.strip() for n in _split_names(names)):
            if name.isidentifier():
                if name not in namespace:
                    candidates = ", ".join(sorted(k for k, v in namespace.items() if _is_mod(v))) or "none"
                    raise CliError(f"{path} defines no {name!r}. Mods defined there: {candidates}.")
                value = namespace[name]
            else:
                try:
                    value = eval(name, namespace)  # noqa: S307 - the user's own file and expression
                except Exception as e:  # the user's expression: report whatever it raised
                    raise CliError(f"evaluating {name!r} in {path} raised {type(e).__name__}: {e}") from None
            if not _is_mod(value):
                raise CliError(f"{name!r} in {path} is not a score_mod (score, b, h, q_idx, kv_idx) or mask_mod "
                               f"(b, h, q_idx, kv_idx); got {type(value).__name__}.")
            found.append((name, value))
        return found
    found = [(k, v) for k, v in namespace.items()
             if not k.startswith("_") and _is_mod(v) and _defined_in(v, path)]
    if not found:
        raise CliError(f"{path} defines no top-level score_mod or mask_mod. Fix: name one, FILE.py:NAME.")
    return found


def _split_names(names: str) -> list[str]:
    """Split ``a,b`` at top-level commas only (expressions may contain commas)."""
    parts, depth, current = [], 0, ""
    for ch in names:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _defined_in(fn: Callable, path: str) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename) == os.path.abspath(path)


def _trace_all(mods: list[tuple[str, Callable]]) -> list[tuple[str, TracedMod]]:
    traced = []
    for label, fn in mods:
        try:
            traced.append((label, trace(fn)))
        except TraceError as e:
            raise CliError(str(e)) from None
    return traced


def _describe_buffers(t: TracedMod) -> list[str]:
    return [f"    {name}: {list(b.shape)} {str(b.dtype).removeprefix('torch.')}"
            for name, b in zip(t.buffer_names, t.buffers)]


def cmd_trace(args: argparse.Namespace) -> int:
    path, names = _split_target(args.target)
    for label, t in _trace_all(_find_mods(path, names)):
        print(f"{label} ({t.kind}): {t}")
        lines = _describe_buffers(t)
        if lines:
            print("  captured tensors:")
            print("\n".join(lines))
    return 0


def _block_size(text: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--block-size takes N or Q,KV (e.g. 128 or 128,64), got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--block-size takes N or Q,KV with positive sizes, got {text!r}")
    return parts[0], parts[1]


def _option(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--option takes NAME=VALUE (e.g. BLOCK_M=64), got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--option {name} needs an integer value, got {value!r}") from None


def cmd_show(args: argparse.Namespace) -> int:
    from .backends.triton_backend import make_spec, source_for

    path, names = _split_target(args.target)
    traced = _trace_all(_find_mods(path, names))
    by_kind: dict[str, list[str]] = {}
    for label, t in traced:
        by_kind.setdefault(t.kind, []).append(label)
    for kind, labels in by_kind.items():
        if len(labels) > 1:
            raise CliError(f"{path} has several {kind}s ({', '.join(labels)}); a kernel takes one of each. "
                           f"Fix: choose with FILE.py:NAME or FILE.py:SCORE_MOD,MASK_MOD.")
    score = next((t for _, t in traced if t.kind == SCORE_MOD), None)
    mask = next((t for _, t in traced if t.kind == MASK_MOD), None)
    head_dim = args.head_dim
    v_head_dim = args.v_head_dim or head_dim
    block_size = args.block_size if mask is not None else None
    target = "interpreter" if args.device == "cpu" else "cuda"
    try:
        if args.backward:  # captured tensors that require grad receive gradients, as in training
            from .attention import _grad_slots
            from .backends.triton_backward import make_backward_spec

            spec = make_backward_spec(score, mask, _DTYPES[args.dtype], head_dim, v_head_dim, block_size,
                                      dict(args.option), target, _grad_slots(score))
        else:
            spec = make_spec(score, mask, _DTYPES[args.dtype], head_dim, v_head_dim, block_size, dict(args.option),
                             target, args.lse)
    except (TypeError, ValueError) as e:
        raise CliError(str(e).removeprefix("flexc: ")) from None
    sys.stdout.write(source_for(spec))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexc", description="flexc: trace attention mods and show their kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="print the traced expression of the mods in FILE.py[:NAME]")
    p.add_argument("target", metavar="FILE.py[:NAME]")
    p.set_defaults(run=cmd_trace)
    p = sub.add_parser("show", help="print the Triton kernel generated for FILE.py[:NAME[,NAME]]")
    p.add_argument("target", metavar="FILE.py[:NAME[,NAME]]")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="query/key/value dtype (bfloat16)")
    p.add_argument("--head-dim", type=int, default=64, help="query/key head dim (64)")
    p.add_argument("--v-head-dim", type=int, default=None, help="value head dim (the head dim)")
    p.add_argument("--block-size", type=_block_size, default=(128, 128), help="BlockMask block size N or Q,KV (128)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the compiled kernel; cpu: the variant run by Triton's interpreter")
    p.add_argument("--lse", action="store_true", help="the variant that also writes the logsumexp")
    p.add_argument("--backward", action="store_true",
                   help="the backward kernel (dQ, dK, dV and gradients of captured tensors that require grad)")
    p.add_argument("--option", "-o", type=_option, action="append", default=[], metavar="NAME=VALUE",
                   help="a kernel option, e.g. -o BLOCK_M=64 -o num_warps=8")
    p.set_defaults(run=cmd_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flexc`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as e:
        print(f"flexc {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
