"""The library of Triton device helpers the printed mods call (:mod:`flexc.codegen.printer`).

:data:`HELPERS` holds each helper's source; a kernel carries the ones its mods call, each once.
They keep torch's semantics where Triton's operators differ (``py_floordiv`` and ``py_mod`` round
like Python, ``wrap_index`` counts a negative index from the end, ``float_pow``, ``sign``) and give
torch's elementwise math beyond ``tl``'s own functions. Triton's ``libdevice`` has those, but not
under the interpreter that runs flexc's kernels on CPU, so each is written here from
``tl.exp``/``tl.log``/``tl.sqrt``/``tl.erf`` and friends, with the usual care at the edges: Kahan's
forms for ``expm1``/``log1p`` (no cancellation near 0), infinities passed through, and a
range-reduced odd polynomial for ``atan`` (Cephes' single-precision coefficients, accurate to fp32
rounding). :data:`MATH_HELPERS` maps an IR op to its helper's name, :data:`LIBDEVICE_NAMES` a
helper to libdevice's function where the CUDA target calls that instead, and :data:`HELPER_NEEDS`
the helpers each one calls.

**Fast math.** On CUDA, fp32 ``tanh`` and ``sigmoid`` (and so ``gelu(approximate="tanh")``, mish and
tanhshrink, which the tracer writes with ``tanh``) lower to one ``exp2`` and one reciprocal instead
of libdevice's ``tanhf`` (an odd polynomial, two compares and selects beside the same ``exp2`` and
reciprocal) and Triton's ``tl.sigmoid`` (a full-range division)::

    tanh(x)    = 1 - 2 * rcp(exp2(x * 2 log2(e)) + 1)
    sigmoid(x) = rcp(1 + exp2(x * -log2(e)))

Both saturate instead of dividing infinities: for large ``|x|`` the power is ``inf`` (reciprocal 0)
or 0, so ``tanh`` is exactly ``+-1`` and ``sigmoid`` exactly 1 or 0; NaN stays NaN. On the GPU the
power is ``ex2.approx.ftz.f32`` (relative error below 2**-22) and the reciprocal
``rcp.approx.ftz.f32`` (:data:`FAST_RECIPROCAL`, within 1 ulp; results below 2**-126 flush to 0).
Error bounds against the exact function, for every fp32 ``x`` (:data:`FAST_TANH_ERROR`,
:data:`FAST_SIGMOID_ERROR`):

* ``tanh``: absolute error at most 6e-7 (measured 1.8e-7 with correctly rounded ``exp2`` and
  reciprocal; the hardware approximations add at most 0.5 * 2**-22 + 2 * 2**-23). It is absolute,
  not relative: near 0 the ``1 - ...`` cancels, so ``tanh(1e-3)`` has a relative error around 1e-4
  and below ~3e-8 the result is 0. Soft-capping's ``cap * tanh(s / cap)`` moves a score by at most
  ``6e-7 * cap``, far below bf16/fp16 resolution of the scores it caps.
* ``sigmoid``: relative error at most ``6e-7 + |x| * 2**-24`` while the result is a normal fp32
  number (measured 1.4e-7 for ``|x| <= 1``). There is no cancellation (``1 + e`` only grows); the
  ``|x|`` term is the rounding of ``x * log2(e)``, which every exp2-based ``exp`` has (``tl.exp`` and
  ``tl.sigmoid`` included). For ``x < -87.3`` the result is subnormal in fp32 and the GPU returns 0
  (an absolute error below 1.2e-38).

The printer folds a multiplication or division by a literal into the power's constant
(``tanh(s / 20)`` is ``exp2(s * 0.1443)``: one multiply fewer, at most 2.7e-8 more absolute error),
and one by a captured number (a kernel argument) too: ``tanh(s / cap)`` is
``exp2(s * (2.885 / cap))``, the quotient computed once per program instead of a division per score.
``kernel_options={"FAST_MATH": False}`` keeps libdevice's ``tanh`` and ``tl.sigmoid``
(:func:`flexc.codegen.printer.keep_precise_math`). fp64 never takes the fast forms: the helpers
(:data:`FAST_HELPERS`) choose the accurate function for a float64 argument when Triton compiles
them, since the printer does not know whether a kernel's scores are float64. Under Triton's
interpreter the default stays the accurate helpers below; ``render_mod(..., fast_math=True)``
prints the fast forms there too (``portable_fast_tanh``: a correctly rounded ``1 / x`` for
``rcp.approx``), which is how the tests run the same expression on CPU.
"""
from __future__ import annotations

from ..constants import LOG2E, TWO_LOG2E  # noqa: F401 (the fast forms' constants; tests read them here)

# IR op -> helper function name in the generated source
MATH_HELPERS = {
    "tan": "tan", "atan": "atan", "asin": "asin", "acos": "acos", "sinh": "sinh", "cosh": "cosh",
    "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "expm1": "expm1", "log1p": "log1p",
    "erfc": "erfc", "log10": "log10", "trunc": "trunc", "round": "round_half_even",
    "atan2": "atan2", "fmod": "float_fmod",
}

# fast-math ops (see the module docstring) and their helpers: CUDA's (rcp.approx as inline PTX, libdevice
# for float64 scores) and the interpreter's (a correctly rounded reciprocal, the accurate helpers for float64)
FAST_MATH_OPS = ("tanh", "sigmoid")
FAST_HELPERS = {"cuda": {"tanh": "fast_tanh", "sigmoid": "fast_sigmoid"},
                "portable": {"tanh": "portable_fast_tanh", "sigmoid": "portable_fast_sigmoid"}}
FAST_TANH_ERROR = 6e-7  # absolute, every fp32 input
FAST_SIGMOID_ERROR = 6e-7  # relative, plus |x| * 2**-24, while the result is a normal fp32 number

# helpers whose libdevice function has another name (CUDA target)
LIBDEVICE_NAMES = {"round_half_even": "rint", "float_fmod": "fmod"}

HELPER_NEEDS = {
    "fast_tanh": ("approx_rcp",), "fast_sigmoid": ("approx_rcp",),
    "portable_fast_tanh": ("rcp", "tanh"), "portable_fast_sigmoid": ("rcp", "sigmoid"),
    "asin": ("atan",), "acos": ("atan",), "atan2": ("atan",), "sinh": ("expm1",), "asinh": ("log1p",),
    "atanh": ("log1p",), "float_fmod": ("trunc",),
}

# helper name -> its source; each is emitted once into a kernel, only when a printed mod calls it
HELPERS = {
    "py_floordiv": '''\
@triton.jit
def py_floordiv(a, b):
    # integer a // b rounded toward -inf like Python and torch (Triton's // truncates toward 0)
    quotient = a // b
    remainder = a - quotient * b
    return tl.where((remainder != 0) & ((remainder < 0) != (b < 0)), quotient - 1, quotient)
''',
    "py_mod": '''\
@triton.jit
def py_mod(a, b):
    # integer a % b with the sign of b like Python and torch (Triton's % takes the sign of a)
    remainder = a % b
    return tl.where((remainder != 0) & ((remainder < 0) != (b < 0)), remainder + b, remainder)
''',
    "float_mod": '''\
@triton.jit
def float_mod(a, b):
    # torch.remainder for floats: a - b * floor(a / b)
    return a - b * tl.floor(a / b)
''',
    "wrap_index": '''\
@triton.jit
def wrap_index(index, size):
    # a negative index counts from the end, as in torch indexing
    return tl.where(index < 0, index + size, index)
''',
    "sigmoid": '''\
@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
''',
    "tanh": '''\
@triton.jit
def tanh(x):
    # through exp(-2|x|), which never overflows; near 0 its Taylor series avoids cancellation
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    # (to x**15: float64-accurate below 0.1, where the next term is under 1e-19 of the result)
    x2 = x * x
    series = x * (1.0 - x2 * (0.3333333333333333 - x2 * (0.13333333333333333 - x2 * (0.05396825396825397
                  - x2 * (0.021869488536155203 - x2 * (0.008863235529902197 - x2 * (0.003592128036572481
                  - x2 * 0.0014558343870513183)))))))
    return tl.where(tl.abs(x) < 0.1, series, t)
''',
    "biased_float": '''\
@triton.jit
def biased_float(index):
    # 2**23 + index in float32, exact for 0 <= index < 2**23: the bits of 2**23 (0x4B000000) plus the
    # index, one integer add where a conversion would be one more instruction per row or column. The
    # difference of two is the exact difference of the indices
    return (index.to(tl.int32) + 0x4B000000).to(tl.float32, bitcast=True)
''',
    "sign": '''\
@triton.jit
def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)
''',
    "float_pow": '''\
@triton.jit
def float_pow(a, b):
    # torch.pow for floats: |a| ** b through exp2/log2, negative bases only with integer exponents
    magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
    b_is_int = b == tl.floor(b)
    b_is_odd = b_is_int & (tl.floor(b * 0.5) * 2.0 != b)
    signed = tl.where(b_is_odd, -magnitude, magnitude)
    result = tl.where(a < 0, tl.where(b_is_int, signed, float("nan")), magnitude)
    return tl.where(b == 0, 1.0, result)
''',
    "approx_rcp": '''\
@triton.jit
def approx_rcp(x):
    # 1 / x as one rcp.approx.ftz.f32 (within 1 ulp; 0 for |x| >= 2**126 and for inf; CUDA only)
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)
''',
    "rcp": '''\
@triton.jit
def rcp(x):
    # 1 / x, correctly rounded: approx_rcp's stand-in where there is no PTX (Triton's interpreter)
    return 1.0 / x
''',
    # The fast forms take the argument x and the power of two the caller computed from it (2 log2(e) x
    # for tanh, -log2(e) x for sigmoid, a constant factor of x folded in): a float64 x (float64
    # kernels) takes the accurate function instead, decided when Triton compiles; the unused
    # argument is dead code there.
    "fast_tanh": '''\
@triton.jit
def fast_tanh(x, power):
    # tanh(x) with power = 2 log2(e) x: 1 - 2 / (2^power + 1), one ex2 and one rcp.approx, exactly +-1 for
    # large |x| (never inf / inf), absolute error below 6e-7 (flexc.codegen.triton_helpers); fp64: libdevice's
    if x.dtype == tl.float64:
        t = libdevice.tanh(x)
    else:
        t = 1.0 - 2.0 * approx_rcp(tl.exp2(power) + 1.0)
    return t
''',
    "fast_sigmoid": '''\
@triton.jit
def fast_sigmoid(x, power):
    # sigmoid(x) with power = -log2(e) x: 1 / (1 + 2^power), one ex2 and one rcp.approx, exactly 0 or 1 for
    # large |x|, relative error below 6e-7 + |x| 2^-24 (flexc.codegen.triton_helpers); fp64: tl.sigmoid
    if x.dtype == tl.float64:
        s = tl.sigmoid(x)
    else:
        s = approx_rcp(1.0 + tl.exp2(power))
    return s
''',
    "portable_fast_tanh": '''\
@triton.jit
def portable_fast_tanh(x, power):
    # fast_tanh with a correctly rounded reciprocal (Triton's interpreter runs it); fp64: the accurate tanh
    if x.dtype == tl.float64:
        t = tanh(x)
    else:
        t = 1.0 - 2.0 * rcp(tl.exp2(power) + 1.0)
    return t
''',
    "portable_fast_sigmoid": '''\
@triton.jit
def portable_fast_sigmoid(x, power):
    # fast_sigmoid with a correctly rounded reciprocal (Triton's interpreter runs it); fp64: the accurate sigmoid
    if x.dtype == tl.float64:
        s = sigmoid(x)
    else:
        s = rcp(1.0 + tl.exp2(power))
    return s
''',
    "tan": '''\
@triton.jit
def tan(x):
    return tl.sin(x) / tl.cos(x)
''',
    "atan": '''\
@triton.jit
def atan(x):
    # odd: reduce |x| to [0, tan(pi/8)] with atan(t) = pi/2 - atan(1/t) (t > tan(3pi/8)) and
    # atan(t) = pi/4 + atan((t - 1)/(t + 1)) (t > tan(pi/8)), then an odd polynomial
    t = tl.abs(x)
    big = t > 2.414213562373095
    mid = (t > 0.41421356237309503) & (t <= 2.414213562373095)
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    r = tl.where(big, -1.0 / t, tl.where(mid, (t - 1.0) / (t + 1.0), t))
    z = r * r
    poly = (((0.0805374449538 * z - 0.138776856032) * z + 0.199777106478) * z - 0.333329491539) * z * r + r
    result = base + poly
    return tl.where(x < 0, -result, result)
''',
    "asin": '''\
@triton.jit
def asin(x):
    return atan(x / tl.sqrt((1.0 - x) * (1.0 + x)))
''',
    "acos": '''\
@triton.jit
def acos(x):
    # 2 atan(sqrt((1 - x) / (1 + x))): no cancellation near x = 1
    return 2.0 * atan(tl.sqrt((1.0 - x) / (1.0 + x)))
''',
    "atan2": '''\
@triton.jit
def atan2(y, x):
    # atan(y / x) moved to the quadrant of (x, y); atan2(0, 0) = 0
    base = atan(y / x)
    pi = 3.141592653589793
    left = tl.where(y >= 0, base + pi, base - pi)
    axis = tl.where(y > 0, 0.5 * pi, tl.where(y < 0, -0.5 * pi, 0.0 * y))
    return tl.where(x > 0, base, tl.where(x < 0, left, axis))
''',
    "expm1": '''\
@triton.jit
def expm1(x):
    # Kahan: (u - 1) * x / log(u) with u = exp(x) cancels the rounding of u near 0
    u = tl.exp(x)
    um1 = u - 1.0
    kahan = um1 * x / tl.log(u)
    return tl.where(u == 1.0, x, tl.where((um1 == -1.0) | (u == float("inf")), um1, kahan))
''',
    "log1p": '''\
@triton.jit
def log1p(x):
    # Kahan: log(u) * x / (u - 1) with u = 1 + x cancels the rounding of u near 0
    u = 1.0 + x
    kahan = tl.log(u) * x / (u - 1.0)
    return tl.where(u == 1.0, x, tl.where((u == float("inf")) | (u <= 0.0), tl.log(u), kahan))
''',
    "sinh": '''\
@triton.jit
def sinh(x):
    return 0.5 * (expm1(x) - expm1(-x))
''',
    "cosh": '''\
@triton.jit
def cosh(x):
    return 0.5 * (tl.exp(x) + tl.exp(-x))
''',
    "asinh": '''\
@triton.jit
def asinh(x):
    # sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2))); log(2|x|) where x^2 would overflow
    t = tl.abs(x)
    small = log1p(t + t * t / (1.0 + tl.sqrt(1.0 + t * t)))
    result = tl.where(t > 1e15, tl.log(t) + 0.6931471805599453, small)
    return tl.where(x < 0, -result, result)
''',
    "acosh": '''\
@triton.jit
def acosh(x):
    # log(x + sqrt(x^2 - 1)); log(2x) where x^2 would overflow
    return tl.where(x > 1e15, tl.log(x) + 0.6931471805599453, tl.log(x + tl.sqrt((x - 1.0) * (x + 1.0))))
''',
    "atanh": '''\
@triton.jit
def atanh(x):
    return 0.5 * log1p(2.0 * x / (1.0 - x))
''',
    "erfc": '''\
@triton.jit
def erfc(x):
    # 1 - erf(x): absolute accuracy; values below ~1e-7 (x > 3.8 in fp32) round to 0
    return 1.0 - tl.erf(x)
''',
    "log10": '''\
@triton.jit
def log10(x):
    return tl.log(x) * 0.4342944819032518
''',
    "trunc": '''\
@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
''',
    "round_half_even": '''\
@triton.jit
def round_half_even(x):
    # torch.round: to the nearest integer, ties to even
    r = tl.floor(x + 0.5)
    tie_to_odd = (r - x == 0.5) & (r - 2.0 * tl.floor(0.5 * r) != 0.0)
    return tl.where(tie_to_odd, r - 1.0, r)
''',
    "float_fmod": '''\
@triton.jit
def float_fmod(a, b):
    # torch.fmod for floats: the remainder of division rounded toward zero (sign of a)
    return a - b * trunc(a / b)
''',
}


def with_needs(names: set) -> set:
    """``names`` plus every helper they call, transitively."""
    todo, out = list(names), set()
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(HELPER_NEEDS.get(name, ()))
    return out
