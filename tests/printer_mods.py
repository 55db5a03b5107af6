"""Mods that exercise every construct the Triton printer writes (operators, math, casts, lookups of
captured tensors of several dtypes): shared by the printer's tests and the offline CUDA compile tests."""
import torch

# the grid these mods' captured tensors are sized for
B, H, L, S = 2, 3, 12, 16

_gen = torch.Generator().manual_seed(1)
table = torch.randn(L + S, generator=_gen)
int_table = torch.randint(-(L + S), L + S, (S,), generator=_gen)
flags = torch.rand(L, generator=_gen) < 0.5
grid3 = torch.randn(H, L, S, generator=_gen, dtype=torch.float64)
scalar = torch.tensor(0.75)
half_table = torch.randn(S, generator=_gen).to(torch.bfloat16)

SCORE_MODS = {
    "add_mul_sub": lambda score, b, h, q_idx, kv_idx: score * 2 - (q_idx - kv_idx) + 0.5,
    "truediv_ints": lambda score, b, h, q_idx, kv_idx: score + q_idx / (kv_idx + 1),
    "floordiv_negative": lambda score, b, h, q_idx, kv_idx: score + (q_idx - 7) // 3 + (kv_idx - 9) // -4,
    "mod_negative": lambda score, b, h, q_idx, kv_idx: score + (q_idx - 7) % 3 + (kv_idx - 9) % -4,
    "floordiv_by_expression": lambda score, b, h, q_idx, kv_idx: score + (kv_idx - 8) // (q_idx % 5 + 1),
    "float_floordiv_mod": lambda score, b, h, q_idx, kv_idx: score // 0.5 + score % 1.5,
    "pow_int_exponents": lambda score, b, h, q_idx, kv_idx: score ** 2 + score ** 3 - (q_idx + 1) ** 2 * 0.01,
    "pow_negative_exponent": lambda score, b, h, q_idx, kv_idx: (score.abs() + 1.0) ** -2,
    "pow_half_and_general": lambda score, b, h, q_idx, kv_idx: score.abs() ** 0.5 + score.abs() ** 1.7,
    "pow_literal_base": lambda score, b, h, q_idx, kv_idx: score + 2.0 ** (-(h + 1) * 0.5),
    "pow_negative_base": lambda score, b, h, q_idx, kv_idx: score ** 3.0 + (score - 10.0) ** 2.0,
    "pow_nan_for_fraction": lambda score, b, h, q_idx, kv_idx: score ** 1.5,
    "pow_large_integer_exponents": lambda score, b, h, q_idx, kv_idx: ((score * 0.3) ** 11 - (score * 0.3) ** 10
                                                                       + (score.abs() + 1) ** -9 + score ** -3.0),
    "pow_tensor_exponent": lambda score, b, h, q_idx, kv_idx: (score - 1.0) ** (kv_idx % 4) + score.abs() ** (score * 0.1),
    "math_functions": lambda score, b, h, q_idx, kv_idx: (torch.exp(score * 0.1) + torch.exp2(-score.abs())
                                                          + torch.log(score.abs() + 1) + torch.log2(q_idx + 1.0)),
    "sqrt_rsqrt_trig": lambda score, b, h, q_idx, kv_idx: (torch.sqrt(score.abs()) + torch.rsqrt(kv_idx + 1.0)
                                                           + torch.sin(score) * torch.cos(q_idx * 0.3)),
    "tanh_sigmoid": lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0) + torch.sigmoid(score - q_idx * 0.1),
    "tanh_tiny_and_huge": lambda score, b, h, q_idx, kv_idx: torch.tanh(score * 1e-3) * 1e3 + torch.tanh(score * 100),
    "floor_ceil_sign_abs": lambda score, b, h, q_idx, kv_idx: (torch.floor(score) + torch.ceil(score * 0.3)
                                                               + torch.sign(score) + torch.sign(q_idx - 5) + (kv_idx - 8).abs()),
    "where_min_max_clamp": lambda score, b, h, q_idx, kv_idx: torch.where(
        q_idx > kv_idx, torch.minimum(score, q_idx * 0.5), torch.maximum(score, kv_idx * -0.2)) + torch.clamp(score, -1, 1),
    "casts": lambda score, b, h, q_idx, kv_idx: (score * 3).long() + (score > 0).float() + q_idx.float() / 7
    + score.to(torch.float64) * 0.5,
    "bool_arithmetic": lambda score, b, h, q_idx, kv_idx: score + (q_idx > kv_idx) * 2 + (kv_idx > 3),
    "negation": lambda score, b, h, q_idx, kv_idx: -score + -(q_idx * 2),
    "captured_1d_negative_index": lambda score, b, h, q_idx, kv_idx: score + table[q_idx - kv_idx],
    "captured_nested_int_lookup": lambda score, b, h, q_idx, kv_idx: score + table[int_table[kv_idx]],
    "captured_3d_float64": lambda score, b, h, q_idx, kv_idx: score + grid3[h, q_idx, kv_idx],
    "captured_0d_scalar": lambda score, b, h, q_idx, kv_idx: score * scalar,
    "captured_bool": lambda score, b, h, q_idx, kv_idx: torch.where(flags[q_idx], score, -float("inf")),
    "captured_bfloat16": lambda score, b, h, q_idx, kv_idx: score + half_table[kv_idx] * 2,
    "ignores_score": lambda score, b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() * -0.05,
    "constant": lambda score, b, h, q_idx, kv_idx: torch.full_like(score, 2.5) if False else 2.5 + 0 * 1.0,
    "shared_subexpression": lambda score, b, h, q_idx, kv_idx: (lambda d: score + d * d - d)((q_idx - kv_idx) * 0.25),
}

MASK_MODS = {
    "compare_and_or": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & ((q_idx - kv_idx < 5) | (kv_idx == 0)),
    "not_xor": lambda b, h, q_idx, kv_idx: ~(q_idx < kv_idx) ^ (h == 1),
    "modular_blocks": lambda b, h, q_idx, kv_idx: (q_idx // 4 == kv_idx // 4) | ((q_idx - kv_idx) % 3 == 0),
    "batch_and_head": lambda b, h, q_idx, kv_idx: (b + h) % 2 == kv_idx % 2,
    "captured_bool_lookup": lambda b, h, q_idx, kv_idx: flags[q_idx] | (kv_idx < 2),
    "int_lookup_compare": lambda b, h, q_idx, kv_idx: int_table[kv_idx] <= q_idx * 3,
    "always_false": lambda b, h, q_idx, kv_idx: torch.zeros_like(q_idx, dtype=torch.bool) if False else (1 > 2) & (q_idx >= 0),
    "logical_ops": lambda b, h, q_idx, kv_idx: torch.logical_and(q_idx > 2, torch.logical_not(kv_idx > 9)),
}

# One score_mod per IR op (and per kind where the op's printing or evaluation differs by kind), for the
# every-op test: ``(op, kind of the op's node, mod)``. Each keeps its operands in the op's domain for
# any score (asin of sin(s) * 0.9, log of s * s + 0.5), so torch's own values, evaluation, the
# printed Triton and the derivative IR can be compared anywhere; integer and bool results are
# added to the score, so the score derivative is exercised by every case.
OP_CASES = [
    ("add", "float", lambda s, b, h, q, kv: s + q * 0.5),
    ("add", "int", lambda s, b, h, q, kv: s + (q + kv)),
    ("sub", "float", lambda s, b, h, q, kv: s - kv * 0.25),
    ("sub", "int", lambda s, b, h, q, kv: s + (q - kv)),
    ("mul", "float", lambda s, b, h, q, kv: s * (kv * 0.1 - 0.7)),
    ("mul", "int", lambda s, b, h, q, kv: s + (q - 5) * (kv - 7)),
    ("truediv", "float", lambda s, b, h, q, kv: s / (q + 1.5) + (kv + 1) / (s * s + 1)),
    # (torch.div with a rounding mode: the spelling of s // 0.5 that autograd differentiates)
    ("floordiv", "float", lambda s, b, h, q, kv: torch.div(s, 0.5, rounding_mode="floor") + s * 0.5),
    ("floordiv", "int", lambda s, b, h, q, kv: s + (q - 7) // 3 + (kv - 9) // -4),
    ("mod", "float", lambda s, b, h, q, kv: s % 1.5 + s % (q * 0.25 + 0.5)),
    ("mod", "int", lambda s, b, h, q, kv: s + (q - 7) % 3 + (kv - 9) % -4),
    ("pow", "float", lambda s, b, h, q, kv: (s * s + 0.5) ** (kv * 0.125 - 1.0) + s ** 3),
    ("pow", "int", lambda s, b, h, q, kv: s + (q - 5) ** 2),
    ("min", "float", lambda s, b, h, q, kv: torch.minimum(s, q * 0.5 - 2.0)),
    ("min", "int", lambda s, b, h, q, kv: s + torch.minimum(q, kv - 3)),
    ("max", "float", lambda s, b, h, q, kv: torch.maximum(s, kv * -0.2)),
    ("max", "int", lambda s, b, h, q, kv: s + torch.maximum(q - 4, kv)),
    ("fmod", "float", lambda s, b, h, q, kv: torch.fmod(s, 1.25) + torch.fmod(s * 3.0, q + 1.5)),
    ("fmod", "int", lambda s, b, h, q, kv: s + torch.fmod(q - 7, 3)),
    ("atan2", "float", lambda s, b, h, q, kv: torch.atan2(s, kv + 1.0) + torch.atan2(q * 0.5 - 3.0, s)),
    ("lshift", "int", lambda s, b, h, q, kv: s + (q << (kv % 3))),
    ("rshift", "int", lambda s, b, h, q, kv: s + ((q - 6) >> (kv % 3))),
    ("and", "bool", lambda s, b, h, q, kv: torch.where((s > 0) & (q > kv), s, s * 0.5)),
    ("and", "int", lambda s, b, h, q, kv: s + (q & kv)),
    ("or", "bool", lambda s, b, h, q, kv: torch.where((s > 1) | (q < kv), s, -s)),
    ("or", "int", lambda s, b, h, q, kv: s + (q | kv)),
    ("xor", "bool", lambda s, b, h, q, kv: torch.where((s > 0) ^ (q > 5), s * 2.0, s)),
    ("xor", "int", lambda s, b, h, q, kv: s + (q ^ kv)),
    ("eq", "bool", lambda s, b, h, q, kv: torch.where(q % 3 == kv % 3, s, s * 0.25)),
    ("ne", "bool", lambda s, b, h, q, kv: torch.where(q != kv, s, s * 3.0)),
    ("lt", "bool", lambda s, b, h, q, kv: torch.where(s < q * 0.5 - 3.0, s, s * 0.5)),
    ("le", "bool", lambda s, b, h, q, kv: torch.where(q <= kv, s, -s)),
    ("gt", "bool", lambda s, b, h, q, kv: torch.where(s > kv * 0.25, s * 2.0, s)),
    ("ge", "bool", lambda s, b, h, q, kv: torch.where(q >= kv, s, s - 1.0)),
    ("neg", "float", lambda s, b, h, q, kv: -s),
    ("neg", "int", lambda s, b, h, q, kv: s + -(q * 2)),
    ("abs", "float", lambda s, b, h, q, kv: torch.abs(s)),
    ("abs", "int", lambda s, b, h, q, kv: s + (kv - 8).abs()),
    ("sign", "float", lambda s, b, h, q, kv: torch.sign(s) * s),
    ("sign", "int", lambda s, b, h, q, kv: s + torch.sign(q - 5)),
    ("not", "bool", lambda s, b, h, q, kv: torch.where(~(q < kv), s, s * 0.5)),
    ("not", "int", lambda s, b, h, q, kv: s + ~q),
    ("exp", "float", lambda s, b, h, q, kv: torch.exp(s * 0.5)),
    ("exp2", "float", lambda s, b, h, q, kv: torch.exp2(s * 0.5)),
    ("log", "float", lambda s, b, h, q, kv: torch.log(s * s + 0.5)),
    ("log2", "float", lambda s, b, h, q, kv: torch.log2(s * s + 0.5)),
    ("log10", "float", lambda s, b, h, q, kv: torch.log10(s * s + 0.5)),
    ("log1p", "float", lambda s, b, h, q, kv: torch.log1p(s * s)),
    ("expm1", "float", lambda s, b, h, q, kv: torch.expm1(s * 0.5)),
    ("sqrt", "float", lambda s, b, h, q, kv: torch.sqrt(s * s + 0.25)),
    ("rsqrt", "float", lambda s, b, h, q, kv: torch.rsqrt(s * s + 0.25)),
    ("tanh", "float", lambda s, b, h, q, kv: torch.tanh(s)),
    ("sigmoid", "float", lambda s, b, h, q, kv: torch.sigmoid(s)),
    ("sin", "float", lambda s, b, h, q, kv: torch.sin(s)),
    ("cos", "float", lambda s, b, h, q, kv: torch.cos(s)),
    ("tan", "float", lambda s, b, h, q, kv: torch.tan(torch.sin(s))),
    ("atan", "float", lambda s, b, h, q, kv: torch.atan(s)),
    ("asin", "float", lambda s, b, h, q, kv: torch.asin(torch.sin(s) * 0.9)),
    ("acos", "float", lambda s, b, h, q, kv: torch.acos(torch.sin(s) * 0.9)),
    ("sinh", "float", lambda s, b, h, q, kv: torch.sinh(s * 0.5)),
    ("cosh", "float", lambda s, b, h, q, kv: torch.cosh(s * 0.5)),
    ("asinh", "float", lambda s, b, h, q, kv: torch.asinh(s)),
    ("acosh", "float", lambda s, b, h, q, kv: torch.acosh(s * s + 1.5)),
    ("atanh", "float", lambda s, b, h, q, kv: torch.atanh(torch.sin(s) * 0.9)),
    ("erf", "float", lambda s, b, h, q, kv: torch.erf(s)),
    ("erfc", "float", lambda s, b, h, q, kv: torch.erfc(s * 0.5)),
    ("floor", "float", lambda s, b, h, q, kv: torch.floor(s) + s),
    ("floor", "int", lambda s, b, h, q, kv: s + torch.floor(q - 5)),
    ("ceil", "float", lambda s, b, h, q, kv: torch.ceil(s) + s),
    ("ceil", "int", lambda s, b, h, q, kv: s + torch.ceil(kv - 5)),
    ("trunc", "float", lambda s, b, h, q, kv: torch.trunc(s) + s),
    ("round", "float", lambda s, b, h, q, kv: torch.round(s * 0.7) + s),
    ("where", "float", lambda s, b, h, q, kv: torch.where(q > kv, s * 0.5, s)),
    ("where", "int", lambda s, b, h, q, kv: s + torch.where(q > kv, q, kv - 3)),
    ("cast", "float", lambda s, b, h, q, kv: s.to(torch.float64) * 0.5 + q.float() / 7 + (s > 0).float()),
    ("cast", "int", lambda s, b, h, q, kv: s + (s * 3).long()),
]
