"""Print a traced mod as a ``@triton.jit`` function.

:func:`render_mod` turns a :class:`~flexc.TracedMod` into the text of one Triton device function
whose parameters are the mod's own arguments followed by one pointer (plus strides, plus sizes
where an index may be negative) per captured tensor. The body keeps torch's semantics where Triton
differs: integer ``//`` and ``%`` round like Python (Triton truncates), ``/`` on integers is true
division, negative lookups count from the end, and math functions run in float32 (Triton's
``tl.exp`` and friends accept fp32/fp64 only). Sub-expressions with no input are folded to
literals, and a node used twice is computed once into a temporary ``t<k>``.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace


from ..mods import ir
from ..mods.evaluate import evaluate
from ..mods.lowering import scalar_form
from ..mods.trace import TracedMod
from ..constants import LOG2E, TWO_LOG2E
from .triton_helpers import FAST_HELPERS, FAST_MATH_OPS, LIBDEVICE_NAMES, MATH_HELPERS, with_needs

# Python operator precedence (higher binds tighter); what decides where parentheses go.
_ATOM, _POW, _UNARY, _MUL, _ADD, _BAND, _BXOR, _BOR, _CMP = 12, 11, 10, 9, 8, 6, 5, 4, 3
_SHIFT = 7  # between + and &, as in Python
_BINARY = {
    "add": ("+", _ADD), "sub": ("-", _ADD), "mul": ("*", _MUL), "and": ("&", _BAND),
    "or": ("|", _BOR), "xor": ("^", _BXOR), "eq": ("==", _CMP), "ne": ("!=", _CMP),
    "lt": ("<", _CMP), "le": ("<=", _CMP), "gt": (">", _CMP), "ge": (">=", _CMP),
}
_MATH = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sqrt": "tl.sqrt",
         "rsqrt": "tl.rsqrt", "sin": "tl.sin", "cos": "tl.cos", "floor": "tl.floor", "ceil": "tl.ceil"}
_TL_DTYPES = {
    "float32": "tl.float32", "float64": "tl.float64", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
    "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8", "uint8": "tl.uint8",
    "bool": "tl.int1",
}
_WIDE_FLOATS = ("float32", "float64")
_INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")  # never negative inside the kernel
# attr of a tanh/sigmoid node that keeps its accurate lowering under fast math (FAST_MATH=False)
PRECISE = "precise"


@dataclass(frozen=True)
class BufferParam:
    """One kernel parameter that carries a captured tensor: its pointer, a stride or a size."""

    name: str
    slot: int  # the captured tensor's slot; for "scalar", the index into TracedMod.scalars
    what: str  # "ptr", "stride", "size", or "scalar" (a captured Python number, see codegen.scalars)
    dim: int = -1


@dataclass(frozen=True)
class RenderedMod:
    """A mod printed as a Triton device function.

    ``source`` is the ``@triton.jit`` function (empty when the mod folds to the constant
    ``literal``); ``params`` are its captured-tensor parameters after the mod's own arguments;
    ``helpers`` names the :data:`~flexc.codegen.triton_helpers.HELPERS` it calls; ``reads`` the mod inputs it uses.
    """

    fn_name: str
    source: str
    params: tuple[BufferParam, ...]
    helpers: frozenset
    reads: frozenset
    literal: object = None
    expression: str = ""
    uses_libdevice: bool = False  # the source calls triton.language.extra.libdevice (CUDA only)
    # lookups computed by the kernel once per program instead of once per tile (``hoist``): (name,
    # expression) pairs, the expression over b, h and the kernel parameters in ``params``
    hoisted: tuple[tuple[str, str], ...] = ()
    # the function's parameters after the mod's own arguments: the hoisted values, then the
    # captured-value parameters its body reads (``params`` when nothing is hoisted)
    call_args: tuple[str, ...] = ()

    @property
    def is_constant(self) -> bool:
        return not self.source


def python_literal(value: object) -> str:
    """``value`` as Triton-compatible Python source (infinities as ``float("inf")``)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return repr(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("-inf")' if value < 0 else 'float("inf")'
    return repr(float(value))


def _safe_name(name: str, slot: int) -> str:
    return name if name.isidentifier() and not name.startswith("_") else f"buf{slot}"


class _Printer:
    def __init__(self, traced: TracedMod, buffer_prefix: dict[int, str], fn_name: str = "mod",
                 target: str | None = None, scalar_prefix: str | None = None, fast_math: bool | None = None,
                 float_indices: bool = False):
        self.traced = traced
        self.fn_name = fn_name
        self.scalar_prefix = scalar_prefix or fn_name
        # "cuda": transcendental functions from libdevice (the interpreter has no libdevice); None or
        # "interpreter": portable helpers written with tl.exp
        self.target = target
        # fp32 tanh/sigmoid from exp2 and a reciprocal (flexc.codegen.triton_helpers); CUDA's default
        self.fast_math = target == "cuda" if fast_math is None else fast_math
        self.uses: dict[int, int] = {}  # id(node) -> how many times its users read it
        self.uses_libdevice = False
        self.prefix = buffer_prefix  # slot -> parameter stem, e.g. "slopes" for slopes_ptr
        self.params: dict[tuple, BufferParam] = {}
        self.helpers: set[str] = set()
        self.text: dict[int, tuple[str, int]] = {}  # id(node) -> (source, precedence)
        self.literal: dict[int, object] = {}
        self.dtype: dict[int, str | None] = {}
        # every index below 2**23 (exact in float32, offset by 2**23 too): index differences read as
        # floats print in float
        self.float_indices = float_indices
        self.float_differences: set[int] = set()  # id(node) of those differences (find_float_differences)
        self.hoisted: dict[int, str] = {}  # id(load node) -> the name of its per-program value (find_hoisted)
        self.hoisted_text: dict[str, str] = {}  # that name -> the load's expression
        self.hoisted_params: dict[tuple, BufferParam] = {}  # the parameters those expressions read

    # -- analysis --------------------------------------------------------------------------
    def fold_constants(self, nodes: list[ir.Node]) -> None:
        """Record the Python value of every sub-expression that reads no input or tensor."""
        for n in nodes:
            if n.op == "const":
                self.literal[id(n)] = n.attr
            elif n.op not in ("input", "buffer", "load") and n.args and all(id(a) in self.literal for a in n.args):
                try:
                    value = evaluate(n).item()
                except (RuntimeError, ValueError, ZeroDivisionError) as e:
                    raise ValueError(f"flexc codegen: the constant part `{n}` of {self.traced.kind} "
                                     f"{self.traced.name} cannot be computed ({e}). Fix: correct that "
                                     f"expression (e.g. an integer division by zero).") from None
                self.literal[id(n)] = bool(value) if n.kind == ir.BOOL else int(value) if n.kind == ir.INT else float(value)

    def infer_dtypes(self, nodes: list[ir.Node]) -> None:
        """Float dtype of each float node (None for weak Python floats and for ints/bools)."""
        for n in nodes:
            d: str | None = None
            if n.kind == ir.FLOAT and id(n) not in self.literal:
                if n.op == "input":
                    d = "float32"
                elif n.op == "load":
                    d = n.args[0].attr[1] if n.args[0].attr[1] in _WIDE_FLOATS else "float32"
                elif n.op == "cast":
                    d = n.attr
                elif n.op in _MATH or n.op in ("sigmoid", "tanh", "truediv", "pow"):
                    d = "float64" if any(self.dtype.get(id(a)) == "float64" for a in n.args) else "float32"
                else:  # arithmetic, where, min/max: torch's promotion among the float operands
                    operands = n.args[1:] if n.op == "where" else n.args
                    seen = {self.dtype.get(id(a)) for a in operands} - {None}
                    if "float64" in seen:
                        d = "float64"
                    elif len(seen) == 1:
                        d = seen.pop()
                    else:
                        d = "float32"
            self.dtype[id(n)] = d

    def find_float_differences(self, nodes: list[ir.Node]) -> None:
        """With ``float_indices``, the index differences ``x - y`` (x, y index inputs or small constants)
        whose every reader takes them as a float (``slopes[h] * (kv_idx - q_idx)``: ALiBi, relative
        position biases): they print as ``biased_float(x) - biased_float(y)``, each operand ``2**23 + x``
        in float32 made by an integer add on its bits (a literal prints as that float). Each index
        becomes a float once per row or column of the tile instead of the difference once per score,
        with no conversion instruction, and the tile pays one float subtraction instead of an integer
        subtraction and a conversion. Exact: indices and literals are integers in [0, 2**23), so both
        operands are integers in [2**23, 2**24), which float32 holds exactly, and so is their difference."""
        if not self.float_indices:
            return
        readers: dict[int, list[ir.Node]] = {}
        for n in nodes:
            for a in n.args:
                readers.setdefault(id(a), []).append(n)

        def small_index(a: ir.Node) -> bool:
            if id(a) in self.literal:
                value = self.literal[id(a)]
                return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 23
            return a.op == "input" and a.attr in _INDEX_INPUTS

        def reads_as_float(r: ir.Node) -> bool:
            if r.op == "cast":
                return r.attr in ("float16", "bfloat16", "float32", "float64")
            return r.kind == ir.FLOAT and r.op in ("add", "sub", "mul")

        for n in nodes:
            if (n.op == "sub" and n.kind == ir.INT and id(n) not in self.literal and n is not self.traced.root
                    and all(small_index(a) for a in n.args) and readers.get(id(n))
                    and all(reads_as_float(r) for r in readers[id(n)])):
                self.float_differences.add(id(n))

    def find_hoisted(self, nodes: list[ir.Node], skip: ir.Node | None = None) -> None:
        """The captured-tensor lookups whose every index is ``b``, ``h`` or a non-negative literal
        (``slopes[h]``, ``bias[b, h]``, ``table[0, h]``): the same value for every score a program
        computes. They print as a parameter (``slopes_at_h``) that the kernel computes once per program
        (per head in a loop over heads), not a load per key tile: Triton does not move loads out of
        loops, and a value kept across them costs one register where a pointer kept for the load
        costs two. ``skip``: a lookup that stays (an address function's root)."""
        for n in nodes:
            if n.op != "load" or n is skip or id(n) in self.literal:
                continue
            parts = []
            for index in n.args[1:]:
                value = self.literal.get(id(index))
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    parts.append(str(value))
                elif index.op == "input" and index.attr in ("b", "h"):
                    parts.append(index.attr)
                else:
                    break
            else:
                self.hoisted[id(n)] = f"{self.prefix[n.args[0].attr[0]]}_at_{'_'.join(parts)}"

    def render_hoisted(self, n: ir.Node) -> str:
        """A lookup of :meth:`find_hoisted`: its name, its expression recorded for the kernel."""
        name = self.hoisted[id(n)]
        body_params, self.params = self.params, self.hoisted_params
        try:
            self.hoisted_text[name] = self.render_load(n)
        finally:
            self.params = body_params
        return name

    def render_float_difference(self, n: ir.Node) -> tuple[str, int]:
        """An index difference of :meth:`find_float_differences`, in float32."""
        def leaf(a: ir.Node) -> str:
            if id(a) in self.literal:
                return python_literal(float(2 ** 23 + self.literal[id(a)]))
            self.helpers.add("biased_float")
            return f"biased_float({a.attr})"
        return f"{leaf(n.args[0])} - {leaf(n.args[1])}", _ADD

    # -- parameters ------------------------------------------------------------------------
    def param(self, slot: int, what: str, dim: int = -1) -> str:
        stem = self.prefix[slot]
        name = f"{stem}_ptr" if what == "ptr" else f"{stem}_{what}_{dim}"
        self.params.setdefault((slot, what, dim), BufferParam(name, slot, what, dim))
        return name

    def scalar_param(self, n: ir.Node) -> str:
        # prefixed with the function name (or the mod it derives from): unique in the kernel, and
        # never a kernel local
        index, _, name = n.attr
        param = f"{self.scalar_prefix}_{name}"
        self.params.setdefault((index, "scalar", -1), BufferParam(param, index, "scalar"))
        return param

    # -- printing --------------------------------------------------------------------------
    def operand(self, n: ir.Node, min_prec: int) -> str:
        text, prec = self.text[id(n)]
        return f"({text})" if prec < min_prec else text

    def as_float(self, n: ir.Node, min_prec: int = _ATOM) -> str:
        """``n`` usable by tl.exp & co: float32 unless already fp32/fp64."""
        if id(n) in self.literal:
            return python_literal(float(self.literal[id(n)]))
        if n.kind == ir.FLOAT and self.dtype.get(id(n)) in _WIDE_FLOATS:
            return self.operand(n, min_prec)
        return f"{self.operand(n, _ATOM)}.to(tl.float32)"

    def as_number(self, n: ir.Node, min_prec: int) -> str:
        """``n`` for arithmetic: bools become int32, as torch promotes them."""
        if n.kind == ir.BOOL and id(n) not in self.literal:
            return f"{self.operand(n, _ATOM)}.to(tl.int32)"
        if n.kind == ir.BOOL:
            return str(int(self.literal[id(n)]))
        return self.operand(n, min_prec)

    def render(self, n: ir.Node) -> tuple[str, int]:
        op, args = n.op, n.args
        if id(n) in self.literal:
            value = self.literal[id(n)]
            text = python_literal(value)
            negative = not isinstance(value, bool) and isinstance(value, (int, float)) and value < 0 and "inf" not in text
            return text, _UNARY if negative else _ATOM
        if op == "input":
            return n.attr, _ATOM
        if id(n) in self.float_differences:
            return self.render_float_difference(n)
        if op == "scalar":
            return self.scalar_param(n), _ATOM
        if op == "load":
            return (self.render_hoisted(n) if id(n) in self.hoisted else self.render_load(n)), _ATOM
        if op == "cast":
            return f"{self.operand(args[0], _ATOM)}.to({_TL_DTYPES[n.attr]})", _ATOM
        if op == "where":
            return f"tl.where({self.operand(args[0], 0)}, {self.operand(args[1], 0)}, {self.operand(args[2], 0)})", _ATOM
        if op in ("min", "max"):
            fn = "tl.minimum" if op == "min" else "tl.maximum"
            return f"{fn}({self.as_number(args[0], 0)}, {self.as_number(args[1], 0)})", _ATOM
        if op in ("add", "sub", "mul"):
            sym, prec = _BINARY[op]
            return f"{self.as_number(args[0], prec)} {sym} {self.as_number(args[1], prec + 1)}", prec
        if op in _BINARY:
            sym, prec = _BINARY[op]
            return f"{self.operand(args[0], prec + (1 if prec == _CMP else 0))} {sym} {self.operand(args[1], prec + 1)}", prec
        if op == "truediv":  # true division, also of integers (torch gives float32)
            a = self.operand(args[0], _MUL) if args[0].kind == ir.FLOAT else self.as_float(args[0], _MUL)
            divisor = self.literal.get(id(args[1]))
            if divisor is not None and not isinstance(divisor, bool) and math.isfinite(divisor) and divisor != 0:
                # by a constant: multiply by its reciprocal (a division is a long instruction
                # sequence on GPUs; Inductor does the same, within an ulp of the quotient)
                return f"{a} * {python_literal(1.0 / divisor)}", _MUL
            if args[1].op == "scalar" and args[1].kind == ir.FLOAT:
                # by a captured number (a kernel argument): the same, its reciprocal computed once per
                # program (the loop-invariant division is hoisted) instead of a division per score
                return f"{a} * (1.0 / {self.operand(args[1], _ATOM)})", _MUL
            b = self.operand(args[1], _MUL + 1) if args[1].kind == ir.FLOAT else self.as_float(args[1], _MUL + 1)
            return f"{a} / {b}", _MUL
        if op in ("floordiv", "mod"):
            return self.render_division(n), _ATOM
        if op == "pow":
            return self.render_pow(n)
        if op == "neg":
            return f"-{self.operand(args[0], _UNARY)}", _UNARY
        if op == "not":
            return f"~{self.operand(args[0], _UNARY)}", _UNARY
        if op == "abs":
            return (self.text[id(args[0])] if args[0].kind == ir.BOOL else (f"tl.abs({self.operand(args[0], 0)})", _ATOM))
        if op in ("floor", "ceil") and args[0].kind != ir.FLOAT:
            return self.text[id(args[0])]  # floor/ceil of an integer is the integer itself
        if op in _MATH:
            return f"{_MATH[op]}({self.as_float(args[0], 0)})", _ATOM
        if op in FAST_MATH_OPS:
            if self.fast_math and n.attr != PRECISE and self.dtype.get(id(args[0])) != "float64":
                return self.render_fast(n)
            if self.target == "cuda":  # the hardware-tuned versions
                if op == "sigmoid":
                    return f"tl.sigmoid({self.as_float(args[0], 0)})", _ATOM
                self.uses_libdevice = True
                return f"libdevice.tanh({self.as_float(args[0], 0)})", _ATOM
            self.helpers.add(op)
            return f"{op}({self.as_float(args[0], 0)})", _ATOM
        if op == "sign":
            if args[0].kind == ir.BOOL:
                return self.text[id(args[0])]
            self.helpers.add("sign")
            return f"sign({self.operand(args[0], 0)})", _ATOM
        if op in ("lshift", "rshift"):  # integers only; Triton's >> on signed integers is arithmetic, as torch's
            sym = "<<" if op == "lshift" else ">>"
            return f"{self.as_number(args[0], _SHIFT)} {sym} {self.as_number(args[1], _SHIFT + 1)}", _SHIFT
        if op == "fmod" and n.kind != ir.FLOAT:  # Triton's integer % truncates toward 0: torch.fmod
            return f"{self.as_number(args[0], _MUL)} % {self.as_number(args[1], _MUL + 1)}", _MUL
        if op == "erf":
            return f"tl.erf({self.as_float(args[0], 0)})", _ATOM
        if op in MATH_HELPERS:
            name = MATH_HELPERS[op]
            if self.target == "cuda":  # the same functions, tuned for the hardware
                self.uses_libdevice = True
                fn = LIBDEVICE_NAMES.get(name, name)
                return f"libdevice.{fn}({', '.join(self.as_float(a, 0) for a in args)})", _ATOM
            self.helpers |= with_needs({name})
            return f"{name}({', '.join(self.as_float(a, 0) for a in args)})", _ATOM
        raise NotImplementedError(f"flexc codegen: no Triton printing for IR op {op!r} in {self.traced!r}")

    def render_fast(self, n: ir.Node) -> tuple[str, int]:
        """fp32 ``tanh``/``sigmoid`` as one exp2 and one reciprocal (flexc.codegen.triton_helpers):
        ``fast_tanh(x, 2 log2(e) x)`` is ``1 - 2 rcp(2^(2x log2 e) + 1)``, ``fast_sigmoid(x, -log2(e) x)``
        ``rcp(1 + 2^(-x log2 e))``; they saturate (never inf/inf) and take the accurate function for
        float64 ``x``. A constant factor of ``x`` is folded into the power's."""
        x = n.args[0]
        scale = TWO_LOG2E if n.op == "tanh" else -LOG2E
        power = f"{self.as_float(x, _MUL)} * {python_literal(scale)}"
        inner, c, divides = self.constant_factor(x)
        if isinstance(c, float):  # x = y * c or y / c, c a literal: y * (c * scale), one multiply fewer
            folded = scale / c if divides else c * scale
            if math.isfinite(folded) and abs(folded) >= 2.0 ** -126:
                power = f"{self.as_float(inner, _MUL)} * {python_literal(folded)}"
        elif c is not None:  # c a captured number (a kernel argument): the same, computed once per program
            scaled = f"tl.math.div_rn({python_literal(scale)}, {c})" if divides else f"({c} * {python_literal(scale)})"
            power = f"{self.as_float(inner, _MUL)} * {scaled}"
        name = FAST_HELPERS["cuda" if self.target == "cuda" else "portable"][n.op]
        self.helpers |= with_needs({name})
        self.uses_libdevice |= self.target == "cuda"  # fast_tanh's float64 branch
        return f"{name}({self.as_float(x, 0)}, {power})", _ATOM

    def constant_factor(self, n: ir.Node) -> tuple[ir.Node | None, float | str | None, bool]:
        """``(x, c, divides)`` when ``n`` is ``x * c``, ``c * x`` or ``x / c`` (``divides``) for a float
        ``x`` and a finite non-zero literal ``c`` (a float) or a captured float number (its parameter
        name), and nothing else reads ``n``; else ``(None, None, False)``."""
        if n.kind != ir.FLOAT or self.uses.get(id(n), 0) != 1 or n.op not in ("mul", "truediv"):
            return None, None, False
        a, b = n.args
        for x, c, divides in ((a, b, n.op == "truediv"), (b, a, False)):
            if x.kind != ir.FLOAT or id(x) in self.literal or self.dtype.get(id(x)) == "float64":
                continue
            value = self.literal.get(id(c))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value != 0:
                return x, float(value), divides
            if c.op == "scalar" and c.kind == ir.FLOAT and value is None:
                return x, self.scalar_param(c), divides
            if n.op == "truediv":
                break
        return None, None, False

    def render_load(self, n: ir.Node) -> str:
        dtype = n.args[0].attr[1]
        load = f"tl.load({self.render_address(n)})"
        if dtype in ("float16", "bfloat16"):
            # computed in fp32, as Inductor does (Triton's interpreter has no 16-bit arithmetic)
            return f"{load}.to(tl.float32)"
        # bool tensors travel as uint8 (Triton has no bool pointers on every version)
        return f"({load} != 0)" if dtype == "bool" else load

    def render_address(self, n: ir.Node) -> str:
        """The pointer a ``load`` node reads: the tensor's pointer plus index times stride per dim."""
        buf, indices = n.args[0], n.args[1:]
        slot = buf.attr[0]
        terms = []
        for dim, index in enumerate(indices):
            stride = self.param(slot, "stride", dim)
            if id(index) in self.literal:
                value = int(self.literal[id(index)])
                if value != 0:
                    terms.append(f"{value} * {stride}")
                continue
            if index.op == "input" and index.attr in _INDEX_INPUTS:
                text = self.operand(index, _MUL)
            else:
                self.helpers.add("wrap_index")
                text = f"wrap_index({self.operand(index, 0)}, {self.param(slot, 'size', dim)})"
            terms.append(f"{text} * {stride}")
        return " + ".join([self.param(slot, "ptr")] + terms)

    def render_division(self, n: ir.Node) -> str:
        a, b = n.args
        if n.kind == ir.FLOAT:
            if n.op == "floordiv":
                return f"tl.floor({self.as_float(a, _MUL)} / {self.as_float(b, _MUL + 1)})"
            self.helpers.add("float_mod")
            return f"float_mod({self.as_float(a, 0)}, {self.as_float(b, 0)})"
        helper = "py_floordiv" if n.op == "floordiv" else "py_mod"
        self.helpers.add(helper)
        return f"{helper}({self.as_number(a, 0)}, {self.as_number(b, 0)})"

    def render_pow(self, n: ir.Node) -> tuple[str, int]:
        base, exponent = n.args
        e = self.literal.get(id(exponent))
        if e is not None and float(e).is_integer() and 0 <= abs(int(e)) <= 8 and (n.kind == ir.FLOAT or e >= 0):
            k = abs(int(e))
            if k == 0:
                return ("1.0" if n.kind == ir.FLOAT else "1"), _ATOM
            x = self.as_number(base, _MUL + 1)
            product = " * ".join([x] * k)
            if e < 0:
                return f"1.0 / ({product})" if k > 1 else f"1.0 / {x}", _MUL
            return product, (_MUL if k > 1 else self.text[id(base)][1])
        if e == 0.5 and n.kind == ir.FLOAT:
            return f"tl.sqrt({self.as_float(base, 0)})", _ATOM
        b = self.literal.get(id(base))
        prec = _ATOM
        if b is not None and b > 0:
            # a positive literal base: b ** x == exp2(x * log2(b))
            text = f"tl.exp2({self.as_float(exponent, _MUL)} * {python_literal(math.log2(b))})"
        elif e is not None:
            # a literal exponent: |x| ** e through exp2/log2, the sign decided here by e's parity
            x = self.as_float(base, 0)
            text = f"tl.exp2({python_literal(float(e))} * tl.log2(tl.abs({x})))"
            if not float(e).is_integer():
                text = f'tl.where({x} < 0, float("nan"), {text})'  # torch: a negative base gives NaN
            elif int(e) % 2:
                text, prec = f"tl.where({x} < 0, -1.0, 1.0) * {text}", _MUL
        else:
            self.helpers.add("float_pow")
            base_text = f"({python_literal(float(b))} + 0.0 * {self.as_float(exponent, _MUL)})" if b is not None \
                else self.as_float(base, 0)
            text = f"float_pow({base_text}, {self.as_float(exponent, 0)})"
        if n.kind != ir.FLOAT:  # integer ** integer stays an integer, as in torch
            text, prec = f"tl.floor({text} + 0.5).to(tl.int64)", _ATOM
        return text, prec


def _pow_repeats(n: ir.Node, literal: dict) -> int:
    """How many times a power with a literal exponent repeats its base (so the base gets a temporary)."""
    e = literal.get(id(n.args[1]))
    if e is None or e == 0.5:
        return 1
    if float(e).is_integer() and abs(int(e)) <= 8:
        return max(1, abs(int(e)))  # x * x * ... (or 1.0 / (x * x ...))
    return 1 if float(e).is_integer() and int(e) % 2 == 0 else 2  # the sign test reads x again


def render_mod(traced: TracedMod, fn_name: str, buffer_stems: dict[int, str] | None = None,
               address: bool = False, *, target: str | None = None, index_dtype: str = "int32",
               scalar_prefix: str | None = None, fast_math: bool | None = None,
               float_indices: bool = False, hoist: bool = False) -> RenderedMod:
    """Print ``traced`` as the Triton device function ``fn_name``.

    ``buffer_stems`` names each captured tensor's parameters (slot -> stem); by default the mod's
    own ``buffer_names``. The function takes the mod's arguments (``score, b, h, q_idx, kv_idx``
    or ``b, h, q_idx, kv_idx``) then the captured-tensor parameters in ``RenderedMod.params``.
    With ``address=True`` the root must be a ``load`` and the function returns the pointer it
    would read (the backward adds captured-tensor gradients there).
    ``target="cuda"`` uses libdevice for the math helpers and the fast forms of fp32 tanh and sigmoid
    (one exp2 and one reciprocal, :mod:`flexc.codegen.triton_helpers`; nodes marked by
    :func:`keep_precise_math` print libdevice's tanh and ``tl.sigmoid``); the default prints portable
    helpers that Triton's interpreter runs too. ``fast_math`` overrides the target's choice of the
    fast forms (``True`` under the interpreter prints them with a correctly rounded reciprocal; the
    tests run them so). ``index_dtype="int64"``
    widens the index arguments first, so integer arithmetic on them cannot wrap (torch computes it
    in int64). Captured numbers (``scalar`` nodes) become parameters ``<scalar_prefix>_<name>``,
    ``fn_name`` by default; functions derived from one mod (its derivatives) pass that mod's
    function name, so each captured number is one kernel argument however many functions read it.
    ``float_indices`` says every index is below 2**23 (the call's extents): index differences read
    as floats then print in float32, exactly (:meth:`_Printer.find_float_differences`).
    ``hoist``: lookups indexed only by ``b``, ``h`` and literals become parameters the kernel computes
    once per program (:meth:`_Printer.find_hoisted`): ``RenderedMod.hoisted`` names them and their
    expressions, ``call_args`` lists them before the parameters the body still reads, and ``params``
    stays every captured-value parameter of both (the kernel's arguments).
    """
    if index_dtype not in ("int32", "int64"):
        raise ValueError(f"render_mod: index_dtype must be 'int32' or 'int64', got {index_dtype!r}. "
                         f"Fix: pass one of those.")
    # a reduction over a small captured axis prints as its unrolled terms; an autograd Function as
    # its traced forward (the kernels are forward-only)
    if scalar_form(traced.root) is not traced.root:
        traced = replace(traced, root=scalar_form(traced.root))
    if buffer_stems is None:
        buffer_stems = {i: _safe_name(name, i) for i, name in enumerate(traced.buffer_names)}
    p = _Printer(traced, buffer_stems, fn_name, target, scalar_prefix, fast_math, float_indices)
    nodes = list(traced.root.walk())
    p.fold_constants(nodes)
    p.infer_dtypes(nodes)
    p.find_float_differences(nodes)
    if hoist:
        p.find_hoisted(nodes, skip=traced.root if address else None)
    reads = frozenset(n.attr for n in nodes if n.op == "input")
    expression = str(traced)
    if id(traced.root) in p.literal:
        return RenderedMod(fn_name, "", (), frozenset(), reads, p.literal[id(traced.root)], expression)

    uses: dict[int, int] = {}
    for n in nodes:
        if id(n) in p.literal:
            continue
        for a in n.args:
            uses[id(a)] = uses.get(id(a), 0) + (_pow_repeats(n, p.literal) if n.op == "pow" and a is n.args[0] else 1)
    p.uses = uses
    body: list[str] = []
    if index_dtype == "int64":
        body += [f"    {name} = {name}.to(tl.int64)  # index arithmetic in int64, as torch does"
                 for name in _INDEX_INPUTS if name in reads and _does_integer_arithmetic(traced.root, name)]
    temps = 0
    for n in nodes:
        if n.op == "buffer":
            continue
        text, prec = p.render(n)
        shared = (uses.get(id(n), 0) > 1 and n.op not in ("input", "const", "scalar") and id(n) not in p.literal
                  and id(n) not in p.hoisted)
        if shared and n is not traced.root:
            name = f"t{temps}"
            temps += 1
            body.append(f"    {name} = {text}")
            text, prec = name, _ATOM
        p.text[id(n)] = (text, prec)
    if address:
        if traced.root.op != "load":
            raise ValueError(f"render_mod(address=True) needs a load at the root, got `{traced.root}`")
        p.text[id(traced.root)] = (p.render_address(traced.root), _ADD)

    hoisted = tuple(p.hoisted_text.items())
    call_args = tuple(name for name, _ in hoisted) + tuple(param.name for param in _ordered(p.params))
    args = list(traced.arg_names) + list(call_args)
    comment = f"    # {fn_name}: {expression}"
    source = "\n".join([
        "@triton.jit",
        f"def {fn_name}({', '.join(args)}):",
        *_wrap_comment(comment),
        *body,
        f"    return {p.text[id(traced.root)][0]}",
        "",
    ])
    params = _ordered({**p.hoisted_params, **p.params})
    return RenderedMod(fn_name, source, params, frozenset(p.helpers), reads, None, expression,
                       p.uses_libdevice, hoisted, call_args)


_precise: "weakref.WeakKeyDictionary[TracedMod, TracedMod]" = weakref.WeakKeyDictionary()


def keep_precise_math(traced: TracedMod | None) -> TracedMod | None:
    """``traced`` with its ``tanh`` and ``sigmoid`` nodes marked :data:`PRECISE`: printed as libdevice's
    tanh and ``tl.sigmoid`` on CUDA instead of the fast exp2-and-reciprocal forms
    (``kernel_options={"FAST_MATH": False}``). The mark is part of the graph, so the kernel cache
    keeps the two variants apart; every other reader of the IR sees the same operations. ``traced``
    itself when it has neither function."""
    if traced is None:
        return None
    marked = _precise.get(traced)
    if marked is not None:
        return marked
    rebuilt: dict[int, ir.Node] = {}
    for n in traced.root.walk():
        args = tuple(rebuilt[id(a)] for a in n.args)
        attr = PRECISE if n.op in FAST_MATH_OPS else n.attr
        same = attr == n.attr and all(a is b for a, b in zip(args, n.args))
        rebuilt[id(n)] = n if same else ir.make(n.op, args, attr, n.kind)
    root = rebuilt[id(traced.root)]
    if root is traced.root:
        marked = traced
    else:  # where each lookup and division was written, for the rebuilt nodes too
        sites = {rebuilt.get(id(node), node): site for node, site in traced.sites.items()}
        marked = replace(traced, root=root, sites=sites)
    _precise[traced] = marked
    return marked


def precise_math_for(options: dict | None, *mods: TracedMod | None) -> tuple:
    """The mods as the call's ``kernel_options`` want them printed: :func:`keep_precise_math` of each
    when ``FAST_MATH`` is false, else the mods themselves."""
    if options is None or options.get("FAST_MATH", True):
        return mods
    return tuple(keep_precise_math(mod) for mod in mods)


def _does_integer_arithmetic(root: ir.Node, name: str) -> bool:
    """Whether the index input ``name`` feeds integer arithmetic (not only compares and lookups)."""
    for n in root.walk():
        if n.kind == ir.INT and n.op not in ("input", "const", "load", "cast") and \
                any(a.op == "input" and a.attr == name for a in n.args):
            return True
    return False


def _ordered(params: dict) -> tuple[BufferParam, ...]:
    order = {"ptr": 0, "stride": 1, "size": 2, "scalar": 3}
    # tensors first (pointer, strides, sizes of each), then the captured numbers
    return tuple(sorted(params.values(), key=lambda q: (q.what == "scalar", q.slot, order[q.what], q.dim)))


def _wrap_comment(line: str, width: int = 110) -> list[str]:
    """Split a long ``# ...`` comment line over several lines."""
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())] + "#   "
    out, current = [], line
    while len(current) > width:
        cut = current.rfind(" ", 0, width)
        if cut <= len(indent):
            cut = width
        out.append(current[:cut])
        current = indent + current[cut:].lstrip()
    out.append(current)
    return out


__all__ = ["PRECISE", "BufferParam", "RenderedMod", "keep_precise_math", "precise_math_for", "python_literal",
           "render_mod"]
