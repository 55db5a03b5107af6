"""The expression graph every flexc consumer reads.

A traced mod is a DAG of :class:`Node` objects. Nodes are hash-consed: building the same
operation on the same operands twice returns the same object, so structural equality is identity,
common subexpressions are shared for free, and a node can key a cache directly. Captured tensors
appear as ``buffer`` nodes that record only their slot, dtype and rank, never their values, so two
closures that differ only in a captured tensor's contents produce the same graph.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Iterator

BOOL, INT, FLOAT = "bool", "int", "float"

# The five mod inputs and their kinds.
INPUT_KINDS = {"score": FLOAT, "b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}

UNARY_OPS = {
    # name: result kind rule ("same", FLOAT, BOOL, INT)
    "neg": "same", "abs": "same", "sign": "same", "not": "same",
    "exp": FLOAT, "exp2": FLOAT, "log": FLOAT, "log2": FLOAT, "sqrt": FLOAT, "rsqrt": FLOAT,
    "tanh": FLOAT, "sigmoid": FLOAT, "sin": FLOAT, "cos": FLOAT,
    "floor": "same", "ceil": "same",
    # the rest of torch's elementwise math (flexc.mods.elementwise maps torch's names onto these)
    "tan": FLOAT, "atan": FLOAT, "asin": FLOAT, "acos": FLOAT, "sinh": FLOAT, "cosh": FLOAT,
    "asinh": FLOAT, "acosh": FLOAT, "atanh": FLOAT, "erf": FLOAT, "erfc": FLOAT, "expm1": FLOAT,
    "log1p": FLOAT, "log10": FLOAT, "trunc": "same", "round": "same",
}
ARITH_OPS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "min", "max", "fmod"}
SHIFT_OPS = {"lshift", "rshift"}  # integers only; shifts by a constant are traced as * and //
FLOAT_BINARY_OPS = {"atan2"}  # float result whatever the operands
LOGIC_OPS = {"and", "or", "xor"}
COMPARE_OPS = {"eq", "ne", "lt", "le", "gt", "ge"}
BINARY_OPS = ARITH_OPS | LOGIC_OPS | COMPARE_OPS | SHIFT_OPS | FLOAT_BINARY_OPS

SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
# Python precedence, higher binds tighter; used by the printer to drop needless parentheses.
_PRECEDENCE = {
    "or": 1, "xor": 2, "and": 3,
    "eq": 4, "ne": 4, "lt": 4, "le": 4, "gt": 4, "ge": 4, "lshift": 5, "rshift": 5,
    "add": 6, "sub": 6, "mul": 7, "truediv": 7, "floordiv": 7, "mod": 7,
    "neg": 8, "not": 8, "pow": 9,
}


def promote(*kinds: str) -> str:
    """The kind of an arithmetic result: float beats int beats bool."""
    if FLOAT in kinds:
        return FLOAT
    if INT in kinds:
        return INT
    return BOOL


class Node:
    """One operation in a traced mod.

    ``op`` names the operation, ``args`` holds operand nodes, ``attr`` holds non-node data
    (an input's name, a constant's value, a buffer's ``(slot, dtype, ndim)``, a cast's dtype),
    and ``kind`` is ``"bool"``, ``"int"`` or ``"float"``. Create nodes only through :func:`make`.
    """

    __slots__ = ("op", "args", "attr", "kind", "__weakref__")

    def __init__(self, op: str, args: tuple, attr: Any, kind: str) -> None:
        self.op, self.args, self.attr, self.kind = op, args, attr, kind

    def __repr__(self) -> str:
        return f"Node({format_expr(self)})"

    def __str__(self) -> str:
        return format_expr(self)

    def __bool__(self) -> bool:  # a Node is always truthy as a Python object
        return True

    def walk(self) -> Iterator["Node"]:
        """Every node reachable from this one, operands before users, each once."""
        seen: set[int] = set()
        order: list[Node] = []
        stack: list[tuple[Node, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for arg in reversed(node.args):
                if id(arg) not in seen:
                    stack.append((arg, False))
        return iter(order)


# Weak values: a node lives as long as someone (a TracedMod, a cache, a user node) holds it, so
# traces with ever-new constants do not grow the table forever. A live node holds its operands,
# so the operand ids inside its key stay valid for as long as the entry exists.
_table: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
_table_lock = threading.Lock()


def _const_key(value: Any) -> Any:
    # 1, 1.0 and True compare equal in Python but are different constants here.
    return (type(value).__name__, repr(value))


def make(op: str, args: tuple = (), attr: Any = None, kind: str | None = None) -> Node:
    """Return the unique node for ``(op, args, attr)``, creating it on first use."""
    if kind is None:
        kind = infer_kind(op, args, attr)
    key = (op, tuple(map(id, args)), _const_key(attr) if op == "const" else attr, kind)
    node = _table.get(key)
    if node is None:
        with _table_lock:
            node = _table.get(key)
            if node is None:
                node = Node(op, tuple(args), attr, kind)
                _table[key] = node
    return node


def infer_kind(op: str, args: tuple, attr: Any) -> str:
    """The result kind of ``op`` on ``args``, following torch's promotion (bool < int < float)."""
    kinds = [a.kind for a in args]
    if op in COMPARE_OPS:
        return BOOL
    if op in LOGIC_OPS:
        return promote(*kinds)
    if op == "truediv" or op in FLOAT_BINARY_OPS:
        return FLOAT
    if op in ARITH_OPS or op in SHIFT_OPS:
        return promote(*kinds)
    if op in UNARY_OPS:
        rule = UNARY_OPS[op]
        if rule != "same":
            return rule
        if op == "neg" and kinds[0] == BOOL:
            raise ValueError("negation of a bool value")
        return kinds[0]
    if op == "where":
        return promote(kinds[1], kinds[2])
    raise ValueError(f"cannot infer the kind of op {op!r}; pass kind=")


# ---- constructors -------------------------------------------------------------------------

def input_(name: str) -> Node:
    """One of the mod's arguments: ``score``, ``b``, ``h``, ``q_idx`` or ``kv_idx``."""
    return make("input", (), name, INPUT_KINDS[name])


def const(value: bool | int | float) -> Node:
    """A Python constant; ``1``, ``1.0`` and ``True`` are three different constants."""
    kind = BOOL if isinstance(value, bool) else INT if isinstance(value, int) else FLOAT
    return make("const", (), value, kind)


def scalar(index: int, kind: str, name: str) -> Node:
    """A captured Python number lifted out of the graph (:mod:`flexc.codegen.scalars`): generated
    kernels take its value as argument ``index``, so new values reuse the kernel."""
    return make("scalar", (), (index, kind, name), kind)


def buffer(slot: int, dtype: str, ndim: int, kind: str) -> Node:
    """A captured tensor: only its slot, dtype name and rank enter the graph."""
    return make("buffer", (), (slot, dtype, ndim), kind)


def load(buf: Node, indices: tuple[Node, ...]) -> Node:
    """``buf[indices]``: one index node per dimension of the captured tensor (none for 0-d)."""
    return make("load", (buf, *indices), None, buf.kind)


def cast(x: Node, dtype: str, kind: str) -> Node:
    """``x.to(dtype)``; ``dtype`` is a torch dtype name such as ``"float32"``."""
    return make("cast", (x,), dtype, kind)


def unary(op: str, x: Node) -> Node:
    """An op from :data:`UNARY_OPS` applied to ``x``."""
    return make(op, (x,))


def binary(op: str, x: Node, y: Node) -> Node:
    """An op from :data:`BINARY_OPS` (``min``/``max`` are elementwise) applied to ``x`` and ``y``."""
    return make(op, (x, y))


def where(cond: Node, x: Node, y: Node) -> Node:
    """``torch.where(cond, x, y)``; ``cond`` must be a bool node."""
    return make("where", (cond, x, y))


# ---- printing -----------------------------------------------------------------------------

def format_expr(node: Node, buffer_names: tuple[str, ...] | None = None) -> str:
    """A Python-like, parenthesis-minimal rendering of ``node``.

    Nodes used more than once are still printed inline: mods are small, and an expression reads
    better than a list of temporaries.
    """

    def name_of(slot: int) -> str:
        if buffer_names is not None and slot < len(buffer_names):
            return buffer_names[slot]
        return f"buf{slot}"

    def fmt(n: Node, parent_prec: int = 0) -> str:
        op = n.op
        if op == "input":
            return n.attr
        if op == "const":
            v = n.attr
            if isinstance(v, float) and v in (float("inf"), float("-inf")):
                text = "-inf" if v < 0 else "inf"
            else:
                text = repr(v)
            # `(-2) ** q_idx` and `(-3).to(...)` need parentheses; `q_idx * -3` does not
            return f"({text})" if text.startswith("-") and parent_prec >= _PRECEDENCE["pow"] else text
        if op == "buffer":
            return name_of(n.attr[0])
        if op == "scalar":
            return n.attr[2]
        if op == "load":
            if len(n.args) == 1:  # a 0-d captured tensor reads as its name
                return fmt(n.args[0])
            idx = ", ".join(fmt(a) for a in n.args[1:])
            return f"{fmt(n.args[0])}[{idx}]"
        if op == "cast":
            inner = fmt(n.args[0], 10)
            return f"({inner}).to({n.attr})" if n.args[0].op == "const" and inner[0] != "(" else f"{inner}.to({n.attr})"
        if op == "where":
            return f"where({fmt(n.args[0])}, {fmt(n.args[1])}, {fmt(n.args[2])})"
        if op == "axis":  # a reduction's loop variable (flexc.mods.reductions)
            return "r"
        if op == "reduce":
            return f"{n.attr[0]}({fmt(n.args[0])} for r in range({n.attr[1]}))"
        if op == "autograd_function":  # a torch.autograd.Function; args[0] is its traced forward
            return f"{n.attr.__name__}.apply({', '.join(fmt(a) for a in n.args[1:])})"
        if op in ("min", "max"):
            return f"{op}imum({fmt(n.args[0])}, {fmt(n.args[1])})"
        if op in BINARY_OPS and op not in SYMBOLS:  # fmod, atan2: function form
            return f"{op}({fmt(n.args[0])}, {fmt(n.args[1])})"
        if op in BINARY_OPS:
            prec = _PRECEDENCE[op]
            # comparisons and bitwise ops get explicit parentheses as operands: `(a >= b) & (c < d)`
            left = fmt(n.args[0], prec + (1 if op == "pow" else 0))
            right = fmt(n.args[1], prec + (0 if op == "pow" else 1))
            text = f"{left} {SYMBOLS[op]} {right}"
            needs = prec < parent_prec or (op in COMPARE_OPS | LOGIC_OPS and parent_prec > 0)
            return f"({text})" if needs else text
        if op == "neg":
            text = f"-{fmt(n.args[0], _PRECEDENCE['neg'])}"
            return f"({text})" if _PRECEDENCE["neg"] < parent_prec else text
        if op == "not":
            return f"~{fmt(n.args[0], 10)}"
        if op in UNARY_OPS:
            return f"{op}({fmt(n.args[0])})"
        return f"{op}({', '.join(fmt(a) for a in n.args)})"

    return fmt(node)


@functools.lru_cache(maxsize=1024)
def inputs_read(root: Node) -> frozenset[str]:
    """The mod arguments (``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``) a graph reads.

    Cached by graph: graphs are shared (hash-consed), and a compiled call rebuilds its TracedMod
    every call around the same graph."""
    return frozenset(node.attr for node in root.walk() if node.op == "input")
