"""One trace for every value of a closure's captured numbers and tensors (gpt-fast's decoding idiom).

A decoding loop makes a new mask_mod each step, ``lambda b, h, q_idx, kv_idx: q_idx + offset >=
kv_idx`` with ``offset`` a new Python int or 0-d tensor. Traced per value, every token pays for
a trace. Here such a cell is *lifted*: the mod is traced once with a placeholder in the cell, and
each new value is substituted into that template's graph.

The substitution must give exactly the graph a trace with the value gives, so a cell is lifted only
where nothing can observe its value but the graph:

- statically, every load of the cell in the mod's bytecode feeds an arithmetic operator or a
  comparison, directly or after one other load (``q_idx + offset``, ``offset <= kv_idx``), and no
  nested function or store touches it;
- at run time a number cell holds a :class:`Marker` that refuses every use but an operator with a
  tracer proxy (``offset + 1``, ``bool(offset)``, hashing, printing raise, and the mod is traced
  with the value instead);
- in the template, each placeholder is an operand of ``+ - * /`` or a comparison whose other operand
  torch would not convert it for (a narrow integer tensor wraps a Python int: value-dependent);
- a tensor cell's tensor is itself one of the trace's buffers (not a value computed from it) and
  shares no identity with other captured tensors; its dtype, shape, device and grad flag are part
  of the cache key (:mod:`flexc.mods.trace_cache`), as the graph depends on them.
"""
from __future__ import annotations

import dataclasses
import dis
import math
import types
from typing import Any

import torch

from . import ir
from .promotion import node_dtype

# ops where substituting ``const(v)`` for the placeholder rebuilds exactly what the tracer builds
_SUBSTITUTABLE_OPS = frozenset({"add", "sub", "mul", "truediv"}) | ir.COMPARE_OPS
_OPERATORS = frozenset({"+", "-", "*", "/", "+=", "-=", "*=", "/="})
_PUSHES = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_CONST",
                     "LOAD_SMALL_INT"})
_NUMBER_TYPES = (int, float)  # exact types: bool is a structural constant
_memo: dict = {}  # id(code) -> (code, liftable cell indices)


def liftable_cells(code: types.CodeType) -> tuple[int, ...]:
    """Indices (into ``__closure__``) of the free variables ``code`` uses only as operator operands."""
    entry = _memo.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    result = _liftable(code)
    _memo[id(code)] = (code, result)  # the code object is kept so its id is never reused
    return result


def _liftable(code: types.CodeType) -> tuple[int, ...]:
    if not code.co_freevars:
        return ()
    nested = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested.update(const.co_freevars)
    instructions = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG", "NOP")]
    ok = {name: True for name in code.co_freevars if name not in nested and name not in code.co_cellvars}
    for at, ins in enumerate(instructions):
        name = ins.argval
        if name not in ok or not isinstance(name, str):
            continue
        if ins.opname == "LOAD_DEREF":
            ok[name] = ok[name] and _feeds_operator(instructions, at)
        elif "DEREF" in ins.opname or ins.opname == "LOAD_CLOSURE":  # stored, deleted, or shared
            ok[name] = False
    return tuple(i for i, name in enumerate(code.co_freevars) if ok.get(name))


def _feeds_operator(instructions: list, at: int) -> bool:
    def operator(i: int) -> bool:
        if i >= len(instructions):
            return False
        ins = instructions[i]
        return ins.opname == "COMPARE_OP" or ins.opname == "BINARY_OP" and ins.argrepr in _OPERATORS
    return operator(at + 1) or (at + 1 < len(instructions) and instructions[at + 1].opname in _PUSHES
                                and operator(at + 2))


def liftable_value(value: Any) -> bool:
    """Whether a cell's value is of a kind lifted: a Python int or float, or a plain strided tensor."""
    return type(value) in _NUMBER_TYPES or type(value) is torch.Tensor and value.layout is torch.strided


class NotLiftable(Exception):
    """The mod used a lifted number other than as an operand of a proxy: trace with the value."""


class Marker:
    """Stands in for a captured number while the template is traced."""

    __slots__ = ("node",)

    def __init__(self, index: int, value: int | float, name: str):
        kind = ir.INT if type(value) is int else ir.FLOAT
        self.node = ir.scalar(index, kind, f"cell {name}")

    def _refuse(self, *args):
        raise NotLiftable

    __bool__ = __index__ = __int__ = __float__ = __hash__ = __format__ = __repr__ = __str__ = _refuse
    __len__ = __iter__ = __getattr__ = __complex__ = __round__ = __abs__ = __neg__ = __pos__ = _refuse


def _operator(name: str):
    def method(self, other):
        if getattr(type(other), "is_trace_proxy", False):  # (by mark: the tracer imports this module)
            return NotImplemented  # the proxy's reflected operator takes the marker
        raise NotLiftable
    method.__name__ = name
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
              "rshift", "matmul", "divmod"):
    setattr(Marker, f"__{_name}__", _operator(f"__{_name}__"))
    setattr(Marker, f"__r{_name}__", _operator(f"__r{_name}__"))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Marker, f"__{_name}__", _operator(f"__{_name}__"))


@dataclasses.dataclass(eq=False)
class Template:
    """A trace with placeholders: ``numbers`` maps placeholder index -> cell index, ``tensors`` maps
    buffer slot -> cell index; ``latest`` is set by :mod:`flexc.mods.trace_cache`."""

    traced: Any  # TracedMod with ``scalar`` placeholder nodes
    numbers: tuple
    tensors: tuple
    # the nodes that read a placeholder, operands first: (node, its operands' places), a place
    # being ("scalar", index), ("node", position in this list) or ("same", node)
    recipe: tuple = ()
    latest: Any = None  # ((values, trace, kept objects, located tensors), ...) of the latest instantiations


def _recipe(root: ir.Node) -> tuple:
    steps, position = [], {}
    for node in root.walk():
        if node.op == "scalar":
            position[id(node)] = ("scalar", node.attr[0])
            continue
        places = tuple(position.get(id(a), ("same", a)) for a in node.args)
        if any(p[0] != "same" for p in places):
            position[id(node)] = ("node", len(steps))
            steps.append((node, places))
    return tuple(steps)


def clone_with_markers(fn: types.FunctionType, cells: tuple[int, ...]) -> tuple[types.FunctionType, dict]:
    """``fn`` with its lifted number cells holding markers (tensor cells keep their tensors), and
    ``{placeholder index: cell index}``."""
    contents, numbers = [], {}
    for i, cell in enumerate(fn.__closure__):
        value = cell.cell_contents
        if i in cells and type(value) in _NUMBER_TYPES:
            numbers[len(numbers)] = i
            value = Marker(len(numbers) - 1, value, fn.__code__.co_freevars[i])
        contents.append(types.CellType(value))
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(contents))
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone, numbers


def template_of(traced: Any, fn: types.FunctionType, cells: tuple[int, ...], numbers: dict) -> Template | None:
    """The template of ``traced`` (the clone's trace), or None where substitution would not be exact."""
    if traced.derivations is not None:
        return None
    for node in traced.root.walk():
        for i, arg in enumerate(node.args):
            if arg.op != "scalar":
                continue
            if node.op not in _SUBSTITUTABLE_OPS or len(node.args) != 2:
                return None
            other = node.args[1 - i]
            dtype = node_dtype(other)
            # a Python int next to a narrow integer tensor is wrapped to its dtype: value-dependent
            if arg.kind == ir.INT and dtype is not None and not (
                    dtype in (torch.bool, torch.int64) or dtype.is_floating_point or dtype.is_complex):
                return None
    tensors = {}
    for i in cells:
        value = fn.__closure__[i].cell_contents
        if type(value) is torch.Tensor:
            slots = [s for s, t in enumerate(traced.buffers) if t is value]
            if len(slots) != 1:  # not read directly (or not at all): the graph may hold its value
                return None
            tensors[slots[0]] = i
    return Template(traced, tuple(numbers[k] for k in sorted(numbers)), tuple(sorted(tensors.items())),
                    _recipe(traced.root))


def instantiate(template: Template, fn: types.FunctionType) -> Any:
    """The trace of ``fn`` (same code and cell kinds as the template's) from the template, or None
    when a value cannot be substituted (a NaN, which the tracer rejects with its own message)."""
    traced = template.traced
    closure = fn.__closure__
    values = tuple(closure[c].cell_contents for c in template.numbers)
    if any(type(v) is float and math.isnan(v) for v in values):
        return None
    consts = [ir.const(v) for v in values]
    made: list[ir.Node] = []
    rebuilt: dict[ir.Node, ir.Node] = {}
    for node, places in template.recipe:
        args = tuple(consts[i] if kind == "scalar" else made[i] if kind == "node" else i for kind, i in places)
        made.append(ir.make(node.op, args, node.attr, node.kind))
        rebuilt[node] = made[-1]
    root = rebuilt.get(traced.root, traced.root)
    buffers = traced.buffers
    if template.tensors:
        buffers = list(buffers)
        for slot, cell in template.tensors:
            buffers[slot] = closure[cell].cell_contents
        buffers = tuple(buffers)
    sites = {rebuilt.get(n, n): site for n, site in traced.sites.items()} if traced.sites else traced.sites
    # (the constructor, not dataclasses.replace: this runs every decoding step)
    return type(traced)(kind=traced.kind, root=root, buffers=buffers, buffer_names=traced.buffer_names,
                        name=traced.name, fn=fn, sites=sites, scalars=traced.scalars, derivations=None,
                        lifted=(root, traced.root, values))


def structure(traced: Any) -> tuple[ir.Node, Any]:
    """``(graph, its scalar values)`` for analyses cached by graph: an instantiated trace answers
    with its template's graph (the same for every value) and the values, others with their root and
    ``.scalars``; so a new decoding offset does not redo work keyed by the graph."""
    lifted = traced.lifted
    if lifted is not None and lifted[0] is traced.root:  # (a replace() that changed root drops it)
        return lifted[1], lifted[2]
    return traced.root, traced.scalars


__all__ = ["Marker", "NotLiftable", "Template", "clone_with_markers", "instantiate", "liftable_cells",
           "liftable_value", "structure", "template_of"]
