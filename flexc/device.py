"""The device seam: every host decision and call that differs between a GPU and the CPU.

No other flexc module calls ``torch.cuda``. The rest of flexc asks this module whether a device
takes the GPU's decisions (:func:`is_gpu`), what it is (:func:`facts`: compute capability, SM
count, shared memory per block), which target kernels are generated for (:func:`target`), and how
a kernel is launched (:func:`launch`: the device's context for a compiled kernel, the
interpreter's lock for an interpreted one).

``FLEXC_SIMULATE_DEVICE=sm_90`` (also ``sm_80``, ``sm_100``; read at import) or the
:func:`simulate` context manager makes CPU tensors take every host decision exactly as on that GPU:
AUTO picks the Triton backend, tiles, variants and guards are the GPU's, decoding dispatches as on
the GPU, and the launch code runs up to the kernel call; only the kernel itself runs in Triton's
interpreter (the source it runs is the interpreter variant of the one a GPU compiles). So every
CUDA-only branch executes in CI, on machines without a GPU.

Devices are also resolved and compared here, as torch means them (:func:`resolve`,
:func:`same_device`): ``"cuda"`` is the current CUDA device, ``"cpu:0"`` the CPU. :func:`usable`
checks a ``device=`` argument can hold tensors, and :func:`default_device` picks one when none is
given (the captured tensors', else a usable accelerator, else the CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from typing import Any, Iterable, Iterator, NamedTuple

import torch

from .compiled_launch import launches_of

SIMULATE_ENV = "FLEXC_SIMULATE_DEVICE"


class DeviceFacts(NamedTuple):
    """What host decisions need to know about a GPU."""

    name: str  # "sm_90"
    capability: int  # 90
    sm_count: int
    shared_memory: int  # bytes per block (the opt-in maximum)


# the GPUs simulation stands for: A100, H100, B200
SIMULATED = {
    "sm_80": DeviceFacts("sm_80", 80, 108, 166912),
    "sm_90": DeviceFacts("sm_90", 90, 132, 232448),
    "sm_100": DeviceFacts("sm_100", 100, 148, 232448),
}
_CPU = torch.device("cpu")


def _parse(name: str | None, where: str) -> DeviceFacts | None:
    if name is None or name == "":
        return None
    facts = SIMULATED.get(name.strip().lower())
    if facts is None:
        raise ValueError(f"flexc: {where} must be one of {', '.join(SIMULATED)}, got {name!r}. "
                         f"Fix: e.g. {SIMULATE_ENV}=sm_90, or leave it unset to run on the real device.")
    return facts


_state = {"simulated": _parse(os.environ.get(SIMULATE_ENV), SIMULATE_ENV)}


def simulated() -> DeviceFacts | None:
    """The GPU that CPU tensors stand for now, or None."""
    return _state["simulated"]


@contextlib.contextmanager
def simulate(name: str | None) -> Iterator[DeviceFacts | None]:
    """Within the block, CPU tensors take the host decisions of GPU ``name`` (``"sm_90"``...);
    ``None`` turns simulation off."""
    facts = _parse(name, "simulate(name)")
    previous = _state["simulated"]
    _state["simulated"] = facts
    try:
        yield facts
    finally:
        _state["simulated"] = previous


# ---- devices as torch means them ----------------------------------------------------------

def resolve(device: Any, where: str = "flexc") -> torch.device:
    """``device`` as torch means it, so that two spellings of one device compare equal: ``"cuda"``
    is the current CUDA device (``cuda:0`` when 0 is current, as under simulation or before CUDA is
    initialised), ``"cpu:0"`` is the CPU (a CPU tensor's device has no index). A tensor's own device
    is already resolved and returns at once. ``where`` names the function taking ``device`` in errors."""
    if type(device) is torch.device:  # (a tensor's device, on every call)
        if device == _CPU:  # (compared first: reading device.type builds a string)
            return _CPU
        if device.index is not None:
            return _CPU if device.type == "cpu" else device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise (ValueError if isinstance(device, (str, int)) else TypeError)(
            f"{where}: device must be a torch.device or a device string such as 'cuda', 'cuda:0' or 'cpu', got "
            f"{type(device).__name__} {device!r}. Fix: pass e.g. device='cuda'.") from None
    if device.type == "cpu":
        return _CPU
    if device.index is None and device.type != "meta":
        return torch.device(device.type, _current_index(device.type))
    return device


def _current_index(kind: str) -> int:
    """The current device index of accelerator type ``kind``; 0 where none is usable (the index
    CUDA makes current first, and the simulated GPU's)."""
    if kind == "cuda":
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    usable_accelerator = accelerator()
    return (torch.accelerator.current_device_index()
            if usable_accelerator is not None and usable_accelerator.type == kind else 0)


def same_device(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` name one device (``"cuda"`` and ``cuda:0`` when 0 is current;
    ``"cpu"`` and ``"cpu:0"``)."""
    return a == b or resolve(a) == resolve(b)


def accelerator() -> torch.device | None:
    """The current accelerator where one is usable, else None."""
    # check_available: a CUDA build of torch on a machine without a GPU has no usable accelerator
    # (without it torch names CUDA anyway, and the first tensor made there fails)
    return torch.accelerator.current_accelerator(check_available=True) if hasattr(torch, "accelerator") else None


def default_device(tensors: Iterable[torch.Tensor] = ()) -> torch.device:
    """Where to build when the caller names no device (``create_block_mask``, eager or compiled):
    the one device ``tensors`` (a mod's captured tensors) live on, else the current accelerator
    where one is usable, else the CPU (which, under simulation, stands for the GPU). 0-d CPU
    tensors go with any device (as in torch), so they do not decide."""
    tensors = list(tensors)
    devices = ({t.device for t in tensors if not (t.is_cpu and t.dim() == 0)}
               or {t.device for t in tensors})
    if len(devices) == 1:
        return resolve(devices.pop())
    usable_accelerator = accelerator()
    return resolve(usable_accelerator) if usable_accelerator is not None else _CPU


def usable(device: Any, where: str = "flexc") -> torch.device:
    """``device`` resolved, after checking that tensors can be made there: ``"cuda"`` on a torch
    without CUDA, or with no GPU visible, raises a ValueError saying so and what to pass instead,
    rather than torch's bare ``AssertionError: Torch not compiled with CUDA enabled`` later."""
    given, device = device, resolve(device, where)
    if device.type != "cuda" or torch.cuda.is_available():
        return device
    if not torch.compiler.is_compiling():  # (dynamo is not to trace the probe)
        try:  # a fake-tensor mode makes CUDA tensors without a GPU: torch itself decides
            torch.empty(0, device=device)
            return device
        except (AssertionError, RuntimeError):
            pass
    why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
           else f"no CUDA GPU is visible to this torch ({torch.__version__}; torch.cuda.is_available() is False)")
    simulating = (f" Under {SIMULATE_ENV} ({_state['simulated'].name} now), CPU tensors stand for the GPU: build "
                  f"on device='cpu'." if _state["simulated"] is not None else "")
    raise ValueError(f"{where}: device={str(given)!r}, but {why}. Fix: pass device='cpu' (or leave device unset: "
                     f"the captured tensors' device, else a usable accelerator, else the CPU).{simulating}")


def is_gpu(device: torch.device) -> bool:
    """Whether tensors on ``device`` take a GPU's host decisions (a CUDA device, or the CPU under
    simulation)."""
    if device == _CPU:  # (compared first: reading device.type builds a string)
        return _state["simulated"] is not None
    return device.type == "cuda"


def simulated_facts() -> "DeviceFacts | None":
    """The GPU that CPU tensors stand in for now (:func:`simulate`), or None."""
    return _state["simulated"]


def is_plain_cpu(device: torch.device) -> bool:
    """Whether ``device`` is the CPU taking the CPU's own decisions (not standing in for a GPU)."""
    return _state["simulated"] is None and device.type == "cpu"


def is_simulated(device: torch.device) -> bool:
    """Whether ``device`` is the CPU standing in for a GPU."""
    return _state["simulated"] is not None and device.type == "cpu"


def facts(device: torch.device) -> DeviceFacts:
    """Capability, SM count and shared memory of the GPU ``device`` is (or stands for)."""
    if is_simulated(device):
        return _state["simulated"]
    if device.type != "cuda":
        raise ValueError(f"flexc: device facts are asked of {device}, which is not a GPU. "
                         f"Fix: pass a CUDA device, or set {SIMULATE_ENV}=sm_90 to simulate one.")
    return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())


_facts_cache: dict[int, DeviceFacts] = {}


def _cuda_facts(index: int) -> DeviceFacts:
    found = _facts_cache.get(index)
    if found is None:
        props = torch.cuda.get_device_properties(index)
        capability = props.major * 10 + props.minor
        shared = getattr(props, "shared_memory_per_block_optin", 0) or 49152
        found = _facts_cache[index] = DeviceFacts(f"sm_{capability}", capability, props.multi_processor_count, shared)
    return found


def target(device: torch.device) -> str:
    """The target kernels are generated and configured for: ``"cuda"`` for a GPU (real or simulated),
    ``"interpreter"`` for the CPU."""
    if is_gpu(device):
        return "cuda"
    if device.type == "cpu":
        return "interpreter"
    raise ValueError(f"flexc: the Triton backend runs on CUDA tensors (compiled) or CPU tensors (interpreted), "
                     f"got tensors on {device}. Fix: move them with .cuda() or .cpu(), or use BACKEND='TORCH'.")


def runs_interpreted(device: torch.device) -> bool:
    """Whether a kernel launched for ``device`` runs in Triton's interpreter (the CPU, simulated or not)."""
    return device.type == "cpu"


def runnable(spec, device: torch.device):
    """The spec whose source runs for tensors on ``device``: for CPU tensors standing in for a GPU,
    the ``"cuda"`` spec's interpreter variant (same tiles and switches, operations the interpreter
    has), else ``spec`` itself."""
    if spec.target == "cuda" and runs_interpreted(device):
        return dataclasses.replace(spec, target="interpreter")
    return spec


def allows_tf32() -> bool:
    """Whether fp32 matmuls may use TF32 on the GPU (torch's global switch). Read from torch's C
    getter that ``torch.backends.cuda.matmul.allow_tf32`` calls: every eager call's signature asks,
    and the attribute's Python lookup cost ~20 us of a CPU training step (B=2, H=4, L=256, D=32)."""
    return bool(torch._C._get_cublas_allow_tf32())


# Triton's interpreter patches triton.language globally while a kernel runs: one at a time.
interpreter_lock = threading.Lock()


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Hold the interpreter, with its integer-overflow checks off while a kernel runs.

    The interpreter checks every 32-bit ``+ - *`` for overflow in int64 (a debugging aid the
    compiled kernel does not have); that was 45% of a backward launch at L = 72.
    """
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    with interpreter_lock:
        options = builder.options
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
        builder.create_fp_trunc = functools.partial(_fp_trunc_to_nearest, builder)
        try:
            yield
        finally:
            builder.options = options
            del builder.create_fp_trunc  # the class's own again


def _fp_trunc_to_nearest(builder, src, dst_type):
    """The interpreter's float narrowing, except fp32 -> bf16 rounds to nearest even as on the GPU.

    The interpreter drops the low 16 bits (rounds toward zero): every bf16 tile cast (the P and dS
    dot operands, the stored outputs and gradients) was biased toward zero, and bf16 gradients
    came out 2.5-6x further from float64 than torch's (rmse, L=128).
    """
    import numpy as np
    from triton.runtime import interpreter
    import triton.language as tl

    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return interpreter.InterpreterBuilder.create_fp_trunc(builder, src, dst_type)
    data = np.asarray(src.data, dtype=np.float32)
    bits = data.view(np.uint32)
    with np.errstate(over="ignore"):  # only NaN bit patterns wrap; they are set below
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    rounded = rounded.astype(np.uint16)
    nan = np.isnan(data)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)  # stays a (quiet) NaN
    return interpreter.TensorHandle(rounded, tl.bfloat16)


def launch(fn, grid: tuple, spec, device: torch.device, args: list, constants: dict, fixed: int = 0) -> None:
    """Launch the ``@triton.jit`` kernel ``fn`` of ``spec`` on ``grid`` for tensors on ``device``:
    compiled in the device's CUDA context (through its compiled launcher once a launch of the same
    specialization compiled it: :mod:`flexc.compiled_launch`), or in Triton's interpreter for CPU
    tensors (after :func:`check_launch`: a simulated GPU refuses what the real one would). ``fixed``:
    how many of the last ``args`` are a plan's scalars, the same at its every launch (no tensor among
    them: checked and keyed faster)."""
    check_launch(grid, spec, device, args, fixed)
    if runs_interpreted(device):
        with interpreting():
            fn[grid](*args, **constants, **launch_options(spec, device))
        return
    with torch.cuda.device(device):  # (later launches of a specialization skip Triton's argument binding)
        launches_of(fn).launch(fn, grid, args, constants, launch_options(spec, device),
                               device.index if device.index is not None else _current_index("cuda"), fixed)


def launch_options(spec, device: torch.device) -> dict:
    """The compiled launch's ``num_warps``/``num_stages`` (a simulated launch passes them too: the
    interpreter ignores them, and the call is the GPU's)."""
    if runs_interpreted(device) and spec.target != "cuda":
        return {}
    return {"num_warps": spec.num_warps, "num_stages": spec.num_stages}


def stream_token(device: torch.device):
    """Which stream work for ``device`` is queued on now: what a cache of device tensors keys them by.

    The rule for every value flexc computes on the device and keeps between calls (compacted
    BlockMask tables, :mod:`flexc.mods.derived`'s replays, an index tensor, any memo value that holds
    device tensors): it is served only to calls whose ``stream_token`` equals the one it was made
    under, and made again otherwise. So the kernels that read it are queued on the stream that
    wrote it (no event or ``record_stream`` needed: CUDA orders one stream's work, and a freed
    value's memory is reused only by its own stream's allocations). While the current stream is
    being captured into a CUDA graph the token is a new object each time: a value made during
    capture is the graph's (its memory holds what the graph's replays write) and is never served
    to another call, and values made outside the capture are made again inside it, so the graph's
    replays recompute them from their sources' contents then.

    ``None`` for CPU tensors (simulated or not: one stream), where every cache hits as before. One
    current-stream query on CUDA, read from torch's C getter (a ``torch.cuda.Stream`` object costs
    microseconds to build at every call).
    """
    if device.type == "cpu":  # (runs_interpreted, read inline: a decoding step asks twice)
        return None
    if torch._C._cuda_isCurrentStreamCapturing():  # (torch.cuda.is_current_stream_capturing's C call)
        return _CaptureToken()  # equal to nothing else: never served again
    # (stream id, device index, device type): what torch.cuda.current_stream(device) reads before
    # wrapping it in a Stream object, and what two Streams compare by; asked on every GPU call
    return torch._C._cuda_getCurrentStream(device.index if device.index is not None else _current_index("cuda"))


class _CaptureToken:
    """The stream token of work being captured into a CUDA graph (see :func:`keeps`)."""


def keeps(token) -> bool:
    """Whether a value made under stream ``token`` may be kept in a cache. Not while a CUDA graph is
    being captured: the value's memory is the graph's pool, and torch.compile's CUDA graphs
    (mode="reduce-overhead") refuse pool memory that outlives the capture untracked ("tensor(s) in
    the cudagraph pool not tracked as outputs", seen on an H200)."""
    return not isinstance(token, _CaptureToken)


# ---- what CUDA enforces and Triton's interpreter does not ----------------------------------
# Checked for real and simulated GPUs alike, so a CPU run under FLEXC_SIMULATE_DEVICE fails where a
# GPU would (docs/architecture.md, "What the simulated GPU enforces").

# torch._assert_async on CUDA refuses a message of 255 characters or more
ASSERT_MESSAGE_LIMIT = 254
# a CUDA grid's y and z extents (x may reach 2**31 - 1)
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)``: the stream stops with ``message`` where
    ``condition`` is False, without a sync. On a GPU (real or simulated) ``message`` must fit
    :data:`ASSERT_MESSAGE_LIMIT` (shorten it with :func:`fit_message`): CUDA raises otherwise, here too."""
    if len(message) > ASSERT_MESSAGE_LIMIT and is_gpu(condition.device):
        raise RuntimeError(f"Message length must be smaller than {ASSERT_MESSAGE_LIMIT + 1} (got {len(message)} "
                           f"characters: {message[:80]!r}...): torch._assert_async on CUDA refuses it")
    torch._assert_async(condition, message)


def fit_message(required: str, *optional: str, limit: int = ASSERT_MESSAGE_LIMIT) -> str:
    """``required`` (cut to ``limit`` characters, ending in ``...``, if it is longer) followed by each of
    ``optional`` that still fits, in order: a device-side assert message CUDA accepts."""
    text = required if len(required) <= limit else required[:limit - 3] + "..."
    for extra in optional:
        if len(text) + len(extra) <= limit:
            text += extra
    return text


def check_launch(grid: tuple, spec, device: torch.device, args: list, fixed: int = 0) -> None:
    """Raise where a GPU launch of ``spec`` on ``grid`` with ``args`` would fail: a grid extent past
    CUDA's limits, a tensor that is not on ``device`` (a host tensor handed to a GPU kernel), or, on
    a simulated GPU, more shared memory than the simulated one has per block (Triton's
    ``OutOfResources``, as a compile for the real one raises; :func:`shared_memory_estimate`).
    ``fixed``: how many of the last ``args`` are a plan's scalars (no tensor there to check)."""
    if not is_gpu(device) or spec.target != "cuda":
        return
    for axis, (extent, limit) in enumerate(zip(grid if isinstance(grid, tuple) else (), GRID_LIMITS)):
        if extent > limit:
            raise ValueError(f"flexc: a launch of {type(spec).__name__} needs a grid of {tuple(grid)}, but CUDA "
                             f"allows at most {limit} programs along axis {'xyz'[axis]}. Fix: split the call "
                             f"(e.g. the batch into chunks) so that each launch stays within the limit.")
    for i, a in enumerate(args[:len(args) - fixed] if fixed else args):
        if isinstance(a, torch.Tensor) and a.device != device and not same_device(a.device, device):
            raise ValueError(f"flexc: kernel argument {i} of a {type(spec).__name__} launch is a tensor on "
                             f"{a.device} {tuple(a.shape)}, but the kernel runs on {device}: a GPU kernel cannot "
                             f"read it. Fix: create that tensor on {device}.")
    if is_simulated(device):
        needed = shared_memory_estimate(spec)
        limit = _state["simulated"].shared_memory
        if needed is not None and needed > limit:
            from triton.runtime.errors import OutOfResources
            raise OutOfResources(needed, limit, "shared memory")


def shared_memory_estimate(spec) -> int | None:
    """Bytes of shared memory a launch of ``spec`` needs at least (its ``shared_memory()``), or None
    where flexc has no estimate (kernels other than the forward and decode): what the simulation
    cannot see is listed in docs/architecture.md."""
    estimate = getattr(spec, "shared_memory", None)
    return estimate() if callable(estimate) else None
