"""The ``flexc`` command.

``flexc trace FILE.py[:NAME]`` prints the traced expression of the mods in a file.
``flexc show FILE.py[:NAME[,NAME]]`` prints the Triton kernels a flex_attention call with them launches
(:func:`flexc.kernel_source` of the call its flags describe).
``flexc draw FILE.py[:NAME[,NAME]] --png OUT.png`` draws a mask_mod's BlockMask, or a score_mod's
values (masked by a mask_mod), with :func:`flexc.plot`.

``NAME`` is a score_mod or mask_mod defined in the file, or a Python expression evaluated in the
file's namespace (``"masks.py:generate_sliding_window(128)"``). Without ``NAME`` every top-level
function with a mod's signature is used (``show`` takes at most one of each kind).

Bad input ends in one message and a ``Fix:`` line (exit status 2), never a traceback; an error
inside flexc itself says so (exit status 1; ``FLEXC_TRACEBACK=1`` prints its traceback).

Arguments are parsed before torch is imported (about a second), so ``--help``, ``--version`` and
argument errors answer at once: torch and flexc's tracer are imported inside the commands.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import linecache
import os
import runpy
import sys
import sysconfig
import traceback
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .._version import __version__

if TYPE_CHECKING:
    import torch

    from ..mods.trace import TracedMod

# --dtype's spellings and the torch dtype each names
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "float32": "float32", "fp32": "float32", "float64": "float64", "fp64": "float64"}


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def _split_target(target: str) -> tuple[str, str | None]:
    path, sep, names = target.partition(".py:")
    if sep:
        return path + ".py", names
    return target, None


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise CliError(f"no such file: {path!r}. Fix: pass an existing FILE.py[:NAME], "
                       f"e.g. `flexc show masks.py:causal`.")


def _load_namespace(path: str) -> dict[str, Any]:
    _check_file(path)
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)  # the file may import its neighbours
    try:
        return runpy.run_path(path, run_name="__flexc_cli__")
    except SyntaxError as e:
        raise CliError(f"{path} does not import: SyntaxError at line {e.lineno}: {e.msg}. "
                       f"Fix: correct the file (python {path} shows the same error).") from None
    except (Exception, SystemExit) as e:  # whatever the user's module raised while running
        raise CliError(f"{path} does not import: {type(e).__name__}: {e}. "
                       f"Fix: make `python {path}` run without errors.") from None
    finally:
        sys.path.remove(directory)


def _is_mod(value: Any) -> bool:
    from ..mods.trace import TraceError, mod_kind

    if not callable(value) or isinstance(value, type):
        return False
    try:
        mod_kind(value)
    except (TraceError, TypeError):
        return False
    return True


def _resolve(namespace: dict[str, Any], path: str, name: str) -> Callable:
    """The mod ``name`` (a name or an expression) denotes in the file's namespace, else CliError."""
    if name.isidentifier():
        if name not in namespace:
            candidates = ", ".join(sorted(k for k, v in namespace.items() if _is_mod(v))) or "none"
            raise CliError(f"{path} defines no {name!r}. Mods defined there: {candidates}. "
                           f"Fix: name one of them, or define {name} in the file.")
        value = namespace[name]
    else:
        try:
            value = eval(name, namespace)  # noqa: S307 - the user's own file and expression
        except Exception as e:  # the user's expression: report whatever it raised
            raise CliError(f"evaluating {name!r} in {path} raised {type(e).__name__}: {e}. "
                           f"Fix: correct the expression (it is evaluated in {path}'s namespace).") from None
    if not _is_mod(value):
        raise CliError(f"{name!r} in {path} is not a score_mod (score, b, h, q_idx, kv_idx) or mask_mod "
                       f"(b, h, q_idx, kv_idx); got {type(value).__name__}. Fix: name a function taking "
                       f"those arguments.")
    return value


def _find_mods(path: str, names: str | None, keep_going: bool = False) -> list[tuple[str, Any]]:
    """``(label, function)`` for each requested mod, or every mod defined at the file's top level.

    With ``keep_going`` a name that does not resolve yields ``(label, CliError)`` instead of raising.
    """
    namespace = _load_namespace(path)
    if names:
        found: list[tuple[str, Any]] = []
        for name in (n.strip() for n in _split_names(names)):
            try:
                found.append((name, _resolve(namespace, path, name)))
            except CliError as e:
                if not keep_going:
                    raise
                found.append((name, e))
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


_FLEXC_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_at(error: BaseException) -> tuple[str, str]:
    """`` (file:line)`` and source text of the innermost frame of ``error`` outside flexc and torch."""
    import torch

    installed = (sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    libraries = tuple(os.path.abspath(d) + os.sep for d in (_FLEXC_DIR, os.path.dirname(torch.__file__), *installed))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not os.path.abspath(frame.filename).startswith(libraries) and not frame.filename.startswith("<"):
            return f" ({frame.filename}:{frame.lineno})", (frame.line or linecache.getline(frame.filename,
                                                                                        frame.lineno)).strip()
    return "", ""


def _trace_mod(label: str, fn: Callable) -> TracedMod:
    """``trace(fn)``; CliError for a mod that does not trace, or that raises when called on traced arguments."""
    from ..mods.trace import MASK_MOD, SCORE_MOD, TraceError, mod_kind, trace

    arguments = {SCORE_MOD: ("score", "b", "h", "q_idx", "kv_idx"), MASK_MOD: ("b", "h", "q_idx", "kv_idx")}
    try:
        return trace(fn)
    except TraceError as e:
        raise CliError(str(e)) from None
    except Exception as e:  # the user's mod raised while flexc called it
        site, line = _raised_at(e)
        kind = mod_kind(fn)
        raise CliError(f"cannot trace {kind} {label}: it raised {type(e).__name__}: {e}{site} when flexc "
                       f"called it with symbolic arguments."
                       + (f"\n    {line}" if line else "")
                       + f"\nFix: make {label} run on tensor arguments without raising (flexc calls it once, "
                       f"with symbolic {', '.join(arguments[kind])}).") from None


def _trace_all(mods: list[tuple[str, Callable]]) -> list[tuple[str, TracedMod]]:
    return [(label, _trace_mod(label, fn)) for label, fn in mods]


def _describe_buffers(t: TracedMod) -> list[str]:
    return [f"    {name}: {list(b.shape)} {str(b.dtype).removeprefix('torch.')}"
            for name, b in zip(t.buffer_names, t.buffers)]


def cmd_trace(args: argparse.Namespace) -> int:
    """Print every mod that traces; report each one that does not (exit 2) without losing the others."""
    path, names = _split_target(args.target)
    failed = 0
    for label, fn in _find_mods(path, names, keep_going=True):
        try:
            if isinstance(fn, CliError):
                raise fn
            t = _trace_mod(label, fn)
        except CliError as e:
            failed += 1
            print(f"flexc trace: {label}: {e}", file=sys.stderr)
            continue
        print(f"{label} ({t.kind}): {t}")
        lines = _describe_buffers(t)
        if lines:
            print("  captured tensors:")
            print("\n".join(lines))
    return 2 if failed else 0


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


def _int_at_least(flag: str, lowest: int, wording: str) -> Callable[[str], int]:
    """An argparse type: an int >= ``lowest``, named after its flag in errors."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {wording}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {lowest}, got {value}")
        return value
    return parse


def _positive(flag: str) -> Callable[[str], int]:
    """An argparse type: an int >= 1 (a head dim or a length)."""
    return _int_at_least(flag, 1, "a positive integer")


def _non_negative(flag: str) -> Callable[[str], int]:
    """An argparse type: an int >= 0 (a batch or head index)."""
    return _int_at_least(flag, 0, "an integer >= 0")


def _option(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--option takes NAME=VALUE (e.g. BLOCK_M=64), got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--option {name} needs an integer value, got {value!r}") from None


def _probability(text: str) -> float:
    """An argparse type for --dropout: a float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dropout takes a probability in [0, 1), got {text!r}. "
                                         f"Fix: pass e.g. --dropout 0.1") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--dropout must be in [0, 1), got {value}. Fix: pass e.g. --dropout 0.1 "
                                         f"(0 is no dropout; 1 would drop every probability)")
    return value


def cmd_show(args: argparse.Namespace) -> int:
    """Print what :func:`flexc.kernel_source` returns for the flex_attention call the flags describe.

    The call's tensors are uninitialised CPU stand-ins of its shapes (only shapes and dtypes reach the
    source), with BACKEND TRITON; ``--device cuda`` runs kernel_source under
    :func:`flexc.device.simulate` (``sm_90``), so it shows the CUDA source a GPU launches. ``--sinks``
    and ``--dropout P`` add flexc's ``sinks=`` (one logit per query head) and ``dropout_p=P``.
    """
    import torch

    from .. import device as gpu
    from ..backends import registry
    from ..call.kernel_source import kernel_source
    from ..call.plan import FallbackWarning
    from ..analysis.bounds import IndexRangeError
    from ..mods.trace import MASK_MOD, SCORE_MOD

    path, names = _split_target(args.target)
    mods = _find_mods(path, names)
    traced = _trace_all(mods)
    by_kind: dict[str, list[str]] = {}
    for label, t in traced:
        by_kind.setdefault(t.kind, []).append(label)
    for kind, labels in by_kind.items():
        if len(labels) > 1:
            raise CliError(f"{path} has several {kind}s ({', '.join(labels)}); a kernel takes one of each. "
                           f"Fix: choose with FILE.py:NAME or FILE.py:SCORE_MOD,MASK_MOD.")
    score = next((fn for (_, fn), (_, t) in zip(mods, traced) if t.kind == SCORE_MOD), None)
    mask = next((fn for (_, fn), (_, t) in zip(mods, traced) if t.kind == MASK_MOD), None)
    dtype = getattr(torch, _DTYPES[args.dtype])
    head_dim = args.head_dim
    v_head_dim = args.v_head_dim or head_dim
    options = _check_call(args, dtype, head_dim, v_head_dim)
    if args.block_size is not None and mask is None:
        raise CliError("--block-size sets the BlockMask's block size, but no mask_mod was given. "
                       "Fix: drop --block-size, or name a mask_mod too (FILE.py:SCORE_MOD,MASK_MOD).")
    q_len, heads = args.q_len, args.heads
    kv_len, kv_heads = args.kv_len or q_len, args.kv_heads or heads
    trains = args.training or args.backward
    q = torch.empty(1, heads, q_len, head_dim, dtype=dtype, requires_grad=trains)
    k = torch.empty(1, kv_heads, kv_len, head_dim, dtype=dtype, requires_grad=trains)
    v = torch.empty(1, kv_heads, kv_len, v_head_dim, dtype=dtype, requires_grad=trains)
    try:
        block_mask = _stand_in_block_mask(mask, args.block_size or (128, 128), q_len, kv_len) if mask else None
        call = dict(score_mod=score, block_mask=block_mask, enable_gqa=heads != kv_heads, return_lse=args.lse,
                    kernel_options={**options, "BACKEND": registry.TRITON}, dropout_p=args.dropout, backward=args.backward)
        sinks = torch.zeros(heads, requires_grad=trains) if args.sinks else None
        with gpu.simulate("sm_90" if args.device == "cuda" else None), torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)  # (the text says what runs instead)
            source = kernel_source(q, k, v, sinks=sinks, **call)
    except IndexRangeError as e:  # the call's lengths are the flags': say which
        raise CliError(f"{str(e).removeprefix('flex_attention: ')}\n(flexc show describes a call of --heads {heads}, --q-len {q_len}, --kv-len {kv_len}: "
                       f"pass the lengths the mods are written for.)") from None
    except (TypeError, ValueError) as e:
        raise CliError(str(e).removeprefix("flexc: ").removeprefix("flex_attention: ")) from None
    sys.stdout.write(source)
    return 0


def _stand_in_block_mask(mask_mod: Callable, block_size: tuple[int, int], q_len: int, kv_len: int) -> Any:
    """A BlockMask of ``mask_mod`` with partial and full block tables of the call's shape: every
    tile listed as partial, none full. The kernels' source depends on the tables' presence and
    block sizes, never on their contents; listing every tile makes the call's bounds check cover the
    whole grid, as it would for a mask that visits everything."""
    import torch

    from ..masks.block_mask import BlockMask

    n_q, n_kv = -(-q_len // block_size[0]), -(-kv_len // block_size[1])
    counts = torch.full((1, 1, n_q), n_kv, dtype=torch.int32)
    indices = torch.arange(n_kv, dtype=torch.int32).expand(1, 1, n_q, n_kv).contiguous()
    no_full = torch.zeros(1, 1, n_q, dtype=torch.int32)
    return BlockMask.from_kv_blocks(counts, indices, no_full, torch.zeros_like(indices), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def _check_call(args: argparse.Namespace, dtype: torch.dtype, head_dim: int, v_head_dim: int) -> dict:
    """Validate the call ``flexc show`` describes as flex_attention would; return its kernel_options."""
    import torch

    from ..call.validate import check_kernel_options, check_tensors

    # One-row stand-ins: flex_attention's own checks of dtypes and head dims, on no real data.
    q = torch.empty(1, 1, 1, head_dim, dtype=dtype)
    v = torch.empty(1, 1, 1, v_head_dim, dtype=dtype)
    try:
        check_tensors(q, q, v, False)
    except (TypeError, ValueError) as e:
        raise CliError(f"--head-dim {head_dim} / --v-head-dim {v_head_dim}: {str(e).removeprefix('flex_attention: ')}") from None
    try:
        options = check_kernel_options(dict(args.option))
    except (TypeError, ValueError) as e:
        raise CliError(f"-o/--option: {str(e).removeprefix('flex_attention: ')}") from None
    options.pop("BACKEND")  # the generated kernels are shown whatever backend a real call would pick
    return options


def cmd_draw(args: argparse.Namespace) -> int:
    """Draw the named mask_mod (its BlockMask) or score_mod (a heat map, masked by a mask_mod) to a PNG."""
    from ..masks.create import create_block_mask
    from ..mods.trace import MASK_MOD, SCORE_MOD
    from .plot import plot

    path, names = _split_target(args.target)
    mods = _find_mods(path, names)
    traced = _trace_all(mods)
    kinds = [t.kind for _, t in traced]
    if len(traced) > 2 or kinds.count(SCORE_MOD) > 1 or kinds.count(MASK_MOD) > 1:
        raise CliError(f"draw takes one mask_mod, one score_mod, or one of each; got "
                       f"{', '.join(label for label, _ in traced)}. Fix: choose with FILE.py:NAME[,NAME].")
    fns = {kind: fn for kind, (_, fn) in zip(kinds, mods)}
    if args.block_size is not None and MASK_MOD not in fns:
        raise CliError("--block-size sets the BlockMask's block size, but no mask_mod was given. "
                       "Fix: drop --block-size, or name a mask_mod too (FILE.py:SCORE_MOD,MASK_MOD).")
    for flag, value, size, sizes in (("--batch", args.batch, args.B, "-B"), ("--head", args.head, args.H, "-H")):
        if value >= size:
            raise CliError(f"{flag} {value} is out of range for {sizes} {size}. "
                           f"Fix: pass {flag} below {size}, or raise {sizes}.")
    folder = os.path.dirname(args.png) or "."
    if not os.path.isdir(folder):
        raise CliError(f"--png {args.png}: the folder {folder!r} does not exist. "
                       f"Fix: create it first (mkdir -p {folder}) or write to an existing folder.")
    if os.path.isdir(args.png):
        raise CliError(f"--png {args.png} is a folder, not a file name. "
                       f"Fix: pass a file, e.g. --png {os.path.join(args.png, 'mask.png')}.")
    _check_picture_format(args.png)
    q_len = args.q_len
    kv_len = args.kv_len or q_len
    try:
        block_mask = None
        if MASK_MOD in fns:
            block_mask = create_block_mask(fns[MASK_MOD], args.B, args.H, q_len, kv_len, device="cpu",
                                           BLOCK_SIZE=args.block_size or 128)
        if SCORE_MOD in fns:  # a heat map, blank where the mask_mod (if any) masks
            plot(fns[SCORE_MOD], args.B, args.H, q_len, kv_len, mask_mod=block_mask, batch=args.batch,
                 head=args.head, max_pixels=args.max_pixels, path=args.png, dpi=args.dpi)
        else:
            plot(block_mask, batch=args.batch, head=args.head, max_pixels=args.max_pixels, path=args.png,
                 dpi=args.dpi)
    except OSError as e:  # savefig: no permission, disk full
        raise CliError(f"--png {args.png}: cannot write it: {e.strerror or e}. "
                       f"Fix: choose a writable location.") from None
    except Exception as e:
        if isinstance(e, (ImportError, TypeError, ValueError)) and "Fix:" in str(e):
            raise CliError(str(e)) from None  # no matplotlib; flexc's checks of sizes and mods
        raise _evaluation_error(e, fns, q_len, kv_len) from None  # e.g. a table too short for --q-len
    print(f"wrote {args.png}")
    return 0


def _check_picture_format(png: str) -> None:
    """CliError unless matplotlib can write a file named ``png`` (its suffix picks the format)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # plot reports the missing matplotlib, with its fix
    suffix = os.path.splitext(png)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise CliError(f"--png {png}: matplotlib writes {', '.join('.' + f for f in sorted(formats))} files, "
                       f"got {'.' + suffix if suffix else 'no suffix'}. Fix: name the file e.g. "
                       f"{os.path.splitext(png)[0]}.png.")


def _evaluation_error(error: Exception, fns: dict[str, Callable], q_len: int, kv_len: int) -> CliError:
    """A CliError for a mod that traced but fails when evaluated at the drawn positions."""
    site, line = _raised_at(error)
    names = " and ".join(getattr(fn, "__name__", kind) for kind, fn in fns.items())
    return CliError(f"evaluating {names} over {q_len} x {kv_len} positions raised {type(error).__name__}: "
                    f"{error}{site}." + (f"\n    {line}" if line else "")
                    + f"\nFix: make the mods valid at every q_idx < --q-len {q_len} and kv_idx < --kv-len "
                    f"{kv_len} (a captured tensor indexed by q_idx needs --q-len entries), or draw a shorter "
                    f"sequence.")


class _Version(argparse.Action):
    """``--version``: flexc's and torch's versions, the latter from torch's installed metadata (no import)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None):
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"flexc {__version__} (torch {torch_version})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexc", description="flexc: trace attention mods and show their kernels.")
    parser.add_argument("--version", action=_Version, help="show flexc's and torch's versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="print the traced expression of the mods in FILE.py[:NAME]")
    p.add_argument("target", metavar="FILE.py[:NAME]")
    p.set_defaults(run=cmd_trace)
    p = sub.add_parser("show", help="print the Triton kernels a flex_attention call with FILE.py[:NAME[,NAME]] "
                                    "launches (flexc.kernel_source)")
    p.add_argument("target", metavar="FILE.py[:NAME[,NAME]]")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="query/key/value dtype (bfloat16)")
    p.add_argument("--head-dim", type=_positive("--head-dim"), default=64, help="query/key head dim (64)")
    p.add_argument("--v-head-dim", type=_positive("--v-head-dim"), default=None, help="value head dim (the head dim)")
    p.add_argument("--q-len", type=_positive("--q-len"), default=4096,
                   help="query rows L (4096); at most 16 shows decoding's split-KV and merge kernels")
    p.add_argument("--kv-len", type=_positive("--kv-len"), default=None, help="keys S (L)")
    p.add_argument("--heads", type=_positive("--heads"), default=1, help="query heads (1)")
    p.add_argument("--kv-heads", type=_positive("--kv-heads"), default=None,
                   help="key/value heads (the query heads; fewer is GQA, enable_gqa=True)")
    p.add_argument("--block-size", type=_block_size, default=None,
                   help="BlockMask block size N or Q,KV (128); needs a mask_mod")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the compiled kernels a GPU launches; cpu: the variant run by Triton's interpreter")
    p.add_argument("--lse", action="store_true", help="the call returns the logsumexp too (return_lse=True)")
    p.add_argument("--training", action="store_true",
                   help="the inputs require grad: the forward training launches (it writes the logsumexp)")
    p.add_argument("--backward", action="store_true",
                   help="the backward kernel training launches (dQ, dK, dV and gradients of captured tensors "
                        "that require grad)")
    p.add_argument("--option", "-o", type=_option, action="append", default=[], metavar="NAME=VALUE",
                   help="a kernel option, e.g. -o BLOCK_M=64 -o num_warps=8")
    p.add_argument("--sinks", action="store_true",
                   help="the call passes sinks= (one learned logit per query head; flexc's own keyword)")
    p.add_argument("--dropout", type=_probability, default=0.0, metavar="P",
                   help="the call passes dropout_p=P, in [0, 1) (flexc's own keyword; 0: none)")
    p.set_defaults(run=cmd_show)
    p = sub.add_parser("draw", help="draw FILE.py[:NAME[,NAME]] (a mask_mod's BlockMask, a score_mod's values) to a PNG")
    p.add_argument("target", metavar="FILE.py[:NAME[,NAME]]")
    p.add_argument("--png", required=True, metavar="OUT.png", help="the file to write")
    p.add_argument("--q-len", type=_positive("--q-len"), default=1024, help="query length Q_LEN (1024)")
    p.add_argument("--kv-len", type=_positive("--kv-len"), default=None, help="key length KV_LEN (Q_LEN)")
    p.add_argument("--block-size", type=_block_size, default=None, help="BlockMask block size N or Q,KV (128)")
    p.add_argument("-B", type=_positive("-B"), default=1, help="batches the mods see (1)")
    p.add_argument("-H", type=_positive("-H"), default=1, help="heads the mods see (1)")
    p.add_argument("--batch", type=_non_negative("--batch"), default=0, help="the batch drawn (0)")
    p.add_argument("--head", type=_non_negative("--head"), default=0, help="the head drawn (0)")
    p.add_argument("--max-pixels", type=_positive("--max-pixels"), default=1024,
                   help="cells per side at most; longer sequences show each cell's centre element (1024)")
    p.add_argument("--dpi", type=_positive("--dpi"), default=100, help="resolution of the PNG (100)")
    p.set_defaults(run=cmd_draw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flexc`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        _check_file(_split_target(args.target)[0])  # before a command imports torch
        return args.run(args)
    except CliError as e:
        print(f"flexc {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a flexc bug, not a user error: one line, and the traceback on request
        if os.environ.get("FLEXC_TRACEBACK"):
            raise
        print(f"flexc {args.command}: internal error: {type(e).__name__}: {e}\n"
              f"Fix: this is a flexc bug, not a problem with your input; please report it with the command "
              f"line (set FLEXC_TRACEBACK=1 to print the traceback).", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
