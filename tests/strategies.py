"""Hypothesis strategies for random mods, shared by the property tests, and their settings.

A random mod is Python source text, drawn from a :class:`Grammar` and turned into a function by
:func:`compile_mod`: the code under test traces or calls it as it would a user's mod, and on a
failure hypothesis prints the shrunk source.

A grammar names, per kind of expression (``"int"``, ``"bool"``, ``"float"``, or any other name),
*leaf* and *form* templates. A template is source text with slots: ``{int}``, ``{bool}``, ``{float}``
(any kind the grammar has leaves for) stand for a drawn subexpression of that kind, any other
``{name}`` for a draw of the grammar's atom ``name`` (a constant, a comparison operator, an input,
a table's name). A label after a colon draws a slot once per template: ``torch.where({int:a} > {int:b},
{int:a}, {int:b})`` repeats the same two subexpressions. An expression is a leaf with chance
1 / ``leaf_odds`` and always at depth 0; a form's subexpressions are drawn one level deeper, a
leaf's afresh at the grammar's ``depth`` for their kind (so a leaf like ``({int} < {int})`` compares
two full integer expressions; a leaf's slots must not be of its own kind).

The grammars below are the ones the property tests use, each with the captured names its source
expects in :func:`compile_mod`'s namespace (the tests own the tables' values):

- :data:`TRACE_MASK`, :data:`TRACE_SCORE`: everything the tracer handles (integer, boolean and float
  expressions over the four indices and the score, math functions, casts, lookups into captured
  tables); :func:`mask_sources` and :func:`score_sources` make whole mods of them.
- :data:`INTEGER_GRAPHS`: integer-only arithmetic (+ - * // % min max where) of indices, constants,
  a captured 0-d tensor and a lookup, for numpy's evaluation of mask_mods.
- :data:`AFFINE_CONDITIONS`: affine forms in ``q`` and ``kv`` (sums, negations, products by a
  constant) compared and combined with ``& | ^ ~ where``, for one query row's allowed intervals.
- :data:`TILE_MASKS`: integer and boolean expressions with constants anywhere (Python numbers made
  tensors by ``as_tensor`` where torch needs one) and lookups into several captured tables, for
  tile classification; :func:`affine_forms`: the coefficients of an affine form of the indices.
- :data:`PRINTER_EXPRESSIONS`: integer (bitwise ops included) and float expressions for the Triton
  printer, every op of its IR.
- :data:`DIFFERENTIABLE`: float expressions of the score through the ops with derivative rules.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Sequence

import torch
from hypothesis import HealthCheck, settings, strategies as st

INPUTS = ("b", "h", "q_idx", "kv_idx")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
COMPARISON_METHODS = ("ge", "gt", "le", "lt", "eq", "ne")
LOGIC = ("&", "|", "^")

_SLOT = re.compile(r"\{(\w+)(?::(\w+))?\}")


# FLEXC_QUICK=1 (`make test-quick`, the inner loop) draws a fifth of each property's examples, at least
# QUICK_MIN; unset (`make test`, CI) every property draws its full count
QUICK_SHARE, QUICK_MIN = 5, 3


def quick_run(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for the quick loop: FLEXC_QUICK set to anything but empty or ``0``."""
    return environ.get("FLEXC_QUICK", "") not in ("", "0")


QUICK = quick_run(os.environ)


def example_count(n: int, quick: bool | None = None) -> int:
    """How many examples a property of ``n`` draws: ``n``, or a fifth (at least QUICK_MIN, at most
    ``n``) in the quick loop (``quick``; by default this run's FLEXC_QUICK)."""
    return min(n, max(QUICK_MIN, n // QUICK_SHARE)) if (QUICK if quick is None else quick) else n


def examples(n: int, *, slow: bool = False) -> settings:
    """``n`` examples (fewer under FLEXC_QUICK=1, see :func:`example_count`) and no deadline; ``slow``
    also lifts the health checks on slow or large draws."""
    return settings(max_examples=example_count(n), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large] if slow else [])


def as_tensor(x):
    """``x`` as a tensor when it is a Python number (torch.minimum, torch.where's condition and
    tensor methods need one); a tensor or a tracer's proxy as it is."""
    return torch.tensor(x) if isinstance(x, (int, float)) else x


def compile_mod(source: str, namespace: Mapping[str, object] = ()):
    """The function ``source`` (a ``lambda``) defines, reading ``torch``, :func:`as_tensor` and ``namespace``."""
    return eval(source, {"torch": torch, "as_tensor": as_tensor, **dict(namespace)})  # noqa: S307 - generated


def mask_source(body: str, names: Sequence[str] = INPUTS) -> str:
    return f"lambda {', '.join(names)}: {body}"


def score_source(body: str, names: Sequence[str] = ("score", *INPUTS)) -> str:
    return f"lambda {', '.join(names)}: {body}"


@dataclasses.dataclass(frozen=True)
class Grammar:
    """Templates by kind of expression (see the module's docstring): ``leaves[kind]`` end a branch,
    ``forms[kind]`` nest; ``atoms[name]`` draws the text of an ``{name}`` slot; ``depth`` (one for
    all kinds or by kind) bounds the nesting of a fresh expression; a node is a leaf with chance
    1 / ``leaf_odds``. A template listed twice is drawn twice as often."""

    leaves: Mapping[str, Sequence[str]]
    forms: Mapping[str, Sequence[str]]
    atoms: Mapping[str, st.SearchStrategy[str]]
    depth: int | Mapping[str, int] = 3
    leaf_odds: int | Mapping[str, int] = 2

    def expressions(self, kind: str, depth: int | None = None) -> st.SearchStrategy[str]:
        """Source text of a random ``kind`` expression, at most ``depth`` forms deep (the grammar's by default)."""
        return _expressions(self, kind, _per_kind(self.depth, kind) if depth is None else depth)

    def replace(self, **changes) -> Grammar:
        """This grammar with some fields replaced; ``leaves``/``forms``/``atoms`` entries are merged."""
        merged = {name: {**getattr(self, name), **changes.pop(name)} for name in ("leaves", "forms", "atoms")
                  if name in changes}
        return dataclasses.replace(self, **merged, **changes)


def _per_kind(value, kind):
    return value if isinstance(value, int) else value[kind]


@st.composite
def _expressions(draw, grammar: Grammar, kind: str, depth: int) -> str:
    return _draw(draw, grammar, kind, depth)


def _draw(draw, grammar: Grammar, kind: str, depth: int) -> str:
    forms = grammar.forms.get(kind, ())
    if depth <= 0 or not forms or draw(st.integers(0, _per_kind(grammar.leaf_odds, kind) - 1)) == 0:
        return _fill(draw, grammar, draw(st.sampled_from(grammar.leaves[kind])), None)
    return _fill(draw, grammar, draw(st.sampled_from(forms)), depth - 1)


def _fill(draw, grammar: Grammar, template: str, depth: int | None) -> str:
    """``template`` with its slots drawn; subexpressions at ``depth`` (None: afresh, for a leaf's)."""
    labelled: dict[tuple[str, str], str] = {}

    def slot(match: re.Match) -> str:
        name, label = match.group(1), match.group(2)
        if label is not None and (name, label) in labelled:
            return labelled[name, label]
        if name in grammar.leaves:
            text = _draw(draw, grammar, name, _per_kind(grammar.depth, name) if depth is None else depth)
        else:
            text = draw(grammar.atoms[name])
        if label is not None:
            labelled[name, label] = text
        return text

    return _SLOT.sub(slot, template)


def _strings(values) -> st.SearchStrategy[str]:
    return st.sampled_from([str(v) for v in values])


def _integers(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.integers(lo, hi).map(str)


# ---- everything the tracer handles -----------------------------------------------------------

TRACE_TABLE = 16
"""The length of TRACE_*'s 1-D captured tables (``int_table``, ``int32_table``, ``float_table``,
``bool_table``, ``doc``; ``head_table`` is ``[H, 16]``, ``offsets`` indexed by ``doc``'s values)."""

_T = TRACE_TABLE  # (short, for the templates below)
TRACE_SCORE = Grammar(
    leaves={
        # relative positions: negatives are common
        "int": (*INPUTS, "(q_idx - kv_idx)", "(kv_idx - q_idx)"),
        "bool": ("({input} {cmp} {const})", "({input} {cmp} {input})"),
        "float": ("({input} * 0.5)", f"float_table[{{input}} % {_T}]", "score", "score"),
    },
    forms={
        "int": ("({int} + {int})", "({int} - {const})", "({const} - {int})", "({int} * {const})",
                "({int} // {positive})", "({int} % {positive})", "abs({int})", "(-{int})", "{int}.abs()",
                "torch.minimum({int}, {int})", "torch.maximum({int}, {int})", "torch.clamp({int}, {const}, {const})",
                "torch.where({bool}, {int}, {const})", "torch.where({bool}, {int}, {int})",
                f"int_table[{{int}} % {_T}]", f"int32_table[{{int}} % {_T}]", f"offsets[doc[{{int}} % {_T}]]",
                "({bool} * {const})", "(({int} % 5) ** 2)"),
        "bool": ("({int} {cmp} {int})", "({float} {cmp} {float_const})", "({bool} & {bool})", "({bool} | {bool})",
                 "({bool} ^ {bool})", "(~{bool})", f"bool_table[{{int}} % {_T}]", "torch.where({bool}, {bool}, {bool})",
                 "torch.logical_and({bool}, {bool})", "{bool}.logical_or({bool})"),
        "float": ("({float} + {float})", "({float} - {float})", "({float} * {float})", "({float} * {float_const})",
                  "({float} / {float_const})", "(1.0 / ({float}.abs() + 1.0))", "({int} / {positive})",
                  "torch.tanh({float})", "torch.sigmoid({float})", "torch.exp({float})", "torch.sin({float})",
                  "torch.floor({float})", "torch.log(torch.abs({float}) + 1.0)", "torch.sqrt(torch.abs({float}))",
                  "{float}.tanh()", "torch.minimum({float}, {float})", "torch.maximum({float}, {int})",
                  "torch.clamp({float}, -1.5, 2.5)", "torch.where({bool}, {float}, {float_const})",
                  "torch.where({bool}, {float}, {float})", "torch.where({bool}, {float}, -float('inf'))",
                  f"float_table[{{int}} % {_T}]", f"head_table[h, {{int}} % {_T}]", "{int}.float()",
                  "(-{float})", "abs({float})"),
    },
    atoms={"input": st.sampled_from(INPUTS), "cmp": st.sampled_from(COMPARISONS), "const": _integers(-6, 20),
           "positive": _integers(1, 7), "float_const": _strings(["0.5", "-1.25", "2.0", "0.1", "3.0", "-0.75"])},
    depth=3, leaf_odds={"int": 5, "bool": 4, "float": 5},
)
TRACE_MASK = TRACE_SCORE.replace(leaves={"float": TRACE_SCORE.leaves["float"][:2]})  # mask_mods have no score


@st.composite
def mask_sources(draw, grammar: Grammar = TRACE_MASK, depths=st.integers(1, 4)) -> str:
    """A mask_mod's source: a boolean expression of ``grammar``, 1 to 4 forms deep."""
    return mask_source(draw(grammar.expressions("bool", draw(depths))))


@st.composite
def score_sources(draw, grammar: Grammar = TRACE_SCORE, depths=st.integers(1, 4)) -> str:
    """A score_mod's source: a float expression of ``grammar``, or now and then the score plus an
    integer expression (an int term promoted by the score)."""
    if draw(st.integers(0, 5)) == 0:
        return score_source(f"score + {draw(grammar.expressions('int', 3))}")
    return score_source(draw(grammar.expressions("float", draw(depths))))


# ---- integer graphs: q, kv, h, a captured 0-d ``off``, ``table`` (8 int32 values) ------------

INTEGER_GRAPHS = Grammar(
    leaves={"int": ("q", "kv", "h", "off", "table[kv % 8]", "{const}")},
    forms={"int": ("({int} + {int})", "({int} - {int})", "({int} * {int})", "({int} // {divisor})",
                   "({int} % {divisor})", "torch.minimum({int} + q * 0, {int} + q * 0)",
                   "torch.maximum({int} + q * 0, {int} + q * 0)",
                   "torch.where({int:a} + q * 0 > {int:b}, {int:a} + q * 0, {int:b})")},
    atoms={"const": _integers(-300, 300), "divisor": _strings([1, 3, -4, 128])},
    depth=3,
)

# ---- affine forms in q and kv, compared and combined: q, kv, a captured 0-d ``off``, a captured
# number ``n``, ``table`` (8 int32 values) --------------------------------------------------------

AFFINE_CONDITIONS = Grammar(
    leaves={"int": ("q", "kv", "off", "{const}", "table[q % 8]", "n"),
            "bool": ("(({int}) + q * 0 {cmp} ({int}))",)},
    # products by a constant only (a product of two kv terms is not affine)
    forms={"int": ("({int} + {int})", "({int} - {int})", "({int} * {coefficient})", "(-{int})"),
           "bool": ("({bool} & {bool})", "({bool} | {bool})", "({bool} ^ {bool})", "(~{bool})",
                    "torch.where({bool}, {bool}, {bool})")},
    atoms={"const": _integers(-300, 300), "coefficient": _integers(-4, 4), "cmp": st.sampled_from(COMPARISONS)},
    depth=2,
)


# ---- tile masks: constants anywhere, integer tables t0..t2 and boolean tables bt0, bt1 ----------

TILE_MASKS = Grammar(
    leaves={"int": ("{input}", "{const}"),
            "bool": ("as_tensor({int}).{compare}({int})", "{bool_table:t}[{int} % len({bool_table:t})]")},
    forms={"int": ("({int} + {int})", "({int} - {int})", "({int} * {factor})", "({int} // {divisor})",
                   "({int} % {divisor})", "torch.minimum(as_tensor({int}), as_tensor({int}))",
                   "torch.maximum(as_tensor({int}), as_tensor({int}))", "abs({int})",
                   "torch.where(as_tensor({int}).{compare}({int}), {int}, {int})",
                   "{table:t}[{int} % len({table:t})]"),  # any index lands in range
           "bool": ("({bool} & {bool})", "({bool} | {bool})", "({bool} ^ {bool})", "(~{bool})")},
    atoms={"input": st.sampled_from(INPUTS), "const": _integers(-40, 40), "factor": _integers(-3, 3),
           "divisor": _strings([1, 2, 3, 7, 16, -5]), "compare": st.sampled_from(COMPARISON_METHODS),
           "table": st.sampled_from(["t0", "t1", "t2"]), "bool_table": st.sampled_from(["bt0", "bt1"])},
    depth={"int": 3, "bool": 2},
)


def affine_forms(unit_steps: bool = False) -> st.SearchStrategy[dict[str, int]]:
    """An affine form's coefficients by input (``{"b": 2, "h": 0, "q_idx": -1, "kv_idx": 3}``), each in
    [-3, 3]; ``unit_steps`` keeps q_idx's and kv_idx's in [-1, 1], so the form moves in unit steps
    along a tile's rows and columns."""
    coefficient = st.integers(-1, 1) if unit_steps else st.integers(-3, 3)
    return st.fixed_dictionaries({name: coefficient if name in ("q_idx", "kv_idx") else st.integers(-3, 3)
                                  for name in INPUTS})


# ---- the Triton printer: every op of the IR -------------------------------------------------------

PRINTER_EXPRESSIONS = Grammar(
    leaves={"int": ("{input}", "{const}"),
            "float": ("score", "{float_const}", "as_tensor({int}).float()")},
    forms={"int": ("({int} + {int})", "({int} - {int})", "({int} * {int})",
                   "torch.minimum(as_tensor({int}), as_tensor({int}))",
                   "torch.maximum(as_tensor({int}), as_tensor({int}))",
                   "({int} & {int})", "({int} | {int})", "({int} ^ {int})",
                   "({int} // {nonzero})", "({int} % {nonzero})",  # by a constant or by a variable
                   "({int} // (({int} % 5) + 1))", "({int} % (({int} % 5) + 1))",
                   "(-{int})", "abs({int})", "torch.where(as_tensor({int}) {cmp} {int}, {int}, {int})"),
           "float": ("({float} + {float})", "({float} - {float})", "({float} * {float})",
                     "torch.minimum(as_tensor({float}), as_tensor({float}))",
                     "torch.maximum(as_tensor({float}), as_tensor({float}))", "({float} / {divisor})",
                     "torch.tanh(as_tensor({float}))", "torch.sigmoid(as_tensor({float}))",
                     "torch.sin(as_tensor({float}))", "(-{float})", "abs({float})",
                     "torch.floor(as_tensor({float}))", "torch.exp(-torch.abs(as_tensor({float})))",
                     "torch.sqrt(torch.abs(as_tensor({float})))",
                     "torch.where(as_tensor({int}) {cmp} {int}, {float}, {float})")},
    atoms={"input": st.sampled_from(INPUTS), "const": _integers(-7, 7), "nonzero": _strings([-5, -3, -1, 2, 3, 7]),
           "float_const": _strings([-2.5, -1.0, 0.5, 3.0]), "divisor": _strings([-4.0, 0.5, 3.0]),
           "cmp": st.sampled_from(COMPARISONS)},
    depth=3,
)


# ---- differentiable float expressions: s, q, kv, h, captured ``bias`` [H] and ``table`` [S] ------

DIFFERENTIABLE = Grammar(
    leaves={"float": ("s", "(s * 0.5)", "((q - kv) * 0.1)", "bias[h]", "(table[kv] * s)")},
    forms={"float": (
        # one argument
        "torch.tanh({float})", "torch.sigmoid({float})", "torch.sin({float})", "torch.cos({float})",
        "torch.abs({float})", "(-{float})", "torch.exp(torch.tanh({float}))", "torch.exp2(torch.sin({float}))",
        "torch.log(torch.abs({float}) + 1.0)", "torch.sqrt(torch.abs({float}) + 0.5)",
        "torch.rsqrt({float:x} * {float:x} + 0.5)", "({float} ** 2)", "((torch.abs({float}) + 0.5) ** 1.5)",
        "torch.clamp({float}, -1.0, 1.0)",
        # a float cast that keeps float64 values: torch rounds gradients at a `.float()` node to float32,
        # which no seed-independent derivative can reproduce (the kink tests cover the rounding cast)
        "{float}.double()",
        # two
        "({float} + {float})", "({float} - {float})", "({float} * {float})", "({float} / (torch.abs({float}) + 1.0))",
        "torch.minimum({float}, {float})", "torch.maximum({float}, {float})",
        "torch.where({float:x} > {float:y}, {float:x}, {float:y} * 0.5)")},
    atoms={},
    depth=3,
)


# ---- packed causal sequences: causal attention inside runs of a per-batch sequence id ----------

DISTURBANCES = ("none", "drop a pair", "add a later key", "add an earlier sequence's key", "window", "shifted diagonal",
                "spread a row")


@st.composite
def packed_causal_masks(draw):
    """``(mask_mod, B, L, S, BLOCK_SIZE, disturbance)``: each batch's positions cut into up to three
    sequences at random boundaries (captured ``[B, max(L, S)]`` ids), causal attention inside each, then perhaps
    one of :data:`DISTURBANCES`: a mask close to, but not of, that form."""
    B = draw(st.integers(1, 2))
    # long enough for sequences of MIN_MEAN_ROWS (causal_call) rows, the row disturbed past the first
    L, S = draw(st.integers(48, 160)), draw(st.integers(48, 160))
    block = draw(st.sampled_from([16, 32, (16, 32), (32, 16)]))
    n = max(L, S)
    ids = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        for boundary in draw(st.lists(st.integers(1, n - 1), max_size=2)):
            ids[b, boundary:] += 1
    kind = draw(st.sampled_from(DISTURBANCES))
    q0 = draw(st.integers(L // 3, L - 1))
    k0 = draw(st.integers(0, S - 1))
    width = draw(st.integers(1, 40))

    # (the row q0 of each batch, its sequence's start s: keys s + 1 and q0 - 1 swapped for s - 1 and
    # q0 + 1, which keeps the row's key count and key sum)
    first = torch.tensor([int((ids[b] == ids[b, q0]).nonzero()[0]) for b in range(B)])

    def mask_mod(b, h, q, kv):
        base = (ids[b, q] == ids[b, kv]) & (q >= kv)
        if kind == "spread a row":
            s = first[b]
            at = q == q0
            return (base & ~(at & ((kv == s + 1) | (kv == q0 - 1)))) | (at & ((kv == s - 1) | (kv == q0 + 1)))
        if kind == "drop a pair":
            return base & ~((q == q0) & (kv == min(k0, q0)))
        if kind == "add a later key":
            return base | ((q == q0) & (kv == min(q0 + 1 + k0 % 3, S - 1)))
        if kind == "add an earlier sequence's key":
            return base | ((q == q0) & (kv == k0 % (q0 + 1)))
        if kind == "window":
            return base & (q - kv < width)
        if kind == "shifted diagonal":
            return (ids[b, q] == ids[b, kv]) & (q + 1 >= kv)
        return base
    return mask_mod, B, L, S, block, kind


# ---- contents changed between calls without moving the tensor's version counter -----------------

# ways to give a tensor other elements: the first three leave its version counter where it was
SWAPS = (".data = new", ".data = a view of another storage", "vector_to_parameters", "set_", "in-place write")


def swap_in(t: torch.Tensor, new: torch.Tensor, how: str) -> None:
    """Give ``t`` the values of ``new`` as ``how`` (one of :data:`SWAPS`) says; ``t``'s old storage is
    then free unless something else holds it."""
    with torch.no_grad():
        if how == ".data = new":
            t.data = new.clone()
        elif how == ".data = a view of another storage":  # (offset 3 in a larger storage)
            base = torch.empty(new.numel() + 3, dtype=new.dtype)
            base[3:] = new.flatten()
            t.data = base[3:].view(new.shape)
        elif how == "vector_to_parameters":  # (it sets each parameter's .data)
            torch.nn.utils.vector_to_parameters(new.flatten().clone(), [t])
        elif how == "set_":
            t.set_(new.clone())
        else:
            t.copy_(new)


@st.composite
def document_ids(draw, n: int, max_documents: int = 3) -> torch.Tensor:
    """``[n]`` int64 document ids: up to ``max_documents`` runs of at least ``n // 4`` positions (long
    enough for flexc's causal kernel calls), in order."""
    cuts = draw(st.lists(st.integers(1, 3), max_size=max_documents - 1, unique=True))
    ids = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        ids[c * n // 4:] += 1
    return ids


# ---- one keyed input of a flex_attention call changed between calls -----------------------------

# what a per-call plan cache keys on, one change each (tests/call/test_contents_changes.py applies them)
KEYED_CHANGES = (
    "q k or v values",  # in place or swapped in as SWAPS says
    "q k or v at a reused address",  # deleted, then a tensor of the same size allocated
    "lengths", "head dim", "batch and heads", "gqa", "layout", "dtype",
    "another mask", "mask table in place", "mask table .data", "mask.mask_mod =", "mask.seq_lengths =",
    "no mask",
    "new score_mod closure", "captured tensor rebound", "captured tensor values", "global read by the mod",
    "no score_mod",
    "scale", "kernel_options", "outputs", "sinks values", "sinks shape",
)
# the ones a training step takes (a table edited under a mask whose q tables were derived is a user's error)
TRAINING_CHANGES = tuple(c for c in KEYED_CHANGES if not c.startswith(("mask table", "mask.", "dtype")))


def keyed_changes(changes: Sequence[str] = KEYED_CHANGES, max_size: int = 6) -> st.SearchStrategy:
    """``[(change, seed)]``: changes of :data:`KEYED_CHANGES` to make between calls, each with the seed
    of its new values."""
    return st.lists(st.tuples(st.sampled_from(changes), st.integers(0, 1 << 16)), min_size=1, max_size=max_size)
