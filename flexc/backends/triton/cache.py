"""The Triton backend's kernel cache: generated sources written to disk, imported, kept in one LRU.

One cache holds the forward, backward, decode and merge kernels, keyed by their spec's key (the
mods' *structure*, tiles and variant flags): new captured-tensor values, sequence lengths and
batch sizes reuse a cached kernel. CPU tensors import the source under Triton's interpreter,
switched on with ``triton.knobs.runtime.interpret`` while the module is imported (no environment
variable). :func:`cache_info` counts hits and misses; :func:`cache_clear` frees everything.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import linecache
import os
import sys
import tempfile
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from ... import device as gpu
from ...codegen.spec import KernelSpec, generate

AnySpec = KernelSpec  # a spec of any kernel kind (its generator registered for its type: codegen.spec.generates)


class CacheInfo(NamedTuple):
    """Kernel cache counters: ``misses`` is how many kernels were generated and compiled."""

    hits: int
    misses: int
    size: int


class Kernel(NamedTuple):
    """A cached kernel: what the generator returned, the imported function, and its source file."""

    generated: Any  # GeneratedForward, GeneratedBackward, GeneratedDecode or GeneratedMerge
    fn: Any  # the imported @triton.jit kernel (an InterpretedFunction under the interpreter)
    path: str


# kernel number (kernel_key) -> kernel, least recently used first; at most _limit["kernels"] entries
_cache: "OrderedDict[int, Kernel]" = OrderedDict()
# (spec key, device part) -> its kernel number: the cache is keyed by small ints, so a warm launch's
# lookup and LRU touch hash an int instead of a spec's key (two hashes of a few dozen fields a hit).
# A number stands for its key for the whole process (plans keep numbers across cache_clear): one
# small entry per spec ever launched
_numbers: dict[tuple, int] = {}
_next_number = itertools.count()
_limit = {"kernels": int(os.environ.get("FLEXC_KERNEL_CACHE_SIZE", "64"))}
# (capability, spec key) -> the spec that replaced it on GPUs of that capability (smaller tiles after
# running out of resources, or plain loads after a TMA variant failed)
_fallbacks: dict[tuple, Any] = {}
_stats = {"misses": 0, "hit reads": 0}
# hits are counted by next() of a counter (one atomic step under the GIL, so a hit takes no lock) and read
# by advancing it too: cache_info subtracts its own reads
_hits = itertools.count()
_cache_lock = threading.Lock()


def cache_info() -> CacheInfo:
    """``CacheInfo(hits, misses, size)`` of the generated-kernel cache (a miss generates and compiles)."""
    with _cache_lock:
        hits = next(_hits) - _stats["hit reads"]
        _stats["hit reads"] += 1
        return CacheInfo(hits, _stats["misses"], len(_cache))


def cache_clear() -> None:
    """Drop every cached kernel and reset the counters: their modules leave ``sys.modules`` and the
    source files this process wrote are deleted, so the memory is freed."""
    global _hits
    with _cache_lock:
        while _cache:
            _release(_cache.popitem(last=False)[1])
        _fallbacks.clear()
        _stats["misses"] = _stats["hit reads"] = 0
        _hits = itertools.count()


def cache_limit(kernels: int | None = None) -> int:
    """The most kernels the cache keeps (least recently used ones are dropped first); with
    ``kernels``, set it and return the previous limit. Default 64, or ``$FLEXC_KERNEL_CACHE_SIZE``."""
    with _cache_lock:
        previous = _limit["kernels"]
        if kernels is not None:
            if isinstance(kernels, bool) or not isinstance(kernels, int) or kernels < 1:
                raise ValueError(f"cache_limit: kernels must be a positive int, got {kernels!r}. Fix: pass e.g. 64.")
            _limit["kernels"] = kernels
            _evict()
        return previous


def cached_kernels() -> list[Kernel]:
    """The cached kernels, least recently used first."""
    with _cache_lock:
        return list(_cache.values())


def _evict() -> None:
    """Drop least recently used kernels beyond the limit (the caller holds _cache_lock)."""
    while len(_cache) > _limit["kernels"]:
        _release(_cache.popitem(last=False)[1])


def _release(kernel: Kernel) -> None:
    """Forget a dropped kernel's module and file, unless another cached kernel shares them."""
    if any(other.path == kernel.path for other in _cache.values()):
        return
    name = os.path.splitext(os.path.basename(kernel.path))[0]
    if getattr(sys.modules.get(name), "__file__", None) == kernel.path:
        del sys.modules[name]
    linecache.cache.pop(kernel.path, None)
    try:
        os.remove(kernel.path)
    except OSError:  # already gone (another process cleared it): nothing to free
        pass


def cache_dir() -> str:
    """Where generated sources are written: ``$FLEXC_CACHE_DIR``, else ``~/.cache/flexc/kernels``."""
    candidates = [os.environ.get("FLEXC_CACHE_DIR"), os.path.join(os.path.expanduser("~"), ".cache", "flexc", "kernels"),
                  os.path.join(tempfile.gettempdir(), f"flexc-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}")]
    for path in candidates:
        if not path:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError("flexc: no writable directory for generated kernels; set FLEXC_CACHE_DIR to one.")


# ---- importing generated source -------------------------------------------------------------

def require_triton() -> Any:
    """The ``triton`` module, or an ImportError saying how to install it.

    Triton is optional (the ``flexc[triton]`` extra): tracing, block masks, the CPU path and
    kernel *source* need only torch; importing and running a generated kernel needs Triton.
    """
    try:
        import triton
    except ImportError as e:
        raise ImportError("flexc: running a generated Triton kernel needs the `triton` package, which is not "
                          "installed. Fix: pip install 'flexc[triton]' (or pip install triton), or use "
                          "kernel_options={'BACKEND': 'TORCH'} on CPU tensors.") from e
    return triton


def _file_holds(path: str, text: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == text
    except OSError:
        return False


def import_source(source: str, target: str) -> tuple[Any, str]:
    """Write ``source`` to the cache directory and import it as a module; return it and its path.

    With ``target="interpreter"`` its ``@triton.jit`` functions run on CPU tensors.
    """
    require_triton()  # a clear ImportError before anything is written
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"flexc_kernel_{digest}"
    path = os.path.join(cache_dir(), name + ".py")
    if not _file_holds(path, source):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    # Triton reads a @triton.jit function's source when it compiles or interprets it, maybe long after
    # the import, through linecache. Another process sharing the directory may delete the file by then
    # (its cache_clear): the lines are kept here, with no modification time, so linecache serves them
    # rather than look for the file
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    try:
        module = _exec_module(name, path, target)
    except FileNotFoundError:  # another process's cache_clear removed the file just now
        with open(path, "w") as f:
            f.write(source)
        module = _exec_module(name, path, target)
    sys.modules.setdefault(name, module)
    return module, path


def _exec_module(name: str, path: str, target: str) -> Any:
    triton = require_triton()

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if target == "interpreter":
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "scope"):
            raise RuntimeError(f"flexc: running the Triton kernel on CPU needs triton.knobs.runtime (Triton >= 3.4), "
                               f"found Triton {triton.__version__}. Fix: upgrade Triton, or use BACKEND='TORCH' on CPU.")
        with runtime.scope():
            runtime.interpret = True  # @triton.jit now builds InterpretedFunctions
            spec.loader.exec_module(module)
    else:
        spec.loader.exec_module(module)
    return module


# ---- kernels by spec -----------------------------------------------------------------------

def device_key(spec: AnySpec, device: torch.device | None) -> tuple:
    """What the device adds to ``spec``'s kernel cache key: for a ``"cuda"`` spec the compute capability
    of the GPU ``device`` is (or stands for, :func:`flexc.device.simulate`), and ``"interpreted"`` where
    CPU tensors run its interpreter variant; nothing for the interpreter's own specs or without a device.
    Kernels, and the fallbacks that replace them (:func:`remember_fallback`), are kept per capability:
    what one GPU cannot hold another may."""
    if device is None or spec.target != "cuda":
        return ()
    capability = gpu.facts(device).capability if gpu.is_gpu(device) else None
    return (capability, "interpreted") if gpu.runs_interpreted(device) else (capability,)


def kernel_key(spec: AnySpec, device: torch.device | None = None) -> int:
    """The cache key of ``spec``'s kernel launched for tensors on ``device`` (:func:`get_kernel`): the
    number standing for its spec key and :func:`device_key`."""
    full = _full_key(spec, device_key(spec, device))
    number = _numbers.get(full)
    if number is None:
        with _cache_lock:
            number = _numbers.setdefault(full, next(_next_number))
    return number


def _full_key(spec: AnySpec, part: tuple) -> tuple:
    """``spec``'s key with a :func:`device_key` part (the spec's own key where the part is empty)."""
    return (spec.key(), *part) if part else spec.key()


def get_kernel(spec: AnySpec, device: torch.device | None = None, key: tuple | None = None) -> Kernel:
    """The compiled kernel for ``spec`` (any kind) launched for tensors on ``device``: from the
    cache, or generated, written and imported. CPU tensors standing in for a GPU
    (:func:`flexc.device.simulate`) run the interpreter variant of a ``"cuda"`` spec, cached apart
    from the compiled one; each GPU capability has its own entries (:func:`device_key`). ``key``:
    :func:`kernel_key` of ``spec`` and ``device``, when the caller keeps it (a launch made once per
    call signature)."""
    if key is None:
        key = kernel_key(spec, device)
    kernel = _cache.get(key)
    if kernel is not None:  # a hit takes no lock: each step is atomic under the GIL (a decoding step makes two)
        try:
            _cache.move_to_end(key)  # (the LRU order sees the use)
        except KeyError:  # dropped by another thread since: this call still launches it
            pass
        next(_hits)
        return kernel
    with _cache_lock:
        kernel = _cache.get(key)
        if kernel is not None:  # (made by another thread meanwhile)
            _cache.move_to_end(key)
            next(_hits)
            return kernel
        runs = gpu.runnable(spec, device) if device is not None else spec  # (a miss only: a new spec per call)
        generated = generate(runs)
        module, path = import_source(generated.source, runs.target)
        kernel = Kernel(generated, getattr(module, generated.kernel_name), path)
        _cache[key] = kernel
        _stats["misses"] += 1
        _evict()
        return kernel


def _fallback_key(spec: AnySpec, device: torch.device | None) -> tuple:
    # per capability only: a simulated sm_80 and a real one share what they cannot hold
    return (device_key(spec, device)[:1], spec.key())


def resolve_fallback(spec: AnySpec, device: torch.device | None = None) -> AnySpec:
    """``spec``, or the configuration that replaced it on ``device``'s GPU (its capability) after a launch
    ran out of resources or its TMA variant failed (:mod:`flexc.backends.triton.retry`)."""
    with _cache_lock:
        return _fallbacks.get(_fallback_key(spec, device), spec)


def remember_fallback(spec: AnySpec, smaller: AnySpec, device: torch.device | None = None) -> None:
    """Launch ``smaller`` from now on wherever ``spec`` (or a spec it replaced) would run on a GPU of
    ``device``'s capability; other capabilities keep ``spec``."""
    key = _fallback_key(spec, device)
    with _cache_lock:
        for replaced_key, replaced in list(_fallbacks.items()):
            if replaced_key[0] == key[0] and replaced.key() == spec.key():
                _fallbacks[replaced_key] = smaller
        _fallbacks[key] = smaller


def generated_for(spec: AnySpec, device: torch.device | None = None) -> Any:
    """The generated kernel (``.source``, ``.kernel_name``) that runs for ``spec`` on ``device``: the
    cached one if compiled already (so a kernel shared by mods of one structure shows its first mods'
    names), else generated now; compiles nothing. A spec replaced on ``device``'s GPU after running
    out of resources gives its replacement. For CPU tensors standing in for a GPU, the source a GPU
    compiles (not its interpreter variant)."""
    spec = resolve_fallback(spec, device)
    part = device_key(spec, device)[:1]  # the compiled kernel's entry, never the interpreted variant's
    with _cache_lock:
        number = _numbers.get(_full_key(spec, part))
        kernel = _cache.get(number) if number is not None else None
    return kernel.generated if kernel is not None else generate(spec)


def source_for(spec: AnySpec, device: torch.device | None = None) -> str:
    """The source that runs for ``spec`` on ``device`` (the cached one if compiled already); compiles nothing."""
    return generated_for(spec, device).source


__all__ = ["CacheInfo", "Kernel", "cache_clear", "cache_dir", "cache_info", "cache_limit", "cached_kernels",
           "device_key", "kernel_key", "generate", "generated_for", "get_kernel", "import_source", "remember_fallback", "require_triton",
           "resolve_fallback", "source_for"]
