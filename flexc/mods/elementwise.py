"""torch's elementwise math and ``torch.nn.functional`` activations as IR.

Each builder takes operand nodes (and the function's Python options) and returns the node of
the result. Functions with a primitive IR op (``tan``, ``erf``, ``expm1``, ``atan2``, ...) map to
it; activations are written as the formulas torch documents (``silu(x) = x * sigmoid(x)``,
``gelu(x) = x/2 * (1 + erf(x/sqrt(2)))``), so every reader of the IR (evaluation, range analysis,
code generation, differentiation) understands them without knowing they were activations.
The tracer (:mod:`flexc.mods.trace`) looks builders up by the called function's name.
"""
from __future__ import annotations

import math
from typing import Callable

from . import ir

# torch function / tensor method name -> primitive unary IR op
UNARY_ALIASES = {
    "tan": "tan", "atan": "atan", "arctan": "atan", "asin": "asin", "arcsin": "asin", "acos": "acos",
    "arccos": "acos", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh", "arcsinh": "asinh", "acosh": "acosh",
    "arccosh": "acosh", "atanh": "atanh", "arctanh": "atanh", "erf": "erf", "erfc": "erfc", "expm1": "expm1",
    "log1p": "log1p", "log10": "log10", "trunc": "trunc", "fix": "trunc", "round": "round",
}
BINARY_ALIASES = {"atan2": "atan2", "arctan2": "atan2", "fmod": "fmod"}


def _c(value: float) -> ir.Node:
    return ir.const(value)


def _float(x: ir.Node) -> ir.Node:
    """``x`` as a float: integer inputs of float functions compute in float32, as in torch."""
    return x if x.kind == ir.FLOAT else ir.cast(x, "float32", ir.FLOAT)


def _mul(a: ir.Node, b: ir.Node) -> ir.Node:
    return ir.binary("mul", a, b)


def _where(cond: ir.Node, a: ir.Node, b: ir.Node) -> ir.Node:
    return ir.where(cond, a, b)


def relu(x: ir.Node) -> ir.Node:
    return ir.binary("max", x, _c(0))


def relu6(x: ir.Node) -> ir.Node:
    return hardtanh(x, 0.0, 6.0)


def hardtanh(x: ir.Node, min_val: float = -1.0, max_val: float = 1.0) -> ir.Node:
    return ir.binary("min", ir.binary("max", x, _c(min_val)), _c(max_val))


def leaky_relu(x: ir.Node, negative_slope: float = 0.01) -> ir.Node:
    return _where(ir.binary("gt", x, _c(0)), x, _mul(x, _c(negative_slope)))


def elu(x: ir.Node, alpha: float = 1.0) -> ir.Node:
    return _where(ir.binary("gt", x, _c(0)), x, _mul(_c(alpha), ir.unary("expm1", x)))


def selu(x: ir.Node) -> ir.Node:
    # the constants torch documents for SELU
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return _mul(_c(scale), elu(x, alpha))


def celu(x: ir.Node, alpha: float = 1.0) -> ir.Node:
    negative = _mul(_c(alpha), ir.unary("expm1", ir.binary("truediv", x, _c(alpha))))
    return _where(ir.binary("gt", x, _c(0)), x, negative)


def gelu(x: ir.Node, approximate: str = "none") -> ir.Node:
    half_x = _mul(_c(0.5), x)
    if approximate == "tanh":
        inner = _mul(_c(math.sqrt(2.0 / math.pi)),
                     ir.binary("add", x, _mul(_c(0.044715), _mul(x, _mul(x, x)))))
        return _mul(half_x, ir.binary("add", _c(1.0), ir.unary("tanh", inner)))
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _mul(half_x, ir.binary("add", _c(1.0), ir.unary("erf", _mul(x, _c(1.0 / math.sqrt(2.0))))))


def silu(x: ir.Node) -> ir.Node:
    return _mul(x, ir.unary("sigmoid", x))


def softplus(x: ir.Node, beta: float = 1.0, threshold: float = 20.0) -> ir.Node:
    # log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (torch's overflow guard)
    bx = _mul(x, _c(beta)) if beta != 1.0 else x
    soft = ir.unary("log1p", ir.unary("exp", bx))
    soft = ir.binary("truediv", soft, _c(beta)) if beta != 1.0 else soft
    return _where(ir.binary("gt", bx, _c(threshold)), x, soft)


def mish(x: ir.Node) -> ir.Node:
    return _mul(x, ir.unary("tanh", softplus(x)))


def softsign(x: ir.Node) -> ir.Node:
    return ir.binary("truediv", x, ir.binary("add", _c(1.0), ir.unary("abs", x)))


def hardsigmoid(x: ir.Node) -> ir.Node:
    return ir.binary("truediv", relu6(ir.binary("add", x, _c(3.0))), _c(6.0))


def hardswish(x: ir.Node) -> ir.Node:
    return ir.binary("truediv", _mul(x, relu6(ir.binary("add", x, _c(3.0)))), _c(6.0))


def logsigmoid(x: ir.Node) -> ir.Node:
    # min(x, 0) - log1p(exp(-|x|)): never overflows
    return ir.binary("sub", ir.binary("min", x, _c(0.0)), ir.unary("log1p", ir.unary("exp", ir.unary("neg", ir.unary("abs", x)))))


def tanhshrink(x: ir.Node) -> ir.Node:
    return ir.binary("sub", x, ir.unary("tanh", x))


def threshold(x: ir.Node, threshold: float, value: float) -> ir.Node:
    return _where(ir.binary("gt", x, _c(threshold)), x, _c(value))


def softshrink(x: ir.Node, lambd: float = 0.5) -> ir.Node:
    shrunk = _where(ir.binary("lt", x, _c(-lambd)), ir.binary("add", x, _c(lambd)), _c(0.0))
    return _where(ir.binary("gt", x, _c(lambd)), ir.binary("sub", x, _c(lambd)), shrunk)


def hardshrink(x: ir.Node, lambd: float = 0.5) -> ir.Node:
    return _where(ir.binary("gt", ir.unary("abs", x), _c(lambd)), x, _c(0.0))


def log_sigmoid(x: ir.Node) -> ir.Node:
    return logsigmoid(x)


def deg2rad(x: ir.Node) -> ir.Node:
    return _mul(_float(x), _c(math.pi / 180.0))


def rad2deg(x: ir.Node) -> ir.Node:
    return _mul(_float(x), _c(180.0 / math.pi))


def sinc(x: ir.Node) -> ir.Node:
    px = _mul(_float(x), _c(math.pi))
    return _where(ir.binary("eq", x, _c(0)), _c(1.0), ir.binary("truediv", ir.unary("sin", px), px))


def hypot(x: ir.Node, y: ir.Node) -> ir.Node:
    return ir.unary("sqrt", ir.binary("add", _mul(x, x), _mul(y, y)))


def logaddexp(x: ir.Node, y: ir.Node) -> ir.Node:
    # max + log1p(exp(-|x - y|)), stable for large arguments
    return ir.binary("add", ir.binary("max", x, y),
                     ir.unary("log1p", ir.unary("exp", ir.unary("neg", ir.unary("abs", ir.binary("sub", x, y))))))


def xlogy(x: ir.Node, y: ir.Node) -> ir.Node:
    return _where(ir.binary("eq", x, _c(0)), _c(0.0), _mul(x, ir.unary("log", _float(y))))


def lerp(start: ir.Node, end: ir.Node, weight: ir.Node) -> ir.Node:
    return ir.binary("add", start, _mul(weight, ir.binary("sub", end, start)))


def copysign(x: ir.Node, y: ir.Node) -> ir.Node:
    # the sign bit of -0.0 is not visible to a comparison; copysign(x, -0.0) gives |x| here
    magnitude = ir.unary("abs", _float(x))
    return _where(ir.binary("lt", y, _c(0)), ir.unary("neg", magnitude), magnitude)


def frac(x: ir.Node) -> ir.Node:
    return ir.binary("sub", x, ir.unary("trunc", x))


def logit(x: ir.Node) -> ir.Node:
    return ir.unary("log", ir.binary("truediv", x, ir.binary("sub", _c(1.0), x)))


# Builders by the name torch gives the function (torch.*, Tensor methods, torch.nn.functional).
# Unary activations take (x, *options); the rest take their operands.
ACTIVATIONS: dict[str, Callable[..., ir.Node]] = {
    "relu": relu, "relu6": relu6, "hardtanh": hardtanh, "leaky_relu": leaky_relu, "elu": elu, "selu": selu,
    "celu": celu, "gelu": gelu, "silu": silu, "softplus": softplus, "mish": mish, "softsign": softsign,
    "hardsigmoid": hardsigmoid, "hardswish": hardswish, "logsigmoid": logsigmoid, "log_sigmoid": log_sigmoid,
    "tanhshrink": tanhshrink, "threshold": threshold, "softshrink": softshrink, "hardshrink": hardshrink,
    "deg2rad": deg2rad, "rad2deg": rad2deg, "sinc": sinc, "frac": frac, "logit": logit,
}
OPERAND_FUNCS: dict[str, Callable[..., ir.Node]] = {
    "hypot": hypot, "logaddexp": logaddexp, "xlogy": xlogy, "lerp": lerp, "copysign": copysign,
}
