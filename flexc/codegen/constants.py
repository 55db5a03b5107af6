"""The numeric constants codegen writes into kernels (defined once; every generator imports them)."""

LOG2E = 1.4426950408889634  # 1 / ln(2): scores move to base 2 so the softmax can use exp2
TWO_LOG2E = 2.8853900817779268  # 2 / ln(2): e^(2x) = 2^(x * TWO_LOG2E)
LN2 = 0.6931471805599453  # a base-2 logsumexp times ln(2) is the natural one

__all__ = ["LN2", "LOG2E", "TWO_LOG2E"]
