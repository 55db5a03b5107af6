"""Analytic tile classification: decide whole tiles of a mask without evaluating their elements.

A block mask needs, for every tile ``(b, h, q block, kv block)``, whether the mask is all-False
(EMPTY), all-True (FULL) or mixed there. Instead of evaluating ``Q_BLOCK * KV_BLOCK`` elements per
tile, :func:`classify_tiles` runs an interval analysis of the traced mask over each tile's index box,
for all tiles at once with torch tensors (bounds shaped ``[B or 1, H or 1, nQ or 1, nKV or 1]``),
so the work is proportional to the number of tiles.

Integer values are bounded by ``IntRange(lo, hi)`` (float64 tensors: exact for integers below
``2**50``, and infinite bounds mean "unknown"); booleans by ``BoolRange(must, may)`` (``must``:
certainly True, ``may``: possibly True). Comparisons rewrite ``lhs - rhs`` into a canonical affine
form (:mod:`flexc.analysis.affine`), whose exact minimum and maximum over a box is a corner computation, so
causal, sliding-window, prefix-LM and chunked masks are decided exactly. Lookups of captured tensors
use range min/max tables (:mod:`flexc.analysis.range_tables`). Anything not understood is unknown, which
only makes a tile UNDECIDED: the caller evaluates those tiles exactly, so correctness never rests
on the analysis being clever, only on it being sound.

Machine arithmetic is respected: a first pass bounds every node over the whole index domain, and a
node whose value could leave its dtype's range (and so wrap around) or exceed ``2**50`` is treated
as unknown everywhere. Float values are not analysed (rounding makes them unknown).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..device import resolve, same_device
from ..mods import ir
from .affine import AffineForm, affine_difference
from ..mods.promotion import node_dtype
from .range_tables import RangeMinMax
from ..mods.lowering import scalar_form
from .tiles import EMPTY, FULL, MIXED, UNDECIDED, cdiv  # noqa: F401  (the tile classes, read from here too)
from ..mods.trace import MASK_MOD, TracedMod

# Integer bounds are float64: exact below 2**53. Nodes that may reach 2**50 are treated as unknown,
# which leaves room for sums of a few such terms inside an affine form.
_EXACT_LIMIT = float(2 ** 50)
_INF = math.inf
# Tiles analysed per chunk: bounds the temporaries whatever the length, and keeps them in cache (much
# faster on these machines than chunks of many MiB, which also pay fresh-page faults).
_TILES_PER_CHUNK = 1 << 18


@dataclass(frozen=True)
class IntRange:
    """Every value of an integer expression over a box lies in ``[lo, hi]`` (float64, maybe +-inf)."""

    lo: Any
    hi: Any


@dataclass(frozen=True)
class BoolRange:
    """``must``: the expression is True everywhere in the box; ``may``: it is True somewhere (or
    might be). ``must`` implies ``may``."""

    must: Any
    may: Any


TOP_INT = IntRange(-_INF, _INF)
TOP_BOOL = BoolRange(False, True)


def classify_tiles(traced: TracedMod, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
                   KV_BLOCK: int, device: Any = "cpu") -> torch.Tensor:
    """Classify every tile of a mask_mod as EMPTY (0), UNDECIDED (1) or FULL (2).

    Returns an int8 tensor ``[B, H, nQ, nKV]`` (``nQ = ceil(Q_LEN / Q_BLOCK)``). A tile's box is its
    in-range part, ``q_idx`` in ``[q0, min(q0 + Q_BLOCK, Q_LEN) - 1]`` and likewise for ``kv_idx``;
    FULL means proven all-True there and EMPTY proven all-False (torch's rule that a ragged tile is
    never FULL is the caller's to apply). ``B`` or ``H`` of 1 means the mask is evaluated at b = 0 or
    h = 0 only, as for a broadcast block mask.

    >>> import flexc
    >>> classify_tiles(flexc.trace(lambda b, h, q, k: q >= k), 1, 1, 4, 4, 2, 2)[0, 0].tolist()
    [[1, 0], [2, 1]]
    """
    _check_arguments(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    device = resolve(device, "classify_tiles")
    sizes = {"b": B, "h": H, "q_idx": Q_LEN, "kv_idx": KV_LEN}
    analysis = _Analysis(traced.root, traced.buffers, sizes, device)
    n_q, n_kv = cdiv(Q_LEN, Q_BLOCK), cdiv(KV_LEN, KV_BLOCK)
    out = torch.empty(B, H, n_q, n_kv, dtype=torch.int8, device=device)
    rows = max(1, _TILES_PER_CHUNK // max(1, B * H * n_kv))
    f64 = dict(dtype=torch.float64, device=device)
    kv_lo = torch.arange(n_kv, **f64) * KV_BLOCK
    kv = IntRange(kv_lo.view(1, 1, 1, n_kv), torch.clamp(kv_lo + KV_BLOCK, max=KV_LEN).sub_(1).view(1, 1, 1, n_kv))
    b = torch.arange(B, **f64).view(B, 1, 1, 1)
    h = torch.arange(H, **f64).view(1, H, 1, 1)
    for r0 in range(0, n_q, rows):
        r1 = min(n_q, r0 + rows)
        q_lo = torch.arange(r0, r1, **f64) * Q_BLOCK
        q = IntRange(q_lo.view(1, 1, -1, 1), torch.clamp(q_lo + Q_BLOCK, max=Q_LEN).sub_(1).view(1, 1, -1, 1))
        verdict = analysis.root_range({"b": IntRange(b, b), "h": IntRange(h, h), "q_idx": q, "kv_idx": kv})
        _write_classes(out[:, :, r0:r1], verdict)
    return out


def mark_mixed_tiles(traced: TracedMod, classes: torch.Tensor, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
                     KV_BLOCK: int, max_points: int = 1 << 22) -> torch.Tensor:
    """Mark UNDECIDED tiles that are proven mixed as MIXED (3), in place, and return ``classes``.

    The mask is evaluated at 9 points of each undecided tile (corners, edge midpoints, centre);
    a tile where both an allowed and a masked point turn up is mixed, and needs no exact
    evaluation. Most undecided tiles of affine masks (the diagonal of a causal mask, the edges of
    a window) are settled this way at 9 evaluations instead of ``Q_BLOCK * KV_BLOCK``.
    ``classes`` is int8 ``[B or 1, H or 1, nQ, nKV]``; a size-1 b or h dimension is evaluated at 0.
    """
    from ..mods.evaluate import evaluate

    coords = (classes == UNDECIDED).nonzero()
    if coords.shape[0] == 0:
        return classes
    device = classes.device
    steps = torch.tensor([0.0, 0.5, 1.0], device=device)
    for start in range(0, coords.shape[0], max(1, max_points // 9)):
        c = coords[start:start + max(1, max_points // 9)]
        q0, k0 = c[:, 2] * Q_BLOCK, c[:, 3] * KV_BLOCK
        q_last = torch.clamp(q0 + Q_BLOCK, max=Q_LEN) - 1  # the in-range box only
        k_last = torch.clamp(k0 + KV_BLOCK, max=KV_LEN) - 1
        q = (q0[:, None] + ((q_last - q0)[:, None] * steps).long()).view(-1, 3, 1)
        k = (k0[:, None] + ((k_last - k0)[:, None] * steps).long()).view(-1, 1, 3)
        n = c.shape[0]
        try:
            allowed = evaluate(traced, b=c[:, 0].view(n, 1, 1), h=c[:, 1].view(n, 1, 1), q_idx=q, kv_idx=k)
        except IndexError:  # sizes that do not fit the captured tensors: left to exact evaluation to report
            return classes
        allowed = allowed.to(torch.bool).expand(n, 3, 3).reshape(n, 9)
        mixed = allowed.any(dim=1) & ~allowed.all(dim=1)
        hit = c[mixed]
        classes[tuple(hit.T)] = MIXED
    return classes


def _write_classes(chunk: torch.Tensor, verdict: BoolRange) -> None:
    """class = must + may: FULL = 2 (both), UNDECIDED = 1 (may only), EMPTY = 0."""
    must = torch.as_tensor(verdict.must, device=chunk.device)
    may = torch.as_tensor(verdict.may, device=chunk.device)
    if must.shape == chunk.shape and may.shape == chunk.shape:
        torch.add(may.view(torch.int8), must.view(torch.int8), out=chunk)  # one pass over the tiles
    else:
        chunk.copy_(may.expand(chunk.shape))
        chunk.add_(must.to(torch.int8))


def _check_arguments(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK) -> None:
    if not isinstance(traced, TracedMod) or traced.kind != MASK_MOD:
        got = f"a traced {traced.kind}" if isinstance(traced, TracedMod) else type(traced).__name__
        raise TypeError(f"classify_tiles: traced must be a flexc.TracedMod of kind 'mask_mod', got {got}. "
                        f"Fix: pass flexc.trace(mask_mod).")
    for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("Q_BLOCK", Q_BLOCK),
                        ("KV_BLOCK", KV_BLOCK)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"classify_tiles: {name} must be an int, got {type(value).__name__} {value!r}. "
                            f"Fix: pass a positive Python int.")
        if value < 1:
            raise ValueError(f"classify_tiles: {name} must be >= 1, got {value}. Fix: pass a positive size.")


# ---- the analysis --------------------------------------------------------------------------

def range_over_box(expr: ir.Node, box: dict, buffers: tuple = (), sizes: dict | None = None) -> tuple:
    """Bounds of one expression over one index box, as Python values (for tests and inspection).

    ``box`` maps input names to inclusive ``(lo, hi)`` pairs; ``sizes`` maps them to the domain
    sizes that bound wrap-around checks (default: ``hi + 1``). Returns ``(lo, hi)`` ints for an
    integer expression (``-inf``/``inf`` when unknown), ``(must, may)`` bools for a bool one, and
    None for a float one.

    >>> from flexc import ir
    >>> q, k = ir.input_("q_idx"), ir.input_("kv_idx")
    >>> range_over_box(ir.binary("sub", q, k), {"q_idx": (10, 20), "kv_idx": (0, 5)})
    (5, 20)
    """
    box = {name: box.get(name, (0, 0)) for name in ("b", "h", "q_idx", "kv_idx")}
    sizes = sizes or {name: hi + 1 for name, (lo, hi) in box.items()}
    analysis = _Analysis(expr, tuple(buffers), sizes, torch.device("cpu"))
    inputs = {name: IntRange(torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
              for name, (lo, hi) in box.items()}
    value = analysis._value(expr, inputs, {})
    if isinstance(value, BoolRange):
        return bool(value.must), bool(value.may)
    if isinstance(value, IntRange):
        as_int = lambda x: int(float(x)) if math.isfinite(float(x)) else float(x)
        return as_int(value.lo), as_int(value.hi)
    return None


def domain_bounds(traced: TracedMod, sizes: dict, device: Any = "cpu") -> dict[int, Any]:
    """Bounds of every integer and bool node of ``traced`` over the whole index domain.

    ``sizes`` maps ``b``, ``h``, ``q_idx``, ``kv_idx`` to their extents. Returns ``id(node)`` ->
    :class:`IntRange` / :class:`BoolRange` (0-d float64 / bool tensors; infinite bounds mean
    unknown) or None for float nodes. :mod:`flexc.analysis.bounds` proves lookups in range with it.
    """
    return _Analysis(traced.root, traced.buffers, sizes, resolve(device)).static


class _Analysis:
    """Range analysis of one expression for one call (domain sizes and captured tensor values)."""

    def __init__(self, root: ir.Node, buffers: tuple, sizes: dict, device: torch.device):
        # reductions over a small captured axis written out term by term (each term is an
        # ordinary expression, so their bounds are as tight as the terms'); autograd Functions inlined
        self.root = root = scalar_form(root)
        self.buffers = buffers
        self.device = device
        self.opaque: set[int] = set()  # nodes whose value may wrap around: unknown everywhere
        self.opaque_nodes: list[ir.Node] = []
        self.forms: dict[int, AffineForm | None] = {}
        self.tables: dict[tuple, RangeMinMax] = {}
        self.static: dict[int, Any] = {}
        limits = _dtype_limits(self.root)
        # Whole-domain pass: bounds every node once, marks those that could wrap around and
        # settles which comparisons may use their affine form.
        self.whole_domain = True
        whole = lambda n: IntRange(torch.tensor(0.0, dtype=torch.float64), torch.tensor(float(n - 1), dtype=torch.float64))
        values: dict[int, Any] = {}
        inputs = {name: whole(size) for name, size in sizes.items()}
        for node in self.root.walk():
            value = self._evaluate(node, inputs, values)
            if isinstance(value, IntRange):
                low, high = limits.get(id(node), (-_EXACT_LIMIT, _EXACT_LIMIT))
                if not (float(value.lo) >= max(low, -_EXACT_LIMIT) and float(value.hi) <= min(high, _EXACT_LIMIT)):
                    self.opaque.add(id(node))
                    self.opaque_nodes.append(node)
                    value = TOP_INT
            values[id(node)] = value
        self.static = values
        self.whole_domain = False

    def root_range(self, inputs: dict) -> BoolRange:
        """The mask's range over the boxes described by ``inputs`` (name -> IntRange)."""
        value = self._value(self.root, inputs, {})
        return value if isinstance(value, BoolRange) else TOP_BOOL

    def _value(self, node: ir.Node, inputs: dict, memo: dict) -> Any:
        # Lazy: a comparison with an affine form reads only its atoms, so intermediate sums such as
        # q_idx - kv_idx are never materialised over all tiles.
        found = memo.get(id(node))
        if found is None:
            if id(node) in self.opaque:
                found = TOP_INT
            else:
                found = self._evaluate(node, inputs, memo)
            memo[id(node)] = found
        return found

    def _arg(self, node: ir.Node, i: int, inputs: dict, memo: dict) -> Any:
        child = node.args[i]
        if self.whole_domain:
            return memo[id(child)]
        return self._value(child, inputs, memo)

    # -- one node --
    def _evaluate(self, node: ir.Node, inputs: dict, memo: dict) -> Any:
        op, kind = node.op, node.kind
        if kind == ir.FLOAT:
            return None
        if op == "input":
            return inputs[node.attr]
        if op == "const":
            v = node.attr
            return BoolRange(v, v) if kind == ir.BOOL else IntRange(float(v), float(v))
        if op == "buffer":
            return None
        if op in ir.COMPARE_OPS:
            return self._compare(node, inputs, memo)
        if op in ("add", "sub", "neg", "mul") and kind == ir.INT:
            form = self._form(node, None, node, memo)
            if form is not None:
                lo, hi = self._form_bounds(form, inputs, memo)
                return IntRange(lo[0] + lo[1], hi[0] + hi[1])
        args = [self._arg(node, i, inputs, memo) for i in range(len(node.args))]
        if op == "load":
            return self._lookup(node, args[1:])
        if op == "where":
            return where_range(args[0], args[1], args[2], kind)
        if op == "cast":
            if kind == ir.BOOL:
                return args[0] if isinstance(args[0], BoolRange) else TOP_BOOL
            return _as_int(args[0])
        if kind == ir.BOOL:
            return _bool_op(op, args)
        second = _constant(node.args[1], memo if self.whole_domain else self.static) if len(node.args) == 2 else None
        return int_range(op, [_as_int(a) for a in args], second)

    # -- comparisons --
    def _form(self, lhs: ir.Node, rhs: ir.Node | None, key: ir.Node, memo: dict) -> AffineForm | None:
        """The affine form of ``lhs - rhs`` (or of ``lhs`` alone), if usable exactly here."""
        if self.whole_domain:
            form = affine_difference(lhs, rhs if rhs is not None else ir.const(0), self.opaque_nodes)
            if form is not None:
                # every term must stay exact in float64 over the whole domain
                total = abs(form.const)
                for atom, c in form.terms:
                    r = _as_int(memo[id(atom)]) if id(atom) in memo else TOP_INT
                    total += abs(c) * max(abs(float(r.lo)), abs(float(r.hi)))
                if not total <= _EXACT_LIMIT:
                    form = None
            self.forms[id(key)] = form
            return form
        return self.forms.get(id(key))

    def _form_bounds(self, form: AffineForm, inputs: dict, memo: dict) -> tuple:
        """``((lo_a, lo_b), (hi_a, hi_b))``: the exact min and max of the form are ``lo_a + lo_b``
        and ``hi_a + hi_b``, where the ``_a`` parts gather terms constant along kv blocks and the
        ``_b`` parts the rest. Keeping the sums apart lets a comparison broadcast once, straight
        into a bool tensor, instead of materialising a float64 sum over all tiles."""
        lo = [float(form.const), 0.0]
        hi = [float(form.const), 0.0]
        for atom, c in form.terms:
            r = _as_int(self._value(atom, inputs, memo) if not self.whole_domain else memo[id(atom)])
            low, high = (r.lo * c, r.hi * c) if c > 0 else (r.hi * c, r.lo * c)
            part = 0 if _constant_along_kv(low) and _constant_along_kv(high) else 1
            lo[part] = lo[part] + low
            hi[part] = hi[part] + high
        return tuple(lo), tuple(hi)

    def _compare(self, node: ir.Node, inputs: dict, memo: dict) -> BoolRange:
        lhs, rhs = node.args
        if ir.FLOAT in (lhs.kind, rhs.kind):
            return TOP_BOOL
        form = self._form(lhs, rhs, node, memo)
        if form is not None:
            lo, hi = self._form_bounds(form, inputs, memo)
        else:
            a = _as_int(self._arg(node, 0, inputs, memo))
            b = _as_int(self._arg(node, 1, inputs, memo))
            lo, hi = (a.lo, -b.hi), (a.hi, -b.lo)
        # sign tests of lo = lo[0] + lo[1] written as lo[0] >= -lo[1]: one broadcast, exact
        lo_a, lo_b, hi_a, hi_b = lo[0], _neg(lo[1]), hi[0], _neg(hi[1])
        op = node.op
        if op in ("ge", "lt"):
            must, may = _ge(lo_a, lo_b), _ge(hi_a, hi_b)  # diff >= 0
        elif op in ("gt", "le"):
            must, may = _gt(lo_a, lo_b), _gt(hi_a, hi_b)  # diff > 0
        else:  # eq / ne: diff == 0
            must = _and(_eq(lo_a, lo_b), _eq(hi_a, hi_b))
            may = _and(_ge(hi_a, hi_b), _ge(lo_b, lo_a))
        if op in ("lt", "le", "ne"):  # the negation of the test above
            must, may = _not(may), _not(must)
        return BoolRange(must, may)

    # -- lookups --
    def _lookup(self, node: ir.Node, index_ranges: list) -> Any:
        slot = node.args[0].attr[0]
        tensor = self.buffers[slot]
        top = TOP_BOOL if node.kind == ir.BOOL else TOP_INT
        if tensor.is_floating_point() or tensor.is_complex():
            return top
        if not same_device(tensor.device, self.device):
            tensor = tensor.to(self.device)
        if not index_ranges:
            value = tensor.reshape(()).to(torch.float64)
            return _from_values(node.kind, value, value)
        valid, los, his = True, [], []
        for dim, r in enumerate(index_ranges):
            r = _as_int(r)
            size = tensor.shape[dim]
            lo = torch.as_tensor(r.lo, dtype=torch.float64, device=self.device)
            hi = torch.as_tensor(r.hi, dtype=torch.float64, device=self.device)
            wrapped = hi < 0  # a wholly negative index counts from the end, as in torch
            lo, hi = torch.where(wrapped, lo + size, lo), torch.where(wrapped, hi + size, hi)
            valid = _and(valid, (lo >= 0) & (hi <= size - 1))
            los.append(lo.clamp(0, size - 1).to(torch.int64))
            his.append(hi.clamp(0, size - 1).to(torch.int64))
        ranged = [d for d in range(len(los)) if not torch.equal(los[d], his[d])]
        if not ranged:
            low = high = tensor[tuple(los)]
        elif len(ranged) == 1 and not self.whole_domain:
            d = ranged[0]
            key = (slot, d)
            if key not in self.tables:
                self.tables[key] = RangeMinMax(tensor, d)
            fixed = tuple(los[i] for i in range(len(los)) if i != d)
            low, high = self.tables[key].query(fixed, los[d], his[d])
        elif not self.whole_domain and _enumerable(los, his, ranged):
            low, high = _enumerate_lookup(tensor, los, his, ranged)
        else:
            # bound by the min/max over every ranged dimension: sound, if coarse
            reduce_from = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
            low, high = reduce_from.amin(dim=ranged, keepdim=True), reduce_from.amax(dim=ranged, keepdim=True)
            at = tuple(torch.zeros_like(los[i]) if i in ranged else los[i] for i in range(len(los)))
            low, high = low[at], high[at]
        result = _from_values(node.kind, low.to(torch.float64), high.to(torch.float64))
        if valid is True:
            return result
        if isinstance(result, BoolRange):
            return BoolRange(result.must & valid, result.may | ~valid)
        return IntRange(torch.where(valid, result.lo, -_INF), torch.where(valid, result.hi, _INF))


# Lookups ranged in several dimensions (``allowed[b, h, q_idx // 16, kv_idx // 16]``) read every
# index combination of the box when there are at most this many per tile.
_MAX_ENUMERATED = 64


def _enumerable(los: list, his: list, ranged: list) -> bool:
    count = 1
    for d in ranged:
        count *= int((his[d] - los[d]).max()) + 1
    return count <= _MAX_ENUMERATED


def _enumerate_lookup(tensor: torch.Tensor, los: list, his: list, ranged: list) -> tuple:
    """Exact min and max of ``tensor`` over each box of indices, by reading every combination.

    Offsets past a box's own end are clamped onto its last index, which repeats a value inside
    the box, so boxes of different sizes share one loop."""
    values = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    spans = [int((his[d] - los[d]).max()) + 1 for d in ranged]
    low = high = None
    for offsets in itertools.product(*(range(s) for s in spans)):
        at = list(los)
        for d, off in zip(ranged, offsets):
            at[d] = torch.minimum(los[d] + off, his[d])
        v = values[tuple(at)]
        low = v if low is None else torch.minimum(low, v)
        high = v if high is None else torch.maximum(high, v)
    return low, high


# ---- interval rules -------------------------------------------------------------------------

def int_range(op: str, args: list, second: int | None = None) -> IntRange:
    """The range of integer op ``op`` from its operands' ranges ``args`` (:class:`IntRange`, of Python
    floats or float64 tensors; infinite bounds mean unknown). ``second``: the second operand's value
    when it is one constant (a divisor, an exponent), else None. Returns :data:`TOP_INT` for an op
    not analysed (or, xor, shifts; a divisor or exponent that is not a constant)."""
    if op in ("add", "sub", "mul", "neg"):  # in classify_tiles, reached only when the node is not affine
        if op == "neg":
            return IntRange(-args[0].hi, -args[0].lo)
        a, b = args
        if op == "add":
            return IntRange(a.lo + b.lo, a.hi + b.hi)
        if op == "sub":
            return IntRange(a.lo - b.hi, a.hi - b.lo)
        corners = [_times(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return IntRange(_min(_min(corners[0], corners[1]), _min(corners[2], corners[3])),
                        _max(_max(corners[0], corners[1]), _max(corners[2], corners[3])))
    if op in ("floordiv", "mod"):
        m = second
        if m is None or m == 0:
            return TOP_INT
        return _floordiv(args[0], m) if op == "floordiv" else _mod(args[0], m)
    if op == "pow" and second is not None and 0 <= second <= 8:  # x ** e: its ends, and 0 inside
        a, e = args[0], second
        ends = (a.lo ** e, a.hi ** e)
        lo = _min(*ends) if e % 2 else _select(_and(_ge(0.0, a.lo), _ge(a.hi, 0.0)), 0.0, _min(*ends))
        return IntRange(lo, _max(*ends))
    if op == "min":
        return IntRange(_min(args[0].lo, args[1].lo), _min(args[0].hi, args[1].hi))
    if op == "max":
        return IntRange(_max(args[0].lo, args[1].lo), _max(args[0].hi, args[1].hi))
    if op == "abs":
        return _abs(args[0])
    if op == "sign":
        return IntRange(_sign(args[0].lo), _sign(args[0].hi))
    if op in ("floor", "ceil"):
        return args[0]  # identity on integers
    if op == "not":  # bitwise not: -x - 1
        return IntRange(-args[0].hi - 1, -args[0].lo - 1)
    if op == "and":  # bitwise and of non-negative numbers lies in [0, min(hi)]
        a, b = args
        both = _and(_ge(a.lo, 0.0), _ge(b.lo, 0.0))
        return IntRange(_select(both, 0.0, -_INF), _select(both, _min(a.hi, b.hi), _INF))
    return TOP_INT  # or, xor, shifts on integers: not analysed


def _bool_op(op: str, args: list) -> BoolRange:
    args = [a if isinstance(a, BoolRange) else TOP_BOOL for a in args]
    if op in ("and", "min", "mul"):  # on bools, min and * are logical and
        a, b = args
        return BoolRange(_and(a.must, b.must), _and(a.may, b.may))
    if op in ("or", "max", "add"):
        a, b = args
        return BoolRange(_or(a.must, b.must), _or(a.may, b.may))
    if op == "not":
        return BoolRange(_not(args[0].may), _not(args[0].must))
    if op == "xor":
        a, b = args
        return BoolRange(_or(_and(a.must, _not(b.may)), _and(_not(a.may), b.must)),
                         _or(_and(a.may, _not(b.must)), _and(_not(a.must), b.may)))
    if op in ("abs", "floor", "ceil"):
        return args[0]
    return TOP_BOOL


def where_range(cond: Any, x: Any, y: Any, kind: str) -> Any:
    """The range of ``where(cond, x, y)`` of kind ``kind`` (an IR kind) from its operands' ranges
    (a ``cond`` that is not a :class:`BoolRange` may be either)."""
    if not isinstance(cond, BoolRange):
        cond = TOP_BOOL
    if kind == ir.BOOL:
        x = x if isinstance(x, BoolRange) else TOP_BOOL
        y = y if isinstance(y, BoolRange) else TOP_BOOL
        # True everywhere if each branch that can be taken is True everywhere
        must = _and(_or(x.must, _not(cond.may)), _or(y.must, cond.must))
        may = _or(_and(x.may, cond.may), _and(y.may, _not(cond.must)))
        return BoolRange(must, may)
    x, y = _as_int(x), _as_int(y)
    lo = _select(cond.must, x.lo, _select(cond.may, _min(x.lo, y.lo), y.lo))
    hi = _select(cond.must, x.hi, _select(cond.may, _max(x.hi, y.hi), y.hi))
    return IntRange(lo, hi)


def _floordiv(a: IntRange, m: int) -> IntRange:
    lo, hi = _floor_div(a.lo, m), _floor_div(a.hi, m)
    return IntRange(lo, hi) if m > 0 else IntRange(hi, lo)  # x // m is decreasing in x for m < 0


def _mod(a: IntRange, m: int) -> IntRange:
    """``x % m`` (Python's sign rule). Exact when the box does not wrap past a multiple of ``m``,
    else the whole residue range."""
    full = (0.0, float(m - 1)) if m > 0 else (float(m + 1), 0.0)
    same_period = _and(_eq(_floor_div(a.lo, m), _floor_div(a.hi, m)), _and(_finite(a.lo), _finite(a.hi)))
    lo = _select(same_period, _remainder(a.lo, m), full[0])
    hi = _select(same_period, _remainder(a.hi, m), full[1])
    return IntRange(lo, hi)


def _abs(a: IntRange) -> IntRange:
    lo = _select(_ge(a.lo, 0.0), a.lo, _select(_ge(0.0, a.hi), -a.hi, 0.0))
    hi = _max(_abs_value(a.lo), _abs_value(a.hi))
    return IntRange(lo, hi)


def _constant(node: ir.Node, static: dict) -> int | None:
    """The value of an integer node that is one constant over the whole domain, else None."""
    r = static.get(id(node))
    if isinstance(r, IntRange) and float(r.lo) == float(r.hi) and math.isfinite(float(r.lo)):
        return int(float(r.lo))
    return None


def _as_int(r: Any) -> IntRange:
    if isinstance(r, IntRange):
        return r
    if isinstance(r, BoolRange):  # a bool used as a number is 0 or 1
        return IntRange(_to_float(r.must), _to_float(r.may))
    return TOP_INT


def _from_values(kind: str, low: Any, high: Any) -> Any:
    if kind == ir.BOOL:
        return BoolRange(low != 0, high != 0)
    return IntRange(low, high)


def _constant_along_kv(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 1


# ---- elementwise helpers for Python scalars and tensors alike -----------------------------------

def _is_t(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) for x in xs)


def _to_float(x: Any) -> Any:
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def _neg(x: Any) -> Any:
    return -x


def _ge(a: Any, b: Any) -> Any:
    return a >= b


def _gt(a: Any, b: Any) -> Any:
    return a > b


def _eq(a: Any, b: Any) -> Any:
    return a == b


def _and(a: Any, b: Any) -> Any:
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    return a & b


def _or(a: Any, b: Any) -> Any:
    if a is False or b is True:
        return b
    if b is False or a is True:
        return a
    return a | b


def _not(a: Any) -> Any:
    return (not a) if isinstance(a, bool) else ~a


def _select(cond: Any, x: Any, y: Any) -> Any:
    if isinstance(cond, bool):
        return x if cond else y
    return torch.where(cond, torch.as_tensor(x, dtype=torch.float64, device=cond.device),
                       torch.as_tensor(y, dtype=torch.float64, device=cond.device))


def _min(a: Any, b: Any) -> Any:
    if _is_t(a, b):
        return torch.minimum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    return min(a, b)


def _max(a: Any, b: Any) -> Any:
    if _is_t(a, b):
        return torch.maximum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    return max(a, b)


def _times(a: Any, b: Any) -> Any:
    # 0 * inf is 0 here: a zero factor makes the product 0 whatever the other factor is
    if _is_t(a, b):
        return torch.nan_to_num(torch.as_tensor(a, dtype=torch.float64) * b, nan=0.0, posinf=_INF, neginf=-_INF)
    p = a * b
    return 0.0 if math.isnan(p) else p


def _finite(x: Any) -> Any:
    return torch.isfinite(x) if isinstance(x, torch.Tensor) else math.isfinite(x)


def _floor_div(x: Any, m: int) -> Any:
    """floor(x / m) for integer-valued float64 ``x`` (exact) and +-inf (kept, sign-adjusted)."""
    if isinstance(x, torch.Tensor):
        finite = torch.isfinite(x)
        q = torch.div(torch.where(finite, x, 0.0), m, rounding_mode="floor")
        return torch.where(finite, q, x if m > 0 else -x)
    if not math.isfinite(x):
        return x if m > 0 else -x
    return float(int(x) // m)


def _remainder(x: Any, m: int) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.remainder(torch.where(torch.isfinite(x), x, 0.0), m)
    return float(int(x) % m) if math.isfinite(x) else 0.0


def _abs_value(x: Any) -> Any:
    return x.abs() if isinstance(x, torch.Tensor) else abs(x)


def _sign(x: Any) -> Any:
    return torch.sign(x) if isinstance(x, torch.Tensor) else float((x > 0) - (x < 0))


# ---- machine integer ranges ---------------------------------------------------------------------

def _dtype_limits(root: ir.Node) -> dict[int, tuple[float, float]]:
    """For each integer node, the range of the dtype torch computes it in
    (:func:`flexc.mods.promotion.node_dtype`; arithmetic on constants only is done in int64)."""
    limits: dict[int, tuple[float, float]] = {}
    for node in root.walk():
        if node.kind != ir.INT:
            continue
        dt = node_dtype(node)
        if dt is None and node.args:
            dt = torch.int64
        if isinstance(dt, torch.dtype) and not dt.is_floating_point and dt != torch.bool:
            info = torch.iinfo(dt)
            limits[id(node)] = (float(info.min), float(info.max))
    return limits
