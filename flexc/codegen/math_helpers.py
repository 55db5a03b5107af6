"""Triton device helpers for torch's elementwise math beyond ``tl``'s own functions.

Triton's ``libdevice`` has these functions, but not under the interpreter that runs flexc's
kernels on CPU, so each is written here from ``tl.exp``/``tl.log``/``tl.sqrt``/``tl.erf`` and
friends, with the usual care at the edges: Kahan's forms for ``expm1``/``log1p`` (no cancellation
near 0), infinities passed through, and a range-reduced odd polynomial for ``atan`` (Cephes'
single-precision coefficients, accurate to fp32 rounding). :data:`MATH_HELPERS` maps an IR op to
its helper's name; :data:`HELPER_SOURCES` holds the sources and :data:`HELPER_NEEDS` the helpers
each one calls.
"""
from __future__ import annotations

# IR op -> helper function name in the generated source
MATH_HELPERS = {
    "tan": "tan", "atan": "atan", "asin": "asin", "acos": "acos", "sinh": "sinh", "cosh": "cosh",
    "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "expm1": "expm1", "log1p": "log1p",
    "erfc": "erfc", "log10": "log10", "trunc": "trunc", "round": "round_half_even",
    "atan2": "atan2", "fmod": "float_fmod",
}

HELPER_NEEDS = {
    "asin": ("atan",), "acos": ("atan",), "atan2": ("atan",), "sinh": ("expm1",), "asinh": ("log1p",),
    "atanh": ("log1p",), "float_fmod": ("trunc",),
}

HELPER_SOURCES = {
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
