"""Bounds checks of a mod's lookups and integer divisions, before anything evaluates it.

A mod is evaluated over the index domain ``b < B, h < H, q_idx < Q_LEN, kv_idx < KV_LEN``, or, in
a call with a BlockMask, over the tiles the BlockMask lists (partial and full): the kernels and the
CPU block path never evaluate an unlisted tile, as torch's compiled kernels do not. A lookup
``table[i]`` must have ``-n <= i < n`` there (a negative index counts from the end, as in torch)
and an integer divisor must never be 0. An index only unlisted tiles would take is no error (a
paged KV cache's pages that a batch row does not own: torch's ``PagedAttention``). :func:`check_mod` proves this from the IR with the interval analysis of
:mod:`flexc.analysis.ranges` (affine indices, lookups of lookups, ``//``, ``%``, clamps: no per-element
work), and evaluates only the index expressions it cannot prove, exactly, over the domain. A
violation raises :class:`IndexRangeError` naming the mod, the line, the tensor and the index
range, on every backend alike; the generated kernels therefore never read out of bounds.
"""
from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from ..mods import ir
from ..device import ASSERT_MESSAGE_LIMIT, assert_async, fit_message, is_gpu
from ..mods.evaluate import evaluate, index_grid
from ..mods.lifted_cells import structure
from .ranges import domain_bounds
from ..mods.trace import TracedMod
from ..versions import contents_states, pinned

# Passed checks: (root, sizes, buffer shapes) -> None when the proof holds for any captured values,
# else the contents states of the captured tensors it read (pinned), which must still match.
_proven: "OrderedDict[tuple, tuple | None]" = OrderedDict()
_proven_lock = threading.Lock()
_MAX_PROVEN = 512
# (graph, captured tensors' shapes) -> its checks: the same for every TracedMod around that graph
# (eager calls reuse traces through flexc.mods.trace_cache; a compiled call rebuilds its TracedMod
# around the same graph every call, see flexc.mods.mod_key)
_checks_memo: "OrderedDict[tuple, list]" = OrderedDict()
_MAX_CHECKS = 512
# Exact checks evaluate at most this many index values at a time.
_CHUNK = 1 << 22


class IndexRangeError(IndexError, ValueError):
    """A mod indexes a captured tensor out of range, or divides an integer by zero."""


def check_mod(traced: TracedMod | None, B: int, H: int, Q_LEN: int, KV_LEN: int, where: str,
              block_mask: Any = None) -> None:
    """Raise :class:`IndexRangeError` if ``traced`` reads a captured tensor out of range or divides
    by zero anywhere in ``[B, H, Q_LEN, KV_LEN]`` (only in the tiles ``block_mask`` lists, when
    given); ``where`` names the caller in the message."""
    if traced is None:
        return
    shapes = tuple(tuple(t.shape) for t in traced.buffers)
    template = structure(traced)[0]
    if template is not traced.root and not _checks_of(template, traced, shapes):
        # a decoding step's new offset: the template has no lookup or division, so neither has this
        # graph (substituted values are never indices or divisors, flexc.mods.lifted_cells)
        return
    checks = _checks_of(traced.root, traced, shapes)
    if not checks:
        return
    sizes = {"b": B, "h": H, "q_idx": Q_LEN, "kv_idx": KV_LEN}
    key = (traced.root, B, H, Q_LEN, KV_LEN, shapes)
    device = traced.buffers[0].device if traced.buffers else torch.device("cpu")
    visited = _Visited(block_mask) if block_mask is not None else None
    watched = traced.buffers + (visited.tables if visited is not None else ())
    with _proven_lock:
        proven_before = key in _proven
        if proven_before:
            values = _proven[key]
            if values is None or values == contents_states(traced.buffers) or (
                    visited is not None and values == contents_states(watched)):
                _proven.move_to_end(key)
                return
    if proven_before and is_gpu(device):
        # new captured values (a decoding step's position): the checks that read them run on the
        # device, asserted there, instead of reading the values on the host (a sync per step)
        # (over the listed tiles only where the host's proof needed them: a full-grid check costs
        # a grid's worth of device work per call, the plain one only the inputs an index reads)
        restricted_before = values is not None and len(values) > len(traced.buffers)
        for check in checks:
            if any(n.op == "load" for n in check[2].walk()):
                _assert_on_device(traced, check, sizes, where, visited if restricted_before else None)
        return
    bounds = domain_bounds(traced, sizes, device)
    data_dependent = restricted = False
    for check in checks:
        expr = check[2]
        data_dependent |= any(n.op == "load" for n in expr.walk())
        if not _proven_by(bounds.get(id(expr)), check):
            restricted |= _exact_check(traced, check, sizes, where, visited)
    # a proof that read captured values holds while those very tensors are unchanged; one that
    # needed the listed tiles, while the BlockMask's tables are unchanged too
    values = None
    if data_dependent or restricted:
        kept = watched if restricted else traced.buffers
        values = pinned(contents_states(kept), kept)
    with _proven_lock:
        _proven[key] = values
        while len(_proven) > _MAX_PROVEN:
            _proven.popitem(last=False)


def has_checks(traced: TracedMod | None) -> bool:
    """Whether ``traced`` has a lookup or an integer division for :func:`check_mod` to check (whose
    verdict may then depend on captured values: checked again at each call)."""
    if traced is None:
        return False
    return bool(_checks_of(traced.root, traced, tuple(tuple(t.shape) for t in traced.buffers)))


def _checks_of(root: ir.Node, traced: TracedMod, shapes: tuple) -> list[tuple]:
    """:func:`_checks` of the graph ``root`` over ``traced``'s captured tensors, memoized."""
    checks = _checks_memo.get((root, shapes))
    if checks is None:
        checks = _checks_memo[(root, shapes)] = _checks(root, traced)
        while len(_checks_memo) > _MAX_CHECKS:
            _checks_memo.popitem(last=False)
    return checks


def _checks(root: ir.Node, traced: TracedMod) -> list[tuple]:
    """``(node, dim, expr, size)`` per computed index (size of that dimension) and per divisor
    (dim and size None), operands before users so an inner lookup is checked first."""
    checks = []
    for node in root.walk():
        if node.op == "load":
            tensor = traced.buffers[node.args[0].attr[0]]
            for dim, index in enumerate(node.args[1:]):
                # constant indices were checked by the tracer; a reduction's axis runs over the dimension itself
                if index.op not in ("const", "axis"):
                    checks.append((node, dim, index, tensor.shape[dim]))
        elif node.op in ("floordiv", "mod") and node.kind != ir.FLOAT and node.args[1].op != "const":
            checks.append((node, None, node.args[1], None))
    return checks


def _proven_by(bound: Any, check: tuple) -> bool:
    lo, hi = getattr(bound, "lo", None), getattr(bound, "hi", None)
    if lo is None:  # a bool divisor has a BoolRange: 0 unless it is surely True
        must = getattr(bound, "must", False)
        return check[1] is None and bool(must)
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    size = check[3]
    if size is None:
        return lo > 0 or hi < 0
    return lo >= -size and hi <= size - 1


class _Visited:
    """The elements a call evaluates: those of the tiles a BlockMask lists (partial or full)."""

    def __init__(self, block_mask: Any):
        self.block_mask = block_mask
        self.tables = tuple(t for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                                        block_mask.full_kv_num_blocks, block_mask.full_kv_indices) if t is not None)
        self._tiles = None

    def elements(self, q0: int, rows: int, sizes: dict, device: torch.device) -> torch.Tensor:
        """bool ``[B or 1, H or 1, rows, KV_LEN]``: whether query rows ``q0 ...`` meet a listed tile."""
        if self._tiles is None:
            tiles = self.block_mask.to_dense().to(device=device, dtype=torch.bool)
            self._tiles = tiles.view(*([1] * (4 - tiles.dim())), *tiles.shape)
        q_block, kv_block = self.block_mask.BLOCK_SIZE
        n_q, n_kv = self._tiles.shape[-2:]
        q_tiles = torch.arange(q0, q0 + rows, device=device) // q_block
        kv_tiles = torch.arange(sizes["kv_idx"], device=device) // kv_block
        inside = (q_tiles < n_q)[:, None] & (kv_tiles < n_kv)[None, :]
        picked = self._tiles[..., q_tiles.clamp(max=n_q - 1), :][..., kv_tiles.clamp(max=n_kv - 1)]
        return picked & inside


def _exact_check(traced: TracedMod, check: tuple, sizes: dict, where: str, visited: _Visited | None) -> bool:
    """Evaluate ``check``'s expression over the domain (only the inputs it reads) and raise on the
    first value out of range; where the domain has one and ``visited`` is given, check again over
    the elements it holds and raise only there. True when only that restriction kept it from raising."""
    try:
        _exact_pass(traced, check, sizes, where, None)
        return False
    except IndexRangeError:
        if visited is None:
            raise
    _exact_pass(traced, check, sizes, where, visited)
    return True


def _exact_pass(traced: TracedMod, check: tuple, sizes: dict, where: str, visited: _Visited | None) -> None:
    node, dim, expr, size = check
    reads = ir.inputs_read(expr)
    low = high = None
    first = None
    for q0, values in _values(traced, expr, sizes, full=visited is not None):
        bad = (values == 0) if size is None else (values < -size) | (values >= size)
        seen = values
        if visited is not None:
            inside = visited.elements(q0, values.shape[2], sizes, values.device).expand_as(values)
            bad, seen = bad & inside, values[inside]
            if seen.numel() == 0:
                continue
        chunk_low, chunk_high = int(seen.min()), int(seen.max())
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
        if first is None and bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            first = (int(values[tuple(at)]), at[0], at[1], at[2] + q0, at[3])
    if first is not None:
        raise IndexRangeError(_message(traced, check, sizes, where, low, high, first, reads))


def _values(traced: TracedMod, expr: ir.Node, sizes: dict, full: bool = False):
    """``(first query row, int64 values of expr)`` over the domain, in chunks of at most ``_CHUNK``
    values (only the inputs ``expr`` reads span their extent, or all of them when ``full``; the
    others are 1)."""
    reads = ir.inputs_read(expr)
    extents = {name: (sizes[name] if name in reads or full else 1) for name in ("b", "h", "q_idx", "kv_idx")}
    device = traced.buffers[0].device if traced.buffers else torch.device("cpu")
    per_row = extents["b"] * extents["h"] * extents["kv_idx"]
    rows = max(1, min(extents["q_idx"], _CHUNK // max(1, per_row)))
    for q0 in range(0, extents["q_idx"], rows):
        n = min(rows, extents["q_idx"] - q0)
        grid = index_grid(extents["b"], extents["h"], n, extents["kv_idx"], device, q_start=q0)
        values = evaluate(expr, buffers=traced.buffers, **{k: v for k, v in grid.items() if k in reads})
        values = torch.as_tensor(values, device=device).to(torch.int64)
        yield q0, values.expand(extents["b"], extents["h"], n, extents["kv_idx"])


def _assert_on_device(traced: TracedMod, check: tuple, sizes: dict, where: str, visited: _Visited | None) -> None:
    """:func:`_exact_check` without a sync: the range test reduced on the device and asserted there
    (``torch._assert_async``), over the elements ``visited`` holds (all, when None); the message
    cannot quote the offending value."""
    node, dim, expr, size = check
    bad = None
    for q0, values in _values(traced, expr, sizes, full=visited is not None):
        out = (values == 0) if size is None else (values < -size) | (values >= size)
        if visited is not None:
            out = out & visited.elements(q0, values.shape[2], sizes, values.device)
        out = out.any()
        bad = out if bad is None else bad | out
    if bad is None:
        return
    assert_async(~bad, _device_message(traced, check, sizes, where))


def _device_message(traced: TracedMod, check: tuple, sizes: dict, where: str) -> str:
    """The device-side assert's message: the mod, its line, what failed and the fix, in the
    :data:`flexc.device.ASSERT_MESSAGE_LIMIT` characters CUDA accepts (the file's name without its
    folders; the expression and the source line only where they fit)."""
    node, dim, expr, size = check
    site, source = traced.sites.get(node, ("", ""))
    if site:  # " (/long/path/to/file.py:12)" -> " (file.py:12)"
        site = f" ({os.path.basename(site.strip(' ()'))})"
    head = f"{where}: {traced.kind} {traced.name}{site}"
    domain = f" for B={sizes['b']}, H={sizes['h']}, Q_LEN={sizes['q_idx']}, KV_LEN={sizes['kv_idx']}."
    if size is None:
        what = " divides by zero. Fix: keep the divisor non-zero, e.g. torch.where(d == 0, 1, d)."
        detail = f" Divisor: `{ir.format_expr(expr, traced.buffer_names)}`."
    else:
        what = (f" indexed `{traced.buffer_names[node.args[0].attr[0]]}` out of range in dim {dim} (valid "
                f"{-size}..{size - 1}). Fix: clamp it, e.g. .clamp(0, {size - 1}), or capture a larger tensor.")
        detail = f" Index: `{ir.format_expr(expr, traced.buffer_names)}`."
    room = ASSERT_MESSAGE_LIMIT - len(what)  # the fix always fits; a long name or file name is cut
    if len(head) > room:
        head = head[:max(0, room - 3)] + "..."
    return fit_message(head + what, domain, detail, f" {source}" if source else "")


def _message(traced: TracedMod, check: tuple, sizes: dict, where: str, low: int, high: int, first: tuple,
             reads: set) -> str:
    node, dim, expr, size = check
    site, source = traced.sites.get(node, ("", ""))
    domain = f"B={sizes['b']}, H={sizes['h']}, Q_LEN={sizes['q_idx']}, KV_LEN={sizes['kv_idx']}"
    value, *position = first
    at = ", ".join(f"{name}={p}" for name, p in zip(("b", "h", "q_idx", "kv_idx"), position) if name in reads)
    text_of = lambda n: ir.format_expr(n, traced.buffer_names)
    head = f"{where}: {traced.kind} {traced.name}{site}"
    if size is None:
        text = (f"{head} divides by zero for {domain}: the divisor `{text_of(expr)}` of `{text_of(node)}` "
                f"is 0 at {at or 'every position'} (torch raises ZeroDivisionError there)")
        fix = "keep the divisor non-zero, e.g. `torch.where(d == 0, 1, d)`, or divide floats with `/`"
    else:
        slot = node.args[0].attr[0]
        tensor = traced.buffers[slot]
        text = (f"{head} indexed a captured tensor out of range for {domain}: `{text_of(node)}` reads "
                f"`{traced.buffer_names[slot]}` (shape {list(tensor.shape)}) in dimension {dim} at "
                f"`{text_of(expr)}`, which takes values in [{low}, {high}] (e.g. {value} at "
                f"{at or 'every position'}); valid indices are {-size}..{size - 1}, negative ones counting "
                f"from the end as in torch")
        fix = (f"keep the index in range (e.g. `.clamp(0, {size - 1})` or `% {size}`), or capture a tensor "
               f"sized for these lengths")
    if source:
        text += f".\n    {source}"
    else:
        text += "."
    return f"{text}\nFix: {fix}."


__all__ = ["IndexRangeError", "check_mod"]
