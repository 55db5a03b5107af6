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
